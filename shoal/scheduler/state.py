"""The scheduler's decisions, without IO.

Theory of operation
-------------------
``SchedulerState.handle(*events)`` takes events (a client submitted a graph, a worker
finished a task, a worker left, ...) and returns instructions for the server to carry
out (send a task to a worker, tell a worker to free keys, tell a client a key is done).
It imports no asyncio, opens no socket and reads no clock, so tests drive it directly.

Task states::

    released -> waiting -> queued -> processing -> memory
                   |          |          |-------> erred
                   |          |          +-------> waiting (a retry; the worker gave it
                   |          |                    back; the worker died)
                   +----------+----------+-------> released -> forgotten

- ``waiting``: some dependency is not in memory yet.
- ``queued``: runnable, but every allowed worker is full (a worker takes at most
  ``nthreads + ahead`` tasks, so it can fetch inputs of the next ones while computing).
- ``processing``: sent to a worker.
- ``memory``: at least one worker holds the value.
- ``erred``: the task (or a dependency) raised; the exception stays opaque. The
  scheduler errs a task itself when it may only run on workers that are not (or no
  longer) in the cluster (``ValueError``), when it was running on ``allowed_failures``
  workers that died (``KilledWorker``), and when a scattered value is lost (``LostData``).
- ``released``: not computed, and no-one holds the value; ``forgotten`` tasks are
  dropped from the state once no client wants them and no dependent needs them.

All changes of state go through :meth:`SchedulerState._transition`, which looks the pair
up in ``_TRANSITIONS``; an illegal pair raises and leaves the state unchanged. A
transition returns recommendations (more transitions), carried out first in, first out
by :meth:`SchedulerState._recommend`; one that no longer fits when its turn comes (a
task recommended "forgotten" that a dependent needs again) is skipped.
:meth:`validate` checks the invariants; the tests call it after every step.

Liveness (:mod:`.liveness`, time arrives only in ``HeartbeatEvent`` and
``CheckLivenessEvent``): a worker silent for ``worker_ttl`` is removed as if it had
died, since a task that freezes its worker is as fatal as one that kills it.

The scheduler never looks inside a task's payload: it holds it opaque and forwards it.
"""

from __future__ import annotations

import heapq
import math
import itertools
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from ..protocol.messages import CancelledKeyMsg, KeyInMemoryMsg, LostKeyMsg, TaskErredMsg, to_wire
from .events import (
    AddClientEvent,
    AddWorkerEvent,
    CancelKeysEvent,
    CheckLivenessEvent,
    ClientMsg,
    CloseWorkerStream,
    ComputeTask,
    Event,
    FreeKeys,
    HeartbeatEvent,
    Instruction,
    MissingDataEvent,
    NewTask,
    ReleaseKeysEvent,
    RemoveClientEvent,
    RemoveWorkerEvent,
    RescheduleEvent,
    TaskErredEvent,
    TaskFinishedEvent,
    UpdateDataEvent,
    UpdateGraphEvent,
)
from .liveness import expired, note_seen
from .model import (
    InvalidTransition,
    TaskState,
    WorkerState,
    dependents_closure,
    find_cycle,
    topological,
)
from ..protocol.messages import Key
from .validation import validate_state

# the task durations the scheduler averages are clamped to this range (seconds)
_MIN_DURATION, _MAX_DURATION = 1e-6, 1e6

__all__ = [
    "SchedulerState",
    "TaskState",
    "WorkerState",
    "InvalidTransition",
    # events
    "AddWorkerEvent",
    "RemoveWorkerEvent",
    "AddClientEvent",
    "RemoveClientEvent",
    "UpdateGraphEvent",
    "NewTask",
    "TaskFinishedEvent",
    "TaskErredEvent",
    "ReleaseKeysEvent",
    "CancelKeysEvent",
    "UpdateDataEvent",
    "MissingDataEvent",
    "RescheduleEvent",
    "HeartbeatEvent",
    "CheckLivenessEvent",
    # instructions
    "ComputeTask",
    "FreeKeys",
    "ClientMsg",
    "CloseWorkerStream",
]


