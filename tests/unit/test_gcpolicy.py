"""The collector's policy while shoal serves in a process (shoal.gcpolicy)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

import shoal
from shoal import config, gcpolicy

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _thresholds() -> Iterator[tuple[int, int, int]]:
    """Python's default thresholds for the test, and whatever was there after it."""
    before = gc.get_threshold()
    assert gcpolicy.holders() == 0
    gc.set_threshold(700, 10, 10)
    try:
        yield gc.get_threshold()
    finally:
        while gcpolicy.holders():
            gcpolicy.release()
        gc.set_threshold(*before)


def test_the_first_hold_raises_the_young_threshold_and_the_last_release_restores_it() -> None:
    gcpolicy.hold()
    assert gc.get_threshold() == (10_000, 10, 10)  # the older generations' stay
    gcpolicy.hold()
    gcpolicy.release()
    assert gc.get_threshold() == (10_000, 10, 10)  # one server still runs
    gcpolicy.release()
    assert gc.get_threshold() == (700, 10, 10)
    gcpolicy.release()  # one release too many changes nothing
    assert gc.get_threshold() == (700, 10, 10) and gcpolicy.holders() == 0


def test_the_setting_decides_and_zero_leaves_the_collector_alone() -> None:
    with config.set(gc_threshold=0):
        gcpolicy.hold()
        assert gc.get_threshold() == (700, 10, 10)
        gcpolicy.release()
    with config.set(gc_threshold=3000):
        gcpolicy.hold()
        assert gc.get_threshold() == (3000, 10, 10)
        gcpolicy.release()
    assert gc.get_threshold() == (700, 10, 10)


def test_a_rarer_collector_is_not_made_more_frequent() -> None:
    gc.set_threshold(50_000, 20, 20)
    gcpolicy.hold()
    assert gc.get_threshold() == (50_000, 20, 20)
    gcpolicy.release()
    assert gc.get_threshold() == (50_000, 20, 20)
    gc.set_threshold(0)  # automatic collection off: stays off
    gcpolicy.hold()
    assert gc.get_threshold()[0] == 0
    gcpolicy.release()
    assert gc.get_threshold()[0] == 0


def test_thresholds_someone_else_set_meanwhile_are_kept() -> None:
    gcpolicy.hold()
    gc.set_threshold(2000, 5, 5)  # the user's own choice, while shoal serves
    gcpolicy.release()
    assert gc.get_threshold() == (2000, 5, 5)


def test_an_in_process_cluster_holds_the_policy_while_it_runs() -> None:
    with shoal.LocalCluster(n_workers=2, processes=False, dashboard_address=None) as cluster, \
            shoal.Client(cluster) as client:
        assert gcpolicy.holders() == 3  # the scheduler and two workers
        assert gc.get_threshold()[0] == 10_000
        assert client.submit(sum, [1, 2]).result(timeout=30) == 3
    assert gcpolicy.holders() == 0
    assert gc.get_threshold() == (700, 10, 10)
