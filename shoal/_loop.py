"""An event loop running in a daemon thread, for synchronous APIs over async code."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["LoopThread", "new_event_loop"]


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop when available (lower per-message overhead), else asyncio's."""
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


class LoopThread:
    """Runs an event loop in a thread; ``run(coro)`` executes a coroutine there and
    waits for its result from any other thread."""

    def __init__(self, name: str = "shoal-loop"):
        self.loop = new_event_loop()
        self._ready = threading.Event()
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.thread.start()
        self._ready.wait()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._ready.set)
        try:
            self.loop.run_forever()
        finally:
            try:
                pending = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
                for t in pending:
                    t.cancel()
                if pending:
                    self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            finally:
                self.loop.close()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and return its result (raises what it raises;
        ``TimeoutError`` after ``timeout`` seconds, cancelling it)."""
        if threading.current_thread() is self.thread:
            raise RuntimeError("LoopThread.run() called from the loop's own thread would deadlock")
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            if fut.done():
                raise  # the coroutine itself raised TimeoutError
            fut.cancel()
            raise TimeoutError(f"timed out after {timeout}s") from None

    def call_soon(self, fn: Any, *args: Any) -> None:
        """Schedule ``fn(*args)`` on the loop from any thread."""
        if threading.current_thread() is self.thread:
            fn(*args)
        else:
            self.loop.call_soon_threadsafe(fn, *args)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop and join the thread."""
        if self.loop.is_closed():
            return
        try:
            self.loop.call_soon_threadsafe(self.loop.stop)
        except RuntimeError:
            pass
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout)
