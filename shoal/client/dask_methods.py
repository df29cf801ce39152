"""The methods dask's all-to-all exchanges use on a shoal cluster.

dask picks how to shuffle a dataframe (``shuffle``, ``merge``, ``set_index``,
``sort_values``, a groupby's or ``drop_duplicates``' ``split_out``) and how to rechunk
an array when it lowers the expression: mostly inside ``.compute()`` or
``dask.compute()``, before any scheduler sees the graph; a bag's ``groupby`` picks its
method when it is made. Finding no dask.distributed client it picks ``"disk"`` for
dataframes and bags: a partd directory on the local disk of whichever worker runs the
first task, which the other tasks then append to and read from by its path. That is
right only while every worker sees that directory (one host) and no task of it runs
twice (a split run again appends its rows again; the store made again is empty).
shoal's own shuffle (``"shoal"``, :mod:`shoal.client.shuffle`) for dataframes and
dask's ``"tasks"`` for arrays are right on any cluster, so:

- while any shoal client is open (default or not: ``dask.compute(x,
  scheduler=client.get)`` lowers ``x`` before it calls the client), dask's config holds
  those (:data:`METHODS`) for each method the user left unset (:func:`hold`, :func:`release`; a
  client holds from the moment it is connected until it closes or is collected); when
  the last holder lets go, each setting still at shoal's choice goes back to what it
  was;
- a graph that still makes a partd store (``method="disk"`` asked for, or a graph made
  while no client was open) is refused when the cluster's workers span hosts
  (:func:`local_stores`, :func:`refusal`); on one host the tasks that make or use a
  store get keys of their own for each submission (:func:`renew_stores`), and those
  that make or write into it are sent to run at most once (:func:`mark_once`): should
  one of them have to run again (its worker died while it ran, its value was lost),
  the scheduler errs what is built on it with :class:`~shoal.errors.RunOnceError`,
  saying why (:data:`ONCE`), where running it again would have given a wrong result.
"""

from __future__ import annotations

import functools
import threading
import uuid
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ..comm.core import parse_address
from ..errors import GraphError

if TYPE_CHECKING:
    from .graphs import Graph

__all__ = ["METHODS", "hold", "release", "use_instead", "hold_while", "local_stores", "refusal", "fail_with", "ONCE",
           "mark_once", "renew_stores"]

#: dask config key -> the method shoal has dask use when the user set none: shoal's own
#: shuffle for dataframes (:mod:`shoal.client.shuffle`; dask's "tasks" should this
#: dask's planner not take it: :func:`use_instead`), dask's task rechunk for arrays
METHODS = {"dataframe.shuffle.method": "shoal", "array.rechunk.method": "tasks"}

_lock = threading.Lock()
_holders = 0
#: what each key set by shoal held before (``_MISSING``: it was not there)
_before: dict[str, Any] = {}
_MISSING = object()


def _dask_config() -> Any:
    try:
        import dask.config
    except ImportError:
        return None
    return dask.config


def hold() -> None:
    """From now on until the matching :func:`release`, dask picks :data:`METHODS` for
    the methods the user left unset (``None`` or absent in dask's config)."""
    global _holders
    from .shuffle import watch

    watch()  # the method "shoal" is known to dask's planner while a client lives
    with _lock:
        _holders += 1
        if _holders > 1:
            return
        cfg = _dask_config()
        if cfg is None:
            return
        for key, method in METHODS.items():
            value = cfg.get(key, _MISSING)
            if value is None or value is _MISSING:
                _before[key] = value
                cfg.set({key: method})


def release() -> None:
    """Undo one :func:`hold`; after the last, each method still at shoal's choice is
    what it was before (a setting the user made meanwhile stays)."""
    global _holders
    with _lock:
        if _holders == 0:
            return
        _holders -= 1
        if _holders > 0:
            return
        cfg = _dask_config()
        before = dict(_before)
        _before.clear()
        if cfg is None:
            return
        for key, value in before.items():
            if cfg.get(key, None) != METHODS[key]:
                continue  # the user's own choice since: it stands
            if value is _MISSING:
                _remove(cfg.config, key.split("."))
            else:
                cfg.set({key: value})


