"""Nannies of a ``LocalCluster(processes=True)``: a worker process that dies, or passes
its memory limit, is started again (its directory and segments removed, what it held
computed again); a task that keeps killing workers ends as KilledWorker; restarts
through the nannies; memory limits of both cluster kinds.

Real processes, real memory: the memory test allocates (and touches) 400 MB in a
worker limited to 300 MB.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

import shoal
from shoal import config
from shoal.comm import shm
from shoal.testing import wait_for
from shoal.worker.memory import parse_memory_limit


def kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def exit_now() -> None:
    os._exit(1)


def allocate(nbytes: int) -> int:
    """Hold ``nbytes`` of touched memory (``b"x" * n`` writes every page) until killed."""
    block = b"x" * nbytes
    time.sleep(60)
    return len(block)


def big_value() -> list[int]:
    return list(range(100_000))


def inc(x: int) -> int:
    return x + 1


def _worker_pids(client: shoal.Client) -> dict[str, int]:
    return {a: w["pid"] for a, w in client.scheduler_info()["workers"].items()}


@pytest.mark.timeout(90)
def test_a_killed_worker_is_restarted_clean_and_its_values_computed_again(tmp_path):
    with shoal.LocalCluster(n_workers=2, local_directory=str(tmp_path)) as cluster, \
            shoal.Client(cluster) as c:
        x = c.submit(big_value, pure=False)
        assert x.result(timeout=30)[-1] == 99_999
        [victim_addr] = c.who_has([x])[x.key]
        info = c.scheduler_info()["workers"][victim_addr]
        handle = cluster.workers[info["name"]]
        assert handle.nanny is not None and handle.nanny_pid == os.getpid()
        assert info["nanny"] == handle.nanny.address and info["pid"] == handle.pid
        victim = handle.pid
        work_dir = handle.nanny.work_dir
        assert os.path.isdir(work_dir) and os.path.dirname(work_dir) == str(tmp_path)
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: cluster.restarts == 1, timeout=20, what="the nanny to restart the worker")
        wait_for(lambda: len(_worker_pids(c)) == 2 and victim not in _worker_pids(c).values(), timeout=30,
                 what="the new worker process to join")
        assert victim_addr not in c.scheduler_info()["workers"]
        assert handle.pid != victim and cluster.workers[info["name"]] is handle
        assert not os.path.exists(work_dir), "the dead worker's directory should be gone"
        assert os.path.isdir(handle.nanny.work_dir) and handle.nanny.work_dir != work_dir
        assert not shm.segments_of(victim)
        # the value only it held: computed again where the client asks for it
        assert x.result(timeout=30)[-1] == 99_999
        assert c.submit(sum, x).result(timeout=30) == sum(range(100_000))
        assert "exited with code -9; starting it again" in cluster.get_logs()["Cluster"]
    assert not [n for n in os.listdir(tmp_path) if n.startswith("shoal-worker-")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("killer", [kill_self, exit_now], ids=["SIGKILL", "os._exit"])
def test_a_task_that_kills_its_worker_ends_as_killed_worker(killer):
    with shoal.LocalCluster(n_workers=2) as cluster, shoal.Client(cluster) as c:
        # (done first: a task that shares a dying worker with the killer counts its deaths too)
        others = c.map(inc, range(20))
        shoal.wait(others, timeout=30)
        f = c.submit(killer, pure=False)
        with pytest.raises(shoal.KilledWorker):
            f.result(timeout=90)
        # what the dead workers held is computed again
        assert [o.result(timeout=60) for o in others] == list(range(1, 21))
        wait_for(lambda: cluster.restarts >= 3, timeout=30, what="three restarts")
        c.wait_for_workers(2, timeout=30)
        assert c.submit(inc, 1, pure=False).result(timeout=30) == 2


@pytest.mark.timeout(120)
def test_a_task_past_the_memory_limit_gets_its_worker_restarted_and_ends_as_killed_worker():
    with shoal.LocalCluster(n_workers=1, memory_limit="300MB") as cluster, shoal.Client(cluster) as c:
        assert cluster.workers["worker-0"].nanny.memory_limit == 300_000_000
        wait_for(lambda: [w["memory_limit"] for w in c.scheduler_info()["workers"].values()] == [300_000_000],
                 timeout=20, what="the worker to report its limit")
        first = cluster.workers["worker-0"].pid
        f = c.submit(allocate, 400_000_000, pure=False)
        with pytest.raises(shoal.KilledWorker):
            f.result(timeout=100)
        wait_for(lambda: cluster.restarts >= 3, timeout=20, what="three restarts")
        assert cluster.workers["worker-0"].pid != first
        logs = cluster.get_logs()["Cluster"]
        assert "past 95% of its memory limit of 286.10 MiB: restarting it" in logs, logs
        c.wait_for_workers(1, timeout=30)
        assert c.submit(inc, 1, pure=False).result(timeout=30) == 2


@pytest.mark.timeout(90)
def test_restart_goes_through_the_nannies_with_and_without_the_cluster_object():
    with shoal.LocalCluster(n_workers=2) as cluster, shoal.Client(cluster) as c:
        pids = set(_worker_pids(c).values())
        x = c.submit(inc, 1)
        assert x.result(timeout=30) == 2
        c.restart(timeout=60)
        assert x.status == "cancelled"
        after = set(_worker_pids(c).values())
        assert len(after) == 2 and after.isdisjoint(pids)
        assert {h.pid for h in cluster.workers.values()} == after
        assert cluster.restarts == 0  # asked for: not counted as deaths
        # a client given only the address: the scheduler asks the nannies
        with shoal.Client(cluster.scheduler_address, set_as_default=False) as remote:
            y = remote.submit(inc, 10)
            assert y.result(timeout=30) == 11
            remote.restart(timeout=60)
            assert y.status == "cancelled"
            again = set(_worker_pids(remote).values())
            assert len(again) == 2 and again.isdisjoint(after)
            assert remote.submit(inc, 2).result(timeout=30) == 3
        wait_for(lambda: {h.pid for h in cluster.workers.values()} == again, timeout=10,
                 what="the cluster's handles to follow")


@pytest.mark.timeout(60)
def test_memory_limit_of_both_cluster_kinds():
    with shoal.Client(n_workers=2, processes=False, memory_limit="1GiB") as c:
        assert [w.memory_limit for w in c.cluster.workers.values()] == [2**30, 2**30]
        assert all(w["memory_limit"] == 2**30 for w in c.scheduler_info()["workers"].values())
    with shoal.LocalCluster(n_workers=2, processes=False) as cluster:
        assert cluster.memory_limit == parse_memory_limit("auto", 2)
        assert all(w.memory_limit == cluster.memory_limit for w in cluster.workers.values())
    with shoal.LocalCluster(n_workers=1, memory_limit=0) as cluster, shoal.Client(cluster) as c:
        assert cluster.memory_limit is None
        [info] = c.scheduler_info()["workers"].values()
        assert info["memory_limit"] == 0 and info["nanny"]
    with pytest.raises(ValueError, match="not a size"):
        shoal.LocalCluster(n_workers=1, memory_limit="lots")


@pytest.mark.timeout(90)
def test_a_nanny_gives_up_after_repeated_crashes():
    with config.set(nanny_max_restarts=1), shoal.LocalCluster(n_workers=1) as cluster, \
            shoal.Client(cluster) as c:
        nanny = cluster.workers["worker-0"].nanny
        for _ in range(2):
            pid = cluster.workers["worker-0"].pid
            wait_for(lambda: pid in _worker_pids(c).values(), timeout=30, what="the worker to join")
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda: cluster.workers["worker-0"].pid != pid or nanny.status != "running", timeout=20,
                     what="the nanny to act")
        wait_for(lambda: nanny.status == "closed", timeout=20, what="the nanny to give up")
        assert cluster.restarts == 1
        assert "died 2 times within 60s (nanny-max-restarts is 1): not starting it again" in (
            cluster.get_logs()["Cluster"])
        # restart() starts a new nanny in its place
        c.restart(timeout=60)
        assert cluster.workers["worker-0"].nanny is not nanny
        assert c.submit(inc, 1, pure=False).result(timeout=30) == 2


@pytest.mark.timeout(120)
def test_a_worker_that_cannot_be_started_is_tried_again_until_it_can(tmp_path):
    # the nanny's directory for its workers becomes a file (as a full disk makes
    # mkdtemp fail): the killed worker cannot be started; the nanny says why once and
    # keeps trying, and starts it as soon as the directory is back
    base = tmp_path / "workers"
    base.mkdir()
    with shoal.LocalCluster(n_workers=1, local_directory=str(base)) as cluster, shoal.Client(cluster) as c:
        handle = cluster.workers["worker-0"]
        nanny = handle.nanny
        pid = handle.pid
        wait_for(lambda: pid in _worker_pids(c).values(), timeout=30, what="the worker to join")
        base.rename(tmp_path / "away")
        base.write_text("not a directory")
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: "cannot start the worker" in cluster.get_logs()["Cluster"]
                 or "cannot start worker" in cluster.get_logs()["Cluster"], timeout=30,
                 what="the nanny to say it cannot start the worker")
        assert nanny.status == "running" and nanny.pid == 0
        base.unlink()
        base.mkdir()
        wait_for(lambda: nanny.pid not in (0, pid), timeout=60, what="the nanny to start the worker again")
        wait_for(lambda: nanny.pid in _worker_pids(c).values(), timeout=30, what="the new worker to join")
        assert c.submit(inc, 1, pure=False).result(timeout=30) == 2
        logs = cluster.get_logs()["Cluster"]
        assert "NotADirectoryError" in logs and "started again" in logs
        assert logs.count("cannot start") == 1  # said once, however many tries
