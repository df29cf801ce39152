"""Dask collections on shoal: ``compute``, ``persist`` and ``get`` for the client.

Graphs go through dask's own conversion (:mod:`.graphs`); collections are optimized and
lowered by dask on the client, as ``dask.compute`` does, then submitted as one graph.
Lowering picks the methods of shuffles and rechunks: an open client has dask pick
methods right on any cluster. A graph that keeps data on one worker's disk (dask's
"disk" shuffle) is refused on a cluster that spans hosts, and on one host the tasks
that make or use that data are sent to run at most once (:mod:`.dask_methods`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, cast

from ..errors import GraphError
from ..protocol import to_serialize
from ..taskspec import RunSpec
from . import dask_methods, graphs
from .future import Future
from .options import TaskOptions, apply_annotations, call_options

if TYPE_CHECKING:
    from .client import Client

__all__ = ["DaskCollections"]


class DaskCollections:
    """The dask-facing methods of :class:`~shoal.Client` (a mixin)."""

    @property
    def _client(self) -> Client:
        # only Client mixes this class in: self is always one
        return cast("Client", self)

    # provided by the client
    def _submit_tasks(self, tasks: list[dict[str, Any]], wanted: list[Any]) -> None:
        raise NotImplementedError

    def _submit_parts(self, parts: Iterable[tuple[list[dict[str, Any]], list[Any], list[Any]]]) -> None:
        raise NotImplementedError

    def _sync(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    async def _gather_async(self, futures: list[Future], timeout: float | None = None,
                            errors: str = "raise") -> list[Any]:
        raise NotImplementedError

    def compute(self, collections: Any, sync: bool = False, optimize_graph: bool = True, workers: Any = None,
                allow_other_workers: bool = False, resources: dict[str, float] | None = None, retries: int = 0,
                priority: int = 0, fifo_timeout: Any = "60s", actors: Any = None, traverse: bool = True,
                **kwargs: Any) -> Any:
        """Start computing dask collections (one, or a list/tuple of them) on the
        cluster; returns a future per collection, whose result is what
        ``collection.compute()`` would return (with ``sync=True``: the results
        themselves). Non-collections come back as they are. ``workers``,
        ``resources``, ``retries``, ``priority`` and ``allow_other_workers`` apply to
        every task, under the graph's own ``dask.annotate`` annotations."""
        import dask
        from dask._expr import FinalizeCompute
        from dask.base import collections_to_expr

        options = call_options(workers, resources, priority, retries, allow_other_workers)

        single = not isinstance(collections, (list, tuple))
        colls = [collections] if single else list(collections)
        out: list[Any] = []
        tasks: list[dict[str, Any]] = []
        wanted: list[Any] = []
        for coll in colls:
            if not dask.is_dask_collection(coll):
                out.append(coll)
                continue
            expr = FinalizeCompute(collections_to_expr([coll], optimize_graph)).optimize()
            keys = graphs.flatten_keys(list(expr.__dask_keys__()), [])
            if len(keys) != 1:
                raise ValueError(f"expected one result key for {type(coll).__name__}, got {len(keys)}")
            graph = graphs.prepare(expr, keys)
            stores = self._local_stores(graph)
            parts = graph.parts() if len(colls) == 1 and not stores else None
            future = Future(keys[0], self._client)
            if parts is not None:
                # a big graph: its first part runs while the client makes the rest
                self._submit_parts(_annotated(parts, _annotations(expr, graph.renamed), options))
            else:
                graph_tasks = graph.tasks()
                apply_annotations(graph_tasks, _annotations(expr, graph.renamed), options)
                dask_methods.mark_once(graph_tasks, stores)
                if stores and self._client.asynchronous:  # (checked before it is sent)
                    self._submit_when_checked(graph_tasks, [keys[0]], stores)
                else:
                    tasks.extend(graph_tasks)
                    wanted.append(keys[0])
            out.append(future)
        if tasks:
            self._submit_tasks(tasks, wanted)
        if sync:
            futures = [f for f in out if isinstance(f, Future)]
            values = iter(self._sync(self._gather_async, futures))
            out = [next(values) if isinstance(f, Future) else f for f in out]
        return out[0] if single else type(collections)(out)

    def persist(self, collections: Any, optimize_graph: bool = True, workers: Any = None,
                allow_other_workers: bool = False, resources: dict[str, float] | None = None, retries: int = 0,
                priority: int = 0, fifo_timeout: Any = "60s", actors: Any = None, **kwargs: Any) -> Any:
        """Start computing dask collections and return the same collections backed by
        the cluster's results (their graphs hold futures): later computations on them
        start from those results. ``dask.persist(x)`` with this client as the default
        calls this. The options are those of :meth:`compute`."""
        import dask
        from dask.base import collections_to_expr

        options = call_options(workers, resources, priority, retries, allow_other_workers)

        single = not isinstance(collections, (list, tuple))
        colls = [collections] if single else list(collections)
        dask_colls = [c for c in colls if dask.is_dask_collection(c)]
        if not dask_colls:
            return collections
        expr = collections_to_expr(dask_colls, optimize_graph).optimize()
        per_coll = [graphs.flatten_keys(list(k) if isinstance(k, (list, tuple)) else [k], [])
                    for k in expr.__dask_keys__()]
        if len(per_coll) != len(dask_colls):  # one collection: its keys come unnested
            per_coll = [graphs.flatten_keys(list(expr.__dask_keys__()), [])]
        all_keys = [k for ks in per_coll for k in ks]
        graph = graphs.prepare(expr, all_keys)
        stores = self._local_stores(graph)
        tasks = graph.tasks()
        apply_annotations(tasks, _annotations(expr, graph.renamed), options)
        futures = {k: Future(k, self._client) for k in all_keys}
        self._submit_graph(tasks, all_keys, stores)
        rebuilt = iter(
            rebuild({k: futures[k] for k in ks}, *state)
            for (rebuild, state), ks in zip((c.__dask_postpersist__() for c in dask_colls), per_coll)
        )
        out = [next(rebuilt) if dask.is_dask_collection(c) else c for c in colls]
        return out[0] if single else type(collections)(out)

    def get(self, dsk: Any, keys: Any, workers: Any = None, allow_other_workers: bool = False,
            resources: dict[str, float] | None = None, retries: int = 0, priority: int = 0, sync: bool = True,
            **kwargs: Any) -> Any:
        """Run a dask-style graph and return the values of ``keys`` (a key or nested
        lists of keys), so ``dask.compute(x, scheduler=client.get)`` works. Raises
        ``KeyError`` for a requested key not in the graph and :class:`GraphError` for a
        cycle."""
        # The graph is made here, on the caller's thread, never on the client's event
        # loop: making a dask expression's graph runs dask's code, which may need a lock
        # the caller holds while it waits for this call (Python 3.11's cached_property
        # holds one lock per class: set_index computes divisions inside one, and the
        # graph of that computation reads other frames' divisions), and would stall
        # the loop meanwhile.
        options = call_options(workers, resources, priority, retries, allow_other_workers)
        graph = graphs.prepare(dsk, keys)
        stores = self._local_stores(graph)
        tasks, flat_keys = graph.tasks(), graph.wanted
        apply_annotations(tasks, _annotations(dsk, graph.renamed), options)
        futures = [Future(k, self._client) for k in flat_keys]
        try:
            self._submit_graph(tasks, flat_keys, stores)
        except BaseException:
            for f in futures:
                f.release()
            raise
        return self._sync(self._get_values, futures, keys)

    async def _get_values(self, futures: list[Future], keys: Any) -> Any:
        """The values of ``futures`` (of ``keys``' flattened), in the shape of ``keys``;
        the futures released whatever happens."""
        try:
            values = await self._gather_async(futures)
        finally:
            for f in futures:
                f.release()
        flat_keys = [f.key for f in futures]
        by_key = dict(zip(flat_keys, values))
        return graphs.pack(keys, by_key)

    # -- graphs that keep data on a worker's disk (dask's "disk" shuffle)

    def _local_stores(self, graph: graphs.Graph) -> list[Any]:
        """The keys of the tasks of ``graph`` that make a partd store, those tasks and
        the ones that use a store given keys of their own
        (:func:`.dask_methods.renew_stores`). A synchronous client raises the refusal
        of the graph (:func:`.dask_methods.refusal`) here when the cluster's workers
        span hosts (it asks the scheduler for them); an asynchronous client checks when
        it sends the graph (:meth:`_submit_graph`)."""
        stores = dask_methods.local_stores(graph.nodes)
        if stores and not self._client.asynchronous:
            error = self._sync(self._store_refusal, stores)
            if error is not None:
                raise error
        return dask_methods.renew_stores(graph, stores)

    def _submit_graph(self, tasks: list[dict[str, Any]], wanted: list[Any], stores: list[Any]) -> None:
        """Send a dask graph's ``tasks``, those that make or write into its partd
        ``stores`` marked to run at most once (:func:`.dask_methods.mark_once`); an
        asynchronous client's graph with stores once they are checked
        (:meth:`_submit_when_checked`)."""
        dask_methods.mark_once(tasks, stores)
        if stores and self._client.asynchronous:
            self._submit_when_checked(tasks, wanted, stores)
        else:
            self._submit_tasks(tasks, wanted)

    async def _store_refusal(self, stores: list[Any]) -> GraphError | None:
        info = await self._client._scheduler_info()
        return dask_methods.refusal(stores, info.get("workers") or {})

    def _submit_when_checked(self, tasks: list[dict[str, Any]], wanted: list[Any], stores: list[Any]) -> None:
        """Send an asynchronous client's graph that makes partd stores once the
        cluster's workers are known (``compute`` and ``persist`` return at once): as it
        is on one host; on several, each store's task raises the refusal instead, so
        the graph's futures err with it."""
        client = self._client

        async def check_then_submit() -> None:
            try:
                error = await self._store_refusal(stores)
            except Exception as exc:  # (the futures must end: they err with this)
                error = GraphError(f"could not learn the hosts of the cluster's workers: {exc}")
            sent = tasks
            if error is not None:
                failing = set(stores)
                sent = [{**t, "deps": [], "payload": to_serialize(RunSpec(dask_methods.fail_with, (error,), {}))}
                        if t["key"] in failing else t for t in tasks]
            with client._lock:  # (keys whose futures were dropped meanwhile are released already)
                still = [k for k in wanted if client._refcount.get(k, 0) > 0]
            if client.status == "running":  # (closed meanwhile: its futures are cancelled)
                self._submit_tasks(sent, still)

        checking = asyncio.ensure_future(check_then_submit())
        _checking.add(checking)  # (the loop keeps only a weak reference to a task)
        checking.add_done_callback(_checking.discard)


