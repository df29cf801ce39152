"""Looking at and acting on the whole cluster, as dask.distributed's Client does (a
mixin of :class:`~shoal.Client`): ``wait_for_workers``, ``nthreads``/``ncores``,
``has_what``, ``processing``, ``scheduler_info``, ``get_versions``, ``replicate``,
``rebalance``, ``run_on_scheduler``, ``restart``, ``upload_file`` and ``shutdown``.

The scheduler's halves are in :mod:`shoal.scheduler.ops`. Values are copied by this
client: it fetches them from a worker that holds them and places them on the others
(``update-data``, as ``scatter`` does), then tells the scheduler; a source copy is
dropped only afterwards and only by the scheduler, which never drops the last one.

Where shoal differs from dask: ``run_on_scheduler`` runs only when the scheduler lives
in this process (a :class:`~shoal.LocalCluster` this client was given or started),
since a scheduler never unpickles what clients send. ``restart`` starts new workers
through the cluster object when there is one, else through the workers' nannies
(``shoal worker`` runs each worker under one unless ``--no-nanny``).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import warnings
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, cast

from ..errors import CommError
from ..protocol import to_serialize
from ..protocol.versions import REQUIRED, get_versions, mismatches
from ..taskspec import takes_parameter
from ..rpc import PooledRPC, raise_error_message
from .coordination import _seconds
from .future import Future
from .options import worker_restrictions
from .structure import futures_of

if TYPE_CHECKING:
    from .client import Client

__all__ = ["ClusterOps", "VersionMismatchWarning", "SchedulerNotLocalError"]

logger = logging.getLogger("shoal.client")

_UPLOADABLE = (".py", ".zip", ".egg")


class VersionMismatchWarning(UserWarning):
    """Client, scheduler and workers run different versions of some package."""


class SchedulerNotLocalError(NotImplementedError):
    """The operation needs the scheduler in this process, and it is not."""


class ClusterOps:
    """The cluster-wide methods of :class:`~shoal.Client` (a mixin)."""

    @property
    def _this_client(self) -> Client:
        # only Client mixes this class in: self is always one
        return cast("Client", self)

    # -- workers and what they hold

    def wait_for_workers(self, n_workers: int, timeout: float | str | None = None) -> Any:
        """Wait until at least ``n_workers`` workers have joined. Raises ``ValueError``
        unless ``n_workers`` is a positive integer, ``TimeoutError`` after ``timeout``
        (seconds, or a duration such as ``"10s"``)."""
        if isinstance(n_workers, bool) or not isinstance(n_workers, int) or n_workers < 1:
            raise ValueError(f"`n_workers` must be a positive integer. Instead got {n_workers}.")
        return self._this_client._sync(self._wait_for_workers, n_workers, _seconds(timeout))

    async def _wait_for_workers(self, n_workers: int, timeout: float | None) -> None:
        await self._this_client._scheduler_rpc().wait_for_workers(n_workers=n_workers, timeout=timeout)

    def nthreads(self, workers: Any = None, **kwargs: Any) -> Any:
        """``{worker_address: number of threads}`` (of ``workers`` only, if given)."""
        return self._this_client._sync(self._ask, "ncores", workers=worker_restrictions(workers))

    ncores = nthreads

    def has_what(self, workers: Any = None, **kwargs: Any) -> Any:
        """``{worker_address: (key, ...)}``: the values each worker holds (of
        ``workers`` only, if given; an unknown address holds nothing)."""
        return self._this_client._sync(self._by_worker, "has_what", worker_restrictions(workers))

    def processing(self, workers: Any = None) -> Any:
        """``{worker_address: (key, ...)}``: the tasks each worker was given to run."""
        return self._this_client._sync(self._by_worker, "processing", worker_restrictions(workers))

    async def _by_worker(self, op: str, workers: list[str] | None) -> dict[str, tuple[Any, ...]]:
        found = await self._ask(op, workers=workers)
        return {w: tuple(keys) for w, keys in found.items()}

    async def _ask(self, op: str, **kwargs: Any) -> Any:
        return await getattr(self._this_client._scheduler_rpc(), op)(**kwargs)

    def scheduler_info(self, n_workers: int = -1, **kwargs: Any) -> Any:
        """``{"type", "id", "address", "n_workers", "total_threads", "workers":
        {address: {"nthreads", "name", "host", "pid", "resources", "status", ...}}}``,
        describing the first ``n_workers`` workers (-1: all of them)."""
        return self._this_client._sync(self._ask, "scheduler_info", n_workers=int(n_workers))

    async def _scheduler_info(self, n_workers: int = -1) -> dict[str, Any]:
        return cast("dict[str, Any]", await self._ask("scheduler_info", n_workers=n_workers))

    # -- versions

    def get_versions(self, check: bool = False, packages: list[str] | None = None) -> Any:
        """``{"scheduler": v, "client": v, "workers": {address: v}}`` where each ``v`` is
        ``{"host": {...}, "packages": {name: version}}`` (Python, shoal, msgpack,
        msgspec, cloudpickle, numpy, dask and ``packages``). Versions that differ give
        a :class:`VersionMismatchWarning`; with ``check=True`` a mismatch of Python,
        shoal, cloudpickle or msgspec raises ``ValueError`` instead."""
        return self._this_client._sync(self._get_versions, check, list(packages or ()))

    async def _get_versions(self, check: bool, packages: list[str]) -> dict[str, Any]:
        client = get_versions(packages)
        scheduler = await self._ask("versions", packages=packages)
        workers = await self._this_client._run(get_versions, (packages,), {}, None)
        found = mismatches(client, scheduler, workers)
        if found:
            table = "\n".join(f"  {name}: client {c}, scheduler {s}, workers {w}" for name, c, s, w in found)
            required = [name for name, *_ in found if name in REQUIRED]
            if check and required:
                raise ValueError(f"mismatched versions of {', '.join(required)} (they must agree):\n{table}")
            warnings.warn(f"mismatched versions found:\n{table}", VersionMismatchWarning, stacklevel=3)
        return {"scheduler": scheduler, "client": client, "workers": workers}

    # -- copies of values

    def replicate(self, futures: Any, n: int | None = None, workers: Any = None, branching_factor: int = 2,
                  **kwargs: Any) -> Any:
        """Have ``n`` copies (default: one per worker) of each of the ``futures``'
        values on ``workers`` (default: all), waiting for them first: copies are made
        where missing, and extra ones (among ``workers``) dropped. Raises
        ``ValueError`` for ``n < 1`` or an unknown worker. ``branching_factor`` is
        accepted for dask's sake (this client sends every copy itself)."""
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"Can not use replicate to delete data (n={n!r})")
        return self._this_client._sync(self._replicate, futures_of(futures), n, worker_restrictions(workers))

    async def _replicate(self, futures: list[Future], n: int | None, workers: list[str] | None) -> None:
        me = self._this_client
        await me._wait_states([f._state for f in futures], None)
        keys = list(dict.fromkeys(f.key for f in futures if f.status == "finished"))
        if not keys:
            return
        targets = await self._known_workers(workers)
        want = len(targets) if n is None else min(n, len(targets))
        rpc = me._scheduler_rpc()
        who_has = await rpc.who_has(keys=keys)
        load = {w: 0 for w in targets}
        for holders in who_has.values():
            for w in holders:
                if w in load:
                    load[w] += 1
        copies: list[tuple[Any, str, str]] = []  # (key, from, to)
        extra: dict[Any, list[str]] = {}
        for key in keys:
            holders = who_has.get(key) or []
            if not holders:
                continue  # lost meanwhile: it is being computed again
            here = [w for w in holders if w in load]
            if len(here) > want:
                extra[key] = sorted(here, key=lambda w: (-load[w], w))[:len(here) - want]
                continue
            for w in sorted((w for w in targets if w not in holders), key=lambda w: (load[w], w))[:want - len(here)]:
                copies.append((key, holders[0], w))
                load[w] += 1
        await self._copy(copies)
        if extra:
            await rpc.remove_replicas(who_has=extra)
        await self._refresh_holders(keys)

    def rebalance(self, futures: Any = None, workers: Any = None, **kwargs: Any) -> Any:
        """Move values between ``workers`` (default: all) so that they hold about the
        same number of bytes: only the ``futures``' values if given (waited for
        first), else any. A value is copied first and its old copy dropped after, by
        the scheduler. Raises ``ValueError`` for an unknown worker."""
        found = None if futures is None else futures_of(futures)
        return self._this_client._sync(self._rebalance, found, worker_restrictions(workers))

    async def _rebalance(self, futures: list[Future] | None, workers: list[str] | None) -> None:
        me = self._this_client
        keys = None
        if futures is not None:
            await me._wait_states([f._state for f in futures], None)
            keys = list(dict.fromkeys(f.key for f in futures if f.status == "finished"))
            if not keys:
                return
        rpc = me._scheduler_rpc()
        moves = await rpc.rebalance_plan(keys=keys, workers=workers)
        done = await self._copy([(key, sender, recipient) for key, sender, recipient in moves])
        sources: dict[Any, list[str]] = {}
        for key, sender, _ in moves:
            if key in done:
                sources.setdefault(key, []).append(sender)
        if sources:
            await rpc.remove_replicas(who_has=sources)
        await self._refresh_holders(list(sources))

    async def _copy(self, copies: list[tuple[Any, str, str]]) -> set[Any]:
        """Copy values from worker to worker (``[(key, source, target)]``) through this
        client, and tell the scheduler of the new holders; returns the keys copied.
        A key the source no longer has is left alone; the first failure to place a
        value is raised once the others are recorded."""
        me = self._this_client
        if not copies:
            return set()
        by_source: dict[str, list[Any]] = {}
        for key, source, _ in copies:
            by_source.setdefault(source, []).append(key)
        fetched = await asyncio.gather(*(me._get_data(w, list(dict.fromkeys(ks))) for w, ks in by_source.items()),
                                       return_exceptions=True)
        values: dict[tuple[str, Any], Any] = {}
        for (source, _), got in zip(by_source.items(), fetched):
            if isinstance(got, BaseException):
                if not isinstance(got, (CommError, OSError)):
                    raise got
                logger.info("could not fetch values from %s to copy them: %s", source, got)
                continue
            for key, value in got.items():
                values[source, key] = value
        targets: dict[Any, list[str]] = {}
        for key, source, target in copies:
            if (source, key) in values:
                targets.setdefault((source, key), []).append(target)
        placement: dict[str, dict[Any, Any]] = {}
        shared: list[Any] = []
        for (source, key), where in targets.items():
            value = values[source, key]
            if len(where) > 1 and me._use_shm:
                value = me._one_copy(value, shared)  # one copy in shared memory for them all
            for w in where:
                placement.setdefault(w, {})[key] = to_serialize(value)
        assert me._pool is not None
        try:
            replies = await asyncio.gather(*(PooledRPC(me._pool, w).update_data(data=d) for w, d in placement.items()),
                                           return_exceptions=True)
        finally:
            for seg in shared:
                seg.retire()
        who_has: dict[Any, list[str]] = {}
        nbytes: dict[Any, int] = {}
        failure: BaseException | None = None
        for (w, data), reply in zip(placement.items(), replies):
            if isinstance(reply, BaseException):
                failure = failure or reply
                continue
            nbytes.update(reply["nbytes"])
            for key in data:
                who_has.setdefault(key, []).append(w)
        if who_has:
            rpc = me._scheduler_rpc()
            await rpc.update_data(who_has=who_has, nbytes=nbytes, client=me.id)
            # update-data makes this client want the keys: those it holds no future of
            # (another client's) are let go again, as they were
            mine = set(me._refcount)
            theirs = [k for k in who_has if k not in mine]
            if theirs:
                me._enqueue({"op": "release-keys", "keys": theirs})
        if failure is not None:
            raise failure
        return set(who_has)

    async def _refresh_holders(self, keys: list[Any]) -> None:
        """Tell this client's futures of ``keys`` where their values are now."""
        me = self._this_client
        mine = [k for k in keys if k in me._states]
        if not mine:
            return
        who_has = await me._scheduler_rpc().who_has(keys=mine)
        for key in mine:
            st = me._states.get(key)
            if st is not None and st.status == "finished" and who_has.get(key):
                st.workers = list(who_has[key])

    async def _known_workers(self, workers: list[str] | None) -> list[str]:
        info = await self._ask("scheduler_info")
        known = sorted(info["workers"])
        if workers is None:
            return known
        unknown = [w for w in workers if w not in info["workers"]]
        if unknown:
            raise ValueError(f"no such worker(s) in this cluster: {unknown}")
        return list(dict.fromkeys(workers))

    # -- the scheduler in this process

    def run_on_scheduler(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``function(*args, **kwargs)`` on the scheduler's event loop and return
        its result (a coroutine function is awaited there); it gets the scheduler
        object as ``dask_scheduler=`` if it takes that argument. Only for a scheduler
        in this process (a LocalCluster this client was given or started): raises
        :class:`SchedulerNotLocalError` (a ``NotImplementedError``) otherwise, since a
        scheduler never runs code that clients send. ``TypeError`` for a non-callable."""
        if not callable(function):
            raise TypeError(f"run_on_scheduler() needs a callable, got {type(function).__name__}")
        return self._this_client._sync(self._run_on_scheduler, function, args, kwargs)

    async def _run_on_scheduler(self, function: Callable[..., Any], args: tuple[Any, ...],
                                kwargs: dict[str, Any]) -> Any:
        scheduler, loop = self._scheduler_here("run_on_scheduler()")
        if takes_parameter(function, "dask_scheduler"):
            kwargs = {**kwargs, "dask_scheduler": scheduler}

        async def call() -> Any:
            result = function(*args, **kwargs)
            if inspect.isawaitable(result):
                result = await result
            return result

        return await _on_loop(loop, call())

    def _scheduler_here(self, what: str) -> tuple[Any, asyncio.AbstractEventLoop | None]:
        """The scheduler object this client is connected to and its loop, when it lives
        in this process; raises :class:`SchedulerNotLocalError` otherwise."""
        me = self._this_client
        cluster = me.cluster
        scheduler = getattr(cluster, "scheduler", None)
        addresses = {getattr(cluster, "local_address", None), getattr(scheduler, "address", None)}
        if scheduler is None or me.scheduler_address not in addresses:
            raise SchedulerNotLocalError(
                f"{what} needs the scheduler in this process (a LocalCluster this client was given "
                f"or started); the scheduler at {me.scheduler_address} runs elsewhere, and it never "
                "runs code that clients send. Use client.run(...) to run a function on the workers.")
        return scheduler, getattr(cluster, "_loop", None)

    # -- restart, upload, shutdown

    def restart(self, timeout: float | str | None = None, wait_for_workers: bool = True) -> Any:
        """Restart every worker (new processes, or new Worker objects in this
        process) and cancel every future of every client (their ``result()`` raises
        :class:`~shoal.CancelledError`); the cluster keeps its size. Waits for the
        workers to be back unless ``wait_for_workers=False``. Without a cluster object
        (a client given a scheduler address) the workers' nannies restart them. Raises
        ``TimeoutError`` after ``timeout``, and ``RuntimeError`` when a worker has no
        nanny and there is no cluster object (``shoal worker --no-nanny``), or a nanny
        failed."""
        return self._this_client._sync(self._restart, _seconds(timeout), wait_for_workers)

    async def _restart(self, timeout: float | None, wait_for_workers: bool) -> None:
        me = self._this_client
        cluster = me.cluster
        restart_workers = getattr(cluster, "_restart_workers", None)
        if restart_workers is None:
            return await self._restart_by_nannies(timeout, wait_for_workers)
        n = len(cluster.workers)
        me._flush_outbox()  # what was submitted before the restart is cancelled with the rest
        await me._scheduler_rpc().restart(client=me.id)
        with me._lock:
            states = list(me._states.values())
            me._states.clear()  # futures made from now on start afresh
        for st in states:
            st.cancel("the cluster was restarted")

        async def restart() -> None:
            await _on_loop(getattr(cluster, "_loop", None), restart_workers())
            if wait_for_workers and n:
                await me._scheduler_rpc().wait_for_workers(n_workers=n, timeout=None)

        work = asyncio.ensure_future(restart())
        try:
            # on a timeout the restart goes on (the cluster keeps its size)
            await asyncio.wait_for(asyncio.shield(work), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"the workers did not restart within {timeout}s") from None

    async def _restart_by_nannies(self, timeout: float | None, wait_for_workers: bool) -> None:
        """``restart()`` without a cluster object: the scheduler has each worker's nanny
        restart it (``restart-workers``). Workers without a nanny (``shoal worker
        --no-nanny``) are a ``RuntimeError``, raised before anything is cancelled."""
        me = self._this_client
        scheduler = me._scheduler_rpc()
        workers = (await scheduler.identity())["workers"]
        without = sorted(a for a, w in workers.items() if not w.get("nanny"))
        if without:
            raise RuntimeError(
                f"restart() needs a supervisor to start each worker again (its nanny, or the cluster "
                f"object), and {len(without)} of the {len(workers)} workers of {me.scheduler_address} have "
                f"none (`shoal worker --no-nanny`, or a cluster of threads given by its address): "
                f"{', '.join(without[:5])}{', ...' if len(without) > 5 else ''}. Connect with "
                "Client(cluster) to a LocalCluster, start the workers without --no-nanny, or restart the "
                "worker processes yourself.")
        me._flush_outbox()  # what was submitted before the restart is cancelled with the rest
        await scheduler.restart(client=me.id)
        with me._lock:
            states = list(me._states.values())
            me._states.clear()  # futures made from now on start afresh
        for st in states:
            st.cancel("the cluster was restarted")
        loop = asyncio.get_running_loop()
        start = loop.time()
        try:
            result = await asyncio.wait_for(scheduler.restart_workers(timeout=timeout), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"the workers did not restart within {timeout}s") from None
        if result["errors"]:
            raise RuntimeError("restart(): these nannies could not restart their workers: " + "; ".join(
                f"{nanny}: {why}" for nanny, why in sorted(result["errors"].items())))
        if wait_for_workers and workers:
            left = None if timeout is None else max(timeout - (loop.time() - start), 0.0)
            await scheduler.wait_for_workers(n_workers=len(workers), timeout=left)

    def upload_file(self, filename: str, load: bool = True) -> Any:
        """Send the local file ``filename`` (``.py``, ``.zip`` or ``.egg``) to every
        worker, and to workers that join later: it is put on their ``sys.path`` and,
        with ``load``, its modules are imported (reloaded if imported before). Raises
        ``ValueError`` for another kind of file, ``OSError`` if it cannot be read, and
        what importing it raised on a worker."""
        name = os.path.basename(os.fspath(filename))
        if os.path.splitext(name)[1] not in _UPLOADABLE:
            raise ValueError(f"upload_file() takes a .py, .zip or .egg file, got {filename!r}")
        with open(filename, "rb") as f:
            data = f.read()
        return self._this_client._sync(self._upload_file, name, data, load)

    async def _upload_file(self, name: str, data: bytes, load: bool) -> None:
        errors = await self._this_client._scheduler_rpc().upload_file(filename=name, data=data, load=load)
        for address in sorted(errors):
            if errors[address] is not None:
                logger.error("worker %s could not take %s: %s", address, name, errors[address].get("message"))
                raise_error_message(errors[address])

    def shutdown(self) -> Any:
        """Close the cluster (scheduler and workers) and this client. Without a cluster
        object (a client given a scheduler address) the workers are told to close; the
        scheduler process itself keeps running (stop it where it was started)."""
        me = self._this_client
        if me.asynchronous:
            return self._shutdown()
        cluster = None if me._own_cluster else me.cluster
        if me.cluster is None and me.status == "running":
            me._sync(self._retire_workers)
        me.close()
        if cluster is not None:
            cluster.close()
        return None

    async def _shutdown(self) -> None:
        me = self._this_client
        cluster = None if me._own_cluster else me.cluster
        if me.cluster is None and me.status == "running":
            await self._retire_workers()
        await me._close()
        if cluster is not None:
            if getattr(cluster, "asynchronous", False):
                await cluster.close()
            else:
                await asyncio.to_thread(cluster.close)

    async def _retire_workers(self) -> None:
        try:
            await self._this_client._scheduler_rpc().retire_all()
        except CommError:
            pass  # the scheduler is gone already


async def _on_loop(loop: asyncio.AbstractEventLoop | None, coro: Coroutine[Any, Any, Any]) -> Any:
    """Run ``coro`` on ``loop`` (the running one if None or the same) and return its result."""
    if loop is None or loop is asyncio.get_running_loop():
        return await coro
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))
