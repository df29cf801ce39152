"""The threads that run a worker's tasks: a pool that a running task may leave.

``TaskThreads(n)`` keeps ``n`` threads taking work by priority (the tasks' own: the
state machine may hand the pool tasks ahead of free threads, and a more urgent one
that comes later still goes first), ties in the order submitted.
A task that waits for other tasks (``shoal.secede()``) makes its thread leave the
pool: another thread is started in its place, so the pool still runs ``n`` tasks at
once, and the thread that left ends with its task. ``rejoin()`` makes it a pool
thread again and an idle one retire, so the pool is back to ``n`` (the worker's state
machine grants the rejoin only when a slot is free: an idle thread is then there to
retire at once).

The pool decides nothing about which task runs: the state machine hands it no more
tasks than it has slots.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["TaskThreads"]

logger = logging.getLogger("shoal.worker")

#: a work item that makes the thread taking it leave the pool
_RETIRE: Any = object()
#: a work item that makes every thread leave (it is put back for the next one)
_STOP: Any = object()


class _Handoff:
    """A priority queue for handing work to threads: a heap under a lock, and one
    token per item in a ``SimpleQueue`` that takers block on. A put is a lock, a
    ``heappush`` and a token, all in C: the event loop hands a task over without
    ``queue.PriorityQueue``'s condition variable (Python code on every put)."""

    __slots__ = ("_heap", "_lock", "_tokens")

    def __init__(self) -> None:
        self._heap: list[tuple[int, tuple[Any, ...], int, Any]] = []
        self._lock = threading.Lock()
        self._tokens: queue.SimpleQueue[None] = queue.SimpleQueue()

    def put(self, item: tuple[int, tuple[Any, ...], int, Any]) -> None:
        with self._lock:
            heapq.heappush(self._heap, item)
        self._tokens.put(None)  # after the push: a taker with a token finds an item

    def get(self) -> tuple[int, tuple[Any, ...], int, Any]:
        """The first item (waits for one)."""
        self._tokens.get()
        with self._lock:
            return heapq.heappop(self._heap)

    def get_nowait(self) -> tuple[int, tuple[Any, ...], int, Any]:
        """The first item; ``queue.Empty`` when there is none."""
        self._tokens.get_nowait()
        with self._lock:
            return heapq.heappop(self._heap)


class TaskThreads:
    """``nthreads`` daemon threads named ``name-N`` (started with the first
    :meth:`submit`) that run callables submitted with it, each after ``initializer()``
    ran in it. A callable's exception is
    logged (the worker's task callables catch their own)."""

    def __init__(self, nthreads: int, name: str = "shoal-task", initializer: Callable[[], None] | None = None):
        if nthreads < 1:
            raise ValueError(f"a pool needs at least one thread, got {nthreads}")
        self.nthreads = nthreads
        self.name = name
        self._initializer = initializer
        #: (0 for control items / 1 for work, priority, order of submission, item):
        #: control first, then work by priority, ties in submission order
        self._queue = _Handoff()
        self._order = itertools.count()
        self._local = threading.local()
        self._lock = threading.Lock()
        self._count = 0
        #: the threads alive: the pool's and those that left it with their task
        self.threads: set[threading.Thread] = set()
        self._closed = False
        self._started = False
        #: cleared while the pool is held (:meth:`hold`): no work item starts
        self._go = threading.Event()
        self._go.set()

    def submit(self, fn: Callable[[], None], priority: tuple[Any, ...] = ()) -> None:
        """Run ``fn()`` in a pool thread, after what was submitted before with a lower
        or equal ``priority`` (compared as tuples: lower first; the threads start with
        the first). Raises ``RuntimeError`` after :meth:`shutdown`."""
        if self._closed:
            raise RuntimeError("cannot submit to a pool that was shut down")
        if not self._started:
            self._started = True
            for _ in range(self.nthreads):
                self._start_thread()
        self._queue.put((1, priority, next(self._order), fn))

    def hold(self) -> None:
        """Start no more work items until :meth:`release` (those running go on): a
        paused worker's tasks handed ahead wait here."""
        self._go.clear()

    def release(self) -> None:
        """Start work items again after :meth:`hold`."""
        self._go.set()

    @property
    def held(self) -> bool:
        return not self._go.is_set()

    def in_pool(self) -> bool:
        """Whether the calling thread is one of this pool's (seceded or not)."""
        return getattr(self._local, "pool", None) is self

    def seceded(self) -> bool:
        """Whether the calling thread left the pool (:meth:`secede`) and did not rejoin."""
        return self.in_pool() and bool(self._local.seceded)

    def secede(self) -> bool:
        """Make the calling pool thread leave the pool: a new thread takes its place; it
        ends with the callable it runs. Returns False (and does nothing) if it left
        already. Raises ``RuntimeError`` outside this pool's threads."""
        if not self.in_pool():
            raise RuntimeError("secede() from a thread that is not a task thread of this worker")
        if self._local.seceded:
            return False
        self._local.seceded = True
        if not self._closed:
            self._start_thread()
        return True

    def rejoin(self) -> bool:
        """Make the calling thread, which left the pool, a pool thread again: an idle
        pool thread retires. Returns False (and does nothing) if it had not left."""
        if not self.seceded():
            return False
        self._local.seceded = False
        self._control(_RETIRE)
        return True

    def shutdown(self) -> None:
        """Drop what has not started, and let every thread end after its callable (a
        running task cannot be stopped). Returns at once."""
        self._closed = True
        self._go.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._control(_STOP)

    def _control(self, item: Any) -> None:
        self._queue.put((0, (), next(self._order), item))

    def _start_thread(self) -> None:
        with self._lock:
            self._count += 1
            n = self._count
        t = threading.Thread(target=self._main, args=(n,), name=f"{self.name}-{n}", daemon=True)
        with self._lock:
            self.threads.add(t)
        t.start()

    def index(self) -> int:
        """The number of the calling task thread in this pool (from 1, in the order
        they started; 0 outside the pool's threads)."""
        return getattr(self._local, "index", 0)

    def _main(self, index: int = 0) -> None:
        local = self._local
        local.pool = self
        local.index = index
        local.seceded = False
        try:
            if self._initializer is not None:
                try:
                    self._initializer()
                except Exception:
                    logger.exception("a task thread's initializer failed")
            while True:
                item = self._queue.get()[3]
                if item is _STOP:
                    self._control(_STOP)  # for the next thread
                    return
                if item is _RETIRE:
                    return
                if not self._go.is_set():
                    self._go.wait()
                    if self._closed:
                        return
                try:
                    item()
                except BaseException:  # noqa: BLE001 - the pool thread must go on
                    logger.exception("a task thread failed outside the task itself")
                finally:
                    item = None  # hold nothing while waiting for the next
                if local.seceded:
                    return  # it left the pool: another thread took its place
        finally:
            with self._lock:
                self.threads.discard(threading.current_thread())
