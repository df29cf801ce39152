"""The task stream on real clusters: ``client.get_task_stream()``, the
``get_task_stream()`` block, and the path each input travelled by (by reference,
shared memory, tcp), as the workers report it."""

from __future__ import annotations

import pytest

import shoal
from shoal.testing import wait_for
from shoal_helpers import add, array_sum, boom, inc, make

MB = 1 << 20


@pytest.fixture(scope="module")
def inproc():
    with shoal.LocalCluster(n_workers=2, threads_per_worker=2, processes=False, dashboard_address=None) as cluster, \
            shoal.Client(cluster) as client:
        yield cluster, client


@pytest.fixture(scope="module")
def procs():
    with shoal.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            shoal.Client(cluster) as client:
        yield cluster, client


def test_each_task_that_ran_has_one_record(inproc):
    cluster, client = inproc
    with shoal.get_task_stream(client) as ts:
        futures = client.map(inc, range(20), pure=False)
        client.gather(futures)
    records = ts.data
    assert sorted(r["key"] for r in records) == sorted(f.key for f in futures)
    workers = set(cluster.scheduler.state.workers)
    for r in records:
        assert r["prefix"] == "inc" and r["status"] == "OK" and r["worker"] in workers
        assert 1 <= r["thread"] <= 2
        assert r["start"] <= r["stop"]
        assert r["startstops"][-1] == {"action": "compute", "start": r["start"], "stop": r["stop"]}
    # the whole stream holds them too, with what ran before
    everything = client.get_task_stream()
    assert {r["key"] for r in records} <= {r["key"] for r in everything}
    assert client.get_task_stream(count=3) == everything[-3:]
    assert client.get_task_stream(count=0) == []


def test_an_erred_task_is_in_the_stream_as_an_error(inproc):
    _, client = inproc
    with shoal.get_task_stream(client) as ts:
        f = client.submit(boom, 1)
        shoal.wait([f])
    (record,) = ts.data
    assert record["key"] == f.key and record["status"] == "error" and record["prefix"] == "boom"


def test_in_one_process_an_input_moves_by_reference(inproc):
    cluster, client = inproc
    a, b = sorted(cluster.scheduler.state.workers)
    with shoal.get_task_stream(client) as ts:
        x = client.submit(inc, 1, workers=[a], pure=False)
        y = client.submit(inc, x, workers=[b])
        assert y.result() == 3
    (record,) = [r for r in ts.data if r["key"] == y.key]
    (moved,) = record["transfers"]
    assert moved["key"] == x.key and moved["from"] == a and moved["path"] == "inproc"
    assert moved["start"] <= moved["stop"] <= record["start"] + 1.0


def test_between_processes_small_values_go_over_tcp_and_large_ones_through_shared_memory(procs):
    cluster, client = procs
    a, b = sorted(cluster.scheduler.state.workers)
    with shoal.get_task_stream(client) as ts:
        small = client.submit(inc, 1, workers=[a], pure=False)
        large = client.submit(make, 8 * MB, workers=[a], pure=False)
        s1 = client.submit(add, small, 1, workers=[b])
        s2 = client.submit(add, small, 2, workers=[b])
        t = client.submit(array_sum, large, workers=[b])
        assert s1.result() == 3 and s2.result() == 4 and t.result() == MB
    by_key = {r["key"]: r for r in ts.data}
    # an input fetched once for two tasks is drawn once, with the first that used it
    moved = by_key[s1.key]["transfers"] + by_key[s2.key]["transfers"]
    (tcp,) = moved
    assert tcp["key"] == small.key and tcp["path"] == "tcp" and tcp["from"] == a and 0 < tcp["bytes"] < 1000
    (mapped,) = by_key[t.key]["transfers"]
    assert mapped["path"] == "shm" and mapped["bytes"] >= 8 * MB


def test_the_workers_figures_reach_the_scheduler(procs):
    cluster, client = procs
    a, b = sorted(cluster.scheduler.state.workers)
    x = client.submit(make, 8 * MB, workers=[a], pure=False)
    y = client.submit(array_sum, x, workers=[b])
    assert y.result() == MB
    diagnostics = cluster.scheduler.diagnostics
    # heartbeats carry them (every heartbeat-interval)
    wait_for(lambda: diagnostics.transfers()["shm"] >= 8 * MB, what="shared-memory bytes in the totals")
    rows = {w["address"]: w for w in diagnostics.workers()}
    assert rows[b]["transfers_in"]["shm"] >= 8 * MB
    assert rows[a]["last_seen"] is not None and rows[a]["status"] == "running"


def test_bad_arguments_are_clear_errors(inproc):
    _, client = inproc
    with pytest.raises(ValueError, match="count"):
        client.get_task_stream(count=-1)
    with pytest.raises(TypeError, match="start and stop"):
        client.get_task_stream(start=[1])
    with pytest.raises(ValueError, match="duration"):
        client.get_task_stream(start="soon")
    assert client.get_task_stream(start="1h") == client.get_task_stream()
    assert client.get_task_stream(stop=0.0) == []
