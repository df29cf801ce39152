"""How a worker fetches its tasks' inputs: the fetching half of
:class:`~shoal.worker.state.WorkerState` (this class is its base). Inputs in a
same-host segment are mapped in one batch (``AttachShm``); the others are asked of
their holders, batched per peer (``GatherDep``; the holder the scheduler listed first
is asked first: one of this host, or the host's worker fetching it), at most
``max_gathers`` peers and ``transfer_bytes`` in flight at once. A pass over the pending fetches runs only when
something that may let one start has changed (:meth:`Fetching._fetch_outlook`). The
theory of operation is in :mod:`shoal.worker.state`.
"""

from __future__ import annotations

from .events import AttachShm, GatherDep, Instruction
from .model import SHM, WState, WTask

__all__ = ["Fetching"]


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

    def _set_state(self, ts: WTask, finish: WState) -> None:
        raise NotImplementedError  # the one writer of a key's state: WorkerState

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
