"""Shared clusters for the integration tests: one in-process and one with worker
processes, started once per module and closed even when tests fail."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import shoal


@pytest.fixture(scope="module", params=[False, True], ids=["threads", "processes"])
def cluster(request: pytest.FixtureRequest) -> Iterator[shoal.LocalCluster]:
    with shoal.LocalCluster(n_workers=2, threads_per_worker=1, processes=request.param) as c:
        yield c


@pytest.fixture
def client(cluster: shoal.LocalCluster) -> Iterator[shoal.Client]:
    with shoal.Client(cluster) as c:
        yield c
