"""How a worker fetches its tasks' inputs, and what it does with what the fetches
bring back: the fetching half of :class:`~shoal.worker.state.WorkerState` (this class
is its base). Inputs in a
same-host segment are mapped in one batch (``AttachShm``); the others are asked of
their holders, batched per peer (``GatherDep``; the holder the scheduler listed first
is asked first: one of this host, or the host's worker fetching it), at most
``max_gathers`` peers and ``transfer_bytes`` in flight at once. A pass over the pending fetches runs only when
something that may let one start has changed (:meth:`Fetching._fetch_outlook`). The
theory of operation is in :mod:`shoal.worker.state`.
"""

from __future__ import annotations

from typing import Any

from .events import AttachShm, GatherDep, GatherDepFailureEvent, GatherDepSuccessEvent, Instruction
from .model import SHM, WState, WTask

__all__ = ["Fetching"]

#: peers whose failures are counted at most (peers that left are never heard of again)
_MAX_FAILING_PEERS = 1024


class Fetching:
    """The fetches of a worker's state (see the module docstring)."""

    # what the worker's state holds, used here (set by WorkerState.__init__)
    fetching: set[WTask]
    in_flight_workers: dict[str, set[WTask]]
    transfer_bytes: int | None
    gather_bytes: int
    max_gathers: int
    paused: bool
    _fetch_version: int
    _fetch_blocked: tuple[int, int, int] | None
    _stimulus: str
    _out: list[Instruction]
    tasks: dict[Any, WTask]
    peer_failures: dict[str, int]
    max_peer_failures: int

    # (WorkerState's, used here)
    def _set_state(self, ts: WTask, finish: WState) -> None:
        raise NotImplementedError  # the one writer of a key's state: WorkerState

    def _send(self, msg: dict[str, Any]) -> None:
        raise NotImplementedError

    def _put(self, ts: WTask, value: Any, managed: int | None = None) -> None:
        raise NotImplementedError

    def _lose(self, ts: WTask) -> None:
        raise NotImplementedError

    def _release(self, ts: WTask) -> None:
        raise NotImplementedError

    # -- what fetches bring back

    def _gather_success(self, ev: GatherDepSuccessEvent) -> None:
        flight = sorted(self.in_flight_workers.pop(ev.worker, set()))
        asked = [ts for ts in flight if ts.state == "flight"]
        failures = 0
        if ev.worker != SHM and asked and not any(ts.key in ev.data for ts in asked):
            # an answer with none of what was asked counts as a failed fetch: a holder
            # that keeps answering so (and the scheduler keeps believing, sending the
            # tasks back here) is given up on as one that does not answer is
            failures = self._count_failure(ev.worker)
        else:
            self.peer_failures.pop(ev.worker, None)
        for ts in flight:
            if ts.state != "flight":
                continue  # dropped while handling an earlier key of this reply
            ts.coming_from = None
            if ts.key in ev.data:
                ts.nbytes = ev.nbytes.get(ts.key, ts.nbytes)
                value = ev.data[ts.key]
                self._put(ts, value, ev.nbytes.get(ts.key))
                info = ev.shm.get(ts.key)
                if info is not None or getattr(type(value), "__shoal_replica__", False):
                    # kept until the scheduler frees it: it crossed hosts (kept for this
                    # host's workers), or its class asks (a shuffle's barrier: this
                    # worker's next assemblies read it, and what the first learned)
                    ts.origin = "replica"
                    self._send({"op": "add-replica", "key": ts.key, "nbytes": ts.nbytes, "shm": info})
            elif failures < self.max_peer_failures:
                self._missing_on(ts, ev.worker, unserved=True)
            else:
                self._give_up(ts, ev.worker, None, f"CommError: cannot fetch input {ts.key!r} from {ev.worker}: "
                                                   f"it answered without it ({failures} fetches from it failed in a row)")

    def _gather_failure(self, ev: GatherDepFailureEvent) -> None:
        if ev.unsendable is not None:
            self._unsendable(ev)
            return
        if ev.worker == SHM:
            for ts in sorted(self.in_flight_workers.pop(SHM, set())):
                if ts.state == "flight":
                    ts.coming_from = None
                    self._shm_failed(ts)
            return
        failures = self._count_failure(ev.worker)
        flight = self.in_flight_workers.pop(ev.worker, set())
        for ts in sorted(flight):
            if ts.state != "flight":
                continue  # dropped while handling an earlier key of this request
            ts.coming_from = None
            if failures < self.max_peer_failures:
                self._missing_on(ts, ev.worker, unserved=ev.unserved)
                continue
            self._give_up(ts, ev.worker, ev.exception, f"cannot fetch input {ts.key!r} from {ev.worker}: "
                                                       f"{ev.text} ({failures} fetches from it failed in a row)")
        # the peer is unreachable: forget it as a holder of anything
        for ts in list(self.tasks.values()):
            if ev.worker in ts.who_has and self.tasks.get(ts.key) is ts:
                ts.who_has.discard(ev.worker)
                if ts.state == "fetch" and not ts.who_has:
                    self._lose(ts)

    def _give_up(self, ts: WTask, worker: str, exception: Any, text: str) -> None:
        """Given up on ``worker`` for ``ts``: another holder is asked, or with none
        left the local tasks that need it err with ``exception`` and ``text``."""
        ts.who_has.discard(worker)
        if ts.who_has:
            self._lose(ts)
        else:
            self._err_dependents(ts, exception, text)

    def _unsendable(self, ev: GatherDepFailureEvent) -> None:
        """The holder is fine, its values are not: asking again (or another holder, or
        computing them again) would fail the same way. The tasks here that need them err
        with the reason; the values stay where they are."""
        for ts in sorted(self.in_flight_workers.pop(ev.worker, set())):
            if ts.state != "flight":
                continue
            ts.coming_from = None
            self._err_dependents(ts, ev.unsendable, ev.text)

    def _err_dependents(self, ts: WTask, exception: Any, text: str) -> None:
        """``ts``'s value cannot be had here: the local tasks waiting for it err with
        ``exception`` (as it travels in ``task-erred``), and ``ts`` goes."""
        for dts in sorted(d for d in ts.dependents if d.state == "waiting"):
            if self.tasks.get(dts.key) is dts:
                self._send({"op": "task-erred", "key": dts.key, "exception": exception,
                            "traceback": "", "text": text})
                self._release(dts)
        if self.tasks.get(ts.key) is ts and not ts.dependents:
            self._release(ts)

    def _count_failure(self, peer: str) -> int:
        """One more failed fetch from ``peer``; returns how many in a row."""
        n = self.peer_failures.pop(peer, 0) + 1
        self.peer_failures[peer] = n  # most recent last
        if len(self.peer_failures) > _MAX_FAILING_PEERS:
            del self.peer_failures[next(iter(self.peer_failures))]  # the peer failing longest ago
        return n

    def _shm_failed(self, ts: WTask) -> None:
        """The segment could not be mapped (gone, or not our domain): ask the holders."""
        ts.shm = None
        if ts.who_has:
            self._set_state(ts, "fetch")
            self.fetching.add(ts)
        else:
            self._lose(ts)

    def _missing_on(self, ts: WTask, worker: str, unserved: bool = False) -> None:
        """``worker`` did not give us ``ts``'s value: ``unserved``, it took the request
        and did not serve it (answered without it, or not in time); else the fetch
        failed on the way."""
        if worker == SHM:
            self._shm_failed(ts)
            return
        ts.who_has.discard(worker)
        msg: dict[str, Any] = {"op": "missing-data", "key": ts.key, "errant_worker": worker}
        if unserved:
            msg["unserved"] = True
        self._send(msg)
        self._lose(ts)

    # -- starting fetches


    def _ensure_communicating(self) -> None:
        if not self.fetching or self.paused:
            return
        if self._fetch_blocked == self._fetch_outlook():
            return  # nothing that lets a fetch start has changed since the last pass
        self._start_fetches()
        self._fetch_blocked = self._fetch_outlook()

    def _fetch_outlook(self) -> tuple[int, int, int]:
        """What decides whether a pass over the fetches can start one: keys or holders
        added, peers in flight (only a pass adds one), bytes in flight (with a bound)."""
        in_flight = 0 if self.transfer_bytes is None else self.in_flight_bytes()
        return self._fetch_version, len(self.in_flight_workers), in_flight

    def _start_fetches(self) -> None:
        if SHM not in self.in_flight_workers:
            mappable = [t for t in sorted(self.fetching) if t.state == "fetch" and t.shm is not None]
            if mappable:
                for t in mappable:
                    self._set_state(t, "flight")
                    t.coming_from = SHM
                    self.fetching.discard(t)
                self.in_flight_workers[SHM] = set(mappable)
                self._out.append(AttachShm(self._stimulus, [t.key for t in mappable], [t.shm for t in mappable]))
        budget = self.max_gathers - len(self.in_flight_workers.keys() - {SHM})
        if budget <= 0:
            return
        room = None if self.transfer_bytes is None else self.transfer_bytes - self.in_flight_bytes()
        # one sort and one pass: the fetches by peer (each under every holder not
        # busy), so that batching them costs what is batched, not a walk per batch
        order = [t for t in sorted(self.fetching) if t.shm is None and t.state == "fetch"]
        by_peer: dict[str, list[WTask]] = {}
        for t in order:
            for w in t.who_has:
                if w not in self.in_flight_workers:
                    by_peer.setdefault(w, []).append(t)
        for ts in order:
            if budget <= 0 or (room is not None and room <= 0):
                break
            if ts.state != "fetch":
                continue  # in a batch already
            peers = [w for w in sorted(ts.who_has) if w not in self.in_flight_workers]
            if not peers:
                continue
            if ts.ask_first in peers and peers[0] != ts.ask_first:
                peers.remove(ts.ask_first)
                peers.insert(0, ts.ask_first)
            if room is not None and ts.nbytes > room and len(self.in_flight_workers.keys() - {SHM}):
                continue  # not now: it comes when the requests in flight are in
            peer = peers[0]
            batch = [ts]
            total = ts.nbytes
            for other in by_peer.get(peer, ()):
                if other is ts or other.state != "fetch":
                    continue
                if total + other.nbytes > self.gather_bytes or (room is not None and total + other.nbytes > room):
                    break
                batch.append(other)
                total += other.nbytes
            for t in batch:
                self._set_state(t, "flight")
                t.coming_from = peer
                self.fetching.discard(t)
            self.in_flight_workers[peer] = set(batch)
            self._out.append(GatherDep(self._stimulus, peer, [t.key for t in batch], total))
            budget -= 1
            if room is not None:
                room -= total

    def in_flight_bytes(self) -> int:
        """The bytes of the fetches over the network in flight now (by the sizes the
        scheduler gave; values mapped from shared memory are not counted)."""
        return sum(ts.nbytes for peer, flight in self.in_flight_workers.items() if peer != SHM for ts in flight)