def use_instead(key: str, method: str) -> None:
    """From now on have dask use ``method`` for ``key`` where it would have used
    :data:`METHODS`' (also now, while held and still at shoal's choice)."""
    with _lock:
        before = METHODS[key]
        METHODS[key] = method
        cfg = _dask_config()
        if _holders and key in _before and cfg is not None and cfg.get(key, None) == before:
            cfg.set({key: method})


def hold_while(owner: object) -> Callable[[], Any]:
    """:func:`hold` for as long as ``owner`` (a client) lives. Returns the function
    that lets go: the first call releases, later ones do nothing (from any thread);
    it is called on its own when ``owner`` is garbage-collected, or at the
    interpreter's exit."""
    hold()
    return weakref.finalize(owner, release)


def _remove(config: dict[str, Any], path: list[str]) -> None:
    """Take ``path`` (a key split at its dots) out of dask's nested ``config``."""
    for part in path[:-1]:
        config = config.get(part)  # type: ignore[assignment]
        if not isinstance(config, dict):
            return
    config.pop(path[-1], None)


# -- graphs that keep data on a worker's local disk

def local_stores(nodes: Mapping[Any, Any]) -> list[Any]:
    """The keys of the tasks of ``nodes`` (key -> dask task-spec node) that make a
    partd store: dask's ``"disk"`` shuffle of a dataframe
    (``dask.dataframe.shuffle.maybe_buffered_partd``) or of a bag (``partd.*``). The
    store lives in a directory of the local disk of the worker that runs that task;
    the shuffle's other tasks reach it by its path, wherever they run."""
    found = []
    for key, node in nodes.items():
        func = getattr(node, "func", None)
        if func is not None and _makes_store(func):
            found.append(key)
    return found


def _makes_store(func: Any) -> bool:
    while isinstance(func, functools.partial):
        func = func.func
    return _defines_store(func if isinstance(func, type) else type(func))


@functools.lru_cache(maxsize=1024)
def _defines_store(cls: type) -> bool:
    module = getattr(cls, "__module__", None) or ""
    return module.partition(".")[0] == "partd" or (
        module == "dask.dataframe.shuffle" and cls.__qualname__ == "maybe_buffered_partd")


def refusal(stores: list[Any], workers: Mapping[str, Mapping[str, Any]]) -> GraphError | None:
    """The error for a graph whose tasks ``stores`` make a partd store (see
    :func:`local_stores`) on a cluster whose ``workers`` (``scheduler_info()
    ["workers"]``) span more than one host; None when they are on one host (or
    there is no store)."""
    if not stores:
        return None
    hosts = _hosts(workers)
    if len(hosts) < 2:
        return None
    listed = "; ".join(f"{host}: {', '.join(sorted(addresses))}" for host, addresses in sorted(hosts.items()))
    return GraphError(
        f"dask's 'disk' shuffle keeps its pieces in a directory on the local disk of one worker, and on "
        f"workers that do not share that disk it loses rows; this cluster's workers are on {len(hosts)} "
        f"hosts ({listed}). Use the 'tasks' method (shuffle_method='tasks', a bag's shuffle='tasks', "
        f"dask.config.set({{'dataframe.shuffle.method': 'tasks'}})), or leave the method unset: shoal then "
        f"has dask use 'tasks'. The graph's partd store: {stores[0]!r}")


def _hosts(workers: Mapping[str, Mapping[str, Any]]) -> dict[str, list[str]]:
    """The workers' addresses by host. Two workers are taken to share a disk only when
    both their addresses' IP and their host identity (hostname, boot, shared-memory
    device) agree: either differing may mean another machine or container."""
    groups: dict[tuple[str, str], list[str]] = {}
    for address, info in workers.items():
        groups.setdefault((_ip(address), str(info.get("host") or "")), []).append(address)
    ips = [ip for ip, _ in groups]
    return {(ip if ip and ips.count(ip) == 1 else f"{ip or 'in-process'} {identity}".strip()): addresses
            for (ip, identity), addresses in groups.items()}


