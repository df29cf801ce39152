"""The scheduler's answer to ``progress`` requests (``shoal.progress``): how many tasks
of each key prefix, among the given keys and everything they depend on, are done,
erred, running or waiting.

Theory of operation
-------------------
A client can only see the tasks it holds futures for, so it asks the scheduler. The
first request of a progress bar (``id`` and ``keys``) starts a walk of the dependency
closure of the keys, done once and kept, as keys (never task states: a forgotten
task's payload must be free to go), in a :class:`ProgressTracker`. The polls that
follow (``id`` alone) go on with the walk while it lasts and look at the keys not yet
finished, round robin, answering from counts kept up to date incrementally. Each
request does at most :data:`POLL_BUDGET` steps of each, however large the graph: a
closure of a million tasks is walked over several requests and refreshed over several
more, and the scheduler's loop is never held for long. Keys the scheduler does not
know yet (the graph and the request travel on different connections) are looked for
again on each poll.

A task counts as done once it is seen in memory, released, or forgotten: a key of the
closure that the scheduler keeps only as a record (released), or no longer knows, was
computed, since its dependents needed it until they ran. Done is final for a tracker
(a value lost with a worker and computed again does not set the bar back); erred is
not (a retried task runs again).

The module does no IO and reads no clock: the handler is given the time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..protocol.messages import Key
from .model import TaskState

__all__ = ["key_prefix", "ProgressTracker", "ProgressRequests", "POLL_BUDGET", "CATEGORIES"]

#: steps of the walk of a closure, and keys looked at, per request, at most (a closure
#: larger than that is walked over several requests; the keys not looked at keep the
#: state they were last seen in): a few milliseconds of the scheduler's loop
POLL_BUDGET = 10_000
#: trackers kept at once (one per progress bar), and seconds one unpolled is kept
MAX_TRACKERS = 64
TRACKER_TTL = 60.0
#: the longest progress id accepted
MAX_ID = 200

#: what a reply counts per prefix besides ``all``, in this order
CATEGORIES = ("waiting", "processing", "erred", "done")
_WAITING, _PROCESSING, _ERRED, _DONE = range(4)
_OF_STATE = {
    "released": _DONE, "forgotten": _DONE, "memory": _DONE,
    "waiting": _WAITING, "queued": _WAITING,
    "processing": _PROCESSING,
    "erred": _ERRED,
}


def key_prefix(key: Key) -> str:
    """The name a key's tasks are grouped under, as dask groups them: the words of
    the key before its token (``"inc-9f2c..."`` and ``("sum-aggregate-1a2b...", 0)``
    give ``"inc"`` and ``"sum-aggregate"``); ``"data"`` for a bare 32-digit token,
    ``"Other"`` for a key that is not a str, bytes or a tuple starting with one."""
    if type(key) is tuple:
        key = key[0] if key else None
    if type(key) is bytes:
        key = key.decode("utf-8", "replace")
    if type(key) is not str or not key:
        return "Other"
    words = key.split("-")
    first = words[0]
    if not first:
        return "Other"
    # a tuple key repr'ed into a string ("('x', 1)") keeps the name inside it
    result = first if first[:1].isalpha() else first.split(",")[0].strip("_'()\"")
    for word in words[1:]:
        if word.isalpha() and not (len(word) == 8 and _is_hex(word)):
            result += "-" + word
        else:
            break
    if len(result) == 32 and _is_hex(result):
        return "data"
    if result.startswith("<"):  # "<function f at 0x...>-..." and the like
        inner = result.strip("<>").split()
        result = inner[0].split(".")[-1] if inner else result
    return result or "Other"


def _is_hex(word: str) -> bool:
    return all(c in "0123456789abcdef" for c in word)


class ProgressTracker:
    """The dependency closure of some keys and how far its tasks are.

    :meth:`add` names the keys; :meth:`poll` walks their closure (a bounded part of it
    per call, resumed by the next) and brings a bounded part of the counts up to date.
    Only keys are held between calls, never task states.
    """

    def __init__(self, complete: bool = True):
        #: with ``complete=False``, tasks done when first seen are left out (and what
        #: they depend on is not walked)
        self.complete = complete
        self.keys: list[Key] = []
        self._group: list[int] = []  # index into self.prefixes, per key
        self._cat = bytearray()  # category per key
        self.prefixes: list[str] = []
        self._prefix_index: dict[str, int] = {}
        #: per prefix: [all, waiting, processing, erred, done]
        self._counts: list[list[int]] = []
        #: keys asked for that the scheduler did not know (yet)
        self.missing: list[Key] = []
        #: every key met by the walk, while it goes on or keys are missing
        self._seen: dict[Key, None] | None = {}
        #: the walk still to do: frames [key, its dependencies' keys or None, next index]
        self._stack: list[list[Any]] = []
        #: indices of keys not done: this round's (looked at up to the cursor), and the
        #: next round's (those found not done, and those taken in since)
        self._pending: list[int] = []
        self._cursor = 0
        self._next: list[int] = []
        self._names: dict[str, str] = {}  # prefix by a tuple key's name (shared by many keys)
        self.last_used = 0.0

    def add(self, tasks: Mapping[Key, TaskState], keys: Iterable[Key]) -> None:
        """Follow ``keys`` (and their closure, walked by :meth:`poll`); keys ``tasks``
        does not hold are kept in :attr:`missing`."""
        seen = self._seen_map()
        missing: list[Key] = []
        for key in keys:
            if key in seen:
                continue
            if key not in tasks:
                missing.append(key)
                continue
            seen[key] = None
            self._stack.append([key, None, 0])
        self.missing = missing

    def _seen_map(self) -> dict[Key, None]:
        if self._seen is None:
            self._seen = dict.fromkeys(self.keys)
            self._seen.update((frame[0], None) for frame in self._stack)
        return self._seen

    def _walk(self, tasks: Mapping[Key, TaskState], budget: int) -> int:
        """Go on with the walk, dependencies first (the prefixes then come in the order
        the work flows), for about ``budget`` steps; returns the steps taken."""
        stack, seen = self._stack, self._seen_map()
        steps = 0
        while stack and steps < budget:
            frame = stack[-1]
            key, deps = frame[0], frame[1]
            if deps is None:
                ts = tasks.get(key)
                if ts is None:  # forgotten since it was met: it ran
                    stack.pop()
                    self._take(key, _DONE)
                    steps += 1
                    continue
                steps += 1
                if not self.complete and ts.state in ("memory", "released"):
                    stack.pop()
                    continue  # done already: left out, with what it depends on
                deps = frame[1] = [d.key for d in ts.dependencies]
                steps += len(deps) // 8  # copying keys costs far less than checking them
            pos, n = frame[2], len(deps)
            descended = False
            while pos < n and steps < budget:
                dep = deps[pos]
                pos += 1
                steps += 1
                if dep not in seen:
                    seen[dep] = None
                    stack.append([dep, None, 0])
                    descended = True
                    break
            frame[2] = pos
            if not descended and pos >= n:
                stack.pop()
                ts = tasks.get(key)
                self._take(key, _DONE if ts is None else _OF_STATE.get(ts.state, _DONE))
                steps += 1
        if not stack and not self.missing:
            self._seen = None  # nothing more can join: the map is no longer needed
        return steps

    def _take(self, key: Key, cat: int) -> None:
        if type(key) is tuple and key and type(key[0]) is str:
            prefix = self._names.get(key[0])
            if prefix is None:
                prefix = self._names[key[0]] = key_prefix(key[0])
        else:
            prefix = key_prefix(key)
        group = self._prefix_index.get(prefix)
        if group is None:
            group = self._prefix_index[prefix] = len(self.prefixes)
            self.prefixes.append(prefix)
            self._counts.append([0] * (1 + len(CATEGORIES)))
        counts = self._counts[group]
        counts[0] += 1
        counts[1 + cat] += 1
        if cat != _DONE:
            self._next.append(len(self.keys))
        self.keys.append(key)
        self._group.append(group)
        self._cat.append(cat)

    def poll(self, tasks: Mapping[Key, TaskState], budget: int = POLL_BUDGET) -> None:
        """Look for the keys still missing, go on with the walk, and look at up to
        ``budget`` of the tasks not done (continuing where the last poll stopped)."""
        if self.missing:
            self.add(tasks, self.missing)
        if self._stack:
            self._walk(tasks, budget)
        keys, cat, group, counts = self.keys, self._cat, self._group, self._counts
        left = min(budget, len(self._pending) + len(self._next))
        while left > 0:
            pending, i = self._pending, self._cursor
            if i >= len(pending):
                # a round is over: the next one looks at what was not done in this one
                # (and at the keys the walk took in meanwhile)
                self._pending, self._next, self._cursor = self._next, [], 0
                if not self._pending:
                    break
                continue
            chunk = pending[i:i + left]
            self._cursor = i + len(chunk)
            left -= len(chunk)
            still = self._next
            for j in chunk:
                ts = tasks.get(keys[j])
                new = _DONE if ts is None else _OF_STATE.get(ts.state, _DONE)
                old = cat[j]
                if new != old:
                    c = counts[group[j]]
                    c[1 + old] -= 1
                    c[1 + new] += 1
                    cat[j] = new
                if new != _DONE:
                    still.append(j)

    def counts(self) -> dict[str, dict[str, int]]:
        """``{prefix: {"all": n, "waiting": n, "processing": n, "erred": n, "done": n}}``
        (fresh maps: in-process they reach the client as they are)."""
        names = ("all", *CATEGORIES)
        return {p: dict(zip(names, c)) for p, c in zip(self.prefixes, self._counts)}

    def finished(self) -> bool:
        """Whether the walk is over, no key is missing, and every task is done or erred."""
        return not self.missing and not self._stack and all(c[0] == c[1 + _DONE] + c[1 + _ERRED] for c in self._counts)


class ProgressRequests:
    """The scheduler's ``progress`` handler and its trackers (one per progress bar,
    by the id the client chose; bounded in number and dropped when unused)."""

    def __init__(self, tasks: Callable[[], Mapping[Key, TaskState]], clock: Callable[[], float]):
        self._tasks = tasks
        self._clock = clock
        self.trackers: dict[str, ProgressTracker] = {}

    def handle(self, comm: Any = None, id: str = "", keys: list[Key] | None = None, complete: bool = True,
               stop: bool = False, **_: Any) -> dict[str, Any]:
        """Answer one request: ``{"known": bool, "missing": int, "finished": bool,
        "counts": {prefix: {...}}}``; ``known`` is False for an id the scheduler keeps
        no tracker for and that came without keys (the client then sends them again).
        ``stop`` drops the tracker. Raises ``ValueError`` for an empty or long id."""
        if not id or len(id) > MAX_ID:
            raise ValueError(f"a progress id is a string of 1 to {MAX_ID} characters, got {len(id)}")
        now = self._clock()
        self._expire(now)
        if stop:
            self.trackers.pop(id, None)
            return {"known": False, "missing": 0, "finished": True, "counts": {}}
        tasks = self._tasks()
        tracker = self.trackers.pop(id, None)  # put back last: the dict is in order of use
        if tracker is None:
            if keys is None:
                return {"known": False, "missing": 0, "finished": False, "counts": {}}
            tracker = ProgressTracker(complete)
            tracker.add(tasks, keys)
        tracker.poll(tasks)
        tracker.last_used = now
        self.trackers[id] = tracker
        while len(self.trackers) > MAX_TRACKERS:
            del self.trackers[next(iter(self.trackers))]
        return {"known": True, "missing": len(tracker.missing), "finished": tracker.finished(),
                "counts": tracker.counts()}

    def _expire(self, now: float) -> None:
        for id, tracker in list(self.trackers.items()):
            if now - tracker.last_used <= TRACKER_TTL:
                break  # in order of use: the rest are younger
            del self.trackers[id]
