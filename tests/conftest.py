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


@pytest.fixture(scope="session", autouse=True)
def private_auth_dir(tmp_path_factory: pytest.TempPathFactory):
    """Auth files that schedulers of this run write (and the processes of this run look
    for) live in a directory of the run's own, not in the user's ~/.shoal; it must be
    empty at the end: every scheduler removes its file when it stops."""
    import os

    path = tmp_path_factory.mktemp("shoal-auth")
    old = os.environ.get("SHOAL_AUTH_DIR")
    os.environ["SHOAL_AUTH_DIR"] = str(path)
    try:
        yield path
    finally:
        if old is None:
            del os.environ["SHOAL_AUTH_DIR"]
        else:
            os.environ["SHOAL_AUTH_DIR"] = old
    left = sorted(p.name for p in path.iterdir())
    assert not left, f"auth files left behind: {left}"


@pytest.fixture(autouse=True)
def no_internal_errors():
    """A test fails if a state machine of this process raised inside ``handle()`` (a
    bug, reported by :func:`shoal.statelog.internal_error`). A test that provokes one
    on purpose clears ``shoal.statelog.internal_errors`` itself."""
    from shoal import statelog

    statelog.internal_errors.clear()
    yield
    errors = list(statelog.internal_errors)
    statelog.internal_errors.clear()
    assert not errors, "internal errors of a state machine:\n" + "\n".join(errors)
