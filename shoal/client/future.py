"""Futures: handles on remote results, and ``wait``/``as_completed`` over them."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import namedtuple
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Any

from ..errors import CancelledError
from ..protocol import Serialize, Serialized, deserialize
from .tracebacks import traceback_from_text
from ..worker.actor import ActorRef
from ..worker.context import waiting


def as_actor(value: Any, client: Client) -> Any:
    """A result as the caller sees it: an actor's value is a handle on the actor."""
    if type(value) is ActorRef:
        from .actor import Actor

        return Actor.of(value, client)
    return value


def _unwrap(value: Any) -> Any:
    if isinstance(value, Serialize):
        return value.data
    if isinstance(value, Serialized):
        return deserialize(value)
    return value

if TYPE_CHECKING:
    from .client import Client

__all__ = ["Future", "FutureState", "wait", "as_completed", "DoneAndNotDone", "fire_and_forget"]

DoneAndNotDone = namedtuple("DoneAndNotDone", ["done", "not_done"])

_FINAL = ("finished", "error", "cancelled")
#: guards every state's callbacks and thread waiter (short sections: one lock for all
#: is cheaper than two per future)
_guard = threading.Lock()


class FutureState:
    """What the client knows of one key; shared by every :class:`Future` of that key.

    Changed only on the client's event loop.
    """

    __slots__ = ("key", "status", "exception", "traceback", "tb", "workers", "shm", "value", "has_value",
                 "nbytes", "_event", "_callbacks", "_waiter")

    def __init__(self, key: Any):
        self.key = key
        self.status = "pending"
        self.exception: BaseException | None = None
        self.traceback: str | None = None
        #: the exception's own traceback object, as it came (an exception raised in
        #: this process has one; it is kept before raising it again extends it)
        self.tb: TracebackType | None = None
        self.workers: list[str] = []
        #: where the value lies in shared memory, if its worker placed it there
        self.shm: Any = None
        #: the value itself, when the scheduler passed it along (small results)
        self.value: Any = None
        self.has_value = False
        #: the value's size as its worker measured it (0: not known)
        self.nbytes = 0
        self._event: asyncio.Event | None = None
        self._callbacks: list[Callable[[], None]] = []
        #: made for the first thread that waits (most futures never have one)
        self._waiter: threading.Event | None = None

    def event(self) -> asyncio.Event:
        if self._event is None:
            self._event = asyncio.Event()
            if self.status in _FINAL:
                self._event.set()
        return self._event

    def wait(self, timeout: float | None = None) -> bool:
        """Block the calling thread (not the loop's) until the state is final; False
        after ``timeout`` seconds."""
        with _guard:
            if self.status in _FINAL:
                return True
            if self._waiter is None:
                self._waiter = threading.Event()
            waiter = self._waiter
        return waiter.wait(timeout)

    def _done(self) -> None:
        # the status is final already: a thread that saw it otherwise under the guard
        # has made its waiter, which is set here
        with _guard:
            waiter = self._waiter
            callbacks, self._callbacks = self._callbacks, []
        if waiter is not None:
            waiter.set()
        if self._event is not None:
            self._event.set()
        for cb in callbacks:
            cb()

    def finish(self, workers: list[str], shm: Any = None, value: Any = None, has_value: bool = False,
               nbytes: int = 0) -> None:
        self.status = "finished"
        self.workers = list(workers)
        self.nbytes = nbytes
        self.shm = shm
        self.value, self.has_value = value, has_value
        self.exception = self.traceback = self.tb = None
        self._done()

    def set_error(self, exception: BaseException, traceback: str | None) -> None:
        self.status = "error"
        self.exception = exception
        self.traceback = traceback
        self.tb = exception.__traceback__
        self._done()

    def cancel(self, reason: str = "") -> None:
        self.status = "cancelled"
        self.exception = CancelledError(reason or f"task {self.key!r} was cancelled")
        self._done()

    def lost(self) -> None:
        """The value was lost with a worker; it is being recomputed."""
        self.status = "lost"
        self.workers = []
        self.shm = None
        self.value, self.has_value = None, False
        with _guard:
            if self._waiter is not None:
                self._waiter.clear()
        if self._event is not None:
            self._event.clear()

    def on_done(self, cb: Callable[[], None]) -> None:
        with _guard:
            if self.status not in _FINAL:
                self._callbacks.append(cb)
                return
        cb()