def _ip(address: str) -> str:
    """The host part of a tcp or tls ``address`` (``""`` for other schemes)."""
    try:
        scheme, location = parse_address(address)
    except TypeError:
        return ""
    if scheme not in ("tcp", "tls"):
        return ""
    return location.rpartition(":")[0].strip("[]")


#: why the tasks of dask's disk shuffle that make its store or write into it run at
#: most once (the end of the error the scheduler gives when one would have run again)
ONCE = ("dask's 'disk' shuffle keeps its rows in a directory that its tasks append to and read back, and "
        "cannot redo part of its work after a worker was lost (a split run again appends its rows again; the "
        "store made again is empty). Use the 'tasks' method (shuffle_method='tasks', a bag's shuffle='tasks', "
        "dask.config.set({'dataframe.shuffle.method': 'tasks'})), or leave the method unset: shoal then has "
        "dask use 'tasks'")


def renew_stores(graph: Graph, stores: list[Any]) -> list[Any]:
    """Give the tasks of ``graph`` that make one of the partd ``stores`` or take one
    as an input keys of their own for this submission (wanted keys excepted), in the
    tasks that refer to them too; returns the stores' keys now.

    shoal takes two tasks of one key for one: a worker that holds a value of that key
    (a copy it fetched), or still runs a task of it (told to drop it: a thread cannot
    be stopped), answers a new task of the key with it. That is right for a task that
    gives the same value whenever it runs, not for these: a graph of the same keys
    made again (a bag's groupby has the same keys each time it is made; a retry after
    an error, say) would find the store of an earlier run, with that run's rows in
    it, or a split of that run standing for its own. (dask gives the tasks of a
    dataframe's disk shuffle new keys each time it lowers one; a bag's keep theirs.)
    The collects that are wanted keep their keys: a value of an earlier run was read
    from a whole store, and is the same."""
    if not stores:
        return stores
    made = set(stores)
    wanted = set(graph.wanted)
    suffix = uuid.uuid4().hex
    new = {key: _fresh(key, suffix) for key, node in graph.nodes.items()
           if (key in made or not made.isdisjoint(node.dependencies)) and key not in wanted}
    graph.rename(new)
    return [new.get(key, key) for key in stores]


def _fresh(key: Any, suffix: str) -> Any:
    """``key`` made unique with ``suffix``, its name (what the dashboard groups by)
    kept."""
    if type(key) is tuple and key and type(key[0]) is str:
        return (f"{key[0]}-{suffix}", *key[1:])
    if type(key) is str:
        return f"{key}-{suffix}"
    return (f"once-{suffix}", key)


def mark_once(tasks: list[dict[str, Any]], stores: list[Any]) -> None:
    """Mark the tasks of ``tasks`` (``update-graph`` tasks) that make one of the
    partd ``stores`` (:func:`local_stores`) or write into one to run at most once
    (``once``: :data:`ONCE`). A store's writers (its splits) are the tasks that take
    it as an input and come before the others that do (its collects, which read it
    back once every split is in): a collect may run again, as long as the store and
    what it waited for are there; should those have to be made again, their own
    tasks err instead."""
    if not stores:
        return
    dependents: dict[Any, list[Any]] = {}
    for t in tasks:
        for d in t["deps"]:
            dependents.setdefault(d, []).append(t["key"])
    once = set(stores)
    for store in stores:
        users = set(dependents.get(store, ()))
        # the tasks built on a user of this store: its users among them read it back
        after: set[Any] = set()
        stack = [k for u in users for k in dependents.get(u, ())]
        while stack:
            key = stack.pop()
            if key not in after:
                after.add(key)
                stack.extend(dependents.get(key, ()))
        once |= users - after
    for t in tasks:
        if t["key"] in once:
            t["once"] = ONCE


def fail_with(error: BaseException) -> None:
    """The function of a task put in place of a refused store's (on an asynchronous
    client, whose graph is checked after ``compute`` returned): running it raises the
    refusal, so the graph's futures err with it."""
    raise error
