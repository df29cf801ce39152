"""Where the scheduler's tasks go: the placement half of
:class:`~shoal.scheduler.state.SchedulerState` (this class is its base, under it the
transitions). The theory of operation is in :mod:`shoal.scheduler.state`.

A task goes to the worker with room holding most of its input bytes, then to the
least busy worker with room. A holder without room still gets it when its inputs would
take longer to move than the tasks ahead of it there take to run (:meth:`Placement.
_worth_waiting`: a fan-out of cheap tasks over one large value, such as a shuffle's
splits of one partition, stays where the value is), and when no worker has room and
they are large (it waits at the holder, not in the queue for whichever worker frees a
thread first). Nothing here walks every worker: the holders of its
inputs are scored, and a :class:`~.model.RoomIndex` per language and per resource
keeps the workers with room by load (:meth:`Placement._touch` keeps them up to date
wherever a worker's load or room may change); a task naming workers (``workers=``)
scores those, found by name. A dependent may go to its inputs' holder past its room
(up to ``_HOLDER_OVERFILL`` times it), and sibling root tasks go together, so a
reduction's inputs are found where it runs; so do a shuffle's outputs (whose input, the
barrier, says only where the splits are) with their siblings: output ``j`` of both
sides of a merge is assembled on one worker. After each event, the workers whose room
grew take tasks from the queue (:meth:`Placement._fill_opened`), each from the
buckets of the tasks it may run.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from .model import Need, PrefixGroup, RoomIndex, TaskState, WorkerState
from .transitions import TaskTransitions

__all__ = ["Placement", "WAIT_OVERFILL", "WAIT_MIN_BYTES"]

# the task durations the scheduler averages are clamped to this range (seconds)
_MIN_DURATION, _MAX_DURATION = 1e-6, 1e6
#: a dependent goes to the worker that holds most of its inputs even when that worker
#: is full, up to this many times its room: moving the inputs costs more than waiting
_HOLDER_OVERFILL = 2
#: root tasks are placed with their siblings (the other inputs of a dependent) when
#: they have at most this many dependents, each with at most this many inputs
_SIBLING_DEPENDENTS, _SIBLING_INPUTS = 4, 4
#: ... and a shuffle's outputs through chains of at most this many tasks of one input
_SIBLING_CHAIN = 3
#: task durations recorded between two changes of how many tasks a worker gets ahead
#: (each change looks at every worker once)
_AHEAD_EVERY = 100
#: what moving a value to another worker is reckoned to cost: bytes per second (the
#: copy, or the mapping, and the unpickling at the reader: the cost of a fetch that is
#: not hidden behind other work), and a fixed cost per value (the request, the reply)
_MOVE_BYTES_PER_SECOND = 200e6
_MOVE_SECONDS = 1e-3
#: a holder is given cheap tasks beyond its room (those it runs sooner than their
#: inputs would move) only while it holds fewer than this many times its room (their
#: time is bounded by the move's; this bounds their number)
WAIT_OVERFILL = 64
#: when no worker has room, a task whose inputs' holder holds this many bytes of them
#: waits there rather than in the queue, while the holder holds fewer than
#: _QUEUE_OVERFILL times its room (past that, the queue balances the load)
WAIT_MIN_BYTES = 1 << 20
_QUEUE_OVERFILL = 4


class Placement(TaskTransitions):
    """Placement of the scheduler's tasks (see the module docstring)."""

    # what the scheduler's state holds, used here (set by SchedulerState.__init__)
    room: RoomIndex
    rooms: dict[str, RoomIndex]
    resource_rooms: dict[str, RoomIndex]
    offering: dict[str, set[WorkerState]]
    _opened: dict[WorkerState, None]
    locating: set[TaskState]
    ahead: int
    max_ahead: int
    refill_seconds: float
    average_duration: float
    _ahead_now: int
    _durations_recorded: int
    non_python_workers: int

    def _capacity(self, ws: WorkerState) -> int:
        if ws.paused:
            return 0  # its memory is past the pause threshold: no new task goes there
        # seceded tasks hold no thread: the tasks they wait for must find room
        return ws.nthreads * (1 + self._ahead_now) - len(ws.processing) + len(ws.long_running)

    def _ahead_per_thread(self) -> int:
        """Tasks a worker should hold beyond one per thread: enough to stay busy for
        the time a refill takes (short tasks need more), at least ``ahead``, at most
        ``max_ahead``."""
        avg = self.average_duration
        if avg <= 0:
            return self.ahead
        return max(self.ahead, min(self.max_ahead, int(self.refill_seconds / avg)))

    def _record_duration(self, duration: float, group: PrefixGroup | None = None) -> None:
        # a worker reports it: a tiny, huge or non-finite one must not reach the
        # division in _ahead_per_thread (int(inf) raised there for every placement)
        if duration > 0 and math.isfinite(duration):
            duration = min(max(duration, _MIN_DURATION), _MAX_DURATION)
            if group is not None:
                g = group.duration
                group.duration = duration if g <= 0 else 0.8 * g + 0.2 * duration
            avg = self.average_duration
            self.average_duration = duration if avg <= 0 else 0.9 * avg + 0.1 * duration
            # a change of how far ahead workers are given tasks touches every worker:
            # it happens at the first duration, then at most once per _AHEAD_EVERY
            n = self._durations_recorded
            self._durations_recorded = n + 1
            if n % _AHEAD_EVERY == 0:
                self._set_ahead(self._ahead_per_thread())

    def _set_ahead(self, ahead: int) -> None:
        if ahead != self._ahead_now:
            self._ahead_now = ahead
            for ws in self.workers.values():
                self._touch(ws)

    def _touch(self, ws: WorkerState) -> None:
        """The load or the room of ``ws`` may have changed: keep the room index up to
        date, and have handle() fill ``ws`` from the queue if it has room."""
        if self.workers.get(ws.address) is not ws:
            return  # leaving: its tasks are being taken off it (a liveness check drops several)
        has_room = self._capacity(ws) > 0
        languages = ws.languages
        if len(languages) == 1 and "python" in languages:
            self.room.update(ws, has_room)
        else:
            rooms = self.rooms
            for lang in languages:
                rooms[lang].update(ws, has_room)
        if ws.resources:
            used = ws.used_resources
            for name, amount in ws.resources.items():
                room = self.resource_rooms.get(name)
                if room is not None:
                    room.update(ws, has_room and amount - used.get(name, 0) > 1e-9)
        if has_room:
            self._opened[ws] = None

    def _decide_worker(self, ts: TaskState) -> WorkerState | None:
        """The worker with room that holds the most input bytes; then the least busy.
        Only workers that ``ts`` may run on count (its language, ``workers=``,
        resources free); with loose restrictions, any worker when none of those has
        room.

        This looks only at the holders of the inputs and at a room index (of the
        task's language, or of a resource it asks for), or at the workers ``workers=``
        names (found by name): its cost does not grow with the cluster."""
        if ts.restrictions is not None:
            best = self._best_worker(ts, [ws for ws in self._named_in(ts) if self._may_run(ts, ws)])
            if best is None and ts.loose_restrictions:
                best = self._anywhere(ts)
            return best
        return self._anywhere(ts)

    def _anywhere(self, ts: TaskState) -> WorkerState | None:
        """For a task that names no worker (or only as a preference): the holder of most
        of its input bytes, else the worker of a sibling, else the least busy worker
        with room (of those that run its language and have the resources it asks for
        free)."""
        if ts.dependencies:
            holder = self._best_holder(ts)
            if holder is None and self._assembles(ts):
                # a shuffle's output, whose inputs are everywhere: it goes with its
                # siblings (a merge's other side), running or done
                holder = self._sibling_worker(ts, held=True)
        else:
            holder = self._sibling_worker(ts)
        if holder is not None:
            return holder
        if ts.resources:
            best = self._least_busy_with(ts)
        else:
            room = self.rooms.get(ts.language)
            best = room.best() if room is not None else None
        if best is None and ts.dependencies:
            # no worker has room: rather than wait in the queue (for whichever worker
            # frees a thread first), a task with a large input waits at its holder
            return self._holder_to_wait_at(ts)
        return best

    def _holder_to_wait_at(self, ts: TaskState) -> WorkerState | None:
        """The holder of most of the input bytes of ``ts``, if they are at least
        ``WAIT_MIN_BYTES`` and it may take the task past its room (up to
        ``_QUEUE_OVERFILL`` times it)."""
        local = self._input_bytes(ts)
        if not local:
            return None
        ws, n = max(local.items(), key=lambda item: (item[1], item[0].address))
        return ws if n >= WAIT_MIN_BYTES and self._may_wait_at(ts, ws, _QUEUE_OVERFILL) else None

    def _least_busy_with(self, ts: TaskState) -> WorkerState | None:
        """The least busy worker with room and the resources ``ts`` asks for free: the
        best of the room index of its scarcest resource (workers with room and some of
        it free); only when that one lacks the amount (or another resource, or the
        language) are all the workers offering them scored."""
        needs = [name for name, amount in ts.resources.items() if amount > 0] if ts.resources else []
        if not needs:
            room = self.rooms.get(ts.language)
            return room.best() if room is not None else None
        offering = self.offering
        scarcest = min(needs, key=lambda name: len(offering.get(name, ())))
        room = self.resource_rooms.get(scarcest)
        best = room.best() if room is not None else None
        if best is None or self._may_run_loosely(ts, best):
            return best  # (None: no worker has any of it free now)
        sets = sorted((offering.get(name, set()) for name in needs), key=len)
        return self._best_worker(ts, [ws for ws in sets[0].intersection(*sets[1:]) if self._may_run_loosely(ts, ws)])

    def _named_in(self, ts: TaskState) -> set[WorkerState]:
        """The workers ``workers=`` of ``ts`` names, by address, name or host."""
        named = self.named
        out: set[WorkerState] = set()
        for name in ts.restrictions or ():
            found = named.get(name)
            if found:
                out |= found
        return out

    def _overfillable(self, ws: WorkerState) -> bool:
        """Whether ``ws`` may take a task beyond its room (an input's holder, a
        sibling): it is not paused and holds less than _HOLDER_OVERFILL times it."""
        limit = _HOLDER_OVERFILL * ws.nthreads * (1 + self._ahead_now)
        return not ws.paused and len(ws.processing) - len(ws.long_running) < limit

    def _siblings(self, ts: TaskState) -> list[TaskState]:
        """The other inputs of the dependents of ``ts`` (a few: see _SIBLING_*), in
        priority order. For a shuffle's output (:meth:`_assembles`) through chains of
        tasks of one input each: dask's planner drops the column of output numbers in
        a task of its own after each output, and a merge joins those two tasks; the
        sibling of one side's output is then the other side's (or the task after it,
        once that exists)."""
        through = self._assembles(ts)
        top = ts
        if through:
            for _ in range(_SIBLING_CHAIN):
                if len(top.dependents) != 1:
                    break
                (up,) = top.dependents
                if len(up.dependencies) != 1:
                    break
                top = up
        if not top.dependents or len(top.dependents) > _SIBLING_DEPENDENTS:
            return []
        out: list[TaskState] = []
        for dts in sorted(top.dependents):
            deps = dts.dependencies
            if len(deps) <= _SIBLING_INPUTS:
                for d in deps:
                    if through:
                        d = self._placed_below(d)
                    if d is not top and d is not ts and d not in out:
                        out.append(d)
        return out

    def _placed_below(self, ts: TaskState) -> TaskState:
        """``ts``, or down its chain of tasks of one input each (a few), the first
        that runs or is held somewhere, or is queued, or is a shuffle's output (never
        its barrier)."""
        for _ in range(_SIBLING_CHAIN):
            if ts.processing_on is not None or ts.who_has or ts.state == "queued" or len(ts.dependencies) != 1 \
                    or self._assembles(ts):
                return ts
            (ts,) = ts.dependencies
        return ts

    def _sibling_worker(self, ts: TaskState, held: bool = False) -> WorkerState | None:
        """The worker where a sibling of ``ts`` runs (even beyond its room, as a
        dependent goes to its inputs), or with ``held`` also one that holds a sibling:
        the dependent then finds both its inputs there (co-assignment)."""
        siblings = self._siblings(ts)
        for sib in siblings:
            ws = sib.processing_on
            if ws is not None and self._may_take(ts, ws):
                return ws
            if held and sib.who_has:
                for ws in sorted(sib.who_has, key=lambda w: w.address):
                    if self._may_take(ts, ws):
                        return ws
        if held:
            # all of them full: it waits there for a thread rather than make its
            # dependent move a sibling (as a task with a large input waits at its holder)
            for sib in siblings:
                ws = sib.processing_on or min(sib.who_has, key=lambda w: w.address, default=None)
                if ws is not None and self._may_wait_at(ts, ws, _QUEUE_OVERFILL):
                    return ws
        return None

    def _assembles(self, ts: TaskState) -> bool:
        """Whether the only inputs of ``ts`` are shuffle barriers (an assembly of
        shoal's shuffle: its rows are on every worker that holds a split)."""
        locating = self.locating
        return bool(ts.dependencies) and all(d in locating for d in ts.dependencies)

    def _input_bytes(self, ts: TaskState) -> dict[WorkerState, int]:
        """The bytes of the inputs of ``ts`` each of their holders holds. A shuffle's
        barrier counts for nothing: its value says where the splits are, all over the
        cluster (the outputs assembled from it go where there is room)."""
        local: dict[WorkerState, int] = {}
        locating = self.locating
        for d in ts.dependencies:
            if d in locating:
                continue
            n = max(d.nbytes, 1)
            for ws in d.who_has:
                local[ws] = local.get(ws, 0) + n
        return local

    def _best_holder(self, ts: TaskState) -> WorkerState | None:
        """Of the workers with room that hold inputs of ``ts``, the one holding the
        most input bytes, then the least busy; None if none has room."""
        local = self._input_bytes(ts)
        if not local:
            return None
        if len(local) == 1:  # (inputs made together are held together)
            (ws,) = local
            if self._may_take(ts, ws):
                return ws
            return ws if self._worth_waiting(ts, ws, local[ws]) else None
        best: WorkerState | None = None
        best_score: tuple[float, float, str] | None = None
        for ws, n in local.items():
            if self._may_take(ts, ws):
                score = (-n, len(ws.processing) / ws.nthreads, ws.address)
                if best_score is None or score < best_score:
                    best, best_score = ws, score
        if best is None:
            ws, n = max(local.items(), key=lambda item: (item[1], item[0].address))
            if self._worth_waiting(ts, ws, n):
                return ws
        return best

    def _worth_waiting(self, ts: TaskState, ws: WorkerState, held: int) -> bool:
        """Whether ``ts`` should wait at ``ws``, which holds ``held`` bytes of its inputs
        and has no room: the tasks ahead of it there (those the worker runs first, by
        priority: their prefixes' average durations, over its threads) end sooner than
        those bytes would move elsewhere.
        Only once tasks of its prefix have run (their cost is known); never past
        ``WAIT_OVERFILL`` times the room of ``ws``, nor to a worker that may not take
        it."""
        group = ts.group
        if group is None or group.duration <= 0 or not self._may_wait_at(ts, ws, WAIT_OVERFILL):
            return False
        move = _MOVE_SECONDS + held / _MOVE_BYTES_PER_SECOND
        fallback = self.average_duration
        wait = 0.0
        budget = move * ws.nthreads
        seceded = ws.long_running
        priority = ts.priority
        for other in ws.processing:
            if other in seceded or not other.priority < priority:
                continue  # (it holds no thread; or the worker runs it after ts)
            g = other.group
            wait += g.duration if g is not None and g.duration > 0 else fallback
            if wait >= budget:
                return False
        return True

    def _may_wait_at(self, ts: TaskState, ws: WorkerState, overfill: int) -> bool:
        """Whether ``ts`` may be sent to ``ws`` past its room to wait for a thread
        there: ``ws`` runs it, is not paused nor leaving, and holds fewer than
        ``overfill`` times its room."""
        if ws.paused or self.workers.get(ws.address) is not ws or ts.language not in ws.languages \
                or not _has_resources(ts, ws):
            return False
        return len(ws.processing) - len(ws.long_running) < overfill * ws.nthreads * (1 + self._ahead_now)

    def _may_take(self, ts: TaskState, ws: WorkerState) -> bool:
        """Whether ``ws`` (an inputs' holder, a sibling's worker) may be sent ``ts``
        beyond its room: it is not too full (:meth:`_overfillable`), not leaving (a
        liveness check drops several at once), and runs it (its language, the resources
        it asks for free)."""
        return self._overfillable(ws) and self.workers.get(ws.address) is ws and ts.language in ws.languages \
            and _has_resources(ts, ws)

    def _constrained(self, ts: TaskState) -> bool:
        """Whether some worker may not run ``ts``: it names workers or asks for
        resources, or its language is not one every worker runs."""
        return ts.restrictions is not None or bool(ts.resources) or ts.language != "python" or self.non_python_workers > 0

    def _may_run(self, ts: TaskState, ws: WorkerState) -> bool:
        """Whether ``ws`` runs the language of ``ts``, is one of the workers ``ts`` is
        restricted to, and has the resources it asks for free."""
        return ts.language in ws.languages and self._allowed(ts, ws) and _has_resources(ts, ws)

    @staticmethod
    def _may_run_loosely(ts: TaskState, ws: WorkerState) -> bool:
        """:meth:`_may_run` with ``workers=`` a preference only (the language and the
        resources still hold)."""
        return ts.language in ws.languages and _has_resources(ts, ws)

    @staticmethod
    def _allowed(ts: TaskState, ws: WorkerState) -> bool:
        """Whether ``workers=`` of ``ts`` names ``ws`` (its address, name or host)."""
        r = ts.restrictions
        return r is None or ws.address in r or ws.name in r or ws.ip in r

    def _best_worker(self, ts: TaskState, candidates: Iterable[WorkerState]) -> WorkerState | None:
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
        """Give queued tasks to ``ws`` while it has room: the first by priority of the
        queue's buckets it may serve (its language, naming it or no worker, the
        resources it has free)."""
        queued = self.queued
        if not queued or self.queued_languages.keys().isdisjoint(ws.languages):
            return  # (a worker of another language beside a queue of Python tasks, or the reverse)
        names = (ws.address, ws.name, ws.ip)
        while queued and self._capacity(ws) > 0:
            # (looked up again each time: placing a task may queue or dequeue others)
            first: tuple[tuple[int, ...], Need] | None = None
            for need, q in queued.buckets_for(names, ws.languages):
                head = q.peek()
                if head is None or (need[2] and not _has_resources(head, ws)):
                    continue  # the tasks of a bucket need the same resources: none fits now
                if first is None or head.priority < first[0]:
                    first = (head.priority, need)
            if first is None:
                return
            ts = queued.take(first[1])
            self._uncount_queued(ts)
            more = self._transition(ts, "processing", ws)
            if more:
                self._recommend(more)
            if not ts.dependencies or self._assembles(ts):
                self._pull_siblings(ts, ws)

    def _pull_siblings(self, ts: TaskState, ws: WorkerState) -> None:
        """The root task (or shuffle output) ``ts`` went to ``ws`` from the queue: its
        queued siblings go with it (beyond the room of ``ws`` if need be), so their
        dependent finds its inputs in one place."""
        for sib in self._siblings(ts):
            if sib.state == "queued" and not self._constrained(sib) and self._overfillable(ws):
                self._dequeue(sib)
                self._recommend(self._transition(sib, "processing", ws))

    def _fill_opened(self) -> None:
        """Fill the workers whose room grew during this event from the queue."""
        opened = self._opened
        while opened and self.queued:
            ws = next(iter(opened))
            del opened[ws]
            if self.workers.get(ws.address) is ws:
                self._fill(ws)
        opened.clear()


def _has_resources(ts: TaskState, ws: WorkerState) -> bool:
    """Whether ``ws`` has the resources ``ts`` asks for free now."""
    if not ts.resources:
        return True
    have, used = ws.resources, ws.used_resources
    return all(have.get(name, 0) - used.get(name, 0) >= amount - 1e-9 for name, amount in ts.resources.items())
