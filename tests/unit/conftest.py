"""Unit-test setup: after each test of the shared-memory modules, this process's segment
registry must hold its invariants (:meth:`shoal.comm.shm_registry.SegmentRegistry.validate`);
``w``, a one-thread worker state of the harness, and ``s``, a scheduler state of the
harness (each validated after the test too)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def valid_segment_registry(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "shm" in request.module.__name__.rsplit(".", 1)[-1]:
        from shoal.comm import shm

        shm.registry.validate()


@pytest.fixture
def w() -> Iterator[object]:
    from worker_harness import Wk

    h = Wk(nthreads=1)
    yield h
    h.state.validate()


@pytest.fixture
def s() -> Iterator[object]:
    from scheduler_harness import Sched

    h = Sched()
    yield h
    h.state.validate()
