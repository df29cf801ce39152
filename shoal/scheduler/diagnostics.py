"""What the dashboard, ``get_task_stream`` and ``performance_report`` read: a bounded
record of the tasks that ran, the workers' latest figures, and views of the state.

Theory of operation
-------------------
Nothing here is on the scheduler's critical path. The state machine keeps the counts
of tasks by key prefix and state itself (:class:`.model.PrefixGroup`, two increments
per transition), so progress and the graph view cost one look per prefix, however
many tasks there are. What workers say for the dashboard only (when a task ran and
on which thread, the inputs moved for it, CPU, bytes moved by path) never enters the
state machine: the server hands it to :meth:`Diagnostics.task_ran` and
:meth:`Diagnostics.worker_figures`, which append to a ring buffer of
``task-stream-size`` records or overwrite a small dict. Readers ask for what is new
since an index (:meth:`Diagnostics.task_stream`), so a page that polls or listens
gets each record once.

Peers are not trusted: their figures are checked here (finite numbers, known paths)
and what does not fit is dropped, never passed on to a page as NaN or as a path the
page cannot draw.

Every method returns JSON-ready values: keys appear as their text (``str(key)``),
times as epoch seconds. The module does no IO and reads no clock: it is given one.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable, Generator, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from .progress import key_prefix

if TYPE_CHECKING:
    from .model import PrefixGroup, TaskState
    from .state import SchedulerState

__all__ = ["Diagnostics", "PATHS", "TASK_STREAM_SIZE", "key_text", "run_steps"]

#: how a value moved: by reference in one process, mapped from shared memory, over tcp
PATHS = ("inproc", "shm", "tcp")
#: records of the task stream kept (the oldest go first)
TASK_STREAM_SIZE = 100_000
#: the longest key text shown
KEY_TEXT = 200
#: transfers of one task kept in its record, at most (a task with more inputs)
MAX_TRANSFERS = 64
#: keys a search looks at between two pauses (see :func:`run_steps`)
SCAN_SLICE = 20_000

T = TypeVar("T")
#: a look through many keys, in slices: it yields None between two, and returns its answer
Steps = Generator[None, None, T]


def run_steps(steps: Steps[T]) -> T:
    """The answer of ``steps``, with no pause (the server pauses between slices)."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def key_text(key: Any) -> str:
    """``key`` as pages show it (bounded)."""
    text = key if type(key) is str else str(key)
    return text if len(text) <= KEY_TEXT else text[: KEY_TEXT - 3] + "..."


def _time(value: Any) -> float | None:
    if type(value) not in (int, float) or not math.isfinite(value):
        return None
    return float(value)


def _count(value: Any) -> int:
    return int(value) if type(value) is int and value >= 0 else 0


def _paths(value: Any) -> dict[str, int]:
    got = value if isinstance(value, dict) else {}
    return {p: _count(got.get(p, 0)) for p in PATHS}


def _as_dict(r: tuple[Any, ...]) -> dict[str, Any]:
    """A task-stream record as pages and clients read it, from what the worker said
    (checked here: see the module)."""
    index, key, prefix, worker, timing, transfers, ok, heard = r
    start = stop = None
    thread = 0
    if isinstance(timing, (list, tuple)) and len(timing) == 3:
        start, stop = _time(timing[0]), _time(timing[1])
        thread = _count(timing[2])
    if start is None or stop is None or stop < start:
        start = stop = heard  # a peer that does not say: drawn as an instant, when heard
    moved = []
    for t in transfers[:MAX_TRANSFERS] if isinstance(transfers, (list, tuple)) else ():
        if not isinstance(t, (list, tuple)) or len(t) != 6 or t[3] not in PATHS:
            continue
        t_start, t_stop = _time(t[4]), _time(t[5])
        if t_start is None or t_stop is None:
            continue
        moved.append({"key": key_text(t[0]), "from": key_text(t[1]), "bytes": _count(t[2]), "path": t[3],
                      "start": t_start, "stop": max(t_start, t_stop)})
    return {"index": index, "key": key_text(key), "prefix": prefix or key_prefix(key), "worker": worker,
            "thread": thread, "start": start, "stop": stop, "status": "OK" if ok else "error", "transfers": moved}


