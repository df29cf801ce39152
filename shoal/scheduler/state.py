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
  workers that died (``KilledWorker``), when a scattered value is lost (``LostData``),
  and when a task that may run only once (``once``: its graph says why) would have to
  run a second time (``RunOnce``): its worker died, left or gave it back while it ran,
  or its value was lost and is needed again. Such a task is not retried either.
- ``released``: not computed, and no-one holds the value; ``forgotten`` tasks are
  dropped from the state once no client wants them and no dependent needs them.

Changes of state are asked for through :meth:`SchedulerState._transition`, which looks
the pair up in ``_TRANSITIONS`` (a route: the function that carries it out); an illegal
pair raises and leaves the state unchanged. A transition returns recommendations (more
transitions), carried out first in, first out by :meth:`SchedulerState._recommend`; one
that no longer fits when its turn comes (a task recommended "forgotten" that a
dependent needs again) is skipped. The state itself is written in one place,
:meth:`~.transitions.TaskTransitions._set_state` (:mod:`.transitions`), which allows only the edges of ``_EDGES`` and logs
each change with the stimulus that caused it. :meth:`validate` checks the invariants;
the tests call it after every step.

The log (:class:`~shoal.statelog.StateLog`) keeps the events handled (payloads, values
and exceptions left out) and every transition: :meth:`SchedulerState.story` tells a
key's; fed the logged events, a fresh state returns the same instructions (decisions
never depend on the order of a set: tasks are sorted by priority where that matters).
An exception inside ``handle()`` is a bug (input is checked when it is decoded): the
server reports it with the keys' stories and fails those keys, or stops if
``validate()`` no longer holds.

Placement (:mod:`.placement`, the base class of this one, above the transitions): the
worker with room that holds most of a task's input bytes, else the least busy worker
with room (of the task's language), found without a walk over the workers; a task that
names workers or asks for resources looks only at those named (indexed by address,
name and host) or those offering them. After each event the workers whose room grew
take tasks from the queue, whose buckets (:class:`.model.Queue`, by what a task asks
of its worker) show each worker only the tasks it may run.

Liveness (:mod:`.liveness`, time arrives only in ``HeartbeatEvent`` and
``CheckLivenessEvent``): a worker silent for ``worker_ttl`` is removed as if it had
died, since a task that freezes its worker is as fatal as one that kills it.

Trust (:mod:`.reports`, the base class of this one, above the placement; workers are
authenticated, but may be buggy): a report about a task is believed only from the
worker the task was sent to (``task-finished``, ``task-erred``, ``reschedule``,
``long-running``); ``add-replica`` and a peer's ``missing-data`` only from a worker sent
a task that needs the value. A ``task-finished`` or ``add-replica`` not believed makes
the worker free the key; such reports are logged (:class:`Warn`). A holder's word that
it lacks a value is believed; a peer's drops that holder when there are others, never
the last one: the state asks that holder itself (:class:`CheckHolder`; the server
carries the question out and feeds the answer back, :class:`HolderCheckedEvent`), and
removes it from the cluster only if it did not answer within the deadline and
``max_unserved`` different workers sent to fetch the value said they did not get it.
Tasks given back meanwhile for want of the value go out again once the answer is in.

The scheduler never looks inside a task's payload: it holds it opaque and forwards it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from ..gcpolicy import collector_off
from ..protocol.messages import CancelledKeyMsg, TaskErredMsg, to_wire
from .events import (
    FIRE_AND_FORGET,
    AddClientEvent,
    AddWorkerEvent,
    CancelKeysEvent,
    CheckHolder,
    CheckLivenessEvent,
    FailKeysEvent,
    FireAndForgetEvent,
    ClientMsg,
    CloseWorkerStream,
    ComputeTask,
    Event,
    FreeKeys,
    HeartbeatEvent,
    HolderCheckedEvent,
    Instruction,
    LongRunningEvent,
    MissingDataEvent,
    ReplicaAddedEvent,
    NewTask,
    ReleaseKeysEvent,
    RemoveClientEvent,
    RemoveReplicasEvent,
    RemoveWorkerEvent,
    RescheduleEvent,
    TaskErredEvent,
    TaskFinishedEvent,
    UpdateDataEvent,
    UpdateGraphEvent,
    Warn,
    WorkerMemoryEvent,
)
from .liveness import expired, note_seen
from .progress import key_prefix
from .model import (
    InvalidTransition,
    PrefixGroup,
    Queue,
    RoomIndex,
    TaskState,
    WorkerState,
    dependents_closure,
    topological,
)
from ..protocol.messages import Key
from ..statelog import StateLog, Transition
from .reports import MAX_UNSERVED, WorkerReports
from .validation import validate_state


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
    "RemoveReplicasEvent",
    "MissingDataEvent",
    "HolderCheckedEvent",
    "ReplicaAddedEvent",
    "RescheduleEvent",
    "LongRunningEvent",
    "HeartbeatEvent",
    "CheckLivenessEvent",
    "FailKeysEvent",
    "FireAndForgetEvent",
    "WorkerMemoryEvent",
    # instructions
    "ComputeTask",
    "FreeKeys",
    "ClientMsg",
    "CloseWorkerStream",
    "CheckHolder",
    "Warn",
]


