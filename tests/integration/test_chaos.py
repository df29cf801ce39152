"""Never a wrong answer: mixed graphs checked against pandas/numpy/plain Python while
worker processes are killed (-9) at random points (shoal.chaos). A longer run is
``python bench/chaos.py``."""

from __future__ import annotations

import random

import pytest

import shoal
from shoal import config
from shoal.chaos import GRAPHS, kill_a_worker, run_chaos

pytest.importorskip("dask.dataframe")

pytestmark = pytest.mark.timeout(240)


def _check(report: shoal.chaos.ChaosReport) -> None:
    report.check()


def test_every_kind_of_graph_is_right_without_faults():
    """The checks themselves: each kind of graph, on worker processes, matches its
    local result when nothing dies (so a kill run that passes means something)."""
    with shoal.Client(n_workers=2, processes=True, dashboard_address=None) as client:
        for kind in GRAPHS:
            report = run_chaos(client, None, graphs=1, seed=11, kinds=[kind])
            assert report.graphs[kind] == 1
            _check(report)
            assert not report.errors


def test_graphs_are_drawn_until_the_kills_asked_for_happened():
    """A run of few fast graphs may be over before the first kill: ``min_kills`` draws
    more until it happened (here a kill that kills nothing, in-process workers)."""
    calls = []

    def kill() -> bool:
        calls.append(1)
        return len(calls) % 2 == 0  # every other call kills

    with shoal.Client(n_workers=1, processes=False, dashboard_address=None) as client:
        report = run_chaos(client, kill, graphs=1, seed=3, kill_every=(0.05, 0.1), min_kills=3, kinds=["chain"])
        _check(report)
        assert report.kills >= 3 and report.total >= 1 and len(calls) >= 6
        quiet = run_chaos(client, None, graphs=2, seed=3, min_kills=3, kinds=["chain"])
        assert quiet.total == 2 and quiet.kills == 0  # no kill to wait for


def test_graphs_stay_right_while_workers_are_killed():
    """Kill -9 of a random worker process every 1-3 s while graphs of every kind
    run, on workers whose small memory limit makes them spill; their nannies restart
    them. No graph may come back wrong or hang."""
    with config.set(nanny_max_restarts=10_000):
        with shoal.Client(n_workers=2, processes=True, dashboard_address=None,
                          memory_limit="300MB") as client:
            report = run_chaos(client, kill_a_worker(client, random.Random(5)), graphs=12, seed=5,
                               kill_every=(1.0, 3.0), deadline=60, min_kills=1)
    _check(report)
    assert report.total >= 12 and report.kills >= 1, report.summary()
