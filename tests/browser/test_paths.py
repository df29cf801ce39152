"""The paths a value moves by, as the status page draws them, on a cluster of worker
processes: a small input goes over tcp, a large one through shared memory; each is
drawn in the task stream in its path's colour, and the bytes-per-second chart shows
the shared-memory bytes (from the workers' totals, differenced between updates)."""

from __future__ import annotations

import pytest

import shoal
from shoal_helpers import add, array_sum, inc, make

MB = 1 << 20


@pytest.fixture(scope="module")
def procs():
    with shoal.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                            dashboard_address="127.0.0.1:0") as cluster, shoal.Client(cluster) as client:
        yield cluster, client


def test_the_status_page_draws_each_path(tab, procs):
    cluster, client = procs
    a, b = sorted(cluster.scheduler.state.workers)
    t = tab(login=cluster.dashboard_link)
    t.wait("() => window.shoalDashboard && window.shoalDashboard.updates() >= 1")
    small = client.submit(inc, 1, workers=[a], pure=False)
    large = client.submit(make, 8 * MB, workers=[a], pure=False)
    s = client.submit(add, small, 1, workers=[b])
    big = client.submit(array_sum, large, workers=[b])
    assert s.result() == 3 and big.result() == MB
    moved = t.wait("() => { const m = window.shoalDashboard.transferCounts(); return m.tcp >= 1 && m.shm >= 1 && m; }")
    assert moved["inproc"] == 0
    # the bytes of the mapped array, per second, once a heartbeat has carried the totals
    t.wait("n => window.shoalDashboard.rates().shm > n", 0)
    t.done()