class Diagnostics:
    """The scheduler's records for the dashboard (see the module). ``state`` is read,
    never changed; ``address`` gives the scheduler's address and ``clock`` the time
    (epoch seconds) when asked."""

    def __init__(self, state: SchedulerState, address: Callable[[], str] = lambda: "",
                 clock: Callable[[], float] = lambda: 0.0, size: int = TASK_STREAM_SIZE) -> None:
        self.state = state
        self._address = address
        self.clock = clock
        #: the records, as tuples (a dict each would weigh twice as much; see _as_dict)
        self.stream: deque[tuple[Any, ...]] = deque(maxlen=max(1, size))
        #: index the next record gets (records are numbered from 0, for good)
        self.next_index = 0
        #: per worker: cpu, transfers in and out, last time heard of (epoch seconds)
        self._workers: dict[str, dict[str, Any]] = {}
        #: bytes moved by workers that left (so that the totals never go back)
        self._gone = dict.fromkeys(PATHS, 0)

    # -- what the server tells

    def task_ran(self, worker: str, key: Any, timing: Any, transfers: Any, ok: bool,
                 prefix: str | None = None) -> None:
        """Worker ``worker`` reported ``key`` finished (``ok``) or erred; ``timing`` and
        ``transfers`` as the wire carries them (``task-finished``). Kept as they came,
        with the time: they are checked when read (:func:`_as_dict`), off the path of
        every task. ``prefix``: the key's prefix when the caller knows it."""
        self.stream.append((self.next_index, key, prefix, worker, timing, transfers, ok, self.clock()))
        self.next_index += 1

    def worker_figures(self, worker: str, cpu: Any, transfers_in: Any, transfers_out: Any) -> None:
        """Worker ``worker``'s latest CPU (percent of one core) and bytes moved so far."""
        now = self.clock()
        c = _time(cpu)
        self._workers[worker] = {"cpu": max(0.0, c) if c is not None else 0.0, "in": _paths(transfers_in),
                                 "out": _paths(transfers_out), "last_seen": now}

    def seen(self, worker: str) -> None:
        """Worker ``worker`` sent something now."""
        now = self.clock()
        figures = self._workers.get(worker)
        if figures is None:
            self._workers[worker] = {"cpu": 0.0, "in": dict.fromkeys(PATHS, 0), "out": dict.fromkeys(PATHS, 0),
                                     "last_seen": now}
        else:
            figures["last_seen"] = now

    def worker_left(self, worker: str) -> None:
        figures = self._workers.pop(worker, None)
        if figures is not None:
            for p in PATHS:
                self._gone[p] += figures["in"][p]

    # -- what pages read

    def _groups(self) -> Iterator[PrefixGroup]:
        return iter(list(self.state.groups.values()))

    @staticmethod
    def _group_view(g: PrefixGroup) -> dict[str, Any]:
        st = g.states
        return {"prefix": g.name, "total": g.size, "done": g.done,
                "waiting": st["waiting"] + st["queued"] + st["released"],
                "processing": st["processing"], "memory": st["memory"], "erred": st["erred"]}

    def summary(self) -> dict[str, Any]:
        """The cluster at a glance."""
        workers = self.state.workers.values()
        counts = dict.fromkeys(("processing", "memory", "erred", "waiting"), 0)
        for g in self._groups():
            view = self._group_view(g)
            for k in counts:
                counts[k] += view[k]
        return {"address": self._address(), "workers": len(workers), "threads": sum(ws.nthreads for ws in workers),
                "tasks": len(self.state.tasks), **counts, "time": self.clock(), "task_stream_total": self.next_index}

    def workers(self) -> list[dict[str, Any]]:
        """One row per worker."""
        out = []
        for ws in list(self.state.workers.values()):
            figures = self._workers.get(ws.address) or {}
            memory = ws.memory
            out.append({
                "address": ws.address, "name": ws.name, "host": ws.host, "nthreads": ws.nthreads,
                "processing": len(ws.processing), "held": len(ws.has_what),
                "memory": {k: int(memory.get(k, 0)) for k in ("limit", "managed", "shm", "spilled", "unmanaged",
                                                               "process")},
                "cpu": figures.get("cpu", 0.0),
                "transfers_in": dict(figures.get("in") or dict.fromkeys(PATHS, 0)),
                "transfers_out": dict(figures.get("out") or dict.fromkeys(PATHS, 0)),
                "last_seen": figures.get("last_seen"),
                "status": "paused" if ws.paused else "running",
            })
        return out

    def task_stream(self, since: int = 0, limit: int = 10_000) -> dict[str, Any]:
        """The records numbered ``since`` and after (those still kept), at most
        ``limit`` of them, oldest first; ``next`` is the ``since`` of the next call."""
        stream = self.stream
        first = self.next_index - len(stream)
        lo = min(max(since, first), self.next_index)
        start = lo - first
        stop = min(len(stream), start + max(0, limit))
        if start > len(stream) // 2:  # the newest: walked from the end (a deque indexes in O(n))
            tail = list(itertools.islice(reversed(stream), len(stream) - start))
            picked = tail[::-1][: stop - start]
        else:
            picked = list(itertools.islice(stream, start, stop))
        records = [_as_dict(r) for r in picked]
        return {"next": first + stop if stop > start else lo, "records": records}

    def progress(self) -> dict[str, Any]:
        """The known tasks by key prefix."""
        return {"prefixes": [self._group_view(g) for g in self._groups()]}

    def graph(self) -> dict[str, Any]:
        """Key prefixes as nodes, with an edge from each prefix to those that use it."""
        groups = list(self._groups())
        names = {g.name for g in groups}
        edges = [{"from": d, "to": g.name} for g in groups for d in sorted(g.dependencies)
                 if d in names and d != g.name]
        return {"nodes": [self._group_view(g) for g in groups], "edges": edges}

    def transfers(self) -> dict[str, Any]:
        """Bytes moved into workers so far, by path."""
        totals = dict(self._gone)
        for figures in self._workers.values():
            for p in PATHS:
                totals[p] += figures["in"][p]
        return {**totals, "time": self.clock()}

    def _find(self, key_text_: str) -> Steps[TaskState | None]:
        tasks = self.state.tasks
        ts = tasks.get(key_text_)
        if ts is not None:
            return ts
        # a key that is not a str: by its text (a look through every key, in slices)
        for i, (key, ts) in enumerate(list(tasks.items())):
            if i % SCAN_SLICE == SCAN_SLICE - 1:
                yield None
            if type(key) is not str and key_text(key) == key_text_ and tasks.get(key) is ts:
                return ts
        return None

    def task(self, key: str) -> dict[str, Any] | None:
        """Everything known of the task whose key reads ``key``; ``None`` if none."""
        return run_steps(self.task_steps(key))

    def task_steps(self, key: str) -> Steps[dict[str, Any] | None]:
        """:meth:`task` in steps (see :func:`run_steps`)."""
        ts = yield from self._find(key)
        if ts is None or self.state.tasks.get(ts.key) is not ts:
            return None
        text = key_text(ts.key)
        last = next((r for r in reversed(self.stream) if r[1] == ts.key), None)  # a click: one look
        run = _as_dict(last) if last is not None else None
        transfers = {t["key"]: t for t in run["transfers"]} if run else {}
        where = ts.processing_on.address if ts.processing_on is not None else (run["worker"] if run else None)
        error = traceback = None
        if ts.state == "erred":
            blame = ts.exception_blame if ts.exception_blame is not None else ts
            error = blame.exception_text or ts.exception_text or blame.error_kind or "erred"
            tb = blame.traceback
            traceback = tb if isinstance(tb, str) else None
        return {
            "key": text, "prefix": key_prefix(ts.key), "state": ts.state, "worker": where,
            "who_has": sorted(ws.address for ws in ts.who_has), "nbytes": max(ts.nbytes, 0),
            "start": run["start"] if run else None, "stop": run["stop"] if run else None,
            "duration": run["stop"] - run["start"] if run else None,
            "dependencies": [{"key": key_text(d.key), "state": d.state, "who_has": sorted(ws.address for ws in d.who_has),
                              "transfer": transfers.get(key_text(d.key))} for d in list(ts.dependencies)],
            "dependents": [key_text(d.key) for d in list(ts.dependents)],
            "story": [{"key": key_text(t.key), "start": t.start, "finish": t.finish, "stimulus_id": t.stimulus_id}
                      for t in self.state.story(ts.key)],
            "error": error, "traceback": traceback,
        }

    def search(self, text: str, limit: int = 20) -> list[str]:
        """Keys whose text holds ``text``, at most ``limit`` (tasks that ran lately first)."""
        return run_steps(self.search_steps(text, limit))

    def search_steps(self, text: str, limit: int = 20) -> Steps[list[str]]:
        """:meth:`search` in steps (see :func:`run_steps`): a million keys are looked
        through in slices of SCAN_SLICE, so that a server can let others run between."""
        found: list[str] = []
        seen: set[str] = set()
        tasks = self.state.tasks
        for i, record in enumerate(list(reversed(self.stream))):
            if i % SCAN_SLICE == SCAN_SLICE - 1:
                yield None
            k = key_text(record[1])
            if text in k and k not in seen and record[1] in tasks:
                seen.add(k)
                found.append(k)
                if len(found) >= limit:
                    return found
        for i, key in enumerate(list(tasks)):
            if i % SCAN_SLICE == SCAN_SLICE - 1:
                yield None
            k = key_text(key)
            if text in k and k not in seen and key in tasks:
                found.append(k)
                seen.add(k)
                if len(found) >= limit:
                    break
        return found

    def counters(self) -> dict[str, Any]:
        """The figures of the Prometheus series, in one dict."""
        states: dict[str, int] = {}
        for g in self._groups():
            for s, n in g.states.items():
                if s != "forgotten":
                    states[s] = states.get(s, 0) + n
        return {"summary": self.summary(), "tasks": states, "progress": self.progress()["prefixes"],
                "workers": self.workers(), "transfers": self.transfers(),
                "done": self.state.done_total, "task_stream_total": self.next_index}
