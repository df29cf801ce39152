"""The cluster objects, used the way a dask.distributed user writes them: ``LocalCluster``
with ``resources=``, ``scale(n)``, ``adapt(minimum=, maximum=)``, ``scheduler_address``,
``workers`` and ``get_logs()``, on both kinds of cluster (worker threads in this
process, worker processes)."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Iterator

import pytest

import shoal
from shoal import Client, LocalCluster
from shoal.testing import wait_for


@pytest.fixture(params=[False, True], ids=["threads", "processes"])
def kind(request: pytest.FixtureRequest) -> bool:
    """``processes=`` of the cluster the test makes."""
    return request.param


def inc(x: int) -> int:
    return x + 1


def slowinc(x: int, delay: float = 0.05) -> int:
    time.sleep(delay)  # the work itself: a task that takes a while
    return x + 1


def n_workers(client: Client) -> int:
    return len(client.scheduler_info()["workers"])


def wait_for_workers(client: Client, n: int, timeout: float = 20) -> None:
    """Exactly ``n`` workers (``client.wait_for_workers(n)`` waits for at least n, and
    for n > 0 only): after a scale down, polled."""
    wait_for(lambda: n_workers(client) == n, timeout=timeout, what=f"{n} workers")


def test_scale_up_then_down(kind: bool) -> None:
    with LocalCluster(n_workers=1, processes=kind) as cluster, Client(cluster) as client:
        assert list(cluster.workers) == ["worker-0"]
        cluster.scale(3)
        client.wait_for_workers(3)
        assert n_workers(client) == 3
        wait_for(lambda: len(cluster.workers) == 3 and all(w.address for w in cluster.workers.values()),
                 what="the cluster to see its 3 workers")
        assert sorted(cluster.workers) == ["worker-0", "worker-1", "worker-2"]
        info = client.scheduler_info()["workers"]
        assert sorted(w["name"] for w in info.values()) == sorted(cluster.workers)
        assert {w.address for w in cluster.workers.values()} == set(info)
        assert sorted(client.gather(client.map(inc, range(20)))) == list(range(1, 21))
        x = client.submit(inc, 10)
        assert x.result() == 11
        cluster.scale(1)
        wait_for_workers(client, 1)
        assert len(cluster.workers) == 1
        # the value was kept where it was, or computed again: never lost
        assert x.result(timeout=20) == 11
        assert client.submit(inc, x).result(timeout=20) == 12
        cluster.scale(0)
        wait_for_workers(client, 0)
        assert cluster.workers == {}
        cluster.scale(2)
        wait_for_workers(client, 2)
        assert client.submit(inc, 1, pure=False).result(timeout=20) == 2


def test_scale_down_retires_the_workers_whose_data_is_safe(kind: bool) -> None:
    with LocalCluster(n_workers=3, processes=kind) as cluster, Client(cluster) as client:
        wait_for(lambda: all(w.address for w in cluster.workers.values()), what="the workers' addresses")
        by_name = {name: w.address for name, w in cluster.workers.items()}
        holder = by_name["worker-1"]
        # (a preference: the value may be computed again elsewhere if it is lost)
        x = client.submit(inc, 1, workers=[holder], allow_other_workers=True)
        assert x.result() == 2
        cluster.scale(2)
        wait_for_workers(client, 2)
        # an idle worker without data went, not the only holder of x (nor the oldest)
        assert sorted(cluster.workers) == ["worker-0", "worker-1"]
        assert client.who_has([x])[x.key] == [holder]
        assert x.result() == 2
        cluster.scale(1)
        wait_for_workers(client, 1)
        assert list(cluster.workers) == ["worker-1"]
        assert client.who_has([x])[x.key] == [holder]
        # scaled below what holds data: the value is computed again by a new worker
        cluster.scale(0)
        wait_for_workers(client, 0)
        cluster.scale(1)
        assert client.submit(inc, x).result(timeout=20) == 3
        assert list(cluster.workers) == ["worker-3"]


def test_scale_by_cores_and_bad_arguments() -> None:
    with LocalCluster(n_workers=0, threads_per_worker=2, processes=False) as cluster, Client(cluster) as client:
        cluster.scale(cores=3)  # two workers of two threads
        wait_for_workers(client, 2)
        assert [w["nthreads"] for w in client.scheduler_info()["workers"].values()] == [2, 2]
        for bad in (-1, 1.5, "2"):
            with pytest.raises(ValueError, match="number of workers"):
                cluster.scale(bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="n or cores"):
            cluster.scale(2, cores=4)
        assert len(cluster.workers) == 2


def test_resources_reach_every_worker(kind: bool) -> None:
    with LocalCluster(n_workers=2, processes=kind, resources={"GPU": 2, "MEM": 10e9}) as cluster, \
            Client(cluster) as client:
        assert cluster.scheduler is not None
        resources = [ws.resources for ws in cluster.scheduler.state.workers.values()]
        assert resources == [{"GPU": 2.0, "MEM": 1e10}] * 2
        # as dask's docs do it: a task that asks for them runs where they are
        futures = [client.submit(inc, i, resources={"GPU": 1, "MEM": 5e9}) for i in range(6)]
        assert client.gather(futures) == list(range(1, 7))
        # workers added later offer them too
        cluster.scale(3)
        wait_for_workers(client, 3)
        assert [ws.resources for ws in cluster.scheduler.state.workers.values()] == [{"GPU": 2.0, "MEM": 1e10}] * 3


@pytest.mark.parametrize("resources, error", [
    ({"GPU": -1}, ValueError), ({"GPU": float("nan")}, ValueError), ({"": 1}, ValueError),
    ({"A=B": 1}, ValueError), ({"GPU": "two"}, TypeError), (["GPU"], TypeError),
])
def test_bad_resources_are_refused_before_anything_starts(resources: object, error: type) -> None:
    with pytest.raises(error, match="resources"):
        LocalCluster(n_workers=1, processes=False, resources=resources)  # type: ignore[arg-type]


def test_adapt_scales_up_under_load_and_down_after(kind: bool) -> None:
    with LocalCluster(n_workers=0, processes=kind) as cluster:
        adaptive = cluster.adapt(minimum=1, maximum=3, interval="50ms", wait_count=2, target_duration="100ms")
        try:
            with Client(cluster) as client:
                wait_for_workers(client, 1)  # the minimum, with no work at all
                futures = client.map(slowinc, range(60), delay=0.05)  # 3 s of work for one thread
                wait_for(lambda: n_workers(client) == 3, timeout=20, what="adapt to add workers")
                assert sorted(client.gather(futures)) == list(range(1, 61))
                # idle again, their results released: back to the minimum
                del futures
                wait_for(lambda: n_workers(client) == 1, timeout=20, what="adapt to retire workers")
                assert len(cluster.workers) == 1
                assert client.submit(inc, 1).result(timeout=20) == 2
        finally:
            adaptive.stop()
        assert not adaptive.running


def test_adapt_keeps_workers_that_hold_the_only_copy_of_a_value() -> None:
    with LocalCluster(n_workers=2, processes=False) as cluster, Client(cluster) as client:
        holder = cluster.workers["worker-1"].address
        x = client.submit(inc, 1, workers=[holder])
        assert x.result() == 2
        adaptive = cluster.adapt(minimum=0, maximum=2, interval="20ms", wait_count=2)
        try:
            # the idle worker without data goes; the holder of x stays while x is wanted
            wait_for(lambda: list(cluster.workers) == ["worker-1"], timeout=10, what="worker-0 to be retired")
            assert adaptive.close_counts.get("worker-1") is None
            assert client.who_has([x])[x.key] == [holder]
            # once nobody wants x, the holder is retirable too
            del x
            wait_for(lambda: not cluster.workers, timeout=10, what="worker-1 to be retired")
        finally:
            adaptive.stop()


def test_a_retirement_cut_short_still_lets_the_cluster_close() -> None:
    """Stopping adapt cancels a retirement under way: the worker's close goes on to
    its end, and the cluster's close (which waits for it) returns."""
    cluster = LocalCluster(n_workers=2, processes=False)
    try:
        async def retire_then_cancel() -> None:
            worker = cluster.workers["worker-0"]
            retiring = asyncio.ensure_future(cluster._retire(["worker-0"]))
            while worker.status != "closing":
                await asyncio.sleep(0)  # until the worker's close has begun
            retiring.cancel()
            with pytest.raises(asyncio.CancelledError):
                await retiring

        cluster._loop_thread.run(retire_then_cancel(), timeout=30)
        assert list(cluster.workers) == ["worker-1"]
    finally:
        cluster.close(timeout=20)
    assert cluster.status == "closed"


