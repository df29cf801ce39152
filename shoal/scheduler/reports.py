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
each tenfold count: a buggy worker may send many).

A value's last holder is never dropped on a peer's word: the scheduler cannot tell
which of the two is wrong, and a scattered value cannot be made again. It believes what
it can check: when a worker sent to fetch the value says the holder took its request
and did not serve it, the scheduler asks the holder itself (:class:`~.events.CheckHolder`,
the ``has-keys`` request, over a connection of its own, answered by the holder's event
loop, the one that serves its peers). Tasks given back meanwhile for want of the value
wait for the answer (:meth:`WorkerReports._unpark`): sent out again at once, they would
fetch from the holder in question, and a worker errs a task whose fetches from one peer
fail ``gather-peer-failures`` times in a row. The answer decides (:meth:`WorkerReports._holder_checked`):
the holder that says it holds the value keeps it, and the reports against it are
forgotten (the workers that gave their tasks back get them again and fetch anew); one
that says it does not is believed, as its own ``missing-data``; one that does not answer
within the deadline (or cannot be asked) is removed from the cluster, as a silent one
is, if ``max_unserved`` different workers said it did not serve them (one worker's
reports count once: a buggy one may send many). What only it held is then recomputed,
and scattered values err with ``LostData``. The server sets the deadline: ``worker-ttl``,
the time any worker has to show it is alive, so a holder whose event loop is held up
(a long call that keeps the GIL) is not removed for that sooner than for its silence.
"""

from __future__ import annotations

from .events import (
    CheckHolder,
    CloseWorkerStream,
    FreeKeys,
    HolderCheckedEvent,
    LongRunningEvent,
    MissingDataEvent,
    ReplicaAddedEvent,
    RescheduleEvent,
    TaskErredEvent,
    TaskFinishedEvent,
    Warn,
)
from .model import TaskState, WorkerState, plus
from .placement import Placement

__all__ = ["WorkerReports", "MAX_UNSERVED"]

#: a worker that is the one holder of a value, did not hand it out to this many
#: different workers sent to fetch it (``missing-data``) and did not answer the
#: scheduler's own question about it (``has-keys``) is removed, as a silent one is
MAX_UNSERVED = 2


class WorkerReports(Placement):
    """The handlers of the workers' reports (see the module docstring)."""

    # what the scheduler's state holds, used here (set by SchedulerState.__init__)
    max_unserved: int
    #: tasks given back by their worker (still counted there) while the holder of an
    #: input is asked whether it holds it: sent out again once the answer is in
    _parked: dict[TaskState, WorkerState]

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
        self._record_duration(ev.duration, ts.group)
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
        the key, should it hold it still), never the last one on its word: it may be
        wrong (a connection that broke, a reply it could not read, a bug), and a
        scattered value cannot be made again. For the last holder the scheduler asks
        the holder itself (:class:`CheckHolder`); see :meth:`_holder_checked`."""
        ts = self.tasks.get(ev.key)
        errant = self.workers.get(ev.errant_worker)
        if ts is None or errant is None or errant not in ts.who_has:
            return
        reporter = self.workers.get(ev.worker)
        if reporter is errant:
            self._lacks(ts, errant)
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
        ts.unserved = plus(ts.unserved, reporter.address)
        if ts.checking != errant.address:
            # one question at a time: reports that come while it is out are counted
            ts.checking = errant.address
            self._emit(CheckHolder(self._stimulus, errant.address, ts.key))

    def _holder_checked(self, ev: HolderCheckedEvent) -> None:
        """The answer to a :class:`CheckHolder`. Held: the holder stays, and the
        reports against it are forgotten (the workers that gave their tasks back are
        sent them again and fetch anew). Not held: as the holder's own
        ``missing-data``. No answer within the deadline, or none to be had: the
        holder is removed from the cluster if ``max_unserved`` different workers sent
        to fetch the value said it did not hand it out; with fewer, it stays (and the
        next report asks it again)."""
        ts = self.tasks.get(ev.key)
        ws = self.workers.get(ev.worker)
        if ts is None or ws is None or ts.checking != ws.address:
            return  # an answer to a question no longer asked (the holders changed)
        ts.checking = None  # (set, it names the one holder: any change of holders clears it)
        if ev.held:
            # (the workers that gave their tasks back are sent them again: _unpark)
            ts.unserved = ()
        elif ev.held is not None:
            self._lacks(ts, ws)
        elif len(ts.unserved) >= self.max_unserved:
            self._expel(ws, f"worker {ws.address} was removed: it is the one holder of {ts.key!r:.100}, did not "
                            f"hand it out to {len(ts.unserved)} workers sent to fetch it "
                            f"({', '.join(sorted(ts.unserved))}), and {ev.why}")

    def _lacks(self, ts: TaskState, ws: WorkerState) -> None:
        """``ws`` says it does not hold ``ts``'s value (it knows): it is no longer a
        holder, and a value held nowhere else is lost (recomputed, or ``LostData``)."""
        self._drop_replica(ts, ws)
        if not ts.who_has and ts.state == "memory":
            recs: dict[TaskState, str] = {}
            self._lost_value(ts, recs)
            self._recommend(recs)

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
        if found is None:
            return
        ts, ws = found
        if any(d.checking is not None for d in ts.dependencies):
            # given back for want of an input whose holder the scheduler is asking
            # about: sent out again once the answer is in (:meth:`_unpark`), not to fetch
            # from that holder meanwhile (each failed fetch counts against it, and the
            # worker errs the task at gather-peer-failures)
            self._parked[ts] = ws
            return
        self._recommend(self._transition(ts, "waiting"))

    def _unpark(self) -> None:
        """Send out again the tasks given back while the holder of an input was asked
        (after each event, once no input of theirs is in question): placed anew, they
        wait for an input that was lost, or fetch it from a holder that answered."""
        for ts, ws in list(self._parked.items()):
            if ts.state != "processing" or ts.processing_on is not ws:
                del self._parked[ts]  # it has left that worker already (released, the worker gone)
            elif not any(d.checking is not None for d in ts.dependencies):
                del self._parked[ts]
                self._recommend(self._transition(ts, "waiting"))

    def _long_running(self, ev: LongRunningEvent) -> None:
        found = self._assigned(ev, "long-running")
        if found is None:
            return
        ts, ws = found
        ws.long_running.add(ts)  # its slot is free: handle() fills it from the queue
        self._touch(ws)
