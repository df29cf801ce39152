"""An exception inside the scheduler's state machine is a bug, not bad input: it is
reported loudly with the stories of the stimulus's keys; if ``validate()`` still holds,
those keys err with an error that says so and everything else carries on; if not, the
scheduler stops rather than schedule from a half-changed state."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

import shoal
from shoal import statelog
from shoal.scheduler.state import TaskFinishedEvent
from shoal.testing import wait_for

pytestmark = pytest.mark.timeout(60)


def inc(x: int) -> int:
    return x + 1


@pytest.fixture
def cluster() -> Iterator[shoal.LocalCluster]:
    with shoal.LocalCluster(n_workers=1, threads_per_worker=1, processes=False) as c:
        yield c
    statelog.internal_errors.clear()  # provoked on purpose


def _break_task_finished(cluster: shoal.LocalCluster, key: Any, corrupt: bool = False) -> None:
    """The scheduler's handler of task-finished raises for ``key`` (once), after
    corrupting the state if ``corrupt``."""
    assert cluster.scheduler is not None
    state = cluster.scheduler.state
    original = state._handlers[TaskFinishedEvent]

    def broken(ev: TaskFinishedEvent) -> None:
        if ev.key != key:
            return original(ev)
        state._handlers[TaskFinishedEvent] = original
        if corrupt:
            state.tasks[key].processing_on = None  # processing, on no worker: validate() fails
        raise RuntimeError("a bug in the state machine")

    state._handlers[TaskFinishedEvent] = broken


def test_an_internal_error_fails_the_keys_of_its_stimulus_and_nothing_else(
    cluster: shoal.LocalCluster, caplog: pytest.LogCaptureFixture,
) -> None:
    _break_task_finished(cluster, "broken")
    with shoal.Client(cluster) as c, caplog.at_level(logging.CRITICAL, logger="shoal.statelog"):
        fine = c.submit(inc, 1, key="fine")
        assert fine.result(timeout=30) == 2
        broken = c.submit(inc, 1, key="broken")
        dependent = c.submit(inc, broken, key="dependent")
        for future in (broken, dependent):
            with pytest.raises(shoal.RemoteError, match="InternalError: internal error in the scheduler's state "
                                                        "machine: RuntimeError: a bug in the state machine"):
                future.result(timeout=30)
        assert c.submit(inc, 41, key="after").result(timeout=30) == 42
    [text] = list(statelog.internal_errors)
    # the report tells the key's story, with the stimulus that moved it
    assert "'broken': released -> waiting" in text and "'broken': waiting -> processing" in text
    assert any("a bug in the state machine" in r.getMessage() for r in caplog.records)
    assert cluster.scheduler is not None
    story = cluster.scheduler.state.story("broken")
    assert story[-1].finish in ("erred", "forgotten")


def test_an_internal_error_that_breaks_the_state_stops_the_scheduler(cluster: shoal.LocalCluster) -> None:
    _break_task_finished(cluster, "broken", corrupt=True)
    assert cluster.scheduler is not None
    scheduler = cluster.scheduler
    with shoal.Client(cluster) as c:
        broken = c.submit(inc, 1, key="broken")
        with pytest.raises(Exception):
            broken.result(timeout=30)
        wait_for(lambda: scheduler.closing, timeout=30, what="the scheduler to stop")
    assert len(statelog.internal_errors) == 1
