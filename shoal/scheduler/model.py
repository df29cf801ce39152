"""What the scheduler knows: tasks, workers, and graph helpers (plain data, no IO)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from .events import NewTask
from ..protocol.messages import Key
from ..statelog import InvalidTransition

__all__ = ["TState", "STATES", "InvalidTransition", "WorkerState", "TaskState", "PrefixGroup", "dependents_closure",
           "find_cycle", "topological"]


#: a task's state on the scheduler (see the theory of operation in :mod:`.state`)
TState = Literal["released", "waiting", "queued", "processing", "memory", "erred", "forgotten"]
STATES: tuple[TState, ...] = ("released", "waiting", "queued", "processing", "memory", "erred", "forgotten")


class PrefixGroup:
    """The tasks of one key prefix (``inc``, ``sum-aggregate``; see
    :func:`.progress.key_prefix`) counted by state, kept up to date at each transition:
    what the dashboard's progress and graph show, without a walk over the tasks. It
    goes when all its tasks are forgotten."""

    __slots__ = ("name", "states", "done", "size", "dependencies")

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

    def __repr__(self) -> str:
        return f"<PrefixGroup {self.name} {self.done}/{self.size} done>"


# ------------------------------------------------------------------------- the model


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

    def __repr__(self) -> str:
        return f"<WorkerState {self.address} processing={len(self.processing)} memory={len(self.has_what)}>"


@dataclass(eq=False)
class TaskState:
    key: Key
    payload: Any = None
    state: TState = "released"
    #: (-user priority, graph generation, order in the graph): lower runs first
    priority: tuple[int, ...] = (0, 0, 0)
    dependencies: set[TaskState] = field(default_factory=set)
    dependents: set[TaskState] = field(default_factory=set)
    #: dependencies not in memory yet
    waiting_on: set[TaskState] = field(default_factory=set)
    #: dependents that have yet to run and need this value
    waiters: set[TaskState] = field(default_factory=set)
    who_has: set[WorkerState] = field(default_factory=set)
    processing_on: WorkerState | None = None
    who_wants: set[str] = field(default_factory=set)
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
    #: a small value the worker sent along (opaque), for clients that ask later
    inline: Any = None
    #: its key prefix's counts (see :class:`PrefixGroup`), and whether it counted as done
    group: PrefixGroup | None = None
    done: bool = False

    def __repr__(self) -> str:
        return f"<TaskState {self.key!r} {self.state}>"

    def __lt__(self, other: TaskState) -> bool:
        return self.priority < other.priority


# -------------------------------------------------------------------------- the state


def dependents_closure(ts: TaskState) -> list[TaskState]:
    """Every task built on ``ts``, directly or not, in priority order (sets of tasks
    iterate in an order of memory addresses: sorted, a replay decides the same)."""
    seen = {ts}
    stack = list(ts.dependents)
    while stack:
        d = stack.pop()
        if d in seen:
            continue
        seen.add(d)
        stack.extend(d.dependents)
    seen.discard(ts)
    return sorted(seen)


def find_cycle(tasks: dict[Key, NewTask]) -> list[Key]:
    """A cycle among ``tasks`` (as a list of keys), or ``[]``."""
    color: dict[Key, int] = {}
    for root in tasks:
        if root in color:
            continue
        stack: list[tuple[Key, Iterable[Key]]] = [(root, iter(tasks[root].dependencies))]
        path = [root]
        color[root] = 1
        while stack:
            key, deps = stack[-1]
            for dep in deps:
                if dep not in tasks:
                    continue
                c = color.get(dep, 0)
                if c == 1:
                    return path[path.index(dep):] + [dep]
                if c == 0:
                    color[dep] = 1
                    path.append(dep)
                    stack.append((dep, iter(tasks[dep].dependencies)))
                    break
            else:
                color[key] = 2
                path.pop()
                stack.pop()
    return []


def topological(tasks: dict[Key, NewTask]) -> list[Key]:
    """Keys with dependencies first, otherwise in submission order."""
    out: list[Key] = []
    done: set[Key] = set()
    for root in tasks:
        if root in done:
            continue
        stack: list[tuple[Key, Any]] = [(root, iter(tasks[root].dependencies))]
        while stack:
            key, deps = stack[-1]
            for dep in deps:
                if dep in tasks and dep not in done:
                    stack.append((dep, iter(tasks[dep].dependencies)))
                    break
            else:
                stack.pop()
                if key not in done:
                    done.add(key)
                    out.append(key)
    return out
