"""Where the scheduler's tasks go: the placement half of
:class:`~shoal.scheduler.state.SchedulerState` (this class is its base, under it the
transitions). The theory of operation is in :mod:`shoal.scheduler.state`.

A task goes to the worker with room holding most of its input bytes, then to the
least busy worker with room. Nothing here walks every worker for an unconstrained
task: the holders of its inputs are scored, and :class:`~.model.RoomIndex` keeps the
workers with room by load (:meth:`Placement._touch` keeps it up to date wherever a
worker's load or room may change). A dependent may go to its inputs' holder past its
room (up to ``_HOLDER_OVERFILL`` times it), and sibling root tasks go together, so a
reduction's inputs are found where it runs. After each event, the workers whose room
grew take tasks from the queue (:meth:`Placement._fill_opened`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from .model import RoomIndex, TaskState, WorkerState
from .transitions import TaskTransitions

__all__ = ["Placement"]

# the task durations the scheduler averages are clamped to this range (seconds)
_MIN_DURATION, _MAX_DURATION = 1e-6, 1e6
#: a dependent goes to the worker that holds most of its inputs even when that worker
#: is full, up to this many times its room: moving the inputs costs more than waiting
_HOLDER_OVERFILL = 2
#: root tasks are placed with their siblings (the other inputs of a dependent) when
#: they have at most this many dependents, each with at most this many inputs
_SIBLING_DEPENDENTS, _SIBLING_INPUTS = 4, 4
#: task durations recorded between two changes of how many tasks a worker gets ahead
#: (each change looks at every worker once)
_AHEAD_EVERY = 100


class Placement(TaskTransitions):
    """Placement of the scheduler's tasks (see the module docstring)."""

    # what the scheduler's state holds, used here (set by SchedulerState.__init__)
    room: RoomIndex
    _opened: dict[WorkerState, None]
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

    def _record_duration(self, duration: float) -> None:
        # a worker reports it: a tiny, huge or non-finite one must not reach the
        # division in _ahead_per_thread (int(inf) raised there for every placement)
        if duration > 0 and math.isfinite(duration):
            duration = min(max(duration, _MIN_DURATION), _MAX_DURATION)
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
        self.room.update(ws, has_room)
        if has_room:
            self._opened[ws] = None

    def _decide_worker(self, ts: TaskState) -> WorkerState | None:
        """The worker with room that holds the most input bytes; then the least busy.
        Only workers that ``ts`` may run on count (``workers=``, resources free); with
        loose restrictions, any worker when none of those has room.

        Unconstrained (the common case), this looks only at the holders of the inputs
        and at the room index: its cost does not grow with the cluster."""
        if self._constrained(ts):
            best = self._best_worker(ts, [ws for ws in self.workers.values() if self._may_run(ts, ws)])
            if best is None and ts.loose_restrictions:
                best = self._best_worker(ts, [ws for ws in self.workers.values() if self._may_run_loosely(ts, ws)])
            return best
        if ts.dependencies:
            holder = self._best_holder(ts)
        else:
            holder = self._sibling_worker(ts)
        return holder if holder is not None else self.room.best()

    def _overfillable(self, ws: WorkerState) -> bool:
        """Whether ``ws`` may take a task beyond its room (an input's holder, a
        sibling): it is not paused and holds less than _HOLDER_OVERFILL times it."""
        limit = _HOLDER_OVERFILL * ws.nthreads * (1 + self._ahead_now)
        return not ws.paused and len(ws.processing) - len(ws.long_running) < limit

    def _siblings(self, ts: TaskState) -> list[TaskState]:
        """The other inputs of the dependents of ``ts`` (a few: see _SIBLING_*), in
        priority order."""
        if not ts.dependents or len(ts.dependents) > _SIBLING_DEPENDENTS:
            return []
        out: list[TaskState] = []
        for dts in sorted(ts.dependents):
            deps = dts.dependencies
            if len(deps) <= _SIBLING_INPUTS:
                out.extend(d for d in deps if d is not ts and d not in out)
        return out

    def _sibling_worker(self, ts: TaskState) -> WorkerState | None:
        """The worker where a sibling of the root task ``ts`` runs (even beyond its
        room, as a dependent goes to its inputs): the dependent then finds both its
        inputs there (co-assignment)."""
        for sib in self._siblings(ts):
            ws = sib.processing_on
            if ws is not None and self._overfillable(ws) and self.workers.get(ws.address) is ws:
                return ws  # (not one that is leaving: a liveness check drops several at once)
        return None

    def _best_holder(self, ts: TaskState) -> WorkerState | None:
        """Of the workers with room that hold inputs of ``ts``, the one holding the
        most input bytes, then the least busy; None if none has room."""
        local: dict[WorkerState, int] = {}
        for d in ts.dependencies:
            n = max(d.nbytes, 1)
            for ws in d.who_has:
                local[ws] = local.get(ws, 0) + n
        best: WorkerState | None = None
        best_score: tuple[float, float, str] | None = None
        workers = self.workers
        for ws, n in local.items():
            if not self._overfillable(ws) or workers.get(ws.address) is not ws:
                continue  # full, or leaving (a liveness check drops several at once)
            score = (-n, len(ws.processing) / ws.nthreads, ws.address)
            if best_score is None or score < best_score:
                best, best_score = ws, score
        return best

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
        """Give queued tasks to ``ws`` while it has room."""
        if not self.queued or self.queued_languages.keys().isdisjoint(ws.languages):
            return  # (a worker of another language beside a queue of Python tasks, or the reverse)
        skipped: list[TaskState] = []
        while self.queued and self._capacity(ws) > 0:
            ts = self.queued.pop()
            if self._constrained(ts) and not self._may_run(ts, ws) and not (
                    ts.loose_restrictions and self._may_run_loosely(ts, ws)):
                skipped.append(ts)
                continue
            self._uncount_queued(ts)
            more = self._transition(ts, "processing", ws)
            if more:
                self._recommend(more)
            if not ts.dependencies:
                self._pull_siblings(ts, ws)
        for ts in skipped:
            self.queued.push(ts)

    def _pull_siblings(self, ts: TaskState, ws: WorkerState) -> None:
        """The root task ``ts`` went to ``ws`` from the queue: its queued siblings go
        with it (beyond the room of ``ws`` if need be), so their dependent finds its
        inputs in one place."""
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
