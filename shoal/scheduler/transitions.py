"""How the scheduler's task states change: the transitions of
:class:`~shoal.scheduler.state.SchedulerState` (this class is its base), the one writer
of a task's state (:meth:`TaskTransitions._set_state`, which allows only the edges of
:data:`_EDGES`), the routes between states (:data:`_TRANSITIONS`) and the helpers they
share. The theory of operation is in :mod:`shoal.scheduler.state`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, get_args

from ..protocol.messages import KeyInMemoryMsg, LostKeyMsg, TaskErredMsg, to_wire
from ..statelog import InvalidTransition, StateLog
from .events import FIRE_AND_FORGET, ClientMsg, ComputeTask, FreeKeys, Instruction
from .model import PrefixGroup, Queue, TaskState, TState, WorkerState, minus

__all__ = ["TaskTransitions", "HOST_COPY_MIN_BYTES", "DURATIONS_KEPT"]

#: values at least this large are kept for its host by a worker that fetched them from
#: another (the worker's ``shoal.comm.shm_family.TRANSFER_MIN_BYTES``; this layer does
#: no IO and imports no transport): such a value gets a fetcher per host
HOST_COPY_MIN_BYTES = 1 << 20
#: the prefixes whose average durations are remembered after their tasks went
DURATIONS_KEPT = 4096


class TaskTransitions:
    """The transitions of the scheduler's tasks (see :mod:`shoal.scheduler.state`)."""

    # what the scheduler's state holds, used here (set by SchedulerState.__init__)
    tasks: dict[Any, TaskState]
    workers: dict[str, WorkerState]
    queued: Queue
    named: dict[str, set[WorkerState]]
    #: language -> how many of the queued tasks are of it
    queued_languages: dict[str, int]
    groups: dict[str, PrefixGroup]
    locating: set[TaskState]
    durations: dict[str, float]
    done_total: int
    log: StateLog
    _stimulus: str
    _instructions: list[Instruction]

    def _decide_worker(self, ts: TaskState) -> WorkerState | None:
        raise NotImplementedError  # placement: SchedulerState

    @staticmethod
    def _allowed(ts: TaskState, ws: WorkerState) -> bool:
        raise NotImplementedError  # placement: SchedulerState

    def _touch(self, ws: WorkerState) -> None:
        raise NotImplementedError  # placement: SchedulerState

    def _recommend(self, recs: dict[TaskState, str]) -> None:
        """Carry out recommendations, and those they lead to, until none are left.

        First in, first out: recommendations are made in priority order (a graph's tasks,
        a finished task's dependents), so that is the order tasks go to workers in. A
        task may be recommended twice (say "processing", then "forgotten", which is
        skipped if a dependent still waits for it): each recommendation is kept, and
        one that no longer fits the task's state is dropped.
        """
        pending = deque(recs.items())
        routes = _TRANSITIONS
        while pending:
            ts, finish = pending.popleft()
            start = ts.state
            if start == finish or start == "forgotten":
                continue
            if finish == "processing":
                if start != "waiting" or ts.waiting_on:
                    continue  # moved on since: erred, released, or waiting on a lost input
            elif finish == "waiting":
                if start != "released":
                    continue  # already on its way, or erred
            elif finish == "forgotten" and start != "released" and (ts.who_wants or ts.waiters):
                continue  # a client or a dependent has come back since
            func = routes.get((start, finish))
            more = func(self, ts) if func is not None else self._transition(ts, finish)
            if more:
                pending.extend(more.items())

    def _set_state(self, ts: TaskState, finish: TState) -> None:
        """The one place a task's state changes: the pair must be an edge of
        :data:`_EDGES` (else :class:`InvalidTransition`, and nothing changes), and it is
        logged with the stimulus that caused it."""
        start = ts.state
        if finish not in _EDGES_FROM[start]:
            raise InvalidTransition(f"{ts.key!r}: {start} -> {finish} is not allowed")
        ts.state = finish
        self.log.transitions.append((ts.key, start, finish, self._stimulus))
        g = ts.group
        if g is not None:
            states = g.states
            states[start] -= 1
            states[finish] += 1
            if finish == "memory" and not ts.done:
                ts.done = True
                g.done += 1
                self.done_total += 1
            elif finish == "forgotten" and states["forgotten"] == g.size and self.groups.get(g.name) is g:
                del self.groups[g.name]
                if g.duration > 0:  # what its tasks took: the next graph's of that name start from it
                    durations = self.durations
                    durations.pop(g.name, None)
                    durations[g.name] = g.duration
                    if len(durations) > DURATIONS_KEPT:
                        del durations[next(iter(durations))]

    def _transition(self, ts: TaskState, finish: str, *args: Any) -> dict[TaskState, str]:
        start = ts.state
        if start == finish:
            return {}
        if finish == "forgotten" and start != "released" and (ts.who_wants or ts.waiters):
            # recommended when nobody needed it; a client or a dependent has come back since
            return {}
        func = _TRANSITIONS.get((start, finish))
        if func is None:
            # multi-step routes through released
            if finish == "waiting" and start in ("memory", "erred"):
                # ts first: its inputs, recommended "forgotten" on the way, are needed again
                more = self._transition(ts, "released")
                return {ts: "waiting", **more}
            raise InvalidTransition(f"{ts.key!r}: {start} -> {finish} is not allowed")
        return func(self, ts, *args) or {}

    def _released_waiting(self, ts: TaskState) -> dict[TaskState, str]:
        if ts.payload is None:
            # data put on workers directly (scatter) cannot be recomputed
            text = f"LostData: the value of {ts.key!r} was lost with its worker and cannot be recomputed"
            return self._err(ts, None, None, text, kind="LostData")
        if ts.once and ts.sent:
            # every way to run a task again comes here (a dead worker's tasks, a lost
            # value, a task given back or released while it ran): this one may not
            return self._err(ts, None, None, _run_once_text(ts), kind="RunOnce")
        recs: dict[TaskState, str] = {}
        self._set_state(ts, "waiting")
        for dep in ts.dependencies:
            if dep.state == "erred":
                blame = dep.exception_blame or dep
                return self._err(ts, blame.exception, blame.traceback, blame.exception_text, blame=blame)
        for dep in ts.dependencies:
            dep.add_waiter(ts)
            if dep.state != "memory":
                ts.wait_on(dep)
                if dep.state == "released":
                    recs[dep] = "waiting"
        if not ts.waiting_on:
            recs[ts] = "processing"
        return recs

    def _waiting_processing(self, ts: TaskState) -> dict[TaskState, str]:
        if self._nowhere(ts):
            return self._err(ts, None, None, self._no_worker_text(ts), kind="ValueError")
        ws = self._decide_worker(ts)
        if ws is None:
            self._set_state(ts, "queued")
            self._enqueue(ts)
            return {}
        self._send_to(ts, ws)
        return {}

    def _queued_processing(self, ts: TaskState, ws: WorkerState) -> dict[TaskState, str]:
        self._send_to(ts, ws)
        return {}

    def _processing_waiting(self, ts: TaskState) -> dict[TaskState, str]:
        """Run it again (a retry, or the worker gave it back); its inputs stay where they are."""
        self._unassign(ts)
        self._set_state(ts, "released")
        return self._released_waiting(ts)

    def _send_to(self, ts: TaskState, ws: WorkerState) -> None:
        self._set_state(ts, "processing")
        ts.sent = True
        ts.processing_on = ws
        ws.processing.add(ts)
        if ts.resources:
            used = ws.used_resources
            for name, amount in ts.resources.items():
                used[name] = used.get(name, 0) + amount
        self._touch(ws)
        who_has: dict[Any, list[str]] = {}
        nbytes: dict[Any, int] = {}
        shm: dict[Any, Any] = {}
        for d in ts.dependencies:
            key = d.key
            who_has[key] = self._holders_for(d, ws)
            nbytes[key] = d.nbytes
            if d.shm is not None and (info := self._shm_info(d, ws.host)) is not None:
                shm[key] = info
        self._emit(ComputeTask(self._stimulus, ws.address, ts.key, ts.payload, who_has, nbytes, ts.priority, shm,
                               bool(ts.who_wants), ts.resources, ts in self.locating, self._local(ts)))

    def _local(self, ts: TaskState) -> bool:
        """Whether ``ts``'s value will most likely be read only where it is made: no
        client waits for it, and it has one dependent, whose only input it is (that
        task then goes where its input is). Its worker need not place it in shared
        memory: a copy for other processes that will not read it."""
        if ts.who_wants or len(ts.dependents) != 1:
            return False
        (dependent,) = ts.dependents
        return len(dependent.dependencies) == 1 and dependent not in self.locating

    def _holders_for(self, ts: TaskState, ws: WorkerState) -> list[str]:
        """The workers ``ws`` may fetch ``ts``'s value from, in the order to ask them:
        those of its own host first. When none is there, the worker of its host that
        was sent a task needing the value first (the host's *fetcher*) comes first: it
        gets the value from another host and keeps it for its host, and it answers a
        request for a value it is fetching once it has it, so a value crosses to a
        host once however many of its workers read it at the same time."""
        host = ws.host
        holders = ts.who_has
        if len(holders) == 1:
            (only,) = holders
            if only.host == host or not host or ts.nbytes < HOST_COPY_MIN_BYTES:
                return [only.address]
            far = [only.address]
        else:
            near = sorted(w.address for w in holders if w.host == host)
            far = sorted(w.address for w in holders if w.host != host)
            if near or not host:
                return near + far
        if ts.nbytes < HOST_COPY_MIN_BYTES:
            return far  # not kept for the host: crossing again costs little
        fetchers = ts.fetchers
        if fetchers is None:
            fetchers = ts.fetchers = {}
        fetcher = fetchers.get(host)
        if fetcher is None or self.workers.get(fetcher.address) is not fetcher:
            fetchers[host] = ws
            return far
        if fetcher is ws:
            return far
        return [fetcher.address, *far]

    def _shm_info(self, ts: TaskState, host: str | None = None) -> Any:
        """A segment that holds ``ts``'s value and still exists (its owner holds the
        key): one on ``host`` (a host identity, §3), or with None the first placed (the
        maker's) still held; None if there is none."""
        for owner, info in (ts.shm or {}).items():
            ws = self.workers.get(owner)
            if ws is not None and ws in ts.who_has and (host is None or ws.host == host):
                return info
        return None

    def _processing_memory(self, ts: TaskState, ws: WorkerState) -> dict[TaskState, str]:
        self._unassign(ts)
        self._set_state(ts, "memory")
        self._add_replica(ts, ws)
        return self._on_memory(ts)

    def _on_memory(self, ts: TaskState) -> dict[TaskState, str]:
        recs: dict[TaskState, str] = {}
        for dts in sorted(ts.dependents):
            if ts in dts.waiting_on:
                dts.waiting_on = minus(dts.waiting_on, ts)
                if not dts.waiting_on and dts.state == "waiting":
                    recs[dts] = "processing"
        ts.waiting_on = ()
        if ts not in self.locating:  # (a locate task keeps its inputs while it is held)
            for dep in ts.dependencies:
                dep.waiters = minus(dep.waiters, ts)
                if not dep.waiters and not dep.who_wants and dep.state in _ACTIVE:
                    recs[dep] = "forgotten"
        if ts.who_wants:
            ts.unwant(FIRE_AND_FORGET)  # it ran to the end: nothing more to hold it for
        if ts.who_wants:
            self._to_clients(ts, self._in_memory_msg(ts))
        elif not ts.waiters:
            recs[ts] = "forgotten"
        return recs

    def _processing_erred(self, ts: TaskState, exception: Any, traceback: Any, text: str) -> dict[TaskState, str]:
        self._unassign(ts)
        return self._err(ts, exception, traceback, text)

    def _to_released(self, ts: TaskState) -> dict[TaskState, str]:
        start = ts.state
        recs: dict[TaskState, str] = {}
        if start == "processing":
            self._unassign(ts, tell=True)
        elif start == "queued":
            self._dequeue(ts)
        elif start == "memory":
            holders = ts.who_has
            for ws in holders if len(holders) < 2 else sorted(holders, key=lambda w: w.address):
                ws.has_what.discard(ts)
                ws.nbytes -= max(ts.nbytes, 0)
                self._emit(FreeKeys(self._stimulus, ws.address, [ts.key]))
            ts.who_has = ()
            ts.inline = ts.shm = ts.fetchers = None
        elif start == "erred":
            ts.exception = ts.traceback = ts.exception_blame = None
            ts.exception_text = ""
            ts.error_kind = ""
        self._set_state(ts, "released")
        for dep in ts.dependencies:
            dep.waiters = minus(dep.waiters, ts)
            if not dep.waiters and not dep.who_wants and dep.state in _ACTIVE:
                recs[dep] = "forgotten"
        ts.waiting_on = ()
        # dependents still to run must wait for this value again
        for dts in ts.dependents:
            if dts.state == "waiting":
                dts.wait_on(ts)
        return recs

    def _to_forgotten(self, ts: TaskState) -> dict[TaskState, str]:
        """Released, then forgotten at once (what that recommends joins what releasing
        it did)."""
        more = self._to_released(ts)
        more.update(self._released_forgotten(ts))
        return more

    def _released_forgotten(self, ts: TaskState) -> dict[TaskState, str]:
        kept = bool(ts.who_wants)  # still needed by a client or by a dependent's record
        for d in ts.dependents:
            state = d.state
            if state in _TO_RUN:
                return {ts: "waiting"}  # a dependent still has to run: compute this again
            if state != "forgotten":
                kept = True
        if kept:
            return {}
        recs: dict[TaskState, str] = {}
        self._set_state(ts, "forgotten")
        del self.tasks[ts.key]
        self.locating.discard(ts)
        for dep in ts.dependencies:
            dep.dependents = minus(dep.dependents, ts)
            dep.waiters = minus(dep.waiters, ts)
            if not dep.dependents and not dep.who_wants and dep.state in ("released", "erred", "memory"):
                recs[dep] = "forgotten"
        ts.dependencies = ()
        return recs

    # -- helpers

    def _err(self, ts: TaskState, exception: Any, traceback: Any, text: str,
             blame: TaskState | None = None, kind: str = "") -> dict[TaskState, str]:
        """Mark ``ts`` and every dependent erred; tell the clients that want them.

        Returns recommendations: inputs nobody needs any more are forgotten, and so is
        ``ts`` if nobody wants it.

        Depth first, in the order a recursion would take, but with a stack of its own:
        a chain of a million tasks errs as a short one does.
        """
        blame = blame or ts
        recs: dict[TaskState, str] = {}
        # (task, phase): 0 the task itself, 1 a dependent (errs if it has yet to
        # finish), 2 after its dependents (forgotten if nobody wants it)
        stack: list[tuple[TaskState, int]] = [(ts, 0)]
        while stack:
            t, phase = stack.pop()
            if phase == 2:
                if not t.who_wants and not t.dependents:
                    recs[t] = "forgotten"
                continue
            if phase == 1:
                if t.state not in ("waiting", "queued", "processing", "released"):
                    continue  # in memory, or erred already (through another input)
                if t.state == "queued":
                    self._dequeue(t)
                elif t.state == "processing" and t.processing_on is not None:
                    self._unassign(t, tell=True)
            self._set_state(t, "erred")
            if t.who_wants:
                t.unwant(FIRE_AND_FORGET)
            t.exception, t.traceback, t.exception_text = exception, traceback, text
            t.exception_blame = blame
            t.error_kind = kind
            t.waiting_on = ()
            for dep in t.dependencies:
                dep.waiters = minus(dep.waiters, t)
                if not dep.waiters and not dep.who_wants and dep.state in _ACTIVE:
                    recs[dep] = "forgotten"
            self._report_error(t)
            stack.append((t, 2))
            stack.extend((dts, 1) for dts in sorted(t.dependents, reverse=True))
        return recs

    def _nowhere(self, ts: TaskState) -> bool:
        """Whether ``ts`` may only run on workers (``workers=``, strictly) none of
        which is in the cluster. (A task that asks for resources no worker offers
        waits for one instead: workers with resources may join.)"""
        r = ts.restrictions
        if r is None or ts.loose_restrictions:
            return False
        named = self.named
        return not any(name in named for name in r)

    def _no_worker_text(self, ts: TaskState) -> str:
        assert ts.restrictions is not None
        return (f"ValueError: task {ts.key!r} may only run on workers={sorted(ts.restrictions)}, and no such "
                f"worker is in the cluster; the workers are {sorted(self.workers)}")

    def _unassign(self, ts: TaskState, tell: bool = False) -> None:
        """``ts`` no longer runs on the worker it was sent to; with ``tell``, that
        worker is told to drop it (free-keys)."""
        ws = ts.processing_on
        assert ws is not None
        ws.processing.discard(ts)
        ws.long_running.discard(ts)
        ts.processing_on = None
        if ts.resources:
            release_resources(ws, ts.resources)
        self._touch(ws)
        if tell:
            self._emit(FreeKeys(self._stimulus, ws.address, [ts.key]))

    def _enqueue(self, ts: TaskState) -> None:
        self.queued.push(ts)
        counts = self.queued_languages
        counts[ts.language] = counts.get(ts.language, 0) + 1

    def _dequeue(self, ts: TaskState) -> None:
        self.queued.remove(ts)
        self._uncount_queued(ts)

    def _uncount_queued(self, ts: TaskState) -> None:
        counts = self.queued_languages
        n = counts[ts.language] - 1
        if n:
            counts[ts.language] = n
        else:
            del counts[ts.language]

    def _report_error(self, ts: TaskState, only: str | None = None) -> None:
        blame = ts.exception_blame or ts
        self._to_clients(ts, to_wire(TaskErredMsg(
            ts.key, ts.exception, ts.traceback, ts.exception_text,
            kind=blame.error_kind or ts.error_kind, blame=blame.key,
        )), only=only)

    def _in_memory_msg(self, ts: TaskState) -> dict[str, Any]:
        return to_wire(KeyInMemoryMsg(
            ts.key, ts.nbytes, sorted(ws.address for ws in ts.who_has),
            shm=self._shm_info(ts), value=ts.inline,
        ))

    def _lost_value(self, ts: TaskState, recs: dict[TaskState, str]) -> None:
        """The last copy of ``ts``'s value is gone: recompute it if anyone needs it;
        and a locate task in memory or running that it is an input of runs again (its
        value says, or will say, where ``ts`` was)."""
        ts.inline = None
        self._set_state(ts, "released")
        stale: list[TaskState] = []
        running: list[TaskState] = []
        for dts in sorted(ts.dependents):
            if dts.state == "memory" and dts in self.locating:
                stale.append(dts)  # (after ts's own fate is decided: it waits for ts)
            elif dts.state == "processing" and dts in self.locating:
                # a barrier running: what it returns names where ts was
                running.append(dts)
            elif dts.state == "waiting":
                dts.wait_on(ts)
            elif dts.state == "queued":
                self._dequeue(dts)
                self._set_state(dts, "waiting")
                dts.waiting_on = ()
                for d in dts.dependencies:
                    if d.state != "memory":
                        dts.wait_on(d)
            # a processing dependent stays: its worker may have the value already, and
            # gives the task back (reschedule) if it cannot get it
        if ts.waiters or ts.who_wants or running:
            for client in sorted(ts.who_wants):
                self._emit(ClientMsg(self._stimulus, client, to_wire(LostKeyMsg(ts.key))))
            recs[ts] = "waiting"
        else:
            recs[ts] = "forgotten"
        for dts in running:
            # it runs again once ts is made again, and its worker drops this run (a
            # late report of it is not taken)
            ws = dts.processing_on
            assert ws is not None
            recs.update(self._transition(dts, "waiting"))
            self._emit(FreeKeys(self._stimulus, ws.address, [dts.key]))
        for dts in stale:
            self._relocate(dts, recs)

    def _relocate(self, ts: TaskState, recs: dict[TaskState, str]) -> None:
        """``ts``, a locate task in memory, lost an input: its value no longer says
        where its inputs are. Its dependents that wait in the queue wait for it again;
        those running give themselves back when they find an input gone
        (``Reschedule``); it runs again once the lost input is made again."""
        for dts in sorted(ts.dependents):
            if dts.state == "queued":
                self._dequeue(dts)
                self._set_state(dts, "waiting")
                dts.waiting_on = ()
                for d in dts.dependencies:
                    if d.state != "memory":
                        dts.wait_on(d)
        needed = any(d.state in _TO_RUN for d in ts.dependents) or ts.who_wants
        # (straight to waiting: released on the way, its inputs it still waits for
        # must not be forgotten before it waits for them again)
        recs.update(self._transition(ts, "waiting" if needed else "forgotten"))

    def _add_replica(self, ts: TaskState, ws: WorkerState, shm: Any = None) -> None:
        """``ws`` holds ``ts``'s value too (with ``shm``: in that segment, which
        workers of its host map; the first such copy per host is the one passed on)."""
        if ws not in ts.who_has:
            ts.add_holder(ws)
            # reports that a one holder did not serve are about that holder alone
            # (see WorkerReports._missing_data)
            ts.unserved = ()
            ts.checking = None
            ws.has_what.add(ts)
            ws.nbytes += max(ts.nbytes, 0)
            if ts.fetchers:
                ts.fetchers.pop(ws.host, None)  # its host has the value now
        if shm is not None:
            if ts.shm is None:
                ts.shm = {}
            ts.shm[ws.address] = shm

    def _drop_replica(self, ts: TaskState, ws: WorkerState) -> None:
        """``ws`` no longer holds ``ts``'s value (nor its segment)."""
        ts.drop_holder(ws)
        ts.unserved = ()
        ts.checking = None
        ws.has_what.discard(ts)
        ws.nbytes -= max(ts.nbytes, 0)
        if ts.shm is not None and ts.shm.pop(ws.address, None) is not None and not ts.shm:
            ts.shm = None

    def _to_clients(self, ts: TaskState, msg: dict[str, Any], only: str | None = None) -> None:
        for client in ([only] if only is not None else sorted(ts.who_wants)):
            self._emit(ClientMsg(self._stimulus, client, msg))

    def _emit(self, instruction: Instruction) -> None:
        self._instructions.append(instruction)


