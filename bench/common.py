"""Helpers for workload functions: event loops, loop threads, helper processes."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import secrets
import statistics
import threading
from collections.abc import Coroutine
from typing import Any

__all__ = ["loop_name", "new_event_loop", "run", "LoopThread", "Helper", "start_helper", "median", "pin", "placement"]


def loop_name(loop: str = "auto") -> str:
    """``"uvloop"`` when asked for it (or ``"auto"`` and it is installed), else ``"asyncio"``."""
    if loop not in ("auto", "uvloop", "asyncio"):
        raise ValueError(f"loop must be auto, uvloop or asyncio, not {loop!r}")
    if loop == "asyncio":
        return "asyncio"
    try:
        import uvloop  # noqa: F401
    except ImportError:
        if loop == "uvloop":
            raise
        return "asyncio"
    return "uvloop"


def new_event_loop(loop: str = "auto") -> asyncio.AbstractEventLoop:
    if loop_name(loop) == "uvloop":
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def run(coro: Coroutine[Any, Any, Any], loop: str = "auto") -> Any:
    """Run ``coro`` to completion on a new loop of the given kind (as shoal's cli does)."""
    with asyncio.Runner(loop_factory=lambda: new_event_loop(loop)) as runner:
        return runner.run(coro)


class LoopThread:
    """An event loop running in a daemon thread; ``call(coro)`` runs a coroutine on it."""

    def __init__(self, loop: str = "auto", name: str = "bench-loop"):
        self.loop = new_event_loop(loop)
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float | None = 60) -> Any:
        """Run ``coro`` on the thread's loop and wait for it (from another thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def acall(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Await ``coro`` running on the thread's loop (from another loop)."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self.loop.close()


class Helper:
    """A helper process started with :func:`start_helper`."""

    def __init__(self, process: Any, conn: Any, value: Any):
        self.process = process
        self.conn = conn
        self.value = value

    def stop(self, timeout: float = 10.0) -> None:
        """Tell the helper to stop (closes its pipe), then wait; kill it if it hangs."""
        try:
            self.conn.send("stop")
        except (OSError, EOFError):
            pass
        self.conn.close()
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)

    def __enter__(self) -> Helper:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def pin(cpus: Any) -> None:
    """Restrict this process (and the threads it starts later) to ``cpus`` (a set of
    CPU numbers); ``None`` or empty leaves it alone."""
    if cpus:
        os.sched_setaffinity(0, set(cpus))


def placement(mode: str) -> tuple[Any, Any]:
    """CPU sets ``(measuring process, helper process)`` for a ``cpus`` parameter:
    ``""`` (the kernel decides), ``"same"`` (both on CPU 0) or ``"split"`` (CPU 0 and
    CPU 1). Wake-ups between CPUs are much slower on a VM than on one CPU, and the
    kernel switches between the two placements from run to run; pinning shows each."""
    if not mode:
        return None, None
    if mode == "same":
        return {0}, {0}
    if mode == "split":
        if (os.cpu_count() or 1) < 2:
            raise ValueError("cpus=split needs two CPUs")
        return {0}, {1}
    raise ValueError(f"cpus must be '', 'same' or 'split', not {mode!r}")


def _helper_main(conn: Any, cpus: Any, target: Any, args: tuple[Any, ...]) -> None:
    pin(cpus)
    target(conn, *args)


def start_helper(target: Any, *args: Any, timeout: float = 120.0, cpus: Any = None) -> Helper:
    """Start ``target(conn, *args)`` in a fresh (spawned) process, pinned to ``cpus``
    if given.

    ``target`` must be a module-level function; it sends one value (e.g. the address it
    listens on) through ``conn`` when ready, and should stop when ``conn`` yields
    ``"stop"`` or EOF (see :func:`wait_for_stop`). Returns a :class:`Helper` holding
    that value.
    """
    # this process and its helpers are one cluster: they share a secret (shoal's
    # listeners and connections take it from the environment)
    os.environ.setdefault("SHOAL_AUTH", secrets.token_hex(16))
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_helper_main, args=(child, cpus, target, args), daemon=True)
    process.start()
    child.close()
    if not parent.poll(timeout):
        process.kill()
        raise TimeoutError(f"helper {target.__name__} did not report within {timeout}s")
    try:
        value = parent.recv()
    except EOFError:
        process.join(5)
        raise RuntimeError(f"helper {target.__name__} died (exit code {process.exitcode})") from None
    if isinstance(value, BaseException):
        process.join(5)
        raise RuntimeError(f"helper {target.__name__} failed: {value!r}") from value
    return Helper(process, parent, value)


def wait_for_stop(conn: Any) -> None:
    """In a helper: block until the parent says stop (or goes away)."""
    try:
        conn.recv()
    except (EOFError, OSError):
        pass


async def async_wait_for_stop(conn: Any) -> None:
    """In a helper's event loop: wait for the parent's stop without blocking the loop."""
    await asyncio.get_running_loop().run_in_executor(None, wait_for_stop, conn)


def median(values: list[float]) -> float:
    return float(statistics.median(values))
