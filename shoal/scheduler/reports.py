"""What the scheduler believes of its workers' reports: the handlers of
``task-finished``, ``task-erred``, ``reschedule``, ``long-running``, ``add-replica`` and
``missing-data``, the half of :class:`~shoal.scheduler.state.SchedulerState` (this
class is its base, above the placement) that decides whom to trust. The theory of
operation is in :mod:`shoal.scheduler.state`.

Workers are authenticated but may be buggy. A report about a task is believed only from
the worker the task was sent to; a copy (``add-replica``) or a value a peer did not get
(``missing-data``) only from a worker sent a task that needs the value. Anything else is
not believed: a worker that reported a value it was not asked for is told to free it,
and the report is logged (:class:`~.events.Warn`, for each worker the first time and at
each tenfold count: a buggy worker may send many). A value's last holder is never
dropped on a peer's word alone: the scheduler cannot tell which of the two is wrong,
and a scattered value cannot be made again; a holder that ``max_unserved`` workers sent
to fetch its value did not get it from is removed from the cluster, as a silent one is.
"""

from __future__ import annotations

from .events import (
    CloseWorkerStream,
    FreeKeys,
    LongRunningEvent,
    MissingDataEvent,
    ReplicaAddedEvent,
    RescheduleEvent,
    TaskErredEvent,
    TaskFinishedEvent,
    Warn,
)
from .model import TaskState, WorkerState
from .placement import Placement

__all__ = ["WorkerReports", "MAX_UNSERVED"]

#: a worker that is the one holder of a value and did not hand it out to this many
#: workers sent to fetch it (``missing-data``) is removed, as a silent one is
MAX_UNSERVED = 2