#: the checks of asynchronous clients' graphs under way (:meth:`DaskCollections._submit_when_checked`)
_checking: set[asyncio.Future[None]] = set()


def _annotated(parts: Iterator[tuple[list[dict[str, Any]], list[Any], list[Any]]],
               per_key: dict[str, dict[Any, Any]], options: TaskOptions
               ) -> Iterator[tuple[list[dict[str, Any]], list[Any], list[Any]]]:
    """``parts`` of a graph, each with the options of its tasks set (as
    :func:`.options.apply_annotations` sets them)."""
    for tasks, wanted, held in parts:
        apply_annotations(tasks, per_key, options)
        yield tasks, wanted, held


def _annotations(graph: Any, renamed: dict[Any, Any]) -> dict[str, dict[Any, Any]]:
    """The per-key annotations of a dask expression or graph (none for a plain dict),
    under the new keys of the tasks ``renamed`` (old key -> new key)."""
    get = getattr(graph, "__dask_annotations__", None)
    if get is None:
        return {}
    try:
        found = dict(get() or {})
    except Exception:  # annotations are hints: a graph that cannot give them still runs
        return {}
    if renamed:
        found = {name: {renamed.get(k, k): v for k, v in values.items()} if isinstance(values, dict) else values
                 for name, values in found.items()}
    return found