class Future:
    """A handle on the result of a task that runs on the cluster.

    ``status`` is one of ``pending``, ``finished``, ``error``, ``cancelled``, ``lost``.
    When the last Future of a key is released (garbage collected or ``release()``d)
    the cluster forgets the key and frees its memory.
    """

    __shoal_future__ = True
    #: dask treats objects with this flag as references to computed keys
    __dask_future__ = True

    def __init__(self, key: Any, client: Client, state: FutureState | None = None):
        self.key = key
        self.client = client
        self._state = state if state is not None else client._state_for(key)
        self._released = False
        client._inc_ref(key)

    @property
    def status(self) -> str:
        return self._state.status

    def done(self) -> bool:
        """Whether the task has finished, erred or been cancelled."""
        return self._state.status in _FINAL

    def cancelled(self) -> bool:
        """Whether the task was cancelled."""
        return self._state.status == "cancelled"

    def result(self, timeout: float | None = None) -> Any:
        """The task's value (waits for it). Raises the task's exception (same type,
        with the worker's traceback as a note), :class:`~shoal.CancelledError` if it was
        cancelled, ``TimeoutError`` after ``timeout`` seconds. On an asynchronous client
        this returns an awaitable."""
        st = self._state
        if not self.client.asynchronous:
            # wait in this thread; a small value that came with its report needs no loop
            began = time.monotonic()
            if st.status not in _FINAL:
                with waiting():  # a task that waits gives its thread up meanwhile
                    if not st.wait(timeout):
                        raise TimeoutError(f"{self!r} not done within {timeout}s")
            if st.status in ("error", "cancelled") and st.exception is not None:
                raise st.exception
            if st.status == "finished" and st.has_value:
                try:
                    return as_actor(_unwrap(st.value), self.client)
                except Exception:
                    pass  # fetch it from its worker below
            if timeout is not None:
                timeout = max(timeout - (time.monotonic() - began), 0.0)  # what is left of it
        return self.client._sync(self._result, timeout)

    async def _result(self, timeout: float | None = None) -> Any:
        values = await self.client._gather_async([self], timeout=timeout)
        return values[0]

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The task's exception, or ``None`` if it succeeded (waits for it)."""
        return self.client._sync(self._exception, timeout)

    async def _exception(self, timeout: float | None = None) -> BaseException | None:
        await self.client._wait_states([self._state], timeout)
        return self._state.exception if self._state.status in ("error", "cancelled") else None

    def traceback(self, timeout: float | None = None) -> Any:
        """The traceback (a ``types.TracebackType``, as dask's) of an erred task, else
        ``None`` (waits for the task). ``traceback.format_tb(future.traceback())`` gives
        its text; from a worker in another process its frames stand for the remote ones
        (file, line, function) and hold no variables. Raises ``TimeoutError``."""
        return self.client._sync(self._traceback, timeout)

    async def _traceback(self, timeout: float | None = None) -> TracebackType | None:
        await self.client._wait_states([self._state], timeout)
        st = self._state
        if st.status != "error":
            return None
        return st.tb if st.tb is not None else traceback_from_text(st.traceback)

    def cancel(self) -> Any:
        """Cancel the task (and what depends on it for this client)."""
        return self.client.cancel([self])

    def add_done_callback(self, fn: Callable[[Future], Any]) -> None:
        """Call ``fn(future)`` once the future is done (in a client thread)."""
        client = self.client

        def fire() -> None:
            client._run_callback(fn, self)

        self._state.on_done(fire)

    def release(self) -> None:
        """Drop this handle's claim on the key now (instead of at garbage collection)."""
        if not self._released:
            self._released = True
            self.client._dec_ref(self.key)

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:
            pass

    def __await__(self) -> Any:
        return self._result().__await__()

    def __repr__(self) -> str:
        return f"<Future {self.key!r} {self.status}>"

    def __dask_tokenize__(self) -> Any:
        return ("shoal.Future", self.key)

    def __reduce__(self) -> Any:
        # unpickled in a task or another process, it is a future of that process's
        # client (the worker's in a task, else the default one), bound on first use
        return (_future_of_key, (self.key,))


def _future_of_key(key: Any) -> Future:
    client = _current_client()
    if client is None:
        return _UnboundFuture(key)
    return client._future_for_key(key)


def _current_client() -> Client | None:
    from .default import get_client

    try:
        return get_client()
    except ValueError:
        return None


class _UnboundFuture(Future):
    """A future unpickled where no client was at hand yet (say, while a worker reads a
    task's arguments): it binds to the client of the place it is first used in."""

    def __init__(self, key: Any):  # noqa: D107 - no client yet, nothing to count
        self.key = key
        self._released = True  # it holds no claim until bound

    def __getattr__(self, name: str) -> Any:
        if name in ("client", "_state"):
            client = _current_client()
            if client is None:
                raise ValueError(f"future {self.key!r} is used where there is no client: "
                                 "start one (shoal.Client(...)) or use it inside a task")
            bound = client._future_for_key(self.key)
            self.client, self._state, self._released = bound.client, bound._state, False
            client._inc_ref(self.key)
            return getattr(self, name)
        raise AttributeError(name)

    def __repr__(self) -> str:
        if "client" not in self.__dict__:
            return f"<Future {self.key!r} unbound>"
        return super().__repr__()


def _client_of(futures: list[Future]) -> Client:
    if not futures:
        raise ValueError("no futures given")
    return futures[0].client


