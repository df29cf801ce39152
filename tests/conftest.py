"""Test setup: ``async def`` tests run on a fresh event loop with a deadline."""

from __future__ import annotations

import asyncio
import inspect

import pytest

ASYNC_TEST_TIMEOUT = 30.0


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    if not inspect.iscoroutinefunction(pyfuncitem.obj):
        return None
    args = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    marker = pyfuncitem.get_closest_marker("async_timeout")
    timeout = marker.args[0] if marker else ASYNC_TEST_TIMEOUT

    async def run() -> None:
        await asyncio.wait_for(pyfuncitem.obj(**args), timeout)

    asyncio.run(run())
    return True


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "async_timeout(seconds): deadline of an async test")
    # hypothesis imports mypy_extensions while it reports a failure; that import's
    # DeprecationWarning, made an error, turned the report into an INTERNALERROR that
    # hid the falsifying example
    config.addinivalue_line(
        "filterwarnings", "ignore:mypy_extensions.TypedDict is deprecated:DeprecationWarning"
    )


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_leaks():
    """The suite leaves nothing in /dev/shm: every segment a (now finished) process of
    this run created is gone at the end."""
    import os

    from shoal.comm import shm

    def ours() -> set[str]:
        try:
            return {n for n in os.listdir(shm.SHM_DIR) if n.startswith(shm.PREFIX)}
        except OSError:
            return set()

    before = ours()
    yield
    leaked = [n for n in ours() - before if shm.process_gone(int(n.split("-")[1]))]
    assert not leaked, f"shared-memory segments left behind: {leaked}"