#: tasks a worker holds beyond its thread count, so input fetches overlap compute
DEFAULT_AHEAD = 2
#: a task that was running on this many workers when they died errs with KilledWorker
ALLOWED_FAILURES = 3
#: graphs of at least this many tasks are taken in with the cyclic garbage collector off
_BIG_GRAPH = 10_000
#: how many keys of refused graphs the scheduler remembers, with why they were refused:
#: a later graph that needs one (the next part of a big graph) is refused for that
#: reason, not for an "unknown key" the user never wrote
REFUSED_KEYS = 100_000


class SchedulerState(WorkerReports):
    """Tasks, workers and clients; ``handle(*events) -> list[instruction]``."""

    def __init__(self, ahead: int = DEFAULT_AHEAD, allowed_failures: int = ALLOWED_FAILURES, log_size: int = 10_000,
                 worker_ttl: float = 0.0, max_unserved: int = MAX_UNSERVED):
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
        if max_unserved < 1:
            raise ValueError(f"max_unserved must be >= 1, got {max_unserved}")
        self.max_unserved = max_unserved
        self._parked = {}
        #: seconds of silence after which a worker is removed (0: never)
        self.worker_ttl = worker_ttl
        self.queued = Queue()
        #: the workers with room, least busy first (kept up to date by _touch): of
        #: those that run Python (``room``), and by language (``rooms``, Python's too)
        self.room = RoomIndex()
        self.rooms: dict[str, RoomIndex] = {"python": self.room}
        #: the workers by address, name and host (what ``workers=`` may name)
        self.named: dict[str, set[WorkerState]] = {}
        #: resource -> the workers that offer some of it, and those of them with room
        #: and some of it free, least busy first
        self.offering: dict[str, set[WorkerState]] = {}
        self.resource_rooms: dict[str, RoomIndex] = {}
        #: workers whose room may have grown during the current event: handle() fills
        #: them from the queue (an ordered set: the order is the order of the events)
        self._opened: dict[WorkerState, None] = {}
        #: tasks a worker holds per thread beyond one (see _ahead_per_thread), as of
        #: the last change
        self._ahead_now = ahead
        self._durations_recorded = 0
        #: language -> queued tasks of it: a worker that runs none of them skips the queue
        self.queued_languages: dict[str, int] = {}
        #: the known tasks counted by key prefix and state (the dashboard's progress)
        self.groups: dict[str, PrefixGroup] = {}
        #: tasks that run on where their inputs are (shoal's shuffle's barriers): their
        #: inputs are kept while they are, and a lost input makes them run again
        self.locating: set[TaskState] = set()
        #: the average durations of prefixes whose groups went (at most DURATIONS_KEPT,
        #: the least recently gone dropped first)
        self.durations: dict[str, float] = {}
        #: workers that do not run Python payloads (while there are none, a task's
        #: language need not be looked at when it is placed)
        self.non_python_workers = 0
        #: tasks that reached memory since the scheduler started, each counted once
        #: (a counter: it never goes down, whatever is forgotten)
        self.done_total = 0
        #: the events handled (opaque data dropped) and every task's transitions
        self.log = StateLog(events=log_size, transitions=10 * log_size)
        self._generation = itertools.count()
        #: keys of refused graphs, oldest first, with the reason (at most REFUSED_KEYS)
        self._refused: dict[Key, str] = {}
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
            RemoveReplicasEvent: self._remove_replicas,
            MissingDataEvent: self._missing_data,
            HolderCheckedEvent: self._holder_checked,
            ReplicaAddedEvent: self._replica_added,
            RescheduleEvent: self._reschedule,
            LongRunningEvent: self._long_running,
            HeartbeatEvent: self._heartbeat,
            CheckLivenessEvent: self._check_liveness,
            FailKeysEvent: self._fail_keys,
            FireAndForgetEvent: self._fire_and_forget,
            WorkerMemoryEvent: self._worker_memory,
        }

    # -- entry point

    def handle(self, *events: Event) -> list[Instruction]:
        """Apply events in order; return the instructions they produce."""
        out: list[Instruction] = []
        for i, event in enumerate(events):
            self._stimulus = event.stimulus_id
            self._instructions = out
            self.log.event(event, first=i == 0)
            if type(event) is UpdateGraphEvent and len(event.tasks) >= _BIG_GRAPH:
                # a big graph makes objects by the million, all of them kept
                with collector_off():
                    self._update_graph(event)
            else:
                self._handlers[type(event)](event)
            if self._parked:
                self._unpark()
            if self._opened:
                # slots opened on these workers (finished, cancelled, released tasks)
                self._fill_opened()
        self._instructions = []
        return out

    def _join_group(self, ts: TaskState, names: dict[Any, str] | None = None) -> None:
        """Count the new task ``ts`` (released) in its key prefix's group. ``names``
        caches the prefixes of the first elements of tuple keys (the chunks of one
        array share it) for the duration of one graph."""
        key = ts.key
        if names is not None and type(key) is tuple and key:
            name = names.get(key[0])
            if name is None:
                name = names[key[0]] = key_prefix(key)
        else:
            name = key_prefix(key)
        g = self.groups.get(name)
        if g is None:
            g = self.groups[name] = PrefixGroup(name)
            g.duration = self.durations.get(name, 0.0)
        g.size += 1
        g.states[ts.state] += 1
        ts.group = g

    def story(self, *keys: Key) -> list[Transition]:
        """What happened to ``keys``: their transitions still in the log, oldest
        first, each with the stimulus that caused it."""
        return self.log.story(*keys)

    # -- events

    def _add_worker(self, ev: AddWorkerEvent) -> None:
        if ev.address in self.workers:
            return
        if ev.nthreads < 1:
            raise ValueError(f"worker {ev.address} has {ev.nthreads} threads")
        ws = self.workers[ev.address] = WorkerState(ev.address, ev.nthreads, ev.host, ev.pid, ev.name,
                                                    last_seen=ev.now, resources=dict(ev.resources),
                                                    ip=_address_host(ev.address),
                                                    languages=frozenset(ev.languages or ("python",)))
        if "python" not in ws.languages:
            self.non_python_workers += 1
        for lang in ws.languages:
            if lang not in self.rooms:
                self.rooms[lang] = RoomIndex()
        for name in _names_of(ws):
            self.named.setdefault(name, set()).add(ws)
        for name, amount in ws.resources.items():
            if amount > 0:
                self.offering.setdefault(name, set()).add(ws)
                if name not in self.resource_rooms:
                    self.resource_rooms[name] = RoomIndex()
        # tasks that failed for want of this worker, or were waiting for any worker
        self._touch(ws)

    def _remove_worker(self, ev: RemoveWorkerEvent) -> None:
        ws = self.workers.pop(ev.address, None)
        if ws is not None:
            self._drop_worker(ws, ev.crashed)

    def _drop_worker(self, ws: WorkerState, crashed: bool) -> None:
        """Reschedule the tasks of ``ws``, no longer in ``self.workers``, and forget its values."""
        self._forget_worker(ws)
        self._opened.pop(ws, None)
        if "python" not in ws.languages:
            self.non_python_workers -= 1
        recs: dict[TaskState, str] = {}
        ws.long_running.clear()
        for ts in sorted(ws.processing):
            ws.processing.discard(ts)
            ts.processing_on = None
            self._set_state(ts, "released")
            if crashed:
                ts.suspicious += 1
            if ts.suspicious >= self.allowed_failures:
                text = (f"KilledWorker: task {ts.key!r} was running on {ts.suspicious} workers "
                        f"that died (the last: {ws.address}); it is not retried again")
                recs.update(self._err(ts, None, None, text, kind="KilledWorker"))
            else:
                recs[ts] = "waiting"
        for ts in sorted(ws.has_what):
            self._drop_replica(ts, ws)
            if not ts.who_has and ts.state == "memory":
                self._lost_value(ts, recs)
        ws.has_what.clear()
        # queued tasks that may only run on workers that are all gone now
        for ts in self.queued.naming(_names_of(ws)):
            if self._nowhere(ts):
                self._dequeue(ts)
                recs.update(self._err(ts, None, None, self._no_worker_text(ts), kind="ValueError"))
        self._recommend(recs)

    def _forget_worker(self, ws: WorkerState) -> None:
        """Take ``ws`` (out of ``self.workers`` now) out of the indexes of workers."""
        for lang in ws.languages:
            self.rooms[lang].discard(ws)
        for name in ws.resources:
            room = self.resource_rooms.get(name)
            if room is not None:
                room.discard(ws)
        for index, names in ((self.named, _names_of(ws)), (self.offering, ws.resources)):
            for name in names:
                holders = index.get(name)
                if holders is not None:
                    holders.discard(ws)
                    if not holders:
                        del index[name]

    def _heartbeat(self, ev: HeartbeatEvent) -> None:
        ws = self.workers.get(ev.worker)
        if ws is not None:
            note_seen(ws, ev.now)

    def _check_liveness(self, ev: CheckLivenessEvent) -> None:
        gone = expired(self.workers.values(), ev.now, self.worker_ttl)
        for ws, _ in gone:  # all of them first: none may take over another's tasks
            del self.workers[ws.address]
            self._forget_worker(ws)
        for ws, silent in gone:
            self._emit(CloseWorkerStream(self._stimulus, ws.address, silent))
            self._drop_worker(ws, crashed=True)

    def _fail_keys(self, ev: FailKeysEvent) -> None:
        recs: dict[TaskState, str] = {}
        for key in ev.keys:
            ts = self.tasks.get(key)
            if ts is None or ts.state in ("memory", "erred", "forgotten"):
                continue
            if ts.state == "processing" and ts.processing_on is not None:
                self._unassign(ts, tell=True)
            elif ts.state == "queued":
                self._dequeue(ts)
            recs.update(self._err(ts, None, None, ev.text, kind="InternalError"))
        self._recommend(recs)

    def _fire_and_forget(self, ev: FireAndForgetEvent) -> None:
        for key in ev.keys:
            ts = self.tasks.get(key)
            if ts is not None and ts.state in ("released", "waiting", "queued", "processing"):
                ts.want(FIRE_AND_FORGET)

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
                    why = self._refused.get(dep)
                    if why is not None:
                        self._refuse_graph(ev, f"task {t.key!r} depends on {dep!r}, of a graph refused before: {why}",
                                           root=why)
                    else:
                        self._refuse_graph(ev, f"task {t.key!r} depends on unknown key {dep!r}")
                    return
        order, cycle = topological(new)
        if cycle:
            self._refuse_graph(ev, "the graph has a cycle: " + " -> ".join(map(repr, cycle)))
            return
        if self._refused:
            for key in new:
                self._refused.pop(key, None)  # made now: no longer a refused graph's
        generation = next(self._generation)
        tasks = self.tasks
        created: list[TaskState] = []
        prefixes: dict[Any, str] = {}
        prioritized = False
        for i, key in enumerate(order):
            t = new[key]
            ts = TaskState(key, payload=t.payload, priority=(-t.priority, generation, i), retries=t.retries)
            prioritized = prioritized or t.priority != 0
            self._join_group(ts, prefixes)
            if t.restrictions is not None:
                ts.restrictions = set(t.restrictions)
                ts.loose_restrictions = t.loose_restrictions
            if t.resources:
                ts.resources = dict(t.resources)
            ts.language = t.language
            ts.once = t.once
            if t.locate:
                self.locating.add(ts)
            tasks[key] = ts
            created.append(ts)
            names = t.dependencies
            if names:
                # its inputs are made already (the order is topological) or were known;
                # in priority order once and for all: every walk over them goes in that order
                inputs = ts.group.dependencies if ts.group is not None else set()
                ts.dependencies = deps = tuple(sorted({tasks[k] for k in names}))
                for dep in deps:
                    dep.add_dependent(ts)
                    if dep.group is not None:
                        inputs.add(dep.group.name)
        for key in ev.wanted:
            if key in tasks:
                tasks[key].want(ev.client)
        self.clients.add(ev.client)
        recs: dict[TaskState, str] = {}
        if prioritized:
            created.sort()  # the tasks go to workers in the order recommended: by priority
        for ts in created:
            if ts.state != "released":
                continue  # erred already, with a dependency that cannot run
            if self._nowhere(ts):
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

    def _refuse_graph(self, ev: UpdateGraphEvent, reason: str, root: str | None = None) -> None:
        """Err the graph's wanted keys with ``reason``, and remember its new keys with
        ``root`` (the first refusal's reason, when this one follows from it)."""
        root = root or reason
        refused = self._refused
        for t in ev.tasks:
            if t.key not in self.tasks:
                refused.pop(t.key, None)
                refused[t.key] = root
        while len(refused) > REFUSED_KEYS:
            del refused[next(iter(refused))]
        for key in ev.wanted:
            self._emit(ClientMsg(self._stimulus, ev.client, to_wire(TaskErredMsg(
                key, text=f"GraphError: {reason}", kind="GraphError", blame=key,
            ))))

    def _release_keys(self, ev: ReleaseKeysEvent) -> None:
        recs: dict[TaskState, str] = {}
        for key in ev.keys:
            ts = self.tasks.get(key)
            if ts is None:
                continue
            ts.unwant(ev.client)
            if not ts.who_wants and not ts.waiters:
                recs[ts] = "forgotten"
        self._recommend(recs)

    def _cancel_keys(self, ev: CancelKeysEvent) -> None:
        recs: dict[TaskState, str] = {}
        seen: set[TaskState] = set()  # tasks cancelled already, with what is built on them
        for key in ev.keys:
            ts = self.tasks.get(key)
            if ts is None or ts in seen:
                continue
            # a value in memory is only released; otherwise the client's futures on this
            # task and on everything built on it are cancelled
            if ts.state == "memory":
                cancelled = [ts]
            else:
                seen.add(ts)
                cancelled = [ts, *dependents_closure(ts, seen)]
            for dts in cancelled:
                if ev.client in dts.who_wants:
                    dts.unwant(ev.client)
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
                ts = self.tasks[key] = TaskState(key, priority=(0, next(self._generation), 0))
                self._join_group(ts)
            ts.want(ev.client)
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
            self._set_state(ts, "memory")
            for ws in workers:
                self._add_replica(ts, ws)
            info = ev.shm.get(key)
            ts.shm = {workers[0].address: info} if info is not None and len(workers) == 1 else None
            recs.update(self._on_memory(ts))
        self._recommend(recs)

    def _remove_replicas(self, ev: RemoveReplicasEvent) -> None:
        for key, addresses in ev.who_has.items():
            ts = self.tasks.get(key)
            if ts is None or ts.state != "memory":
                continue
            for address in addresses:
                ws = self.workers.get(address)
                # never the last copy; nor one that a task running there may be reading
                if ws is None or ws not in ts.who_has or len(ts.who_has) < 2:
                    continue
                if any(dts.processing_on is ws for dts in ts.dependents):
                    continue
                self._drop_replica(ts, ws)
                self._emit(FreeKeys(self._stimulus, ws.address, [key]))

    def _worker_memory(self, ev: WorkerMemoryEvent) -> None:
        ws = self.workers.get(ev.worker)
        if ws is None:
            return
        ws.memory = ev.memory
        if ws.paused != ev.paused:
            # going on: handle() fills it from the queue after this event
            ws.paused = ev.paused
            self._touch(ws)

    # -- inspection

    def validate(self) -> None:
        """Check every invariant; raise ``AssertionError`` on the first broken one."""
        validate_state(self)

    def task_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for ts in self.tasks.values():
            counts[ts.state] = counts.get(ts.state, 0) + 1
        return counts


def _address_host(address: str) -> str:
    """``"tcp://10.0.0.1:8786"`` -> ``"10.0.0.1"`` (``[v6]`` without brackets)."""
    rest = address.split("://", 1)[-1]
    host = rest.rsplit(":", 1)[0] if ":" in rest else rest
    return host.strip("[]")


def _names_of(ws: WorkerState) -> set[str]:
    """What ``workers=`` may name ``ws`` by: its address, name and host."""
    return {n for n in (ws.address, ws.name, ws.ip) if n}
