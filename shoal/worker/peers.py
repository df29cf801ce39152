"""What a worker asks of its peers and serves them: the fetches of its tasks' inputs
(``get-data`` to the holders, retried while a failure may pass, given up on when the
holder has not answered within ``fetch-timeout`` as if it had broken the connection;
values from another
host kept in shared memory for the workers of this host, landed there by the socket
itself), the mapping of inputs that same-host peers placed in segments, and its answer
to ``get-data``, which waits for a value this worker is fetching itself (the
scheduler names it to the other workers of its host: a value crosses to a host once),
and to the scheduler's ``has-keys``. The base class of :class:`~shoal.worker.server.Worker`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from .. import config
from ..comm import Comm, shm, shm_born, shm_family
from ..errors import CommBrokenError, CorruptedDataError, SerializationError, describe, short_repr
from ..protocol import REMOTE, sizeof, to_serialize
from ..protocol.sizes import managed_sizeof
from ..rpc import ConnectionPool, fetch_deadline
from . import shuffle_sources
from .diagnostics import Traffic
from .monitor import MemoryMonitor
from .outcomes import MAX_RETRY_DELAY, UNSENDABLE, exception_for, fetch_error, may_pass
from .state import (
    SHM,
    AttachShm,
    DataLostEvent,
    GatherDep,
    GatherDepFailureEvent,
    GatherDepSuccessEvent,
    WorkerState,
)
from .store import WorkerStore

__all__ = ["PeerData"]

logger = logging.getLogger("shoal.worker")


class FetchTimeoutError(CommBrokenError):
    """A holder took a ``get-data`` request and did not answer within ``fetch-timeout``:
    the fetch fails as on a broken connection, and the scheduler hears that the holder
    did not serve the value (``missing-data`` with ``unserved``)."""

#: the states of a key on its way here (fetched, or mapped, from a peer)
_COMING = ("fetch", "flight")
#: the store's kinds of values whose buffers lie in shared memory
_IN_SEGMENTS = ("shm", "mapped")


class PeerData:
    """The worker's exchanges of values with its peers (see the module docstring)."""

    # what the worker holds, used here (set by Worker.__init__ and start)
    state: WorkerState | None
    store: WorkerStore
    pool: ConnectionPool
    traffic: Traffic
    monitor: MemoryMonitor | None
    use_shm: bool
    status: str
    _awaited: list[WaitingRequest]

    def handle_stimulus(self, *events: Any) -> bool:
        raise NotImplementedError  # the Worker's

    def _stimulus(self, what: str) -> str:
        raise NotImplementedError  # the Worker's

    @property
    def _scheduler_destination(self) -> str:
        raise NotImplementedError  # the Worker's

    def _place(self, value: Any) -> tuple[shm.Segment, Any] | None:
        raise NotImplementedError  # the Worker's

    # -- fetching

    async def _gather_dep(self, inst: GatherDep) -> None:
        """Fetch ``inst.keys`` from peer ``inst.worker``. A failure that may pass (out of
        descriptors or memory, here or at the peer) is tried again after a pause that
        doubles, ``gather-attempts`` times in all; then the state machine hears of it."""
        attempts = max(1, config.get("gather-attempts"))
        delay = config.get("gather-retry-delay")
        attempt = 1
        while True:
            try:
                await self._fetch(inst)
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if attempt < attempts and self.status == "running" and may_pass(exc):
                    logger.info("fetching %d keys from %s failed (attempt %d of %d; again in %.2fs): %s",
                                len(inst.keys), inst.worker, attempt, attempts, delay, describe(exc))
                    await asyncio.sleep(delay)
                    delay = min(2 * delay, MAX_RETRY_DELAY)
                    attempt += 1
                    continue
                logger.info("fetching %d keys from %s failed (attempt %d of %d): %s",
                            len(inst.keys), inst.worker, attempt, attempts, describe(exc))
                text = f"could not fetch {short_repr(inst.keys, 200)} from {inst.worker} ({attempt} attempt(s)): {describe(exc)}"
                destination = self._scheduler_destination
                self.handle_stimulus(GatherDepFailureEvent(self._stimulus("gather-failed"), inst.worker, inst.keys, text,
                                                  exception=exception_for(fetch_error(exc, text), destination),
                                                  unserved=isinstance(exc, FetchTimeoutError)))
                return

    async def _fetch(self, inst: GatherDep) -> None:
        """One attempt of :meth:`_gather_dep`: raises if it did not get an answer."""
        began = time.time()
        comm = await self.pool.connect(inst.worker)
        if self.use_shm and comm.destination == REMOTE:
            # large values land in pooled segments: keeping them for this host is no copy
            comm.receive_large_frames_into(shm_born.land, shm_family.TRANSFER_MIN_BYTES)
        request: dict[str, Any] = {"op": "get-data", "reply": True, "keys": inst.keys}
        if comm.destination != REMOTE:
            request["host_fetch"] = True  # the peer may be this host's fetcher of them

        async def exchange() -> Any:
            await comm.write(request)
            return await comm.read()

        deadline = fetch_deadline(inst.total_nbytes)
        try:
            response = await asyncio.wait_for(exchange(), deadline)
        except asyncio.TimeoutError:
            comm.abort()
            # a holder that never answers is as good as one that broke the connection
            raise FetchTimeoutError(f"{inst.worker} did not answer get-data within {deadline:.1f}s "
                                    "(fetch-timeout)") from None
        except BaseException:
            comm.abort()
            raise
        finally:
            self.pool.reuse(inst.worker, comm)
        if isinstance(response, dict) and response.get("type") == UNSENDABLE:
            # the peer is fine; its values cannot travel: asking again would not help
            text = f"{inst.worker} cannot send {inst.keys!r:.200} here: {response.get('message')}"
            destination = self._scheduler_destination
            self.handle_stimulus(GatherDepFailureEvent(self._stimulus("gather-unsendable"), inst.worker, inst.keys,
                                              text, exception_for(SerializationError(text), destination)))
            return
        if not isinstance(response, dict) or response.get("status") != "OK":
            raise RuntimeError(f"get-data failed: {response.get('message') if isinstance(response, dict) else response!r}")
        data = response["result"]["data"]
        # measured once, here: the traffic, the task's size and the store use it
        nbytes = {k: managed_sizeof(v) for k, v in data.items()}
        self.traffic.fetched(comm.destination, nbytes, data, inst.worker, began, time.time())
        kept: dict[Any, Any] = {}
        try:
            if self.use_shm and comm.destination == REMOTE:
                await self._keep_for_host(data, nbytes, kept)
            self.handle_stimulus(GatherDepSuccessEvent(self._stimulus("gather"), inst.worker, data, inst.keys, nbytes,
                                                       kept))
        finally:
            for key in kept:
                self.store.unexpect(key)  # no-op for the values the store took

    async def _keep_for_host(self, data: dict[Any, Any], nbytes: dict[Any, int], kept: dict[Any, Any]) -> None:
        """Put the large values that came from another host in segments of this worker
        (copied in a thread, off the loop), so that the other workers of this host map
        them instead of fetching them across again; replaces them in ``data`` and puts
        their segment infos in ``kept`` (the store takes the segments with the values)."""
        fits = self.store.fits if self.monitor is None else self.monitor.fits
        for key, value in list(data.items()):
            if nbytes[key] < shm_family.TRANSFER_MIN_BYTES or not fits(nbytes[key]):
                continue
            placed = await asyncio.to_thread(self._place, value)
            if placed is None:
                continue
            segment, data[key] = placed
            self.store.expect(key, segment)
            kept[key] = segment.info

    def _attach(self, inst: AttachShm) -> None:
        """Map inputs that same-host peers placed in shared memory: no peer involved."""
        data: dict[Any, Any] = {}
        nbytes: dict[Any, int] = {}
        for key, info in zip(inst.keys, inst.infos):
            try:
                value = shm.attach(info)
            except Exception as exc:  # gone, reused, corrupt: whatever it is, ask the holders
                logger.info("cannot map %r from shared memory (%s); asking its holders", key, exc)
                continue
            data[key] = value
            nbytes[key] = managed_sizeof(value)
        self.traffic.mapped(nbytes, time.time())
        self.handle_stimulus(GatherDepSuccessEvent(self._stimulus("attach"), SHM, data, inst.keys, nbytes))

    # -- serving

    def get_data(self, comm: Comm, keys: list[Any], host_fetch: bool = False) -> Any:
        assert self.state is not None
        tasks, store = self.state.tasks, self.store
        coming = {k for k in keys if k not in store and (t := tasks.get(k)) is not None and t.state in _COMING}
        # a worker of this host asks for what this worker has not heard of: the
        # scheduler may have named it the host's fetcher, its own task still on the way
        # (one it forgot lately is not coming: the asker's holders are out of date)
        released = self.state.released
        unheard = {k for k in keys if k not in store and k not in tasks and k not in released} if host_fetch else set()
        if coming or unheard:
            return self._get_data_once_fetched(comm, keys, coming | unheard, unheard)
        return self._serve(comm, keys)

    async def _get_data_once_fetched(self, comm: Comm, keys: list[Any], waited: set[Any],
                                     unheard: set[Any]) -> dict[str, Any]:
        """``get-data`` for keys this worker is fetching itself (the scheduler named it
        to the other workers of its host as the one fetching them): the answer waits
        until those fetches have ended, or ``host-fetch-wait`` seconds. Keys it has not
        heard of are waited for ``host-fetch-grace`` seconds: if one is still unheard of
        then, it answers with what it has."""
        entry = WaitingRequest(waited, unheard, asyncio.get_running_loop().create_future())
        self._awaited.append(entry)
        try:
            wait = config.get("host-fetch-wait")
            if unheard:
                grace = min(wait, config.get("host-fetch-grace"))
                await asyncio.wait([entry.done], timeout=grace)
                wait = 0 if entry.unheard else wait - grace
            if wait > 0:
                await asyncio.wait([entry.done], timeout=wait)
        finally:
            self._awaited.remove(entry)
        return self._serve(comm, keys)

    def _serve(self, comm: Comm, keys: list[Any]) -> dict[str, Any]:
        store = self.store
        # a spilled value is read for the peer and stays on disk here; one whose file
        # fails is lost here: left out (the asker tries another holder), and the
        # scheduler hears it from this worker (it computes the value again)
        found: dict[Any, Any] = {}
        lost: list[Any] = []
        for k in keys:
            if k in store:
                try:
                    found[k] = store.peek(k)
                except CorruptedDataError as exc:  # its spill file, or its segment (shm-verify)
                    logger.error("%s; it is computed again", exc)
                    lost.append(k)
        if lost:
            self.values_lost(lost)
        # the sizes the store measured them at: a value served again is not measured
        # again (here, nor by the transport deciding where to serialize it)
        sizes = {k: store.nbytes(k) for k in found}
        # only a value the store found in a segment can be mapped by the peer
        in_segments = {k: v for k, v in found.items() if store.kind(k) in _IN_SEGMENTS}
        self.traffic.served(comm.destination, sizes, in_segments)
        return {"data": {k: to_serialize(v, sizes[k]) for k, v in found.items()}}

    def values_lost(self, keys: list[Any]) -> None:
        """Tell the scheduler that this worker lost the values of ``keys`` (their spill
        files, or segments, fail): it makes them again."""
        self.handle_stimulus(DataLostEvent(self._stimulus("data-lost"), keys))

    async def get_slices(self, comm: Comm, keys: list[Any], index: int) -> dict[str, Any]:
        """``get-slices``: the rows of output partition ``index`` of the splits of
        shoal's shuffle among ``keys`` that this worker holds (:mod:`.shuffle_sources`)."""
        held, rows, lost = await shuffle_sources.serve_slices(self, keys, index)
        size = sum(map(sizeof, rows))
        self.traffic.served(comm.destination, {"rows": size}, {})
        return {"held": held, "rows": to_serialize(rows, size), "lost": lost}

    def split_outputs(self, comm: Comm, keys: list[Any]) -> dict[str, Any]:
        """``split-outputs``: for each split of shoal's shuffle among ``keys`` that
        this worker holds, the output partitions it has rows for (:mod:`.shuffle_sources`)."""
        held, outputs, files = shuffle_sources.serve_outputs(self.store, keys)
        if any(f is not None for f in files):
            return {"held": held, "outputs": outputs, "files": to_serialize(files)}
        return {"held": held, "outputs": outputs}

    def has_keys(self, comm: Comm | None, keys: list[Any]) -> dict[str, list[Any]]:
        """``{"held": [key, ...]}``: those of ``keys`` this worker holds, that a
        ``get-data`` would send. The scheduler asks (``has-keys``) when workers sent to
        fetch a value say this worker did not serve it: answered by the event loop that
        serves the peers, over the listener they fetch through, the values left unread."""
        store = self.store
        return {"held": [k for k in keys if k in store]}

    def transfer_stats(self, comm: Comm | None = None) -> dict[str, int]:
        return dict(self.traffic.moved)

    def _wake_awaited(self) -> None:
        """Answer the get-data requests whose keys are no longer being fetched here (or
        awaited: a key not yet heard of is awaited until it is)."""
        assert self.state is not None
        tasks, store = self.state.tasks, self.store
        for entry in self._awaited:
            if entry.done.done():
                continue
            if entry.unheard:
                entry.unheard -= {k for k in entry.unheard if k in tasks or k in store}
                if entry.unheard:
                    continue
            if not any((t := tasks.get(k)) is not None and t.state in _COMING for k in entry.keys):
                entry.done.set_result(None)


class WaitingRequest:
    """A get-data request waiting for ``keys``; ``unheard``: those not yet heard of."""

    __slots__ = ("keys", "unheard", "done")

    def __init__(self, keys: set[Any], unheard: set[Any], done: asyncio.Future[None]):
        self.keys = keys
        self.unheard = unheard
        self.done = done