#: tasks a worker holds beyond its thread count, so input fetches overlap compute
DEFAULT_AHEAD = 2
#: a task that was running on this many workers when they died errs with KilledWorker
ALLOWED_FAILURES = 3


class SchedulerState:
    """Tasks, workers and clients; ``handle(*events) -> list[instruction]``."""

    def __init__(self, ahead: int = DEFAULT_AHEAD, allowed_failures: int = ALLOWED_FAILURES, log_size: int = 10_000,
                 worker_ttl: float = 0.0):
        self.tasks: dict[Key, TaskState] = {}
        self.workers: dict[str, WorkerState] = {}
        self.clients: set[str] = set()
        self.ahead = ahead
        #: the most tasks per thread a worker is given ahead, however short they are
        self.max_ahead = 50
        #: seconds a worker's refill (finished -> scheduler -> new task) takes, roughly
        self.refill_seconds = 0.004
        #: moving average of task run times (seconds), reported by workers
        self.average_duration = 0.0
        self.allowed_failures = allowed_failures
        #: seconds of silence after which a worker is removed (0: never)
        self.worker_ttl = worker_ttl
        self.queued: list[TaskState] = []  # heap by priority
        self.log: deque[tuple[str, str, Any]] = deque(maxlen=log_size)
        self._generation = itertools.count()
        self._instructions: list[Instruction] = []
        self._stimulus = ""
        #: how many payloads this scheduler deserialized (it never does: tests assert 0)
        self.payload_deserializations = 0
        self._handlers: dict[type, Callable[[Any], None]] = {
            AddWorkerEvent: self._add_worker,
            RemoveWorkerEvent: self._remove_worker,
            AddClientEvent: self._add_client,
            RemoveClientEvent: self._remove_client,
            UpdateGraphEvent: self._update_graph,
            TaskFinishedEvent: self._task_finished,
            TaskErredEvent: self._task_erred,
            ReleaseKeysEvent: self._release_keys,
            CancelKeysEvent: self._cancel_keys,
            UpdateDataEvent: self._update_data,
            MissingDataEvent: self._missing_data,
            RescheduleEvent: self._reschedule,
            HeartbeatEvent: self._heartbeat,
            CheckLivenessEvent: self._check_liveness,
        }

    # -- entry point

    def handle(self, *events: Event) -> list[Instruction]:
        """Apply events in order; return the instructions they produce."""
        out: list[Instruction] = []
        for event in events:
            self._stimulus = event.stimulus_id
            self._instructions = out
            if type(event) not in _CLOCK_EVENTS:
                self.log.append((event.stimulus_id, type(event).__name__, getattr(event, "key", None)))
            self._handlers[type(event)](event)
            if self.queued and type(event) is not HeartbeatEvent:
                # slots may have opened anywhere (finished, cancelled, released tasks)
                self._fill_all()
        self._instructions = []
        return out

    # -- events

    def _add_worker(self, ev: AddWorkerEvent) -> None:
        if ev.address in self.workers:
            return
        if ev.nthreads < 1:
            raise ValueError(f"worker {ev.address} has {ev.nthreads} threads")
        self.workers[ev.address] = WorkerState(ev.address, ev.nthreads, ev.host, ev.pid, ev.name, last_seen=ev.now)
        # tasks that failed for want of this worker, or were waiting for any worker
        self._fill(self.workers[ev.address])

    def _remove_worker(self, ev: RemoveWorkerEvent) -> None:
        ws = self.workers.pop(ev.address, None)
        if ws is not None:
            self._drop_worker(ws, ev.crashed)

    def _drop_worker(self, ws: WorkerState, crashed: bool) -> None:
        """Reschedule the tasks of ``ws``, no longer in ``self.workers``, and forget its values."""
        recs: dict[TaskState, str] = {}
        for ts in sorted(ws.processing):
            ws.processing.discard(ts)
            ts.processing_on = None
            ts.state = "released"
            if crashed:
                ts.suspicious += 1
            if ts.suspicious >= self.allowed_failures:
                text = (f"KilledWorker: task {ts.key!r} was running on {ts.suspicious} workers "
                        f"that died (the last: {ws.address}); it is not retried again")
                recs.update(self._err(ts, None, None, text, kind="KilledWorker"))
            else:
                recs[ts] = "waiting"
        for ts in sorted(ws.has_what):
            ts.who_has.discard(ws)
            if not ts.who_has and ts.state == "memory":
                self._lost_value(ts, recs)
        ws.has_what.clear()
        # queued tasks that may only run on workers that are all gone now
        for ts in sorted(self.queued):
            if ts.restrictions is not None and not (ts.restrictions & self.workers.keys()):
                self._dequeue(ts)
                recs.update(self._err(ts, None, None, self._no_worker_text(ts), kind="ValueError"))
        self._recommend(recs)

    def _heartbeat(self, ev: HeartbeatEvent) -> None:
        ws = self.workers.get(ev.worker)
        if ws is not None:
            note_seen(ws, ev.now)

    def _check_liveness(self, ev: CheckLivenessEvent) -> None:
        gone = expired(self.workers.values(), ev.now, self.worker_ttl)
        for ws, _ in gone:  # all of them first: none may take over another's tasks
            del self.workers[ws.address]
        for ws, silent in gone:
            # logged when they act only: a heartbeat per worker a second would crowd the log
            self.log.append((ev.stimulus_id, type(ev).__name__, ws.address))
            self._emit(CloseWorkerStream(self._stimulus, ws.address, silent))
            self._drop_worker(ws, crashed=True)

    def _add_client(self, ev: AddClientEvent) -> None:
        self.clients.add(ev.client)

    def _remove_client(self, ev: RemoveClientEvent) -> None:
        self.clients.discard(ev.client)
        keys = [ts.key for ts in self.tasks.values() if ev.client in ts.who_wants]
        self._release_keys(ReleaseKeysEvent(ev.stimulus_id, ev.client, keys))

    def _update_graph(self, ev: UpdateGraphEvent) -> None:
        new = {t.key: t for t in ev.tasks if t.key not in self.tasks}
        # check before changing anything: unknown dependencies, cycles
        for t in new.values():
            for dep in t.dependencies:
                if dep not in new and dep not in self.tasks:
                    self._refuse_graph(ev, f"task {t.key!r} depends on unknown key {dep!r}")
                    return
        cycle = find_cycle(new)
        if cycle:
            self._refuse_graph(ev, "the graph has a cycle: " + " -> ".join(map(repr, cycle)))
            return
        generation = next(self._generation)
        order = topological(new)
        created: list[TaskState] = []
        for i, key in enumerate(order):
            t = new[key]
            ts = TaskState(key, payload=t.payload, priority=(generation, i), retries=t.retries)
            if t.restrictions is not None:
                ts.restrictions = set(t.restrictions)
            self.tasks[key] = ts
            created.append(ts)
        for ts in created:
            for dep_key in new[ts.key].dependencies:
                dep = self.tasks[dep_key]
                ts.dependencies.add(dep)
                dep.dependents.add(ts)
        for key in ev.wanted:
            if key in self.tasks:
                self.tasks[key].who_wants.add(ev.client)
        self.clients.add(ev.client)
        recs: dict[TaskState, str] = {}
        for ts in created:
            if ts.state != "released":
                continue  # erred already, with a dependency that cannot run
            if ts.restrictions is not None and not (ts.restrictions & self.workers.keys()):
                recs.update(self._err(ts, None, None, self._no_worker_text(ts), kind="ValueError"))
                continue
            recs[ts] = "waiting"
        # wanted keys that already existed: tell the client now, or compute them again
        for key in ev.wanted:
            old = self.tasks.get(key)
            if old is None:
                # neither in this graph nor known: say so rather than leave a future hanging
                self._emit(ClientMsg(self._stimulus, ev.client, to_wire(TaskErredMsg(
                    key, text=f"KeyError: {key!r} is neither in the submitted graph nor known "
                              "to the scheduler (was it released?)",
                    kind="KeyError", blame=key,
                ))))
                continue
            if key in new:
                continue
            if old.state == "memory":
                self._to_clients(old, self._in_memory_msg(old), only=ev.client)
            elif old.state == "erred":
                self._report_error(old, only=ev.client)
            elif old.state == "released":
                recs[old] = "waiting"
        self._recommend(recs)

    def _refuse_graph(self, ev: UpdateGraphEvent, reason: str) -> None:
        for key in ev.wanted:
            self._emit(ClientMsg(self._stimulus, ev.client, to_wire(TaskErredMsg(
                key, text=f"GraphError: {reason}", kind="GraphError", blame=key,
            ))))

    def _task_finished(self, ev: TaskFinishedEvent) -> None:
        ts = self.tasks.get(ev.key)
        ws = self.workers.get(ev.worker)
        if ws is None:
            return
        if ts is None or ts.state not in ("processing", "memory") or (ts.state == "processing" and ts.processing_on is not ws):
            # a result nobody wants any more (released or moved meanwhile)
            if ts is None or ws not in ts.who_has:
                self._emit(FreeKeys(self._stimulus, ws.address, [ev.key]))
            return
        self._record_duration(ev.duration)
        if ts.state == "memory":
            self._add_replica(ts, ws)
            return
        ts.nbytes = ev.nbytes
        ts.shm, ts.shm_owner = (ev.shm, ws.address) if ev.shm is not None else (None, "")
        ts.inline = ev.value
        self._recommend(self._transition(ts, "memory", ws))

    def _task_erred(self, ev: TaskErredEvent) -> None:
        ts = self.tasks.get(ev.key)
        ws = self.workers.get(ev.worker)
        if ts is None or ws is None or ts.state != "processing" or ts.processing_on is not ws:
            return
        if ts.retries > 0:
            ts.retries -= 1
            self._recommend(self._transition(ts, "waiting"))
        else:
            self._recommend(self._transition(ts, "erred", ev.exception, ev.traceback, ev.exception_text))

    def _release_keys(self, ev: ReleaseKeysEvent) -> None:
        recs: dict[TaskState, str] = {}
        for key in ev.keys:
            ts = self.tasks.get(key)
            if ts is None:
                continue
            ts.who_wants.discard(ev.client)
            if not ts.who_wants and not ts.waiters:
                recs[ts] = "forgotten"
        self._recommend(recs)

    def _cancel_keys(self, ev: CancelKeysEvent) -> None:
        recs: dict[TaskState, str] = {}
        for key in ev.keys:
            ts = self.tasks.get(key)
            if ts is None:
                continue
            # a value in memory is only released; otherwise the client's futures on this
            # task and on everything built on it are cancelled
            for dts in [ts] if ts.state == "memory" else [ts, *dependents_closure(ts)]:
                if ev.client in dts.who_wants:
                    dts.who_wants.discard(ev.client)
                    self._emit(ClientMsg(self._stimulus, ev.client, to_wire(CancelledKeyMsg(dts.key))))
                if not dts.who_wants:
                    # tasks other clients still need keep their waiters: "forgotten" skips them
                    recs[dts] = "forgotten"
        self._recommend(recs)

    def _update_data(self, ev: UpdateDataEvent) -> None:
        self.clients.add(ev.client)
        recs: dict[TaskState, str] = {}
        for key, addresses in ev.who_has.items():
            workers = [self.workers[a] for a in addresses if a in self.workers]
            if not workers:
                continue
            ts = self.tasks.get(key)
            if ts is None:
                ts = self.tasks[key] = TaskState(key, priority=(next(self._generation), 0))
            ts.who_wants.add(ev.client)
            if ts.state == "processing":
                # a task is computing this key already: keep it; it will report the value,
                # and copies elsewhere are not needed
                for ws in workers:
                    if ws is not ts.processing_on:
                        self._emit(FreeKeys(self._stimulus, ws.address, [key]))
                continue
            if ts.state == "memory":
                for ws in workers:
                    self._add_replica(ts, ws)
                continue
            if ts.state != "released":
                # waiting, queued or erred: the value is here now, stop computing it
                recs.update(self._transition(ts, "released"))
            ts.nbytes = ev.nbytes.get(key, 0)
            ts.state = "memory"
            for ws in workers:
                self._add_replica(ts, ws)
            info = ev.shm.get(key)
            ts.shm, ts.shm_owner = (info, workers[0].address) if info is not None and len(workers) == 1 else (None, "")
            recs.update(self._on_memory(ts))
        self._recommend(recs)

    def _missing_data(self, ev: MissingDataEvent) -> None:
        ts = self.tasks.get(ev.key)
        ws = self.workers.get(ev.errant_worker)
        if ts is None or ws is None or ws not in ts.who_has:
            return
        ts.who_has.discard(ws)
        ws.has_what.discard(ts)
        ws.nbytes -= max(ts.nbytes, 0)
        if not ts.who_has and ts.state == "memory":
            recs: dict[TaskState, str] = {}
            self._lost_value(ts, recs)
            self._recommend(recs)

    def _reschedule(self, ev: RescheduleEvent) -> None:
        ts = self.tasks.get(ev.key)
        ws = self.workers.get(ev.worker)
        if ts is None or ws is None or ts.state != "processing" or ts.processing_on is not ws:
            return
        self._recommend(self._transition(ts, "waiting"))

    # -- transitions

    def _recommend(self, recs: dict[TaskState, str]) -> None:
        """Carry out recommendations, and those they lead to, until none are left.

        First in, first out: recommendations are made in priority order (a graph's tasks,
        a finished task's dependents), so that is the order tasks go to workers in. A
        task may be recommended twice (say "processing", then "forgotten", which is
        skipped if a dependent still waits for it): each recommendation is kept, and
        one that no longer fits the task's state is dropped.
        """
        pending = deque(recs.items())
        while pending:
            ts, finish = pending.popleft()
            if ts.state in ("forgotten", finish):
                continue
            if finish == "processing" and (ts.state != "waiting" or ts.waiting_on):
                continue  # moved on since: erred, released, or waiting on a lost input
            if finish == "waiting" and ts.state != "released":
                continue  # already on its way, or erred
            pending.extend(self._transition(ts, finish).items())

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
            if finish == "forgotten" and start in ("memory", "waiting", "queued", "processing", "erred"):
                more = self._transition(ts, "released")
                return {**more, ts: "forgotten"} if ts.state == "released" else more
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
        recs: dict[TaskState, str] = {}
        ts.state = "waiting"
        ts.waiting_on = set()
        for dep in sorted(ts.dependencies):
            if dep.state == "erred":
                blame = dep.exception_blame or dep
                return self._err(ts, blame.exception, blame.traceback, blame.exception_text, blame=blame)
        for dep in sorted(ts.dependencies):
            dep.waiters.add(ts)
            if dep.state != "memory":
                ts.waiting_on.add(dep)
                if dep.state == "released":
                    recs[dep] = "waiting"
        if not ts.waiting_on:
            recs[ts] = "processing"
        return recs

    def _waiting_processing(self, ts: TaskState) -> dict[TaskState, str]:
        if ts.restrictions is not None and not (ts.restrictions & self.workers.keys()):
            return self._err(ts, None, None, self._no_worker_text(ts), kind="ValueError")
        ws = self._decide_worker(ts)
        if ws is None:
            ts.state = "queued"
            heapq.heappush(self.queued, ts)
            return {}
        self._send_to(ts, ws)
        return {}

    def _queued_processing(self, ts: TaskState, ws: WorkerState) -> dict[TaskState, str]:
        self._send_to(ts, ws)
        return {}

    def _processing_waiting(self, ts: TaskState) -> dict[TaskState, str]:
        """Run it again (a retry, or the worker gave it back); its inputs stay where they are."""
        ws = ts.processing_on
        assert ws is not None
        ws.processing.discard(ts)
        ts.processing_on = None
        ts.state = "released"
        return self._released_waiting(ts)

    def _send_to(self, ts: TaskState, ws: WorkerState) -> None:
        ts.state = "processing"
        ts.processing_on = ws
        ws.processing.add(ts)
        self._emit(ComputeTask(
            self._stimulus, ws.address, ts.key, ts.payload,
            {d.key: sorted(w.address for w in d.who_has) for d in sorted(ts.dependencies)},
            {d.key: d.nbytes for d in sorted(ts.dependencies)},
            ts.priority,
            {d.key: d.shm for d in ts.dependencies if self._shm_valid(d)},
            bool(ts.who_wants),
        ))

    @staticmethod
    def _shm_valid(ts: TaskState) -> bool:
        """Whether ``ts``'s shared-memory copy still exists (its owner holds the key)."""
        return ts.shm is not None and any(ws.address == ts.shm_owner for ws in ts.who_has)

    def _processing_memory(self, ts: TaskState, ws: WorkerState) -> dict[TaskState, str]:
        assert ts.processing_on is not None
        ts.processing_on.processing.discard(ts)
        ts.processing_on = None
        ts.state = "memory"
        self._add_replica(ts, ws)
        return self._on_memory(ts)

    def _on_memory(self, ts: TaskState) -> dict[TaskState, str]:
        recs: dict[TaskState, str] = {}
        for dts in sorted(ts.dependents):
            if ts in dts.waiting_on:
                dts.waiting_on.discard(ts)
                if not dts.waiting_on and dts.state == "waiting":
                    recs[dts] = "processing"
        ts.waiting_on.clear()
        for dep in sorted(ts.dependencies):
            dep.waiters.discard(ts)
            if not dep.waiters and not dep.who_wants and dep.state in _ACTIVE:
                recs[dep] = "forgotten"
        if ts.who_wants:
            self._to_clients(ts, self._in_memory_msg(ts))
        elif not ts.waiters:
            recs[ts] = "forgotten"
        return recs

    def _processing_erred(self, ts: TaskState, exception: Any, traceback: Any, text: str) -> dict[TaskState, str]:
        assert ts.processing_on is not None
        ts.processing_on.processing.discard(ts)
        ts.processing_on = None
        return self._err(ts, exception, traceback, text)

    def _to_released(self, ts: TaskState) -> dict[TaskState, str]:
        start = ts.state
        recs: dict[TaskState, str] = {}
        if start == "processing":
            ws = ts.processing_on
            assert ws is not None
            ws.processing.discard(ts)
            ts.processing_on = None
            self._emit(FreeKeys(self._stimulus, ws.address, [ts.key]))
        elif start == "queued":
            self._dequeue(ts)
        elif start == "memory":
            for ws in sorted(ts.who_has, key=lambda w: w.address):
                ws.has_what.discard(ts)
                ws.nbytes -= max(ts.nbytes, 0)
                self._emit(FreeKeys(self._stimulus, ws.address, [ts.key]))
            ts.who_has.clear()
            ts.inline = None
        elif start == "erred":
            ts.exception = ts.traceback = ts.exception_blame = None
            ts.exception_text = ""
            ts.error_kind = ""
        ts.state = "released"
        for dep in sorted(ts.dependencies):
            dep.waiters.discard(ts)
            if not dep.waiters and not dep.who_wants and dep.state in _ACTIVE:
                recs[dep] = "forgotten"
        ts.waiting_on.clear()
        # dependents still to run must wait for this value again
        for dts in ts.dependents:
            if dts.state == "waiting":
                dts.waiting_on.add(ts)
        return recs

    def _released_forgotten(self, ts: TaskState) -> dict[TaskState, str]:
        if any(d.state in ("waiting", "queued", "processing") for d in ts.dependents):
            # a dependent still has to run: compute this again
            return {ts: "waiting"}
        if ts.who_wants or any(d.state != "forgotten" for d in ts.dependents):
            return {}  # still needed by a client or by a dependent's record
        recs: dict[TaskState, str] = {}
        ts.state = "forgotten"
        del self.tasks[ts.key]
        for dep in sorted(ts.dependencies):
            dep.dependents.discard(ts)
            dep.waiters.discard(ts)
            if not dep.dependents and not dep.who_wants and dep.state in ("released", "erred", "memory"):
                recs[dep] = "forgotten"
        ts.dependencies.clear()
        return recs

    # -- helpers

    def _err(self, ts: TaskState, exception: Any, traceback: Any, text: str,
             blame: TaskState | None = None, kind: str = "") -> dict[TaskState, str]:
        """Mark ``ts`` and every dependent erred; tell the clients that want them.

        Returns recommendations: inputs nobody needs any more are forgotten, and so is
        ``ts`` if nobody wants it.
        """
        ts.state = "erred"
        ts.exception, ts.traceback, ts.exception_text = exception, traceback, text
        ts.exception_blame = blame or ts
        ts.error_kind = kind
        ts.waiting_on.clear()
        recs: dict[TaskState, str] = {}
        for dep in sorted(ts.dependencies):
            dep.waiters.discard(ts)
            if not dep.waiters and not dep.who_wants and dep.state in _ACTIVE:
                recs[dep] = "forgotten"
        self._report_error(ts)
        for dts in sorted(ts.dependents):
            if dts.state in ("waiting", "queued", "processing", "released"):
                if dts.state == "queued":
                    self._dequeue(dts)
                elif dts.state == "processing" and dts.processing_on is not None:
                    dts.processing_on.processing.discard(dts)
                    self._emit(FreeKeys(self._stimulus, dts.processing_on.address, [dts.key]))
                    dts.processing_on = None
                recs.update(self._err(dts, exception, traceback, text, blame=ts.exception_blame, kind=kind))
        if not ts.who_wants and not ts.dependents:
            recs[ts] = "forgotten"
        return recs

    def _no_worker_text(self, ts: TaskState) -> str:
        assert ts.restrictions is not None
        return (f"ValueError: task {ts.key!r} may only run on workers={sorted(ts.restrictions)}, and no such "
                f"worker is in the cluster; the workers are {sorted(self.workers)}")

    def _dequeue(self, ts: TaskState) -> None:
        self.queued.remove(ts)
        heapq.heapify(self.queued)

    def _report_error(self, ts: TaskState, only: str | None = None) -> None:
        blame = ts.exception_blame or ts
        self._to_clients(ts, to_wire(TaskErredMsg(
            ts.key, ts.exception, ts.traceback, ts.exception_text,
            kind=blame.error_kind or ts.error_kind, blame=blame.key,
        )), only=only)

    def _in_memory_msg(self, ts: TaskState) -> dict[str, Any]:
        return to_wire(KeyInMemoryMsg(
            ts.key, ts.nbytes, sorted(ws.address for ws in ts.who_has),
            shm=ts.shm if self._shm_valid(ts) else None, value=ts.inline,
        ))

    def _lost_value(self, ts: TaskState, recs: dict[TaskState, str]) -> None:
        ts.inline = None
        """The last copy of ``ts``'s value is gone: recompute it if anyone needs it."""
        ts.state = "released"
        for dts in ts.dependents:
            if dts.state == "waiting":
                dts.waiting_on.add(ts)
            elif dts.state == "queued":
                self._dequeue(dts)
                dts.state = "waiting"
                dts.waiting_on = {d for d in dts.dependencies if d.state != "memory"}
            # a processing dependent stays: its worker may have the value already, and
            # gives the task back (reschedule) if it cannot get it
        if ts.waiters or ts.who_wants:
            for client in sorted(ts.who_wants):
                self._emit(ClientMsg(self._stimulus, client, to_wire(LostKeyMsg(ts.key))))
            recs[ts] = "waiting"
        else:
            recs[ts] = "forgotten"

    def _add_replica(self, ts: TaskState, ws: WorkerState) -> None:
        if ws not in ts.who_has:
            ts.who_has.add(ws)
            ws.has_what.add(ts)
            ws.nbytes += max(ts.nbytes, 0)

    def _to_clients(self, ts: TaskState, msg: dict[str, Any], only: str | None = None) -> None:
        for client in ([only] if only is not None else sorted(ts.who_wants)):
            self._emit(ClientMsg(self._stimulus, client, msg))

    def _emit(self, instruction: Instruction) -> None:
        self._instructions.append(instruction)

    def _capacity(self, ws: WorkerState) -> int:
        return ws.nthreads * (1 + self._ahead_per_thread()) - len(ws.processing)

    def _ahead_per_thread(self) -> int:
        """Tasks a worker holds beyond one per thread: enough to stay busy for the time
        a refill takes (short tasks need more), at least ``ahead``, at most ``max_ahead``."""
        avg = self.average_duration
        if avg <= 0:
            return self.ahead
        return max(self.ahead, min(self.max_ahead, int(self.refill_seconds / avg)))

    def _record_duration(self, duration: float) -> None:
        # a worker reports it: a tiny, huge or non-finite one must not reach the
        # division in _ahead_per_thread (int(inf) raised there for every placement)
        if duration > 0 and math.isfinite(duration):
            duration = min(max(duration, _MIN_DURATION), _MAX_DURATION)
            avg = self.average_duration
            self.average_duration = duration if avg <= 0 else 0.9 * avg + 0.1 * duration

    def _decide_worker(self, ts: TaskState) -> WorkerState | None:
        """The worker with room that holds the most input bytes; then the least busy."""
        if ts.restrictions is not None:
            candidates: Iterable[WorkerState] = (self.workers[a] for a in ts.restrictions if a in self.workers)
        else:
            candidates = self.workers.values()
        best: WorkerState | None = None
        best_score: tuple[float, float, str] | None = None
        for ws in candidates:
            if self._capacity(ws) <= 0:
                continue
            local = sum(max(d.nbytes, 1) for d in ts.dependencies if ws in d.who_has) if ts.dependencies else 0
            score = (-local, len(ws.processing) / ws.nthreads, ws.address)
            if best_score is None or score < best_score:
                best, best_score = ws, score
        return best

    def _fill(self, ws: WorkerState) -> None:
        """Give queued tasks to ``ws`` while it has room."""
        if not self.queued:
            return
        skipped: list[TaskState] = []
        while self.queued and self._capacity(ws) > 0:
            ts = heapq.heappop(self.queued)
            if ts.restrictions is not None and ws.address not in ts.restrictions:
                skipped.append(ts)
                continue
            self._recommend(self._transition(ts, "processing", ws))
        for ts in skipped:
            heapq.heappush(self.queued, ts)

    def _fill_all(self) -> None:
        for ws in list(self.workers.values()):
            self._fill(ws)

    # -- inspection

    def validate(self) -> None:
        """Check every invariant; raise ``AssertionError`` on the first broken one."""
        validate_state(self)

    def task_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for ts in self.tasks.values():
            counts[ts.state] = counts.get(ts.state, 0) + 1
        return counts


#: events that only keep time: not logged unless they act (see _check_liveness)
_CLOCK_EVENTS = frozenset({HeartbeatEvent, CheckLivenessEvent})

#: states that hold a value or will compute one: worth forgetting once nobody needs them
_ACTIVE = frozenset({"waiting", "queued", "processing", "memory"})

_TRANSITIONS: dict[tuple[str, str], Callable[..., dict[TaskState, str]]] = {
    ("released", "waiting"): SchedulerState._released_waiting,
    ("waiting", "processing"): SchedulerState._waiting_processing,
    ("queued", "processing"): SchedulerState._queued_processing,
    ("processing", "memory"): SchedulerState._processing_memory,
    ("processing", "erred"): SchedulerState._processing_erred,
    ("processing", "waiting"): SchedulerState._processing_waiting,
    ("waiting", "released"): SchedulerState._to_released,
    ("queued", "released"): SchedulerState._to_released,
    ("processing", "released"): SchedulerState._to_released,
    ("memory", "released"): SchedulerState._to_released,
    ("erred", "released"): SchedulerState._to_released,
    ("released", "forgotten"): SchedulerState._released_forgotten,
}
