"""Shared clusters for the integration tests: one in-process and one with worker
processes, started once per module and closed even when tests fail; and
``processes``, the processes a test starts, stopped after it whatever happened."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest

import shoal
from shoal_helpers import auth_files, stop_processes


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen]]:
    """A list for the test's processes (``shoal_helpers.start_shoal``): terminated after
    the test (killed if they do not stop), with the auth files killed ones leave."""
    procs: list[subprocess.Popen] = []
    before = auth_files()
    yield procs
    stop_processes(procs, before)


@pytest.fixture(scope="module", params=[False, True], ids=["threads", "processes"])
def cluster(request: pytest.FixtureRequest) -> Iterator[shoal.LocalCluster]:
    with shoal.LocalCluster(n_workers=2, threads_per_worker=1, processes=request.param) as c:
        yield c


@pytest.fixture
def client(cluster: shoal.LocalCluster) -> Iterator[shoal.Client]:
    with shoal.Client(cluster) as c:
        yield c
