"""Results and data placement for the client (a mixin of :class:`~shoal.Client`):
``gather`` (values mapped from shared memory on this host, or asked of their workers
in bounded batches, with a deadline per request and recomputed values waited for) and
``scatter`` (values put on workers directly, one shared-memory copy for several workers
of this host)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

from ..comm import shm, shm_family
from ..errors import CommBrokenError, CommError, CorruptedDataError, LostDataError
from ..protocol import to_serialize
from ..rpc import ConnectionPool, PooledRPC, fetch_deadline
from ..taskspec import tokenize, unique_token, validate_key
from .future import Future, FutureState, _unwrap, as_actor
from .options import worker_restrictions
from .structure import collect_futures, rebuild

if TYPE_CHECKING:
    from .client import Client

__all__ = ["Gathering", "serving", "GATHER_BATCH_BYTES"]

#: one get-data request asks for at most this many bytes (by the sizes workers reported)
GATHER_BATCH_BYTES = 64 << 20


class Gathering:
    """The methods of :class:`~shoal.Client` that bring values back and put them on
    workers (a mixin)."""

    if TYPE_CHECKING:
        id: str
        status: str
        scheduler_address: str
        _states: dict[Any, FutureState]
        _pool: ConnectionPool | None
        _use_shm: bool
        _scatter_rr: Iterator[int]

        def _sync(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any: ...

        def _scheduler_rpc(self) -> PooledRPC: ...

    # -- results

    async def _wait_states(self, states: list[FutureState], timeout: float | None) -> None:
        """Return once every state is final (finished, erred, cancelled); raises
        ``TimeoutError`` after ``timeout`` seconds, values lost and recomputed meanwhile
        included."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        pending = states
        # a future may be lost (and recomputed) after it finished: wait again
        while pending := [st for st in pending if st.status not in ("finished", "error", "cancelled")]:
            # one waiter for all of them: states change on this loop and count down
            done = loop.create_future()
            remaining = [len(pending)]

            def one_done() -> None:
                remaining[0] -= 1
                if remaining[0] == 0 and not done.done():
                    done.set_result(None)

            for st in pending:
                st.on_done(one_done)
            try:
                await asyncio.wait_for(done, None if deadline is None else max(deadline - loop.time(), 0))
            except asyncio.TimeoutError:
                left = sum(st.status not in ("finished", "error", "cancelled") for st in pending)
                raise TimeoutError(f"{left} future(s) not done within {timeout}s") from None

    def gather(self, futures: Any, errors: str = "raise") -> Any:
        """The values of ``futures`` (a future, or lists/tuples/dicts of them), in the
        same structure. Raises the first erred task's exception (``errors="raise"``);
        ``errors="skip"`` leaves erred results out of lists (None in their place
        elsewhere), as dask does."""
        return self._sync(self._gather_structure, futures, errors)

    async def _gather_structure(self, futures: Any, errors: str = "raise") -> Any:
        flat: list[Future] = []
        collect_futures(futures, flat)
        values = await self._gather_async(flat, errors=errors)
        by_key = {f.key: v for f, v in zip(flat, values)}
        skipped = frozenset(f.key for f in flat if f.status in ("error", "cancelled")) if errors == "skip" else frozenset()
        return rebuild(futures, by_key, skipped)

    async def _gather_async(self, futures: list[Future], timeout: float | None = None, errors: str = "raise") -> list[Any]:
        """The futures' values (waiting for them); raises the first erred task's
        exception (``errors="raise"``), ``TimeoutError`` after ``timeout`` seconds
        whatever the cluster does (a holder that never answers included), and
        :class:`~shoal.errors.LostDataError` for values no holder hands out."""
        if timeout is None:
            return await self._gather_values(futures, errors)
        # (values at hand, with no wait, are returned even with a timeout of 0)
        limit = asyncio.timeout(timeout)
        try:
            async with limit:
                return await self._gather_values(futures, errors)
        except TimeoutError:
            if not limit.expired():
                raise
            left = sum(f._state.status not in ("finished", "error", "cancelled") for f in futures)
            raise TimeoutError(f"{len(futures)} future(s) not gathered within {timeout}s ({left} not done)") from None

    async def _gather_values(self, futures: list[Future], errors: str) -> list[Any]:
        states = [f._state for f in futures]
        values: dict[Any, Any] = {}
        for attempt in range(20):
            await self._wait_states(states, None)
            for st in states:
                if st.status in ("error", "cancelled") and errors == "raise":
                    assert st.exception is not None
                    raise st.exception
            need = [st for st in states if st.status == "finished" and st.key not in values]
            for st in need:
                if st.has_value:  # a small result that came with its report
                    try:
                        values[st.key] = _unwrap(st.value)
                    except Exception:
                        st.has_value = False  # ask its worker instead
            need = [st for st in need if st.key not in values]
            if self._use_shm:
                # values in shared memory on this host: map them, no worker involved
                for st in need:
                    if st.shm is not None:
                        try:
                            values[st.key] = shm.attach(st.shm)
                        except Exception:  # gone, reused, corrupt: ask its worker instead
                            st.shm = None
                need = [st for st in need if st.key not in values]
            if need and self.status != "running":
                # workers leave with their scheduler: nobody is left to serve these
                raise LostDataError(f"{[st.key for st in need]!r:.200} cannot be fetched: the "
                                    f"connection to the scheduler at {self.scheduler_address} is gone")
            by_worker: dict[str, list[Any]] = {}
            unknown: list[Any] = []
            for st in need:
                if st.workers:
                    by_worker.setdefault(st.workers[0], []).append(st.key)
                else:
                    unknown.append(st.key)
            if unknown:
                who_has = await self._scheduler_rpc().who_has(keys=unknown)
                for k in unknown:
                    holders = who_has.get(k) or []
                    if holders:
                        by_worker.setdefault(holders[0], []).append(k)
            results = await asyncio.gather(
                *(self._get_data_batched(w, keys) for w, keys in by_worker.items()), return_exceptions=True
            )
            for (w, keys), res in zip(by_worker.items(), results):
                if isinstance(res, BaseException):
                    # (bytes that failed their checksum on the way: asked for again)
                    if not isinstance(res, (CommError, OSError, CorruptedDataError)):
                        raise res
                    res = {}
                values.update(res)
                for k in keys:
                    if k not in res:
                        state = self._states.get(k)
                        if state is not None and state.workers and state.workers[0] == w:
                            state.workers = state.workers[1:]  # w did not have it: try the next
            # a key lost since it finished (its holder could not read it back, or died)
            # is being computed again: waited for at the top of the next round
            missing = [st for st in states if st.status not in ("error", "cancelled") and st.key not in values]
            if not missing:
                break
            if need and not any(st.key in values for st in need):
                # nothing came: a holder lost the value and the scheduler's word of it
                # (lost-key) is on its way; a moment before asking again
                await asyncio.sleep(min(0.005 * 2**attempt, 0.5))
        else:
            raise LostDataError(f"could not fetch {[st.key for st in missing]!r} from any worker")
        out = []
        for st in states:
            if st.key in values:
                out.append(as_actor(values[st.key], cast("Client", self)))
            elif errors == "skip":
                out.append(None)
            else:
                out.append(st.exception)
        return out

    async def _get_data_batched(self, worker: str, keys: list[Any]) -> dict[Any, Any]:
        """:meth:`_get_data` in requests of at most :data:`GATHER_BATCH_BYTES` each (by
        the sizes the workers reported), one after the other: a worker reads spilled
        values back from disk to send them, and must not hold them all at once."""
        batches: list[list[Any]] = [[]]
        size = 0
        for k in keys:
            st = self._states.get(k)
            n = st.nbytes if st is not None else 0
            if batches[-1] and size + n > GATHER_BATCH_BYTES:
                batches.append([])
                size = 0
            batches[-1].append(k)
            size += n
        if len(batches) == 1:
            return await self._get_data(worker, keys)
        out: dict[Any, Any] = {}
        for batch in batches:
            out.update(await self._get_data(worker, batch))
        return out

    async def _get_data(self, worker: str, keys: list[Any]) -> dict[Any, Any]:
        """The values ``worker`` holds of ``keys``. Raises
        :class:`~shoal.errors.CommBrokenError` when it has not answered within the
        fetch deadline (``fetch-timeout``), the errors of the connection, and the
        worker's error."""
        assert self._pool is not None
        nbytes = 0
        for k in keys:
            st = self._states.get(k)
            nbytes += st.nbytes if st is not None else 0
        deadline = fetch_deadline(nbytes)
        try:
            result = await asyncio.wait_for(PooledRPC(self._pool, worker).get_data(keys=keys), deadline)
        except asyncio.TimeoutError:
            raise CommBrokenError(f"{worker} did not answer get-data within {deadline:.1f}s (fetch-timeout)") from None
        return {k: _unwrap(v) for k, v in result["data"].items()}

    # -- data placement

    def scatter(self, data: Any, workers: Any = None, broadcast: bool = False, direct: bool | None = None,
                hash: bool = True) -> Any:
        """Put ``data`` on workers: one object gives one future, a list a list, a dict
        a dict of futures keyed alike. ``workers`` limits where; ``broadcast`` puts
        every value on every (allowed) worker. Keys are tokens of the values, or random
        with ``hash=False``. ``direct`` is accepted for dask's sake: this client always
        sends values to the workers directly (the scheduler never holds them)."""
        return self._sync(self._scatter, data, workers, broadcast, hash)

    async def _scatter(self, data: Any, workers: Any = None, broadcast: bool = False, hash: bool = True) -> Any:
        def key_of(v: Any) -> str:
            return f"{type(v).__name__}-{tokenize(v) if hash else unique_token()}"

        if isinstance(data, dict):
            items = list(data.items())
            for k, _ in items:
                validate_key(k)
        elif isinstance(data, (list, tuple, set, frozenset)):
            items = [(key_of(v), v) for v in data]
        else:
            items = [(key_of(data), data)]
        info = await self._scheduler_rpc().scheduler_info()
        targets = serving(info, "update-data")
        allowed = worker_restrictions(workers)
        if allowed is not None:
            unknown = [w for w in allowed if w not in info["workers"]]
            if unknown:
                raise ValueError(f"no such worker(s) in this cluster: {unknown}")
            targets = [w for w in targets if w in allowed]
        if not targets:
            raise RuntimeError("the cluster has no workers to scatter to" + (
                "" if not info["workers"] else " (none of them serves update-data)"))
        placement: dict[str, dict[Any, Any]] = {}
        who_has: dict[Any, list[str]] = {}
        shared: list[Any] = []
        for k, v in items:
            chosen = targets if broadcast else [targets[next(self._scatter_rr) % len(targets)]]
            if len(chosen) > 1 and self._use_shm:
                v = self._one_copy(v, shared)
            for w in chosen:
                placement.setdefault(w, {})[k] = to_serialize(v)
            who_has[k] = chosen
        assert self._pool is not None
        try:
            replies = await asyncio.gather(*(PooledRPC(self._pool, w).update_data(data=d) for w, d in placement.items()))
        finally:
            # every worker has mapped what it maps: the name may go (the pages stay
            # theirs) and the memory waits in this process's pool for reuse
            for seg in shared:
                seg.retire()
        nbytes: dict[Any, int] = {}
        placed: dict[Any, Any] = {}  # values a worker keeps in shared memory, and where
        for reply in replies:
            nbytes.update(reply["nbytes"])
            placed.update(reply.get("shm") or {})
        futures = {k: Future(k, cast("Client", self)) for k, _ in items}
        for k, f in futures.items():
            f._state.finish(who_has[k])
        extra = {"shm": placed} if placed else {}
        await self._scheduler_rpc().update_data(who_has=who_has, nbytes=nbytes, client=self.id, **extra)
        if isinstance(data, dict):
            return futures
        if isinstance(data, (list, tuple, set, frozenset)):
            return [futures[k] for k, _ in items]
        return futures[items[0][0]]

    @staticmethod
    def _one_copy(value: Any, shared: list[Any]) -> Any:
        """``value`` copied once into shared memory, for several workers of this host
        to map (instead of a copy each); the value itself if that is not worth it."""
        try:
            placed = shm.place(value, shm_family.TRANSFER_MIN_BYTES)
        except shm.ShmUnavailable:
            return value
        if placed is None:
            return value
        shared.append(placed[0])
        return placed[1]


def serving(info: dict[str, Any], op: str) -> list[str]:
    """The workers of ``scheduler_info()`` that serve the optional ``op`` (those that
    declared no ``ops`` serve them all), sorted: a worker in another language may not."""
    return sorted(a for a, w in info["workers"].items() if "ops" not in w or op in w["ops"])
