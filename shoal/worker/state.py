"""A worker's decisions, without IO.

Theory of operation
-------------------
``WorkerState.handle(*events)`` takes events (the scheduler sent a task, a task
finished in an executor thread, a fetch from a peer came back) and returns
instructions for the server (``Execute`` a task, ``GatherDep`` from a peer,
``SendMsg`` to the scheduler). It imports no asyncio and reads no clock.

A key the worker knows is either a task to compute (sent by the scheduler) or a
dependency to fetch from peers. States (``WState``)::

    compute:  waiting -> ready -> executing -> memory            (or: error, reported)
                                      \\-> cancelled (freed while running; the result is
                                           dropped, or kept as a copy if a local task needs it)
    fetch:    fetch -> flight -> memory
                 ^--------/ (missing on that peer: the next holder; none left: the tasks
                            that need it go back to the scheduler, ``reschedule``)

``released`` is where a key starts (a record just made) and ends: a released key is
forgotten at once (it leaves ``tasks``, its value leaves ``data``), so no key rests in
it between two calls of ``handle()``. A task that erred is reported (``task-erred``)
and forgotten: the worker keeps no ``error`` state. A key whose value will not come
from where it was expected (its computation failed or was freed, its holder did not
have it) goes back to ``fetch`` if a local task needs it and another holder has it.

Transitions are data: ``TRANSITIONS`` (:mod:`shoal.worker.model`) lists, for each
state, the states it may go to, and :meth:`WorkerState._set_state` is the one place a key's state changes. An illegal
pair raises :class:`~shoal.statelog.InvalidTransition` and changes nothing; every legal
one is kept in ``log`` (a :class:`~shoal.statelog.StateLog`) with the stimulus that
caused it, next to the events handled (less their values), so that ``story(key)``
tells what happened to a key, and feeding ``log.events`` to a fresh ``WorkerState``
(same parameters, the same grouping into ``handle()`` calls) replays the run: the
machine is deterministic (no clock, no set order: ties break by creation order). The
messages it sends carry the id of the stimulus that caused them (``stimulus_id``).

A fetch that fails (the server has already retried it, with backoff, as often as
``gather-attempts`` says, or its holder did not answer within ``fetch-timeout``)
counts against its peer. A holder that answers without a key is reported
(``missing-data``) once and the next holder asked; with none left the tasks that need
the key go back to the scheduler, which decides whether to believe that holder still
(:mod:`shoal.scheduler.reports`: it asks the holder itself): nothing here asks one
holder twice for one task. After ``max_peer_failures`` failed fetches from one peer in
a row, the tasks that need a value only that peer holds err with the fetch's error
instead of going back to the scheduler once more: the scheduler would send them here
again, and the same fetch would fail again (a peer this worker cannot reach, a worker
out of descriptors, a holder that keeps answering without what it was asked for: such
an answer counts as a failed fetch). A fetch from that peer that brings something
clears its count.

A value this worker held may be lost without the worker dying: its spill file did
not give back what was written (a checksum failed, :mod:`.spill`). The server finds
that out when it reads the value for a task or a peer, and says so
(``DataLostEvent``): the key is forgotten, the scheduler hears ``missing-data`` naming
this worker (it computes the value again, or errs the tasks that need a scattered
one), and the local tasks that were to use it go back to the scheduler
(``reschedule``), the one about to start included.

The worker runs at most ``nthreads`` tasks at once and takes more from the scheduler
than it can run, so it fetches the inputs of the next tasks while computing. Up to
``queued`` more tasks whose inputs are all here are handed to the thread pool ahead
(state ``executing``, waiting for a thread): a thread that finishes one task starts the
next at once, with no round trip through the event loop. Fetches go
to one peer at a time per peer, batched: every input wanted from that peer goes in one
request, up to ``gather_bytes``. With ``transfer_bytes`` (a worker with a memory limit:
``memory-transfer`` of it), the bytes in flight over the network at once stay within
it too, and so does each request: a worker that recomputes what a lost peer held
does not take in more than it can hold (one request may exceed it when it is the only
one in flight: a single value larger than it must still come). Values mapped from
shared memory are not counted: they cost the mapper nothing.

A task that asks for abstract resources (``{"GPU": 1}``, of those the worker was
started with) waits in ``ready`` until they are free, then holds them until its thread
reports (done, erred, or cancelled and returned), also while it waits in the thread
pool. Such tasks start in their order of priority; tasks that need none pass them.

A worker whose memory passed its pause threshold gets a ``PauseEvent``: from then on
no task is handed to the thread pool and no fetch begins (a seceded task may still
rejoin: it runs already), until an ``UnpauseEvent``. Tasks handed to the pool ahead wait
there too (the server holds the pool). While its memory is past its target
(``MemoryTightEvent``), no task is handed ahead: the next starts once a thread is free
and the last result is stored (and spilled), so that two results are not in memory at
once beside the values the target allows.

A running task may leave the thread pool (``secede()``, e.g. to wait for tasks it
submitted): it gives up its slot (not its resources), so another task runs in its
place, and the scheduler hears that it is ``long-running``. ``rejoin()`` asks for a
slot again: the task gets the first one free (no new task starts before it) and its
thread waits until then (the ``Rejoin`` instruction).

A task whose thread is running keeps its record until the thread reports, so one key
never runs twice at once. Fetched copies are the worker's own business: it drops them
once no local task needs them. Values it computed (or received by scatter) are dropped
when the scheduler says.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

from ..protocol.messages import Key
from ..statelog import InvalidTransition, StateLog, Transition
from . import events as _events
from .events import (
    AttachShm,
    ComputeTaskEvent,
    DataLostEvent,
    Event,
    Execute,
    ExecuteFailureEvent,
    ExecuteSuccessEvent,
    FreeKeysEvent,
    GatherDep,
    GatherDepFailureEvent,
    GatherDepSuccessEvent,
    Instruction,
    Rejoin,
    MemoryTightEvent,
    PauseEvent,
    RejoinEvent,
    SecedeEvent,
    SendMsg,
    UnpauseEvent,
    UpdateDataEvent,
)
from .fetching import Fetching
from .model import SHM, TRANSITIONS, WState, WTask
from .validation import validate_state

__all__ = ["WorkerState", "WTask", "WState", "SHM", *_events.__all__]


# -------------------------------------------------------------------------- the state


class WorkerState(Fetching):
    def __init__(
        self,
        address: str,
        nthreads: int = 1,
        data: MutableMapping[Key, Any] | None = None,
        gather_bytes: int = 64 << 20,
        max_gathers: int = 4,
        log_size: int = 10_000,
        queued: int = 0,
        max_peer_failures: int = 3,
        resources: Mapping[str, float] | None = None,
        transfer_bytes: int | None = None,
    ):
        if nthreads < 1:
            raise ValueError(f"a worker needs at least one thread, got {nthreads}")
        if queued < 0:
            raise ValueError(f"queued must be >= 0, got {queued}")
        if max_peer_failures < 1:
            raise ValueError(f"max_peer_failures must be >= 1, got {max_peer_failures}")
        self.address = address
        self.nthreads = nthreads
        #: tasks handed to the thread pool at once: one per thread and ``queued`` more
        self.slots = nthreads + queued
        self.data: MutableMapping[Key, Any] = {} if data is None else data
        self.tasks: dict[Key, WTask] = {}
        #: the last RELEASED_KEYS keys this worker forgot, oldest first: a peer of its
        #: host asking for one of them has an old ``who_has`` and is answered at once
        #: (a key it never heard of may be one it is about to fetch: that request waits)
        self.released: dict[Key, None] = {}
        #: ready tasks that need no resources, and those that do: heaps of
        #: ``(priority, seq, task)`` (compared in C: ``seq`` is unique)
        self.ready: list[tuple[tuple[int, ...], int, WTask]] = []
        self.constrained: list[tuple[tuple[int, ...], int, WTask]] = []
        #: tasks that hold a slot (running, or waiting in the thread pool)
        self.executing: set[WTask] = set()
        #: tasks whose thread runs without a slot (``secede()``), and those of them
        #: waiting for one again (``rejoin()``), first come first served
        self.seceded: set[WTask] = set()
        self.rejoining: list[WTask] = []
        #: abstract resources this worker offers, what of them is free, and what each
        #: task whose thread has not reported yet holds
        self.total_resources: dict[str, float] = {k: float(v) for k, v in (resources or {}).items()}
        self.available_resources: dict[str, float] = dict(self.total_resources)
        self.holding: dict[WTask, dict[str, float]] = {}
        self.fetching: set[WTask] = set()  # state "fetch"
        self.in_flight_workers: dict[str, set[WTask]] = {}
        #: counts what may let a fetch start (a key to fetch, a holder more); with the
        #: peers and bytes in flight, what the last pass over the fetches saw when it
        #: could start no more (another pass then needs one of them to change)
        self._fetch_version = 0
        self._fetch_blocked: tuple[int, int, int] | None = None
        if transfer_bytes is not None and transfer_bytes < 1:
            raise ValueError(f"transfer_bytes must be at least 1 (or None), got {transfer_bytes}")
        #: bytes fetched over the network at once, at most (None: no bound but requests')
        self.transfer_bytes = transfer_bytes
        self.gather_bytes = gather_bytes if transfer_bytes is None else min(gather_bytes, transfer_bytes)
        self.max_gathers = max_gathers
        self.max_peer_failures = max_peer_failures
        #: peer -> fetches from it that failed in a row (bounded: see _count_failure)
        self.peer_failures: dict[str, int] = {}
        #: the events handled (their values dropped) and every key's transitions
        self.log = StateLog(events=log_size, transitions=10 * log_size)
        self._out: list[Instruction] = []
        self._seq = itertools.count()
        self._stimulus = ""
        self._handlers: dict[type, Callable[[Any], None]] = {
            ComputeTaskEvent: self._compute_task,
            FreeKeysEvent: self._free_keys,
            ExecuteSuccessEvent: self._execute_success,
            ExecuteFailureEvent: self._execute_failure,
            GatherDepSuccessEvent: self._gather_success,
            GatherDepFailureEvent: self._gather_failure,
            UpdateDataEvent: self._update_data,
            DataLostEvent: self._data_lost,
            SecedeEvent: self._secede,
            RejoinEvent: self._rejoin,
            PauseEvent: self._pause,
            MemoryTightEvent: self._memory_tight,
            UnpauseEvent: self._unpause,
        }
        #: over the memory pause threshold: no task starts, no fetch begins
        self.paused = False
        #: memory past the target: no task is handed to the pool ahead
        self.tight = False

    def handle(self, *events: Event) -> list[Instruction]:
        """Apply events in order; return the instructions they produce. Raises only on
        a bug of this machine (e.g. :class:`~shoal.statelog.InvalidTransition`): the
        state may then be half-changed, and the worker must not go on with it."""
        out: list[Instruction] = []
        self._out = out
        for i, event in enumerate(events):
            self._stimulus = event.stimulus_id
            self.log.event(event, first=i == 0)
            self._handlers[type(event)](event)
        self._ensure_communicating()
        self._ensure_computing()
        self._out = []
        return out

    def story(self, *keys: Key) -> list[Transition]:
        """What happened to ``keys`` here: their transitions still in the log, oldest
        first, each with the stimulus that caused it."""
        return self.log.story(*keys)

    def _set_state(self, ts: WTask, finish: WState) -> None:
        """The one place a key's state changes: ``finish`` must be in
        ``TRANSITIONS[ts.state]`` (else :class:`~shoal.statelog.InvalidTransition`, and
        nothing changes); the change is logged with the current stimulus."""
        start = ts.state
        if finish not in TRANSITIONS[start]:
            raise InvalidTransition(f"{ts.key!r}: {start} -> {finish} is not allowed")
        ts.state = finish
        self.log.transitions.append((ts.key, start, finish, self._stimulus))
        if finish == "fetch":
            self._fetch_version += 1

    # -- events

    def _compute_task(self, ev: ComputeTaskEvent) -> None:
        ts = self.tasks.get(ev.key)
        if ts is not None:
            if ts.state == "memory":
                ts.origin = "compute"
                self._send({"op": "task-finished", "key": ts.key, "nbytes": ts.nbytes})
                return
            if ts.state == "cancelled":
                self._set_state(ts, "executing")  # still running: report it this time
                ts.origin = "compute"
                if ts in self.seceded:
                    self._send({"op": "long-running", "key": ts.key})  # as when it seceded
                return
            if ts.state in ("waiting", "ready", "executing"):
                return  # already on it
        if ev.locate:
            self._locate(ts, ev)
            return
        # an input nobody can send (not here, no other holder): give the task back, and
        # tell the scheduler when it believed this worker held the input
        unavailable = [k for k, holders in ev.who_has.items()
                       if k not in self.tasks and not set(holders) - {self.address} and k not in ev.shm]
        if unavailable:
            for k in unavailable:
                if self.address in ev.who_has[k]:
                    self._send({"op": "missing-data", "key": k, "errant_worker": self.address})
            self._send({"op": "reschedule", "key": ev.key})
            return
        short = {r: a for r, a in (ev.resources or {}).items() if a > self.total_resources.get(r, 0.0)}
        if short:
            # it would wait here forever (a scheduler that does not place by resources)
            self._send({"op": "task-erred", "key": ev.key, "exception": None, "traceback": "",
                        "text": f"ValueError: task {ev.key!r:.100} needs resources {short}, more than worker "
                                f"{self.address} has ({self.total_resources or 'none'})"})
            return
        if ts is None:
            ts = self.tasks[ev.key] = WTask(ev.key, seq=next(self._seq))
        else:
            # it was an input we were fetching: compute it here instead
            self._drop_fetch(ts)
        ts.origin = "compute"
        ts.payload = ev.payload
        ts.report = ev.report
        ts.local = ev.local
        ts.priority = tuple(ev.priority)
        # an amount of 0 is no need (nor a resource this worker must offer)
        ts.resources = {r: a for r, a in (ev.resources or {}).items() if a > 0} or None
        ts.waiting_for_data = set()
        for dep_key, holders in ev.who_has.items():
            if dep_key == ev.key:
                continue
            dts = self.tasks.get(dep_key)
            if dts is None:
                dts = self.tasks[dep_key] = WTask(dep_key, origin="fetched", priority=ts.priority, seq=next(self._seq))
            dts.nbytes = ev.nbytes.get(dep_key) or dts.nbytes
            ts.dependencies.add(dts)
            dts.dependents.add(ts)
            if dts.state == "memory":
                continue
            dts.who_has.update(h for h in holders if h != self.address)
            if holders and holders[0] != self.address:
                dts.ask_first = holders[0]
            self._fetch_version += 1  # a holder more (or a segment) may let it start
            if dep_key in ev.shm and dts.state in ("released", "fetch"):
                dts.shm = ev.shm[dep_key]
            ts.waiting_for_data.add(dts)
            if dts.state == "released":
                self._set_state(dts, "fetch")
                self.fetching.add(dts)
            elif dts.state in ("fetch", "flight"):
                dts.priority = min(dts.priority, ts.priority)
            # else it is being computed here (waiting, ready, executing, cancelled)
        if ts.waiting_for_data:
            self._set_state(ts, "waiting")
        else:
            self._make_ready(ts)

    def _locate(self, ts: WTask | None, ev: ComputeTaskEvent) -> None:
        """A task that runs on where its inputs are (a shuffle's barrier): ready at
        once, its inputs neither fetched nor held here."""
        if ts is None:
            ts = self.tasks[ev.key] = WTask(ev.key, seq=next(self._seq))
        else:
            self._drop_fetch(ts)
        ts.origin = "compute"
        ts.payload = ev.payload
        ts.report = ev.report
        ts.priority = tuple(ev.priority)
        ts.resources = None
        ts.located = {k: (list(holders), ev.nbytes.get(k, 0), ev.shm.get(k))
                      for k, holders in ev.who_has.items() if k != ev.key}
        self._make_ready(ts)

    def _free_keys(self, ev: FreeKeysEvent) -> None:
        pending = {ts for ts in map(self.tasks.get, ev.keys) if ts is not None}
        for ts in _dependents_first(pending):
            if self.tasks.get(ts.key) is not ts or ts.state in ("fetch", "flight"):
                continue  # fetches are this worker's business, not the scheduler's
            if ts.state in ("executing", "cancelled"):
                # the thread cannot be stopped: drop (or keep for a local task) its result
                if ts.state == "executing":
                    self._set_state(ts, "cancelled")
                ts.origin = "fetched"
            elif self._needed(ts):
                if ts.state == "memory":
                    ts.origin = "fetched"  # a local task still needs this value: keep a copy
                else:
                    self._lose(ts)  # waiting or ready: not computed here after all
            else:
                self._release(ts)

    def _thread_done(self, key: Key) -> WTask | None:
        """The task whose thread reported, with its thread freed; ``None`` when the
        report is moot (unknown key, or a scattered value arrived meanwhile)."""
        ts = self.tasks.get(key)
        if ts is None or (ts not in self.executing and ts not in self.seceded):
            return None
        self.executing.discard(ts)
        self.seceded.discard(ts)
        held = self.holding.pop(ts, None)
        if held:
            self._give_back(held)
        if ts.state == "memory":
            return None  # a scattered value arrived meanwhile: keep that one
        return ts

    def _execute_success(self, ev: ExecuteSuccessEvent) -> None:
        ts = self._thread_done(ev.key)
        if ts is None:
            return
        if ts.state == "cancelled" and not self._needed(ts):
            self._release(ts)
            return
        ts.nbytes = ev.nbytes
        self._put(ts, ev.value, ev.managed)
        if ts.state == "memory" and ts.origin == "compute":
            msg: dict[str, Any] = {"op": "task-finished", "key": ts.key, "nbytes": ev.nbytes, "duration": ev.duration}
            if ev.shm is not None:
                msg["shm"] = ev.shm
            if ev.inline is not None:
                msg["value"] = ev.inline
            if ev.timing is not None:
                msg["timing"] = ev.timing
            if ev.transfers:
                msg["transfers"] = ev.transfers
            self._send(msg)
        self._release_unneeded_deps(ts)

    def _execute_failure(self, ev: ExecuteFailureEvent) -> None:
        ts = self._thread_done(ev.key)
        if ts is None:
            return
        if ts.state == "executing" and ev.reschedule:
            self._send({"op": "reschedule", "key": ts.key})
        elif ts.state == "executing":
            msg = {
                "op": "task-erred", "key": ts.key, "exception": ev.exception,
                "traceback": ev.traceback, "text": ev.text,
            }
            if ev.timing is not None:
                msg["timing"] = ev.timing
            if ev.transfers:
                msg["transfers"] = ev.transfers
            self._send(msg)
        self._lose(ts)

    def _update_data(self, ev: UpdateDataEvent) -> None:
        for key, value in ev.data.items():
            ts = self.tasks.get(key)
            if ts is None:
                ts = self.tasks[key] = WTask(key, origin="scattered", seq=next(self._seq))
            elif ts.state in ("waiting", "ready", "executing"):
                continue  # the scheduler has this key computed here: that reports the value
            elif ts.state in ("fetch", "flight"):
                self._drop_fetch(ts)
            elif ts.state == "cancelled":
                self._release_unneeded_deps(ts)  # its thread has its inputs already
            if ts.origin == "fetched":
                ts.origin = "scattered"
            ts.payload = None
            ts.nbytes = ev.nbytes.get(key, 0)
            self._put(ts, value)

    def _data_lost(self, ev: DataLostEvent) -> None:
        for key in ev.keys:
            ts = self.tasks.get(key)
            if ts is None or ts.state != "memory":
                continue
            # the scheduler drops this copy: it computes the value again if no other
            # worker holds it (or errs its dependents: a scattered value is lost)
            self._send({"op": "missing-data", "key": key, "errant_worker": self.address})
            for dts in sorted(ts.dependents):
                if dts.state in ("waiting", "ready") and self.tasks.get(dts.key) is dts:
                    self._reschedule(dts)
            if self.tasks.get(key) is ts:
                self._release(ts)
        if ev.task is not None:
            ts = self._thread_done(ev.task)
            if ts is not None:
                if ts.state == "executing":
                    self._send({"op": "reschedule", "key": ts.key})
                self._lose(ts)

    # -- helpers

    def _send(self, msg: dict[str, Any]) -> None:
        # the receiver files what it does about it under this stimulus too (protocol §6)
        msg["stimulus_id"] = self._stimulus
        self._out.append(SendMsg(self._stimulus, msg))

    def _make_ready(self, ts: WTask) -> None:
        self._set_state(ts, "ready")
        heapq.heappush(self.constrained if ts.resources else self.ready, (ts.priority, ts.seq, ts))

    def _needed(self, ts: WTask) -> bool:
        """Whether a local task still waits for ``ts``'s value, or is about to run with it."""
        return any(d.state in ("waiting", "ready") for d in ts.dependents)

    def _put(self, ts: WTask, value: Any, managed: int | None = None) -> None:
        """``ts``'s value is here: store it and wake the tasks waiting for it.
        ``managed``: its managed size, when measured already (off the event loop)."""
        self.fetching.discard(ts)
        if ts.state != "memory":  # else a new value (scattered again) replaces the old
            self._set_state(ts, "memory")
        put = getattr(self.data, "put", None) if managed is not None else None
        if put is not None:  # the worker's store: it need not measure the value again
            put(ts.key, value, managed)
        else:
            self.data[ts.key] = value
        for dts in sorted(ts.dependents):
            if ts in dts.waiting_for_data:
                dts.waiting_for_data.discard(ts)
                if not dts.waiting_for_data and dts.state == "waiting":
                    self._make_ready(dts)

    def _lose(self, ts: WTask) -> None:
        """``ts``'s value will not come from where it was expected (its computation here
        failed or was freed, or its holder did not have it): fetch it from another holder
        if a local task needs it, else give those tasks back to the scheduler; then
        forget ``ts`` unless it is being fetched."""
        self.fetching.discard(ts)
        if ts.coming_from is not None:
            self.in_flight_workers.get(ts.coming_from, set()).discard(ts)
            ts.coming_from = None
        waiting = sorted(d for d in ts.dependents if d.state == "waiting")
        if waiting and ts.who_has:
            self._release_unneeded_deps(ts)
            ts.payload = None
            ts.origin = "fetched"
            self._set_state(ts, "fetch")
            self.fetching.add(ts)
            return
        for dts in waiting:
            if self.tasks.get(dts.key) is dts and dts.state == "waiting":
                self._reschedule(dts)
        if self.tasks.get(ts.key) is ts:
            self._release(ts)

    def _reschedule(self, ts: WTask) -> None:
        """Give a task back to the scheduler (an input cannot be had)."""
        self._send({"op": "reschedule", "key": ts.key})
        self._lose(ts)

    def _drop_fetch(self, ts: WTask) -> None:
        self.fetching.discard(ts)
        if ts.coming_from is not None:
            self.in_flight_workers.get(ts.coming_from, set()).discard(ts)
            ts.coming_from = None
        self._set_state(ts, "released")

    def _release(self, ts: WTask) -> None:
        """Forget ``ts`` entirely (its value too) and drop inputs nobody needs now.

        Callers make sure no local task waits for it. A task whose thread still runs
        keeps its record (``cancelled``) until the thread reports.
        """
        data = self.data
        if ts.key in data:
            del data[ts.key]  # (not pop(): a spilled value would be read back to be dropped)
        if ts in self.executing or ts in self.seceded:
            if ts.state != "cancelled":
                self._set_state(ts, "cancelled")
            ts.origin = "fetched"
            return
        self._drop_fetch(ts)
        ts.payload = None
        if self.tasks.get(ts.key) is ts:
            del self.tasks[ts.key]
            released = self.released
            released.pop(ts.key, None)
            released[ts.key] = None
            if len(released) > RELEASED_KEYS:
                del released[next(iter(released))]
        for dts in ts.dependents:
            # only tasks that have their inputs already (executing) can be left
            dts.dependencies.discard(ts)
            dts.waiting_for_data.discard(ts)
        ts.dependents.clear()
        self._release_unneeded_deps(ts)

    def _release_unneeded_deps(self, ts: WTask) -> None:
        for dep in sorted(ts.dependencies):
            dep.dependents.discard(ts)
            if not dep.dependents and dep.origin == "fetched" and self.tasks.get(dep.key) is dep:
                self._release(dep)
        ts.dependencies.clear()
        ts.waiting_for_data.clear()

    def _ensure_computing(self) -> None:
        # a seceded task that asks for a thread back gets the first one free; no new
        # task takes a thread before it (else a busy worker would starve it)
        while self.rejoining and len(self.executing) < self.nthreads:
            back = self.rejoining.pop(0)
            self.seceded.discard(back)
            self.executing.add(back)
            self._out.append(Rejoin(self._stimulus, back.key))
        if self.rejoining or self.paused:
            return
        limit = self.open_slots
        while len(self.executing) < limit:
            ts = self._next_ready()
            if ts is None:
                break
            if ts.resources:
                self._take(ts)
            self._set_state(ts, "executing")
            self.executing.add(ts)
            self._out.append(Execute(self._stimulus, ts.key))
        if limit > self.nthreads:
            self._overtake()

    def _overtake(self) -> None:
        """A ready task more urgent than one handed to the thread pool ahead (which may
        not have started) goes to the pool too: the pool takes work by priority, so it
        starts first. (How many that can be is bounded by the scheduler: it gives a
        worker at most ``nthreads * (1 + ahead)`` tasks.)"""
        ready = self.ready
        worst = None
        while ready:
            while ready and not self._live(ready[0][2], False):
                heapq.heappop(ready)
            if not ready:
                return
            if worst is None:
                # stays the worst: only more urgent ones join
                worst = max([(t.priority, t.seq) for t in self.executing])
            head = ready[0]
            if not (head[0], head[1]) < worst:
                return
            ts = heapq.heappop(ready)[2]
            self._set_state(ts, "executing")
            self.executing.add(ts)
            self._out.append(Execute(self._stimulus, ts.key))

    def _next_ready(self) -> WTask | None:
        """Pop the ready task to run next: the first by priority of those that need no
        resources and of the first that needs some, if they are free. Tasks that need
        resources start in their order: one that waits for them holds back the others
        that need some (so a large request is not starved by small ones)."""
        ready, constrained = self.ready, self.constrained
        while ready and not self._live(ready[0][2], False):
            heapq.heappop(ready)  # released (or computed again) while it waited
        while constrained and not self._live(constrained[0][2], True):
            heapq.heappop(constrained)
        if constrained and self.fits(constrained[0][2]) and (not ready or constrained[0] < ready[0]):
            return heapq.heappop(constrained)[2]
        return heapq.heappop(ready)[2] if ready else None

    def _live(self, ts: WTask, constrained: bool) -> bool:
        """Whether a heap entry still stands for a ready task (of that heap)."""
        return ts.state == "ready" and self.tasks.get(ts.key) is ts and bool(ts.resources) == constrained

    def fits(self, ts: WTask) -> bool:
        """Whether the resources ``ts`` needs are free now."""
        available = self.available_resources
        return all(amount <= available.get(name, 0.0) for name, amount in (ts.resources or {}).items())

    def _take(self, ts: WTask) -> None:
        assert ts.resources is not None
        held = self.holding[ts] = dict(ts.resources)
        for name, amount in held.items():
            self.available_resources[name] -= amount

    def _give_back(self, held: dict[str, float]) -> None:
        available = self.available_resources
        if not self.holding:
            # nobody holds any: exactly the total (no rounding left over from sums)
            available.update(self.total_resources)
            return
        for name, amount in held.items():
            available[name] = min(available[name] + amount, self.total_resources[name])

    def _secede(self, ev: SecedeEvent) -> None:
        ts = self.tasks.get(ev.key)
        if ts is None or ts not in self.executing:
            return  # seceded already, or its thread reported (the server checks)
        self.executing.discard(ts)
        self.seceded.add(ts)
        if ts.state == "executing":
            # the scheduler no longer counts it against this worker's threads either
            self._send({"op": "long-running", "key": ts.key})

    def _rejoin(self, ev: RejoinEvent) -> None:
        ts = self.tasks.get(ev.key)
        if ts is None or ts not in self.seceded:
            # nothing to wait for (a bug of the caller's): wake its thread at once
            self._out.append(Rejoin(self._stimulus, ev.key))
            return
        if ts not in self.rejoining:
            self.rejoining.append(ts)

    def _pause(self, ev: PauseEvent) -> None:
        self.paused = True

    def _unpause(self, ev: UnpauseEvent) -> None:
        self.paused = False

    def _memory_tight(self, ev: MemoryTightEvent) -> None:
        self.tight = ev.tight

    @property
    def open_slots(self) -> int:
        """The tasks that may hold a slot now: one per thread, and ``queued`` more
        unless memory is tight."""
        return self.nthreads if self.tight else self.slots

    # -- inspection

    def validate(self) -> None:
        """Check every invariant; raise ``AssertionError`` on the first broken one."""
        validate_state(self)


def _dependents_first(tasks: set[WTask]) -> list[WTask]:
    """``tasks`` ordered so that each comes after its dependents among them (then by
    priority): an input freed along with its dependents is not kept for them."""
    order: list[WTask] = []
    done: set[WTask] = set()
    for root in sorted(tasks):
        if root in done:
            continue
        stack = [(root, iter(sorted(root.dependents & tasks)))]
        done.add(root)
        while stack:
            ts, deps = stack[-1]
            for d in deps:
                if d not in done:
                    done.add(d)
                    stack.append((d, iter(sorted(d.dependents & tasks))))
                    break
            else:
                stack.pop()
                order.append(ts)
    return order


#: keys a worker remembers having forgotten (:attr:`WorkerState.released`)
RELEASED_KEYS = 10_000