def test_a_second_adapt_replaces_the_first() -> None:
    with LocalCluster(n_workers=1, processes=False) as cluster:
        first = cluster.adapt(minimum=1, maximum=2, interval="20ms")
        second = cluster.adapt(minimum=2, maximum=2, interval="20ms")
        assert not first.running and second.running
        wait_for(lambda: len(cluster.workers) == 2, timeout=10, what="the second adapt's minimum")
        second.stop()
        with pytest.raises(ValueError, match="maximum"):
            cluster.adapt(minimum=3, maximum=2)
        with pytest.raises(ValueError, match="interval"):
            cluster.adapt(interval="soon")


async def test_an_asynchronous_cluster_scales_and_adapts() -> None:
    async with LocalCluster(n_workers=1, processes=False, asynchronous=True) as cluster:
        async with Client(cluster, asynchronous=True) as client:
            cluster.scale(2)
            await cluster.wait_for_workers(2, timeout=10)
            assert len((await client.scheduler_info())["workers"]) == 2
            # one check by hand (the loop's own comes in an hour): no load, one worker to go
            adaptive = cluster.adapt(minimum=1, maximum=1, interval="1h", wait_count=1)
            await adaptive.adapt()
            assert list(cluster.workers) == ["worker-0"]
            assert len((await client.scheduler_info())["workers"]) == 1
            adaptive.stop()


