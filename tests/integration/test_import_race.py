"""A task whose imports meet another thread's half-done import (a worker just started
unpickles a payload in the task's thread and a fetched value in the offload thread, of
one package with circular imports) is run again once instead of failing; a module that
is really missing still fails the task with the real error."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

import shoal
from shoal.worker.outcomes import raised_while_importing

pytestmark = pytest.mark.timeout(60)

#: fails its first import the way a half-initialized package makes it fail
_FLAKY = '''
import os
_marker = os.path.join(os.path.dirname(__file__), "imported-once")
if not os.path.exists(_marker):
    open(_marker, "w").close()
    raise KeyError("dask")
VALUE = 42
'''


@pytest.fixture
def module_dir(tmp_path: Path):  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(tmp_path))
    try:
        yield tmp_path
    finally:
        sys.path.remove(str(tmp_path))
        for name in ("shoal_flaky_import", "shoal_flaky_plain"):
            sys.modules.pop(name, None)


def _use_flaky() -> int:
    import shoal_flaky_import  # type: ignore[import-not-found]

    return int(shoal_flaky_import.VALUE)


def _use_missing() -> int:
    import shoal_no_such_module_anywhere  # type: ignore[import-not-found]  # noqa: F401

    return 0


def test_errors_out_of_the_import_machinery_are_told_apart(module_dir: Path) -> None:
    (module_dir / "shoal_flaky_plain.py").write_text(_FLAKY)
    with pytest.raises(KeyError) as during_import:
        import shoal_flaky_plain  # type: ignore[import-not-found]  # noqa: F401
    assert raised_while_importing(during_import.value)
    with pytest.raises(KeyError) as elsewhere:
        {}["dask"]
    assert not raised_while_importing(elsewhere.value)
    assert raised_while_importing(ImportError("cannot import name 'DataFrame' from partially initialized "
                                              "module 'dask.dataframe.dask_expr' (most likely due to a circular import)"))


def test_a_task_whose_import_fails_once_is_run_again(module_dir: Path) -> None:
    (module_dir / "shoal_flaky_import.py").write_text(_FLAKY)
    with shoal.Client(n_workers=1, processes=False, dashboard_address=None) as c:
        assert c.submit(_use_flaky, pure=False).result(timeout=30) == 42
        assert (module_dir / "imported-once").exists()
        with pytest.raises(ModuleNotFoundError, match="shoal_no_such_module_anywhere"):
            c.submit(_use_missing, pure=False).result(timeout=30)


#: fails the first import in each process, as a half-initialized package does
_FLAKY_PER_PROCESS = '''
import os
_marker = os.path.join(os.path.dirname(__file__), f"imported-in-{os.getpid()}")
if not os.path.exists(_marker):
    open(_marker, "w").close()
    raise KeyError("dask")


class Box:
    def __init__(self, value):
        self.value = value
'''


def _make_box(n: int) -> object:
    import shoal_flaky_box  # type: ignore[import-not-found]

    return shoal_flaky_box.Box(list(range(n)))


def _open_box(box: object) -> int:
    return sum(box.value)  # type: ignore[attr-defined]


@pytest.mark.timeout(120)
def test_a_fetched_value_whose_import_fails_once_is_fetched_again(module_dir: Path, monkeypatch) -> None:
    # the consumer's worker imports the value's module for the first time as it
    # unpickles the fetched value, and that import fails once (in a worker just started,
    # another thread's half-done import does this): the fetch is tried again, not failed
    (module_dir / "shoal_flaky_box.py").write_text(_FLAKY_PER_PROCESS)
    monkeypatch.setenv("PYTHONPATH", f"{module_dir}:{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("SHOAL_SHM", "0")  # the value crosses the socket, and is unpickled as it arrives
    with shoal.LocalCluster(n_workers=2, dashboard_address=None) as cluster, shoal.Client(cluster) as c:
        producer, consumer = sorted(c.scheduler_info()["workers"])
        box = c.submit(_make_box, 100_000, workers=[producer], pure=False)
        total = c.submit(_open_box, box, workers=[consumer], pure=False)
        assert total.result(timeout=60) == sum(range(100_000))
        pids = {w["pid"] for w in c.scheduler_info()["workers"].values()}
    assert {f"imported-in-{pid}" for pid in pids} <= {p.name for p in module_dir.iterdir()}
