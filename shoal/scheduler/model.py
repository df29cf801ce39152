"""What the scheduler knows: tasks, workers, and graph helpers (plain data, no IO)."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias, TypeVar

from .events import NewTask
from ..protocol.messages import Key
from ..statelog import InvalidTransition

__all__ = ["TState", "STATES", "InvalidTransition", "WorkerState", "TaskState", "Few", "FEW", "plus", "minus",
           "PrefixGroup", "TaskQueue", "Queue", "Need", "need_of", "RoomIndex", "dependents_closure", "topological"]


#: a task's state on the scheduler (see the theory of operation in :mod:`.state`)
TState = Literal["released", "waiting", "queued", "processing", "memory", "erred", "forgotten"]
STATES: tuple[TState, ...] = ("released", "waiting", "queued", "processing", "memory", "erred", "forgotten")


class PrefixGroup:
    """The tasks of one key prefix (``inc``, ``sum-aggregate``; see
    :func:`.progress.key_prefix`) counted by state, kept up to date at each transition:
    what the dashboard's progress and graph show, without a walk over the tasks. It
    goes when all its tasks are forgotten."""

    __slots__ = ("name", "states", "done", "size", "dependencies", "duration")

    def __init__(self, name: str) -> None:
        self.name = name
        #: tasks by their current state (forgotten ones included)
        self.states: dict[str, int] = dict.fromkeys(STATES, 0)
        #: tasks that reached memory at least once
        self.done = 0
        #: tasks in all (forgotten ones included)
        self.size = 0
        #: the prefixes of the inputs of its tasks
        self.dependencies: set[str] = set()
        #: how long its tasks take, averaged over those that ran (seconds; 0: none yet)
        self.duration = 0.0

    def __repr__(self) -> str:
        return f"<PrefixGroup {self.name} {self.done}/{self.size} done>"


# ------------------------------------------------------------------------- the model


T = TypeVar("T")

#: a task's small sets: a tuple while it has at most :data:`FEW` members, a set
#: beyond. Most of a task's sets hold none or one member (its one dependent, the
#: client that wants it, the worker that holds it), and a set costs 216 bytes where a
#: tuple of one costs 56; the empty tuple is shared. Read them as any collection (``in``,
#: iteration, ``len``); change them only through :func:`plus` and :func:`minus` (which
#: :class:`TaskState`'s methods use), which return the container to keep.
Few: TypeAlias = "tuple[T, ...] | set[T]"

#: the most members a :data:`Few` holds as a tuple (its ``in`` is a scan)
FEW = 8


def plus(c: Few[T], x: T) -> Few[T]:
    """``c`` with ``x`` in it (``c`` itself when it is a set, changed)."""
    if type(c) is tuple:
        if x in c:
            return c
        if len(c) < FEW:
            return (*c, x)
        c = set(c)
    c.add(x)  # type: ignore[union-attr]
    return c


def minus(c: Few[T], x: T) -> Few[T]:
    """``c`` without ``x`` (``c`` itself when it is a set, changed)."""
    if type(c) is tuple:
        n = len(c)
        if n == 1:
            return () if c[0] == x else c
        if n == 2:  # (the inputs of a reduction's step)
            a, b = c
            return (b,) if a == x else (a,) if b == x else c
        if x not in c:
            return c
        return tuple([y for y in c if y != x])
    c.discard(x)  # type: ignore[union-attr]
    return c


@dataclass(eq=False)
class WorkerState:
    address: str
    nthreads: int
    host: str = ""
    pid: int = 0
    name: str = ""
    processing: set[TaskState] = field(default_factory=set)
    #: processing tasks that seceded (they wait for other tasks): they hold no thread
    long_running: set[TaskState] = field(default_factory=set)
    has_what: set[TaskState] = field(default_factory=set)
    nbytes: int = 0
    #: when it last sent anything, on the clock of the liveness events (None: not yet)
    last_seen: float | None = None
    #: the last liveness check found it silent for longer than the ttl
    overdue: bool = False
    #: abstract resources it offers, and how much of them its processing tasks hold
    resources: dict[str, float] = field(default_factory=dict)
    used_resources: dict[str, float] = field(default_factory=dict)
    #: the host part of its address (``workers=`` may name a host)
    ip: str = ""
    #: the address of the nanny that runs its process ("": none; see ``restart-workers``)
    nanny: str = ""
    #: the optional ops (protocol §8.2) it serves; None: all of them (a Python worker)
    ops: frozenset[str] | None = None
    #: the payload languages it runs
    languages: frozenset[str] = frozenset({"python"})
    #: its memory passed its pause threshold: no task is placed there until it goes on
    paused: bool = False
    #: what it said of its memory last (``worker-memory``: limit, managed, shm, ...)
    memory: dict[str, int] = field(default_factory=dict)
    #: its reports the scheduler did not believe (about tasks it was not given)
    disbelieved: int = 0

    def __repr__(self) -> str:
        return f"<WorkerState {self.address} processing={len(self.processing)} memory={len(self.has_what)}>"


@dataclass(eq=False, slots=True)
class TaskState:
    """One task as the scheduler knows it. Its sets are :data:`Few`: change them with
    the methods below (or :func:`plus`/:func:`minus`), empty them with ``()``."""

    key: Key
    payload: Any = None
    state: TState = "released"
    #: (-user priority, graph generation, order in the graph): lower runs first
    priority: tuple[int, ...] = (0, 0, 0)
    #: its inputs, in priority order (fixed when it is made; emptied when it is forgotten)
    dependencies: tuple[TaskState, ...] = ()
    dependents: Few[TaskState] = ()
    #: dependencies not in memory yet
    waiting_on: Few[TaskState] = ()
    #: dependents that have yet to run and need this value
    waiters: Few[TaskState] = ()
    who_has: Few[WorkerState] = ()
    processing_on: WorkerState | None = None
    who_wants: Few[str] = ()
    #: where it may run: worker addresses, names or hosts (None: anywhere)
    restrictions: set[str] | None = None
    #: ``restrictions`` are a preference (allow_other_workers)
    loose_restrictions: bool = False
    #: abstract resources it holds while it runs (None: none)
    resources: dict[str, float] | None = None
    #: the language of its payload: it runs only on workers that run it
    language: str = "python"
    nbytes: int = -1
    retries: int = 0
    suspicious: int = 0
    #: the workers sent to fetch it that said its one holder did not hand the value
    #: out (each counts once), since that holder became the one or last showed the
    #: scheduler that it holds it
    unserved: Few[str] = ()
    #: the holder the scheduler asked whether it holds the value (its answer awaited)
    checking: str | None = None
    #: why it may run only once ("": it may run again): once sent to a worker, it errs
    #: (``RunOnce``) rather than go to a worker again, and it is not retried
    once: str = ""
    #: it was sent to a worker to run (at least once)
    sent: bool = False
    #: for erred tasks: the exception (opaque), its traceback text, and the task that raised
    exception: Any = None
    traceback: Any = None
    exception_text: str = ""
    exception_blame: TaskState | None = None
    #: for errors the scheduler raises itself: "KilledWorker", "LostData", ...
    error_kind: str = ""
    #: where the value lies in shared memory: {address of the worker that placed it:
    #: segment info (opaque)}, one per host at most that matters; None: nowhere
    shm: dict[str, Any] | None = None
    #: {host: the worker of that host first sent a task needing this value from another
    #: host}: the host's later readers ask it first, so the value crosses to a host once
    fetchers: dict[str, WorkerState] | None = None
    #: a small value the worker sent along (opaque), for clients that ask later
    inline: Any = None
    #: its key prefix's counts (see :class:`PrefixGroup`), and whether it counted as done
    group: PrefixGroup | None = None
    done: bool = False

    def __repr__(self) -> str:
        return f"<TaskState {self.key!r} {self.state}>"

    def __lt__(self, other: TaskState) -> bool:
        return self.priority < other.priority

    def want(self, client: str) -> None:
        """``client`` wants this value."""
        self.who_wants = plus(self.who_wants, client)

    def unwant(self, client: str) -> None:
        self.who_wants = minus(self.who_wants, client)

    def add_dependent(self, ts: TaskState) -> None:
        self.dependents = plus(self.dependents, ts)

    def add_waiter(self, ts: TaskState) -> None:
        """The dependent ``ts`` has yet to run and needs this value."""
        self.waiters = plus(self.waiters, ts)

    def wait_on(self, dep: TaskState) -> None:
        """This task waits for its input ``dep`` to be in memory."""
        self.waiting_on = plus(self.waiting_on, dep)

    def add_holder(self, ws: WorkerState) -> None:
        self.who_has = plus(self.who_has, ws)

    def drop_holder(self, ws: WorkerState) -> None:
        self.who_has = minus(self.who_has, ws)


# --------------------------------------------------------------------- the indexes


class _Queued:
    """What both queues answer from their members: membership, size, and the tasks in
    priority order."""

    __slots__ = ()
    _members: set[TaskState] | dict[TaskState, Any]

    def __contains__(self, ts: object) -> bool:
        return ts in self._members

    def __len__(self) -> int:
        return len(self._members)

    def __bool__(self) -> bool:
        return bool(self._members)

    def __iter__(self) -> Iterator[TaskState]:
        """The queued tasks in priority order."""
        return iter(sorted(self._members))


class TaskQueue(_Queued):
    """The queued tasks, first by priority.

    Tasks queued in priority order (a graph's root tasks are: they are recommended in
    that order) wait in a FIFO, where they go in and come out in O(1); a task that
    comes ahead of the last one queued goes into a heap instead. The first task is the
    first of the two heads.

    Taking a task out of the middle (it was released, cancelled, its worker died) only
    forgets it as a member, in O(1); its entry is skipped when it comes up, and both
    are rebuilt once more than half of their entries are such. So release, cancel and
    a client leaving cost what they touch, not the length of the queue.
    """

    __slots__ = ("_run", "_heap", "_members")

    def __init__(self) -> None:
        #: entries in priority order, and the others as a heap (priorities are unique:
        #: tuples compare in C, never reaching the tasks)
        self._run: deque[tuple[tuple[int, ...], TaskState]] = deque()
        self._heap: list[tuple[tuple[int, ...], TaskState]] = []
        self._members: set[TaskState] = set()

    def push(self, ts: TaskState) -> None:
        self._members.add(ts)
        run = self._run
        if not run or run[-1][0] < ts.priority:
            run.append((ts.priority, ts))
        else:
            heapq.heappush(self._heap, (ts.priority, ts))

    def pop(self) -> TaskState:
        """The first task by priority, taken out (``IndexError`` when empty)."""
        run, heap, members = self._run, self._heap, self._members
        while True:
            if heap and (not run or heap[0][0] < run[0][0]):
                ts = heapq.heappop(heap)[1]
            else:
                ts = run.popleft()[1]
            if ts in members:
                members.discard(ts)
                return ts

    def remove(self, ts: TaskState) -> None:
        """Take ``ts`` out (``KeyError`` if it is not queued)."""
        self._members.remove(ts)
        if len(self._run) + len(self._heap) > 2 * len(self._members) + 64:
            self._run = deque(sorted((t.priority, t) for t in self._members))
            self._heap = []

    def peek(self) -> TaskState | None:
        """The first task by priority, left in; None when empty."""
        run, heap, members = self._run, self._heap, self._members
        while heap and heap[0][1] not in members:
            heapq.heappop(heap)
        while run and run[0][1] not in members:
            run.popleft()
        if heap and (not run or heap[0][0] < run[0][0]):
            return heap[0][1]
        return run[0][1] if run else None


#: what a queued task asks of the worker it runs on: its language, the workers it
#: names strictly (``workers=`` without ``allow_other_workers``; None: any), and the
#: resources it needs (sorted ``(name, amount)``)
Need = tuple[str, frozenset[str] | None, tuple[tuple[str, float], ...]]
_ANY_PYTHON: Need = ("python", None, ())


def need_of(ts: TaskState) -> Need:
    """What ``ts`` asks of its worker (see :data:`Need`)."""
    if ts.restrictions is None and not ts.resources and ts.language == "python":
        return _ANY_PYTHON
    names = frozenset(ts.restrictions) if ts.restrictions is not None and not ts.loose_restrictions else None
    resources = tuple(sorted((n, a) for n, a in ts.resources.items() if a > 0)) if ts.resources else ()
    return (ts.language, names, resources)


class Queue(_Queued):
    """The queued tasks, in buckets (:class:`TaskQueue`) by what they ask of their
    worker (:data:`Need`). A worker with room takes the first tasks by priority from
    the buckets it may serve (:meth:`buckets_for`), and looks at no other: queued
    tasks it cannot run (named to other workers, of another language) cost it nothing.
    Buckets naming workers are found through those names, so however many there are,
    a worker sees only its own."""

    __slots__ = ("_buckets", "_open", "_by_name", "_members")

    def __init__(self) -> None:
        self._buckets: dict[Need, TaskQueue] = {}
        #: the buckets whose tasks name no worker (any worker of the language may run them)
        self._open: dict[Need, TaskQueue] = {}
        #: a name (address, name or host) -> the buckets whose tasks name it
        self._by_name: dict[str, set[Need]] = {}
        self._members: dict[TaskState, Need] = {}

    def push(self, ts: TaskState) -> None:
        need = need_of(ts)
        q = self._buckets.get(need)
        if q is None:
            q = self._buckets[need] = TaskQueue()
            if need[1] is None:
                self._open[need] = q
            else:
                for name in need[1]:
                    self._by_name.setdefault(name, set()).add(need)
        q.push(ts)
        self._members[ts] = need

    def remove(self, ts: TaskState) -> None:
        """Take ``ts`` out (``KeyError`` if it is not queued)."""
        need = self._members[ts]
        self._buckets[need].remove(ts)
        self._forget(ts, need)

    def take(self, need: Need) -> TaskState:
        """The first task of the bucket ``need`` (of :meth:`buckets_for`), taken out."""
        ts = self._buckets[need].pop()
        self._forget(ts, need)
        return ts

    def _forget(self, ts: TaskState, need: Need) -> None:
        del self._members[ts]
        if not self._buckets[need]:
            del self._buckets[need]
            if need[1] is None:
                del self._open[need]
            else:
                for name in need[1]:
                    needs = self._by_name[name]
                    needs.discard(need)
                    if not needs:
                        del self._by_name[name]

    def buckets_for(self, names: Iterable[str], languages: frozenset[str]) -> list[tuple[Need, TaskQueue]]:
        """The buckets of the tasks a worker known by ``names`` (its address, name and
        host) that runs ``languages`` may run, resources aside (each bucket's tasks
        need the same)."""
        out = [(need, q) for need, q in self._open.items() if need[0] in languages]
        if self._by_name:
            seen: set[Need] = set()
            for name in names:
                for need in self._by_name.get(name, ()):
                    if need not in seen and need[0] in languages:
                        seen.add(need)
                        out.append((need, self._buckets[need]))
        return out

    def naming(self, names: Iterable[str]) -> list[TaskState]:
        """The queued tasks that may run only on workers they name, one of ``names``
        among them (the only ones a worker's leaving can make unrunnable), in priority
        order."""
        needs = {need for name in names for need in self._by_name.get(name, ())}
        return sorted(ts for need in needs for ts in self._buckets[need])


class RoomIndex:
    """The workers with room for a task, least busy first (busy: processing tasks
    per thread; ties by address), as a heap of ``(busy, address, version, worker)``.

    The state calls :meth:`update` whenever a worker's load or room may have changed;
    that bumps the worker's version, so its older entries are skipped when they come
    up. :meth:`best` is then O(log N) amortized: placement never walks every worker.
    """

    __slots__ = ("_heap", "_version", "_count")

    def __init__(self) -> None:
        self._heap: list[tuple[float, str, int, WorkerState]] = []
        #: address -> the version of its one valid entry (versions never repeat, so an
        #: entry of a worker that left matches no worker that comes back at its address)
        self._version: dict[str, int] = {}
        self._count = 0

    def update(self, ws: WorkerState, has_room: bool) -> None:
        self._count = v = self._count + 1
        self._version[ws.address] = v
        if has_room:
            heapq.heappush(self._heap, (len(ws.processing) / ws.nthreads, ws.address, v, ws))
            if len(self._heap) > 4 * len(self._version) + 64:
                self._compact()

    def discard(self, ws: WorkerState) -> None:
        """``ws`` left the cluster."""
        self._version.pop(ws.address, None)

    def best(self) -> WorkerState | None:
        """The least busy worker with room, or None; it stays in the index."""
        heap, version = self._heap, self._version
        while heap:
            _, address, v, ws = heap[0]
            if version.get(address) == v:
                return ws
            heapq.heappop(heap)
        return None

    def with_room(self) -> dict[str, float]:
        """address -> busy, of the workers the index holds as having room (for
        ``validate()``)."""
        version = self._version
        return {e[1]: e[0] for e in self._heap if version.get(e[1]) == e[2]}

    def _compact(self) -> None:
        version = self._version
        self._heap = [e for e in self._heap if version.get(e[1]) == e[2]]
        heapq.heapify(self._heap)


# -------------------------------------------------------------------------- the state


def dependents_closure(ts: TaskState, seen: set[TaskState] | None = None) -> list[TaskState]:
    """Every task built on ``ts``, directly or not, in priority order (sets of tasks
    iterate in an order of memory addresses: sorted, a replay decides the same).

    With ``seen``, tasks in it are left out and not walked through, and those found
    are added to it: the closures of many tasks (every future along a chain) then
    cost one walk over the graph, not one per task."""
    if seen is None:
        seen = set()
    found: list[TaskState] = []
    stack = list(ts.dependents)
    while stack:
        d = stack.pop()
        if d in seen or d is ts:
            continue
        seen.add(d)
        found.append(d)
        stack.extend(d.dependents)
    found.sort()
    return found


def topological(tasks: dict[Key, NewTask]) -> tuple[list[Key], list[Key]]:
    """``(order, cycle)``: the keys of ``tasks`` each after its dependencies (among
    ``tasks``), otherwise in submission order; and a cycle among them (as a list of
    keys, its first key again at its end) or ``[]``. One walk, without recursion:
    with a cycle, ``order`` is incomplete."""
    out: list[Key] = []
    #: 1 on the walk's path, 2 placed in ``out``
    color: dict[Key, int] = {}
    for root in tasks:
        if root in color:
            continue
        stack: list[tuple[Key, Iterator[Key]]] = [(root, iter(tasks[root].dependencies))]
        path = [root]
        color[root] = 1
        while stack:
            key, deps = stack[-1]
            for dep in deps:
                c = color.get(dep, 0)
                if c == 0:
                    if dep not in tasks:
                        continue  # a key the scheduler has already
                    color[dep] = 1
                    path.append(dep)
                    stack.append((dep, iter(tasks[dep].dependencies)))
                    break
                if c == 1:
                    return out, path[path.index(dep):] + [dep]
            else:
                color[key] = 2
                out.append(key)
                path.pop()
                stack.pop()
    return out, []