def test_scheduler_address_and_workers(kind: bool) -> None:
    with LocalCluster(n_workers=2, processes=kind) as cluster, Client(cluster.scheduler_address) as client:
        scheme = "tcp://" if kind else "inproc://"
        assert cluster.scheduler_address.startswith(scheme)
        assert client.scheduler_info()["address"] == cluster.scheduler_address
        assert cluster.scheduler_info["address"] == cluster.scheduler_address
        assert sorted(cluster.workers) == ["worker-0", "worker-1"]
        wait_for(lambda: all(w.address for w in cluster.workers.values()), what="the workers' addresses")
        pids = client.run(os.getpid)
        if kind:
            assert {w.pid for w in cluster.workers.values()} == set(pids.values())
            assert sorted(p.pid for p in cluster.procs) == sorted(pids.values())
        else:
            assert set(pids.values()) == {os.getpid()}
            assert all(isinstance(w, shoal.worker.server.Worker) for w in cluster.workers.values())
        assert {w.address for w in cluster.workers.values()} == set(pids)
        assert "2 workers" in repr(cluster)


@pytest.fixture
def info_logs() -> Iterator[None]:
    """shoal's loggers let INFO through (as a user who wants to see more sets them)."""
    logger = logging.getLogger("shoal")
    old = logger.level
    logger.setLevel(logging.INFO)
    yield
    logger.setLevel(old)


def warn_from_task(text: str) -> str:
    logging.getLogger("shoal.worker").warning("a task says %s", text)
    return text


def test_get_logs(kind: bool, info_logs: None) -> None:
    with LocalCluster(n_workers=2, processes=kind) as cluster, Client(cluster) as client:
        wait_for(lambda: all(w.address for w in cluster.workers.values()), what="the workers' addresses")
        w1 = cluster.workers["worker-1"].address
        assert client.submit(warn_from_task, "hello", workers=[w1]).result() == "hello"
        logs = cluster.get_logs()
        assert set(logs) == {"Cluster", "Scheduler", "worker-0", "worker-1"}
        assert all(isinstance(text, str) for text in logs.values())
        assert "started worker-0" in logs["Cluster"] and "started worker-1" in logs["Cluster"]
        assert f"worker {w1} joined" in logs["Scheduler"]
        if kind:
            # a worker process's log is what it wrote: its address, its log records
            assert f"shoal worker at {w1}" in logs["worker-1"]
            assert logs["worker-1"].count("a task says hello") == 1
        else:
            wait_for(lambda: "a task says hello" in cluster.get_logs()["worker-1"], what="the task's record")
        assert "a task says hello" not in logs["worker-0"]
        assert set(cluster.get_logs(cluster=False, scheduler=False, workers=["worker-0"])) == {"worker-0"}
        if kind:
            log_dir = os.path.dirname(cluster.workers["worker-0"].log_path)
            assert os.path.isdir(log_dir)
    if kind:
        assert not os.path.exists(log_dir)  # the cluster's files went with it


def test_logs_of_two_clusters_stay_apart(info_logs: None) -> None:
    with LocalCluster(n_workers=1, processes=False) as a, LocalCluster(n_workers=1, processes=False) as b:
        with Client(a) as client:
            assert client.submit(warn_from_task, "to a").result() == "to a"
        wait_for(lambda: "a task says to a" in a.get_logs()["worker-0"], what="a's record")
        assert "to a" not in str(b.get_logs())
        assert a.scheduler_address not in b.get_logs()["Scheduler"]