class WorkerReports(Placement):
    """The handlers of the workers' reports (see the module docstring)."""

    # what the scheduler's state holds, used here (set by SchedulerState.__init__)
    max_unserved: int

    def _forget_worker(self, ws: WorkerState) -> None:
        raise NotImplementedError  # the workers: SchedulerState

    def _drop_worker(self, ws: WorkerState, crashed: bool) -> None:
        raise NotImplementedError  # the workers: SchedulerState

    def _task_finished(self, ev: TaskFinishedEvent) -> None:
        ts = self.tasks.get(ev.key)
        ws = self.workers.get(ev.worker)
        if ws is None:
            return
        if ts is None or ts.processing_on is not ws:
            # believed only from the worker the task is assigned to: a value from any
            # other would reach dependents unchecked. A worker that holds it already
            # tells nothing new (its segment is kept); one the task left (released, sent
            # elsewhere after that worker was told to free it) holds nothing worth
            # keeping; any other was never given the task
            if ts is not None and ws in ts.who_has:
                self._add_replica(ts, ws, ev.shm)
                return
            self._emit(FreeKeys(self._stimulus, ws.address, [ev.key]))
            if ts is not None:
                self._disbelieve(ws, "task-finished", ts)
            return
        self._record_duration(ev.duration)
        ts.nbytes = ev.nbytes
        ts.shm = {ws.address: ev.shm} if ev.shm is not None else None
        ts.inline = ev.value
        self._recommend(self._transition(ts, "memory", ws))

    def _assigned(self, ev: TaskErredEvent | RescheduleEvent | LongRunningEvent,
                  op: str) -> tuple[TaskState, WorkerState] | None:
        """The task ``ev`` is about and the worker that sent it, when the task runs
        there; else None (the report is not believed, and logged as such)."""
        ts = self.tasks.get(ev.key)
        ws = self.workers.get(ev.worker)
        if ts is None or ws is None or ts.processing_on is not ws:
            if ts is not None and ws is not None:
                self._disbelieve(ws, op, ts)
            return None
        return ts, ws

    def _task_erred(self, ev: TaskErredEvent) -> None:
        found = self._assigned(ev, "task-erred")
        if found is None:
            return
        ts, _ = found
        if ts.retries > 0 and not ts.once:
            ts.retries -= 1
            self._recommend(self._transition(ts, "waiting"))
        else:
            self._recommend(self._transition(ts, "erred", ev.exception, ev.traceback, ev.exception_text))

    def _replica_added(self, ev: ReplicaAddedEvent) -> None:
        ts = self.tasks.get(ev.key)
        ws = self.workers.get(ev.worker)
        if ws is None:
            return
        if ts is None or ts.state != "memory":
            # not wanted any more (or being computed again): the copy goes
            if ts is None or ws not in ts.who_has:
                self._emit(FreeKeys(self._stimulus, ws.address, [ev.key]))
            return
        if ws not in ts.who_has and not self._sent_to_fetch(ts, ws):
            # a copy of a value it had no reason to fetch: nothing vouches for it
            self._emit(FreeKeys(self._stimulus, ws.address, [ev.key]))
            self._disbelieve(ws, "add-replica", ts)
            return
        self._add_replica(ts, ws, ev.shm)

    def _sent_to_fetch(self, ts: TaskState, ws: WorkerState) -> bool:
        """Whether ``ws`` was sent a task that needs ``ts``'s value (it runs there
        still), or is the worker fetching it for its host."""
        if ts.fetchers is not None and ts.fetchers.get(ws.host) is ws:
            return True
        return any(d.processing_on is ws for d in ts.dependents)

    def _missing_data(self, ev: MissingDataEvent) -> None:
        """A worker did not get ``key`` from ``errant_worker``. The holder's own word
        is believed; a peer's is believed only from a worker sent to fetch the value.
        Such a peer makes the scheduler drop a holder of several (and tell it to free
        the key, should it hold it still), never the last one on its word alone: it
        may be wrong (a connection that broke, a reply it could not read), and a
        scattered value cannot be made again. The last holder is removed from the
        cluster once ``max_unserved`` such reports came (a worker that keeps a value
        it does not hand out is of no more use than a dead one): what it held is then
        recomputed (scattered values err with ``LostData``)."""
        ts = self.tasks.get(ev.key)
        errant = self.workers.get(ev.errant_worker)
        if ts is None or errant is None or errant not in ts.who_has:
            return
        reporter = self.workers.get(ev.worker)
        recs: dict[TaskState, str] = {}
        if reporter is errant:
            self._drop_replica(ts, errant)
            if not ts.who_has and ts.state == "memory":
                self._lost_value(ts, recs)
                self._recommend(recs)
            return
        if reporter is None or not self._sent_to_fetch(ts, reporter):
            if reporter is not None:
                self._disbelieve(reporter, "missing-data", ts)
            return
        if len(ts.who_has) > 1:
            self._drop_replica(ts, errant)
            self._emit(FreeKeys(self._stimulus, errant.address, [ts.key]))
            return
        if not ev.unserved:
            # the fetch failed on the way (no descriptor here or there, a connection
            # that broke): that says nothing of the holder; the fetching worker bounds
            # its own attempts (gather-peer-failures) and a dead holder's stream breaks
            return
        ts.unserved += 1
        if ts.unserved < self.max_unserved:
            return
        self._expel(errant, f"worker {errant.address} was removed: it is the one holder of {ts.key!r:.100} and did "
                            f"not hand it out to {ts.unserved} workers sent to fetch it (the last: {reporter.address})")

    def _expel(self, ws: WorkerState, why: str) -> None:
        """Remove ``ws`` as if its connection had died (its tasks go elsewhere, what
        only it held is recomputed) and close its stream, saying ``why``; its running
        tasks are not counted against it."""
        del self.workers[ws.address]
        self._forget_worker(ws)
        self._emit(CloseWorkerStream(self._stimulus, ws.address, 0.0, why))
        self._drop_worker(ws, crashed=False)

    def _disbelieve(self, ws: WorkerState, op: str, ts: TaskState) -> None:
        """``ws`` sent ``op`` about ``ts``, which it was not given (nor sent to
        fetch): not believed. When ``ts`` runs or is held elsewhere, logged the first
        time and every tenfold time for each worker (a buggy worker may send many);
        reports about a task that has left (released, waiting again) come late in the
        ordinary course of things."""
        if ts.state not in ("processing", "memory"):
            return
        ws.disbelieved += 1
        n = ws.disbelieved
        if n == 10 ** (len(str(n)) - 1):
            if ts.processing_on is not None:
                where = f"processing on {ts.processing_on.address}"
            elif ts.state == "memory":
                where = f"in memory on {sorted(w.address for w in ts.who_has)}"
            else:
                where = ts.state
            self._emit(Warn(self._stimulus, f"worker {ws.address} sent {op} for {ts.key!r:.100}, which is {where}: "
                                            f"not believed ({n} report(s) of this worker so far)"))

    def _reschedule(self, ev: RescheduleEvent) -> None:
        found = self._assigned(ev, "reschedule")
        if found is not None:
            self._recommend(self._transition(found[0], "waiting"))

    def _long_running(self, ev: LongRunningEvent) -> None:
        found = self._assigned(ev, "long-running")
        if found is None:
            return
        ts, ws = found
        ws.long_running.add(ts)  # its slot is free: handle() fills it from the queue
        self._touch(ws)
