"""SIGTERM and SIGINT of the ``shoal scheduler`` and ``shoal worker`` processes (see
:class:`Signals`), and how long their closing may take."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, NoReturn

__all__ = ["Signals", "CLOSE_TIMEOUT", "closing", "leaving"]


#: how long a closing scheduler or worker may take to say goodbye to its peers before
#: it leaves anyway (its segments are removed after that, whatever happened)
CLOSE_TIMEOUT = 5.0


async def closing(close: Coroutine[Any, Any, None], what: str) -> None:
    """Await ``close`` (of ``what``), for :data:`CLOSE_TIMEOUT` seconds at most."""
    try:
        await asyncio.wait_for(close, CLOSE_TIMEOUT)
    except asyncio.TimeoutError:
        print(f"shoal: {what} did not close within {CLOSE_TIMEOUT}s; leaving anyway", file=sys.stderr, flush=True)


class Signals:
    """SIGTERM and SIGINT of a ``shoal scheduler`` or ``shoal worker`` process, for its
    whole life. The first asks it to close: :meth:`wait` returns, or, while it still
    starts (a worker waiting for its scheduler), the start is given up. Another one
    while it closes makes it leave at once (:func:`_exit_now`). Either way the process
    removes every shared-memory segment it owns before it exits, and exits with 0: it
    stopped as it was asked.

    Python-level handlers, not the event loop's: those go with the loop, and then a
    SIGTERM (default action) during the last clean-up, after the loop, would kill the
    process with its segments left in /dev/shm. uvloop wakes up for them (it watches
    the signal wake-up fd), so a signal is seen at once while the loop waits; asyncio's
    own loop, when the main thread gets it (Linux gives it that thread first).
    """

    def __init__(self) -> None:
        self.received = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._main: asyncio.Future[Any] | None = None
        self._stop: asyncio.Future[None] | None = None
        self._at_exit_now: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)

    def at_exit_now(self, fn: Callable[..., Any], *args: Any) -> None:
        """Have ``fn(*args)`` called should the process leave at once (it must take no
        lock: it runs in a signal handler)."""
        self._at_exit_now.append((fn, args))

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.received += 1
        if self.received > 1:
            _exit_now(f"a second signal ({signal.Signals(signum).name}) while closing", self._at_exit_now)
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._stop_now)
            except RuntimeError:
                pass  # the loop has closed: the clean-up after it runs already

    def _stop_now(self) -> None:
        if self._stop is not None:
            if not self._stop.done():
                self._stop.set_result(None)
        elif self._main is not None:
            self._main.cancel()  # still starting: give up

    def run(self, main: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run ``main()`` on a new event loop until it returns, or a signal ended its
        start. Raises what it raises."""

        async def run() -> None:
            self._loop = asyncio.get_running_loop()
            self._main = asyncio.current_task()
            if not self.received:  # not signalled before the loop ran
                await main()

        try:
            _run(run())
        except asyncio.CancelledError:
            if not self.received:
                raise

    async def wait(self, *also: Awaitable[Any]) -> bool:
        """Wait for a signal, or until one of ``also`` is done; returns whether a
        signal came."""
        self._stop = asyncio.get_running_loop().create_future()
        if self.received:  # before this was waited for
            return True
        others = {asyncio.ensure_future(a) for a in also}
        try:
            await asyncio.wait({self._stop, *others}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for other in others:
                other.cancel()
        return bool(self.received)

    def rearm(self) -> bool:
        """Starting again (a worker that lost its scheduler waits for it): a signal
        from now on gives that up, as during the first start. Returns whether a
        signal came already."""
        if self.received:
            return True
        self._stop = None
        return False


def leaving() -> None:
    """The process has removed what it owns and only the interpreter's exit is left: a
    SIGINT or SIGTERM from now on is ignored. CPython puts back the default action of
    every signal it handled when it finalizes, and a second signal that came then (a
    few milliseconds after the first, while modules are torn down) would kill a process
    that stopped as it was asked, exit code -2 or -15 instead of 0."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


def _exit_now(why: str, cleanups: list[tuple[Callable[..., Any], tuple[Any, ...]]]) -> NoReturn:
    """Leave at once (from a signal handler): this process's segments are removed by
    their names (:func:`.shm.sweep` takes no lock: the handler may have interrupted
    code that holds one), then ``cleanups`` run."""
    from .comm import shm

    shm.sweep(os.getpid())
    for fn, args in cleanups:
        try:
            fn(*args)
        except Exception:
            pass
    os.write(2, f"shoal: {why}: exiting now\n".encode())
    os._exit(0)


def _run(coro: Any) -> Any:
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)
