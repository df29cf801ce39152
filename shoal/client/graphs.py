"""Dask-style graphs to shoal tasks.

With dask installed, graphs go through dask's own ``convert_legacy_graph``, which
accepts every form current dask produces (legacy tuple tasks, key references, nested
containers, and the task-spec classes ``Task``, ``Alias``, ``DataNode``, ``List``,
``Dict``...); each node runs on a worker as ``node(values)``. Without dask, legacy
graphs (tuples whose first element is callable, key references, lists) are converted
here.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Iterator, Mapping
from typing import Any

from ..errors import GraphError
from ..gcpolicy import collector_off
from ..protocol import to_serialize
from ..protocol.serialize import sizeof
from ..taskspec import Ref, RunSpec, Task
from .shuffle import is_locate

__all__ = ["graph_to_tasks", "prepare", "Graph", "pack", "flatten_keys", "split_graph", "GRAPH_CHUNK"]


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


def _run_node(node: "Node", values: dict[Any, Any]) -> Any:
    return node.node(values)


class Node:
    """A node of a dask graph (``dask._task_spec``), as the argument of its task.

    Its ``nbytes`` is the bytes of the data it carries (its constants, and the values
    of its data nodes), found by a walk of its own: the size of a task's arguments is
    asked for every task that runs (it decides whether a payload is serialized off the
    event loop, and counts what a worker was sent), and dask's own ``sizeof`` of a
    node measures each of its parts through its dispatch (49 us on the event loop for
    a fused task of a dask array's sum: a sixth of all the loop did for it)."""

    __slots__ = ("node", "_nbytes")

    def __init__(self, node: Any):
        self.node = node
        self._nbytes: int | None = None

    def __reduce__(self) -> Any:
        return (Node, (self.node,))

    def __repr__(self) -> str:
        return f"Node({self.node!r})"

    @property
    def nbytes(self) -> int:
        if self._nbytes is None:
            self._nbytes = _carried_bytes(self.node)
        return self._nbytes


def _carried_bytes(node: Any) -> int:
    """Bytes of the constants in dask graph node ``node`` (without recursion).
    References (to keys, to other nodes' outputs) and classes (a dtype's, say:
    pickled by name) carry none."""
    Alias, DataNode, Task, TaskRef = _spec_classes()
    total = 0
    stack = [node]
    while stack:
        x = stack.pop()
        typ = type(x)
        if typ is Alias or typ is TaskRef or typ is int or typ is float or typ is bool or x is None:
            pass
        elif typ is tuple or typ is list:
            stack.extend(x)
        elif typ is str or typ is bytes:
            total += len(x)  # (keys, mostly)
        elif typ is dict:
            stack.extend(x.values())
        elif isinstance(x, Task):
            stack.extend(x.args)
            stack.extend(x.kwargs.values())
        elif isinstance(x, DataNode):
            stack.append(x.value)
        elif not isinstance(x, (TaskRef, Alias, type)):
            total += sizeof(x)
    return total


@functools.cache
def _spec_classes() -> tuple[Any, Any, Any, Any]:
    """dask's ``Alias``, ``DataNode``, ``Task`` and ``TaskRef`` (imported once: a
    graph's every task is sized)."""
    from dask._task_spec import Alias, DataNode, Task, TaskRef

    return Alias, DataNode, Task, TaskRef


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
    graph = prepare(dsk, keys)
    return graph.tasks(), graph.wanted


def prepare(dsk: Any, keys: Any) -> "Graph":
    """``dsk`` (see :func:`graph_to_tasks`) materialized and checked, ready to be made
    into tasks: all at once (:meth:`Graph.tasks`) or, a big graph, part by part as they
    are sent (:meth:`Graph.parts`). Raises what :func:`graph_to_tasks` raises."""
    with collector_off():
        return Graph(dsk, keys)


class Graph:
    """A dask graph's nodes, checked (see :func:`prepare`)."""

    def __init__(self, dsk: Any, keys: Any):
        if hasattr(dsk, "__dask_graph__"):
            dsk = dsk.__dask_graph__()
        if not isinstance(dsk, Mapping):
            raise TypeError(f"a graph is a mapping of keys to tasks, got {type(dsk).__name__}")
        dsk = dict(dsk)
        self.wanted: list[Any] = flatten_keys(keys, [])
        for k in self.wanted:
            try:
                if k not in dsk:
                    raise KeyError(f"key {k!r} is not in the graph")
            except TypeError:
                raise KeyError(f"key {k!r} is not a valid key") from None
        self._legacy: dict[Hashable, Any] | None = None
        self.nodes: dict[Any, Any] = {}
        #: keys given new ones (:meth:`rename`): old key -> new key
        self.renamed: dict[Any, Any] = {}
        try:
            from dask._task_spec import convert_legacy_graph
        except ImportError:
            self._legacy = dsk
            return
        external = {v.key for v in dsk.values() if getattr(v, "__dask_future__", False)}
        self.nodes = convert_legacy_graph(dsk)
        # keys the converter dropped (aliases of themselves) are still wanted
        for k in self.wanted:
            if k not in self.nodes and k not in external and k not in dsk:
                raise GraphError(f"key {k!r} does not name a task")

    def __len__(self) -> int:
        return len(self._legacy) if self._legacy is not None else len(self.nodes)

    def rename(self, new: Mapping[Any, Any]) -> None:
        """Give the tasks of the keys of ``new`` (key -> its new key; none of them
        wanted) their new keys, in the tasks that refer to them too."""
        nodes: dict[Any, Any] = {}
        for key, node in self.nodes.items():
            renamed = new.get(key, key)
            if renamed != key or not new.keys().isdisjoint(node.dependencies):
                node = node.substitute(new, key=renamed)
            nodes[renamed] = node
        self.nodes = nodes
        self.renamed.update(new)

    def tasks(self) -> list[dict[str, Any]]:
        """Every task, in the order to run them."""
        with collector_off():
            if self._legacy is not None:
                return _convert_legacy(self._legacy)
            tasks = [_task_of(key, node) for key, node in self.nodes.items()]
            _order_tasks(tasks, self.nodes, self.wanted)
            return tasks

    def parts(self, size: int | None = None
              ) -> Iterator[tuple[list[dict[str, Any]], list[Any], list[Any]]] | None:
        """A graph of more than :data:`DASK_ORDER_MAX` tasks as the ``update-graph`` messages
        :func:`split_graph` would cut it into, each ``(tasks, wanted, held)`` made when
        it is asked for: the first goes to the scheduler, and starts running, while
        the client makes the others. The order is depth first (each task after its
        inputs), so a part may end after any task. None for a smaller graph, a graph
        with a cycle (sent whole: the scheduler refuses it) or without dask."""
        if self._legacy is not None or len(self.nodes) <= DASK_ORDER_MAX:
            return None
        with collector_off():
            deps = {key: list(node.dependencies) for key, node in self.nodes.items()}
            order, cyclic = _depth_first(deps, self.wanted)
            if cyclic:
                return None
            last: dict[Any, int] = {}  # key -> the position of its last dependent
            for i, key in enumerate(order):
                for d in deps[key]:
                    last[d] = i
        return self._make_parts(order, deps, last, GRAPH_CHUNK if size is None else size)

    def _make_parts(self, order: list[Any], deps: dict[Any, list[Any]], last: dict[Any, int], size: int
                    ) -> Iterator[tuple[list[dict[str, Any]], list[Any], list[Any]]]:
        nodes = self.nodes
        want = set(self.wanted)
        placed: set[Any] = set()
        for begin in range(0, len(order), size):
            end = min(begin + size, len(order))
            keys = order[begin:end]
            with collector_off():  # (a full pass over the graph would come every few parts)
                part = [_task_of(key, nodes[key], deps[key]) for key in keys]
            held = [k for k in keys if last.get(k, -1) >= end and k not in want]
            wanted = [k for k in keys if k in want]
            placed.update(wanted)
            if end == len(order):  # wanted keys no part defines (on the cluster already)
                wanted += [k for k in self.wanted if k not in placed]
            yield part, wanted + held, held


def _task_of(key: Any, node: Any, deps: list[Any] | None = None) -> dict[str, Any]:
    # a dependency outside the graph may be a key on the cluster already (a
    # persisted collection's); the scheduler refuses the graph if it is not
    if deps is None:
        deps = list(node.dependencies)
    payload = RunSpec(_run_node, (Node(node), {d: Ref(d) for d in deps}))
    task = {"key": key, "payload": to_serialize(payload), "deps": deps, "workers": None, "retries": 0}
    if is_locate(getattr(node, "func", None)):
        task["locate"] = True  # a barrier of shoal's shuffle: it runs on where its inputs are
    return task


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
        walked, _ = _depth_first({t["key"]: t["deps"] for t in tasks}, wanted)
        position = {k: i for i, k in enumerate(walked)}
        tasks.sort(key=lambda t: position[t["key"]])
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


def _depth_first(deps: dict[Any, list[Any]], wanted: list[Any]) -> tuple[list[Any], bool]:
    """The keys of ``deps`` (key -> its inputs) each right after its inputs, the inputs
    of each wanted key (then of each key nobody wants, in the given order) walked
    first, without recursion; and whether a cycle was met (its keys are then in some
    order: the scheduler refuses the graph)."""
    order: list[Any] = []
    done: set[Any] = set()
    walking: set[Any] = set()  # on the stack
    cyclic = False
    for root in [*wanted, *deps]:
        if root in done or root not in deps:
            continue
        stack: list[tuple[Any, int]] = [(root, 0)]
        walking.add(root)
        while stack:
            key, i = stack[-1]
            inputs = deps[key]
            while i < len(inputs):
                d = inputs[i]
                if d in walking:
                    cyclic = True
                elif d not in done and d in deps:
                    break
                i += 1  # done already, or a key outside the graph
            if i < len(inputs):
                stack[-1] = (key, i + 1)
                stack.append((inputs[i], 0))
                walking.add(inputs[i])
                continue
            stack.pop()
            walking.discard(key)
            done.add(key)
            order.append(key)
    return order, cyclic


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


#: a graph of more tasks than this goes to the scheduler in parts of about this many
#: (:func:`split_graph`): the scheduler starts the first part's tasks while the client
#: still sends (and the scheduler takes in) the rest
GRAPH_CHUNK = 20_000


def split_graph(tasks: list[dict[str, Any]], wanted: list[Any], size: int | None = None
                ) -> tuple[list[tuple[list[dict[str, Any]], list[Any]]], list[Any]]:
    """``tasks`` (in the order to run them) cut into parts of at least ``size`` tasks,
    each an ``update-graph`` of its own: ``([(tasks, wanted), ...], held)``.

    A part ends only where every task so far has its inputs in this part or an earlier
    one (so each part refers only to keys the scheduler knows); a graph whose order
    allows no cut stays whole. A part wants the keys of ``wanted`` it defines, and also
    its tasks that later parts depend on (``held``): the scheduler would forget a value
    nobody wants or waits for before its dependents arrive. The caller releases
    ``held`` once the last part is sent; the keys of ``wanted`` no part defines (keys
    already on the cluster) go with the last part. ``size`` defaults to
    :data:`GRAPH_CHUNK`."""
    if size is None:
        size = GRAPH_CHUNK
    if len(tasks) <= size:
        return [(tasks, wanted)], []
    defined = {t["key"] for t in tasks}
    later: dict[Any, int] = {}  # key -> dependents not sent yet
    for t in tasks:
        for d in t["deps"]:
            if d in defined:
                later[d] = later.get(d, 0) + 1
    want = set(wanted)
    seen: set[Any] = set()
    ahead: set[Any] = set()  # inputs named before their task came
    parts: list[tuple[list[dict[str, Any]], list[Any]]] = []
    held: list[Any] = []
    start = 0
    for i, t in enumerate(tasks):
        key = t["key"]
        seen.add(key)
        ahead.discard(key)
        for d in t["deps"]:
            if d in defined:
                later[d] -= 1
                if d not in seen:
                    ahead.add(d)
        if i + 1 - start >= size and not ahead and i + 1 < len(tasks):
            part = tasks[start:i + 1]
            keep = [p["key"] for p in part if later.get(p["key"], 0) > 0 and p["key"] not in want]
            held.extend(keep)
            parts.append((part, [p["key"] for p in part if p["key"] in want] + keep))
            start = i + 1
    if not parts:
        return [(tasks, wanted)], []
    last = tasks[start:]
    placed = {k for _, w in parts for k in w} | {p["key"] for p in last}
    parts.append((last, [p["key"] for p in last if p["key"] in want] + [k for k in wanted if k not in placed]))
    return parts, held
