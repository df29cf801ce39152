"""Dask-style graphs to shoal tasks.

With dask installed, graphs go through dask's own ``convert_legacy_graph``, which
accepts every form current dask produces (legacy tuple tasks, key references, nested
containers, and the task-spec classes ``Task``, ``Alias``, ``DataNode``, ``List``,
``Dict``...); each node runs on a worker as ``node(values)``. Without dask, legacy
graphs (tuples whose first element is callable, key references, lists) are converted
here.
"""

from __future__ import annotations

import gc
from collections.abc import Hashable, Mapping
from typing import Any

from ..errors import GraphError
from ..protocol import to_serialize
from ..taskspec import Ref, RunSpec, Task

__all__ = ["graph_to_tasks", "pack", "flatten_keys"]


def flatten_keys(keys: Any, out: list[Any]) -> list[Any]:
    if isinstance(keys, list):
        for k in keys:
            flatten_keys(k, out)
    else:
        out.append(keys)
    return out


def pack(keys: Any, values: dict[Any, Any]) -> Any:
    """Values in the nested-list shape of ``keys``."""
    if isinstance(keys, list):
        return [pack(k, values) for k in keys]
    return values[keys]


def _run_node(node: Any, values: dict[Any, Any]) -> Any:
    return node(values)



def _identity(x: Any) -> Any:
    return x


def graph_to_tasks(dsk: Any, keys: Any) -> tuple[list[dict[str, Any]], list[Any]]:
    """``(tasks for update-graph, flat list of wanted keys)`` of ``dsk``, a mapping of
    keys to tasks or an object with ``__dask_graph__`` (a dask expression).

    Values that are futures (of a persisted collection) stand for keys already on the
    cluster: no task is made for them and tasks may depend on them. Raises ``TypeError``
    for a ``dsk`` that is neither, ``KeyError`` for a wanted key not in the graph and
    :class:`GraphError` for a reference to a key the graph does not define.
    """
    if not gc.isenabled():
        return _to_tasks(dsk, keys)
    # a graph (a big one above all) makes objects by the thousand, all of them kept
    # until it is sent: the cyclic collector's passes over them would free nothing
    gc.disable()
    try:
        return _to_tasks(dsk, keys)
    finally:
        gc.enable()


def _to_tasks(dsk: Any, keys: Any) -> tuple[list[dict[str, Any]], list[Any]]:
    if hasattr(dsk, "__dask_graph__"):
        dsk = dsk.__dask_graph__()
    if not isinstance(dsk, Mapping):
        raise TypeError(f"a graph is a mapping of keys to tasks, got {type(dsk).__name__}")
    dsk = dict(dsk)
    wanted = flatten_keys(keys, [])
    for k in wanted:
        try:
            if k not in dsk:
                raise KeyError(f"key {k!r} is not in the graph")
        except TypeError:
            raise KeyError(f"key {k!r} is not a valid key") from None
    try:
        from dask._task_spec import convert_legacy_graph
    except ImportError:
        return _convert_legacy(dsk), wanted
    external = {v.key for v in dsk.values() if getattr(v, "__dask_future__", False)}
    nodes = convert_legacy_graph(dsk)
    tasks = []
    for key, node in nodes.items():
        # a dependency outside the graph may be a key on the cluster already (a
        # persisted collection's); the scheduler refuses the graph if it is not
        deps = list(node.dependencies)
        payload = RunSpec(_run_node, (node, {d: Ref(d) for d in deps}))
        tasks.append({"key": key, "payload": to_serialize(payload), "deps": deps, "workers": None, "retries": 0})
    _order_tasks(tasks, nodes, wanted)
    # keys the converter dropped (aliases of themselves) are still wanted
    for k in wanted:
        if k not in nodes and k not in external and k not in dsk:
            raise GraphError(f"key {k!r} does not name a task")
    return tasks, wanted


#: graphs of more tasks than this are ordered depth first here, not by ``dask.order``
#: (which costs ~40 us per task: most of a big graph's time to its first task)
DASK_ORDER_MAX = 100_000


def _order_tasks(tasks: list[dict[str, Any]], nodes: Mapping[Any, Any], wanted: list[Any]) -> None:
    """Sort ``tasks`` into dask's static order (``dask.order``): the scheduler runs
    ready tasks in submission order, and this one finishes each part of a reduction
    before starting the next, so intermediates are few and freed early. A graph of
    more than :data:`DASK_ORDER_MAX` tasks is put in depth-first order from the wanted
    keys instead, in time linear in its size: the same for trees and chains."""
    if len(tasks) > DASK_ORDER_MAX:
        rank = _depth_first(tasks, wanted)
        tasks.sort(key=lambda t: rank.get(t["key"], 0))
        return
    try:
        from dask.order import order
    except ImportError:
        return
    try:
        rank = order(nodes)
    except Exception:  # an ordering is an optimization: a graph it cannot rank still runs
        return
    tasks.sort(key=lambda t: rank.get(t["key"], 0))


def _depth_first(tasks: list[dict[str, Any]], wanted: list[Any]) -> dict[Any, int]:
    """key -> rank: each task right after its inputs, the inputs of each wanted key
    (then of each task nobody wants, in the given order) walked first, without
    recursion."""
    deps = {t["key"]: t["deps"] for t in tasks}
    rank: dict[Any, int] = {}
    walking: set[Any] = set()  # on the stack (met again: a cycle, which the scheduler refuses)
    for root in [*wanted, *deps]:
        if root in rank or root not in deps:
            continue
        stack: list[tuple[Any, int]] = [(root, 0)]
        walking.add(root)
        while stack:
            key, i = stack[-1]
            inputs = deps[key]
            while i < len(inputs) and (inputs[i] in rank or inputs[i] in walking or inputs[i] not in deps):
                i += 1  # done already, or a key outside the graph
            if i < len(inputs):
                stack[-1] = (key, i + 1)
                stack.append((inputs[i], 0))
                walking.add(inputs[i])
                continue
            stack.pop()
            walking.discard(key)
            rank[key] = len(rank)
    return rank


def _is_task(v: Any) -> bool:
    return type(v) is tuple and bool(v) and callable(v[0])


def _convert_legacy(dsk: dict[Hashable, Any]) -> list[dict[str, Any]]:
    def conv(v: Any, deps: set[Any]) -> Any:
        if _is_task(v):
            return Task(None, v[0], tuple(conv(a, deps) for a in v[1:]))
        if type(v) is list:
            return [conv(a, deps) for a in v]
        try:
            if v in dsk:
                deps.add(v)
                return Ref(v)
        except TypeError:
            pass
        return v

    tasks = []
    for key, v in dsk.items():
        deps: set[Any] = set()
        if _is_task(v):
            spec = RunSpec(v[0], tuple(conv(a, deps) for a in v[1:]))
        else:
            spec = RunSpec(_identity, (conv(v, deps),))
        tasks.append({"key": key, "payload": to_serialize(spec), "deps": list(deps), "workers": None, "retries": 0})
    return tasks