#: states that hold a value or will compute one: worth forgetting once nobody needs them
_ACTIVE = frozenset({"waiting", "queued", "processing", "memory"})
#: states of a task that has yet to run
_TO_RUN = frozenset({"waiting", "queued", "processing"})

#: every change of a task's state that may happen (what :meth:`TaskTransitions._set_state`
#: allows); the routes of :data:`_TRANSITIONS` are made of these
_EDGES: frozenset[tuple[TState, TState]] = frozenset({
    ("released", "waiting"), ("released", "memory"), ("released", "erred"), ("released", "forgotten"),
    ("waiting", "queued"), ("waiting", "processing"), ("waiting", "released"), ("waiting", "erred"),
    ("queued", "processing"), ("queued", "waiting"), ("queued", "released"), ("queued", "erred"),
    ("processing", "memory"), ("processing", "released"), ("processing", "erred"),
    ("memory", "released"),
    ("erred", "released"),
})

#: the same, by the state they leave (looked up on every change of state)
_EDGES_FROM: dict[str, frozenset[str]] = {
    state: frozenset(f for s, f in _EDGES if s == state) for state in get_args(TState)
}

_TRANSITIONS: dict[tuple[str, str], Callable[..., dict[TaskState, str]]] = {
    ("released", "waiting"): TaskTransitions._released_waiting,
    ("waiting", "processing"): TaskTransitions._waiting_processing,
    ("queued", "processing"): TaskTransitions._queued_processing,
    ("processing", "memory"): TaskTransitions._processing_memory,
    ("processing", "erred"): TaskTransitions._processing_erred,
    ("processing", "waiting"): TaskTransitions._processing_waiting,
    ("waiting", "released"): TaskTransitions._to_released,
    ("queued", "released"): TaskTransitions._to_released,
    ("processing", "released"): TaskTransitions._to_released,
    ("memory", "released"): TaskTransitions._to_released,
    ("erred", "released"): TaskTransitions._to_released,
    ("released", "forgotten"): TaskTransitions._released_forgotten,
    ("waiting", "forgotten"): TaskTransitions._to_forgotten,
    ("queued", "forgotten"): TaskTransitions._to_forgotten,
    ("processing", "forgotten"): TaskTransitions._to_forgotten,
    ("memory", "forgotten"): TaskTransitions._to_forgotten,
    ("erred", "forgotten"): TaskTransitions._to_forgotten,
}


def _run_once_text(ts: TaskState) -> str:
    """The error of ``ts``, which may run only once, sent to a worker before and now to
    run again."""
    if ts.done:
        why = "its value was lost with its worker, and is needed again"
    elif ts.suspicious:
        why = "its worker died while it ran"
    else:
        why = "its worker left, gave it back or was told to drop it while it ran"
    return f"RunOnce: task {ts.key!r} may run only once, and it would have had to run again ({why}): {ts.once}"


def release_resources(ws: WorkerState, resources: dict[str, float]) -> None:
    """A task that held ``resources`` on ``ws`` no longer runs there."""
    used = ws.used_resources
    for name, amount in resources.items():
        left = used.get(name, 0) - amount
        if left > 1e-9:
            used[name] = left
        else:
            used.pop(name, None)
