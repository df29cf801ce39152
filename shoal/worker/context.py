"""Inside a task: which worker runs it, a client of that worker, and leaving the
thread pool while waiting for other tasks.

A task thread notes the worker and the key it runs in a thread-local (set by the
worker around each task), so these functions find them without arguments, as in
dask.distributed::

    def fib(n):
        if n < 2:
            return n
        with worker_client() as client:     # secede() on enter, rejoin() on exit
            a, b = client.gather([client.submit(fib, n - 1), client.submit(fib, n - 2)])
        return a + b

Outside a task (no worker noted in this thread), they raise ``ValueError``, except
:func:`task_client`, which returns ``None`` (``shoal.get_client`` then looks for the
default client).

A worker's :class:`TaskServices` does the work: the client of its tasks, and seceding
(the thread leaves the pool, the state machine frees the task's slot:
``SecedeEvent``) and rejoining (the thread waits until the state machine gives the
task a slot again: ``RejoinEvent``, answered by the ``Rejoin`` instruction).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Hashable, Iterator
from typing import TYPE_CHECKING, Any

from ..errors import describe
from .events import RejoinEvent, SecedeEvent

if TYPE_CHECKING:
    from .server import Worker

__all__ = ["get_worker", "task_key", "task_client", "secede", "rejoin", "worker_client", "enter_task", "leave_task",
           "seceded_at", "waiting", "TaskServices"]

logger = logging.getLogger("shoal.worker")

_local = threading.local()


def enter_task(worker: Worker, key: Hashable) -> None:
    """Note that this thread runs task ``key`` for ``worker`` (the worker's side; plain
    assignments, not a context manager: this is on every task's path)."""
    _local.worker, _local.key, _local.seceded_at = worker, key, None


def leave_task() -> None:
    """This thread no longer runs a task."""
    _local.worker = _local.key = None


def seceded_at() -> float | None:
    """When (``time.perf_counter()``) the calling task first seceded, or None: its
    duration as the scheduler averages it ends there (the rest was waiting)."""
    return getattr(_local, "seceded_at", None)


def _current() -> Worker:
    worker = getattr(_local, "worker", None)
    if worker is None:
        raise ValueError("No worker found: not called from a task running on a shoal worker")
    return worker


def get_worker() -> Worker:
    """The :class:`~shoal.worker.server.Worker` running the calling task. Raises
    ``ValueError`` when not called from a task."""
    return _current()


def task_key() -> Hashable:
    """The key of the calling task. Raises ``ValueError`` when not called from a task."""
    _current()
    return _local.key


def task_client(timeout: float | None = None) -> Any:
    """A :class:`~shoal.Client` of the calling task's worker, connected to its
    scheduler (one per worker, made on first use, reused by its tasks, closed with the
    worker); ``None`` when not called from a task. Raises what connecting raises
    (``OSError``/``TimeoutError`` after ``timeout`` seconds)."""
    worker = getattr(_local, "worker", None)
    return None if worker is None else worker.services.client(timeout)


@contextlib.contextmanager
def waiting() -> Iterator[None]:
    """Around a blocking wait of the calling thread (a future's result, a gather, a
    dask ``.compute()``): a task that has not seceded leaves the thread pool for it
    and rejoins after, so the tasks it waits for can have its thread (a one-thread
    worker does not wait for itself). Anywhere else it does nothing."""
    worker = getattr(_local, "worker", None)
    if worker is None or worker.threads.seceded():
        yield
        return
    secede()
    try:
        yield
    finally:
        rejoin()


def secede() -> None:
    """Leave the worker's thread pool: the calling task no longer counts against the
    worker's ``nthreads``, so another task runs in its place (e.g. one it waits for).
    Does nothing if it left already. Raises ``ValueError`` when not called from a task."""
    _current().services.secede(_local.key)


def rejoin() -> None:
    """Come back into the thread pool after :func:`secede`: waits until a thread slot
    of the worker is free (the task then counts against ``nthreads`` again). Does
    nothing if the task did not secede. Raises ``ValueError`` when not called from a
    task."""
    _current().services.rejoin(_local.key)


@contextlib.contextmanager
def worker_client(timeout: float | None = None, separate_thread: bool = True) -> Iterator[Any]:
    """``with worker_client() as client:`` in a task: the worker's client
    (:func:`task_client`), with the task seceded meanwhile (``separate_thread=False``:
    not seceded), so it may submit tasks and wait for them without holding a thread.
    Rejoins on exit, however the block ends. Raises ``ValueError`` when not called from
    a task."""
    worker = _current()
    client = worker.services.client(timeout)
    if separate_thread:
        secede()
    try:
        yield client
    finally:
        if separate_thread:
            rejoin()


def _on_loop(loop: Any) -> bool:
    try:
        return loop is not None and asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


class TaskServices:
    """What the tasks of ``worker`` may ask of it, from their threads: a client
    (:meth:`client`), leaving the thread pool (:meth:`secede`) and coming back
    (:meth:`rejoin`)."""

    def __init__(self, worker: Worker):
        self.worker = worker
        self._client: Any = None
        #: held while a task thread makes the client (long: it connects); the loop
        #: thread never takes it, only ``_swap`` (held for an assignment)
        self._client_lock = threading.Lock()
        self._swap = threading.Lock()
        #: threads of seceded tasks waiting for a slot again, by key
        self._rejoining: dict[Hashable, threading.Event] = {}
        self._ids = itertools.count()

    def client(self, timeout: float | None = None) -> Any:
        """The client of this worker's tasks: connected to the worker's scheduler,
        made on first use, reused by every task of the worker, closed with it. It runs
        its own loop thread, never the worker's (so its blocking calls from a task
        thread cannot stall the worker, nor an in-process scheduler on that loop).
        Raises ``RuntimeError`` once the worker is closing, or when it would be made
        on the worker's event loop thread, or what connecting raises
        (``TimeoutError`` after ``timeout`` seconds)."""
        worker = self.worker
        with self._client_lock:
            client = self._client
            if client is not None and client.status == "running":
                return client
            if worker.status != "running":
                raise RuntimeError(f"worker {worker.address} is {worker.status}: no client for its tasks")
            if _on_loop(worker.loop):
                # connecting blocks this thread, and an in-process scheduler runs on it
                raise RuntimeError("the worker's client cannot be made on the worker's event loop (it would "
                                   "wait for itself); ask for it from a task")
            # the client layer, loaded by the first task that asks for a client
            from ..client import Client

            client = Client(worker.scheduler_address, security=worker.security,
                            timeout=30.0 if timeout is None else timeout, set_as_default=False)
            with self._swap:
                self._client = client
            if worker.status != "running":
                # the worker began closing while this client connected: whoever takes
                # it from ``_client`` first (here or aclose) closes it
                self._take_client_and_close()
                raise RuntimeError(f"worker {worker.address} is {worker.status}: no client for its tasks")
            return client

    def _take_client_and_close(self) -> None:
        with self._swap:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    def secede(self, key: Hashable) -> None:
        """In the thread of task ``key``: leave the thread pool (a new thread takes its
        place) and free the task's slot. Does nothing if it left already; raises
        ``RuntimeError`` from a thread that is not one of the worker's task threads."""
        if self.worker.threads.secede():
            if getattr(_local, "seceded_at", None) is None:
                _local.seceded_at = time.perf_counter()
            self.worker.call_soon(self.worker.handle_stimulus, SecedeEvent(self._sid("secede", key), key))

    def rejoin(self, key: Hashable) -> None:
        """In the thread of task ``key``, seceded: wait until the state machine gives
        the task a slot again, then be a pool thread again. Does nothing if it did not
        secede. Returns early when the worker closes."""
        worker = self.worker
        if not worker.threads.seceded():
            return
        woken = self._rejoining[key] = threading.Event()
        if not worker.call_soon(self._ask_rejoin, RejoinEvent(self._sid("rejoin", key), key)):
            woken.set()
        # a closing worker wakes every waiter; a loop that died without closing the
        # worker would not: look at its status now and then
        while not woken.wait(1.0) and worker.status in ("created", "running"):
            pass
        self._rejoining.pop(key, None)
        worker.threads.rejoin()

    def rejoined(self, key: Hashable) -> None:
        """The state machine gave ``key`` a slot again (``Rejoin``): wake its thread."""
        waiter = self._rejoining.pop(key, None)
        if waiter is not None:
            waiter.set()

    def wake_all(self) -> None:
        """Wake every thread waiting to rejoin (the worker closes: no slot will come)."""
        for waiter in list(self._rejoining.values()):
            waiter.set()

    def _ask_rejoin(self, event: RejoinEvent) -> None:
        if not self.worker.handle_stimulus(event) or self.worker.status != "running":
            self.wake_all()

    def _sid(self, what: str, key: Hashable) -> str:
        return f"{what}-{key}-{next(self._ids)}"

    async def aclose(self, timeout: float = 5.0) -> None:
        """Wake the threads waiting to rejoin, and close the tasks' client, from a
        thread of its own: its ``close()`` blocks until its loop is done (and, with an
        in-process scheduler, that loop waits for the worker's)."""
        self.wake_all()
        with self._swap:
            client, self._client = self._client, None
        if client is None:
            return
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def finished() -> None:
            if not done.done():
                done.set_result(None)

        def close() -> None:
            try:
                client.close(timeout=timeout)
            except Exception as exc:  # noqa: BLE001 - closing: nothing left to do about it
                logger.debug("closing the tasks' client: %s", describe(exc))
            finally:
                try:
                    loop.call_soon_threadsafe(finished)
                except RuntimeError:
                    pass  # the worker's loop is gone already

        threading.Thread(target=close, name="shoal-close-task-client", daemon=True).start()
        try:
            await asyncio.wait_for(asyncio.shield(done), timeout + 1)
        except asyncio.TimeoutError:
            logger.info("the tasks' client of worker %s did not close within %.0fs", self.worker.address, timeout)
