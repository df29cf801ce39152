"""An exception inside a worker's state machine is a bug, not bad input: it is reported
loudly with the stories of the keys of the events being handled, and the worker closes
rather than go on from a half-changed state. Its scheduler sees it leave and has its
tasks computed elsewhere; a LocalCluster with worker processes starts a new worker."""

from __future__ import annotations

import logging
from typing import Any

import pytest

import shoal
from shoal import statelog
from shoal.testing import wait_for
from shoal.worker.state import WorkerState, WTask

pytestmark = pytest.mark.timeout(60)


def inc(x: int) -> int:
    return x + 1


def test_an_internal_error_closes_the_worker_and_its_task_is_computed_elsewhere(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    broke: list[str] = []  # the address of the worker whose machine failed
    original = WorkerState._put

    def put(self: WorkerState, ts: WTask, value: Any, *rest: Any) -> None:
        if ts.key == "x" and not broke:  # the first worker that finishes x, once
            broke.append(self.address)
            raise RuntimeError("a bug in the worker's state machine")
        original(self, ts, value, *rest)

    monkeypatch.setattr(WorkerState, "_put", put)
    try:
        with shoal.LocalCluster(n_workers=2, processes=False) as cluster, shoal.Client(cluster) as c, \
                caplog.at_level(logging.CRITICAL, logger="shoal.statelog"):
            one = c.submit(inc, 0, key="one")
            assert one.result(timeout=30) == 1
            x = c.submit(inc, one, key="x")
            assert x.result(timeout=30) == 2, "computed again, on the other worker"
            assert c.submit(inc, x, key="after").result(timeout=30) == 3
            (address,) = broke
            (worker,) = [w for w in cluster.workers.values() if w.address == address]
            (other,) = [w for w in cluster.workers.values() if w.address != address]
            wait_for(lambda: worker.status == "closed", 10, "the broken worker to close")
            assert worker.broken
            assert address not in cluster.worker_addresses, "the scheduler saw it leave"
            assert other.state is not None and other.state.tasks["x"].state == "memory"
        [text] = list(statelog.internal_errors)
        assert "internal error in the worker's state machine: RuntimeError: a bug in the worker's state machine" in text
        # the report tells the story of x on that worker, up to the event that failed
        assert "'x': released -> ready" in text or "'x': released -> waiting" in text
        assert "'x': ready -> executing" in text and "'x': executing -> memory" not in text
        assert any(r.levelno == logging.CRITICAL and "'x': ready -> executing" in r.getMessage()
                   for r in caplog.records)
    finally:
        statelog.internal_errors.clear()  # provoked on purpose


def _break_put_once() -> bool:
    """In a worker process: its machine fails the first time a value of ``x`` comes."""
    original = WorkerState._put
    broke: list[bool] = []

    def put(self: WorkerState, ts: WTask, value: Any) -> None:
        if ts.key == "x" and not broke:
            broke.append(True)
            raise RuntimeError("a bug in the worker's state machine")
        original(self, ts, value)

    WorkerState._put = put  # type: ignore[method-assign]
    return True


def test_a_worker_process_that_met_an_internal_error_is_replaced() -> None:
    with shoal.LocalCluster(n_workers=2, processes=True) as cluster, shoal.Client(cluster) as c:
        assert set(c.run(_break_put_once).values()) == {True}
        # one worker or both fail x (once each), and leave; the cluster starts new ones
        assert c.submit(inc, 1, key="x").result(timeout=45) == 2
        wait_for(lambda: cluster.restarts >= 1 and len(cluster.worker_addresses) == 2, 30,
                 "the broken worker to be replaced")
        assert c.submit(inc, 2, key="y").result(timeout=30) == 3