def wait(futures: Any, timeout: float | None = None, return_when: str = "ALL_COMPLETED") -> Any:
    """Wait until all (``ALL_COMPLETED``) or any (``FIRST_COMPLETED``) of the futures (a
    future, containers of them, persisted dask collections: :func:`futures_of`) are
    done; return ``DoneAndNotDone(done, not_done)`` sets. Raises ``TimeoutError``.
    On an asynchronous client this returns an awaitable."""
    from .structure import futures_of

    futures = futures_of(futures)
    if return_when not in ("ALL_COMPLETED", "FIRST_COMPLETED"):
        raise ValueError(f"return_when must be ALL_COMPLETED or FIRST_COMPLETED, got {return_when!r}")
    if not futures:
        return DoneAndNotDone(set(), set())
    client = _client_of(futures)
    return client._sync(_wait_async, futures, timeout, return_when)


async def _wait_async(futures: list[Future], timeout: float | None, return_when: str) -> DoneAndNotDone:
    client = futures[0].client
    states = [f._state for f in futures]
    if return_when == "ALL_COMPLETED":
        await client._wait_states(states, timeout)
    else:
        waits = [asyncio.ensure_future(s.event().wait()) for s in states]
        try:
            done, _ = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                raise TimeoutError(f"no future finished within {timeout}s")
        finally:
            for w in waits:
                w.cancel()
    done_set = {f for f in futures if f.done()}
    return DoneAndNotDone(done_set, set(futures) - done_set)


class as_completed:
    """Iterate over futures in the order they complete (``with_results=True`` yields
    ``(future, result)`` pairs). ``add(future)`` and ``update(futures)`` add more while
    iterating; ``next_batch()`` and ``batches()`` give every future done so far at
    once; ``count()`` says how many are yet to be given. Also an async iterator."""

    def __init__(self, futures: Iterable[Future] = (), with_results: bool = False):
        self.with_results = with_results
        self._queue: queue.Queue[Future] = queue.Queue()
        self._pending = 0
        self._lock = threading.Lock()
        self._wakeup: asyncio.Event | None = None
        for f in futures:
            self.add(f)

    def add(self, future: Future) -> None:
        """Add ``future``: it is given once it is done. Raises ``TypeError`` for
        what is not a future."""
        if not isinstance(future, Future):
            raise TypeError(f"as_completed takes futures, got {type(future).__name__}")
        with self._lock:
            self._pending += 1
        future._state.on_done(lambda: self._arrived(future))

    def update(self, futures: Iterable[Future]) -> None:
        """Add each of ``futures`` (as :meth:`add`)."""
        for f in futures:
            self.add(f)

    def count(self) -> int:
        """How many futures are yet to be given: still running, or done and not yet
        given."""
        with self._lock:
            return self._pending

    def is_empty(self) -> bool:
        """Whether every future was given (none runs, none waits to be given)."""
        return not self.count()

    def has_ready(self) -> bool:
        """Whether a done future waits to be given."""
        return not self._queue.empty()

    def next_batch(self, block: bool = True) -> list[Any]:
        """Every future done so far and not yet given (with their results when
        ``with_results``); with ``block``, waits for at least one first (raises
        ``StopIteration`` when none is left), else may return ``[]``."""
        batch = [next(self)] if block else []
        while True:
            with self._lock:
                if self._pending == 0:
                    break
                try:
                    future = self._queue.get_nowait()
                except queue.Empty:
                    break
                self._pending -= 1
            batch.append((future, future.result()) if self.with_results else future)
        return batch

    def batches(self) -> Iterator[list[Any]]:
        """Lists of the futures done so far, as soon as there are any, until every
        future was given (``for batch in ac.batches(): client.gather(batch)``)."""
        while True:
            try:
                yield self.next_batch(block=True)
            except StopIteration:
                return

    def _arrived(self, future: Future) -> None:
        self._queue.put(future)
        if self._wakeup is not None:
            # async iteration: callbacks run on the client's loop, where the waiter is
            self._wakeup.set()

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        with self._lock:
            if self._pending == 0:
                raise StopIteration
            self._pending -= 1
        with waiting():
            future = self._queue.get()
        if self.with_results:
            return future, future.result()
        return future

    def __aiter__(self) -> AsyncIterator[Any]:
        return self

    async def __anext__(self) -> Any:
        with self._lock:
            if self._pending == 0:
                raise StopAsyncIteration
            self._pending -= 1
        while True:
            try:
                future = self._queue.get_nowait()
                break
            except queue.Empty:
                self._wakeup = asyncio.Event()
                if self._queue.empty():
                    await self._wakeup.wait()
        if self.with_results:
            return future, await future._result()
        return future


def fire_and_forget(futures: Any) -> None:
    """Let the tasks of ``futures`` (a future, or containers of them) run to the end
    even once no client holds them (their results are then dropped): for tasks run for
    their side effects."""
    from .structure import collect_futures

    flat: list[Future] = []
    collect_futures(futures, flat)
    by_client: dict[int, tuple[Client, list[Any]]] = {}
    for f in flat:
        by_client.setdefault(id(f.client), (f.client, []))[1].append(f.key)
    for client, keys in by_client.values():
        client._enqueue({"op": "fire-and-forget", "keys": keys})
