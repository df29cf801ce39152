"""Workers with a memory limit, as real processes on real disk: values beyond the
target spill and come back right, a worker past its pause threshold starts nothing
until its memory falls, and the scheduler shows each worker's memory."""

from __future__ import annotations

import os
import threading

import psutil
import pytest

import shoal
from shoal.testing import wait_for
from shoal_helpers import small_tmpfs

np = pytest.importorskip("numpy")

pytestmark = pytest.mark.timeout(180)

MiB = 1 << 20


def make(i, nbytes):
    out = np.empty(nbytes // 8)
    out.fill(float(i))
    return out


def total(arr):
    return float(arr.sum())


def first(arr):
    return float(arr[0]), float(arr[-1]), arr.nbytes


class PeakRss:
    """The largest resident memory of each worker process (by pid), sampled in a thread."""

    def __init__(self, pids):
        self.procs = [psutil.Process(p) for p in pids]
        self.peak = {p: 0 for p in pids}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(0.01):
            for p in self.procs:
                try:
                    self.peak[p.pid] = max(self.peak[p.pid], p.memory_info().rss)
                except psutil.Error:
                    pass

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(5)


def test_results_three_times_the_memory_limit_spill_and_come_back_right(tmp_path):
    limit = 512 * MiB
    size = 16 * MiB
    n = 3 * 2 * limit // size  # 3x what the two workers may hold
    with shoal.LocalCluster(n_workers=2, processes=True, memory_limit=limit, local_directory=str(tmp_path)) as cluster, \
            shoal.Client(cluster) as client:
        pids = list(client.run(os.getpid).values())
        with PeakRss(pids) as peak:
            futures = client.map(make, range(n), [size] * n)
            shoal.wait(futures)

            def spilled():
                return sum(w["memory"]["spilled"] for w in client.scheduler_info()["workers"].values())

            # most of it went to disk (the figures come with the workers' next heartbeat)
            wait_for(lambda: spilled() > limit, timeout=30, what="the spilled bytes to show")
            info = client.scheduler_info()["workers"]
            # every value, read back from disk where it went: right
            checks = client.gather(client.map(first, futures))
        assert checks == [(float(i), float(i), size) for i in range(n)]
        for w in info.values():
            assert w["memory"]["limit"] == limit
            assert w["memory_limit"] == limit
        # the limit held: a worker holds what is below its target, plus one value on its
        # way to disk, plus the interpreter and its libraries
        margin = 160 * MiB
        for pid, rss in peak.peak.items():
            assert rss < limit + margin, f"worker {pid} peaked at {rss / MiB:.0f} MiB"
        # the workers' spill directories are under the local directory, and go with them
        assert any(name.startswith("shoal-worker-") for name in os.listdir(tmp_path))
    assert not [name for name in os.listdir(tmp_path) if name.startswith("shoal-worker-")]


def grow(nbytes, dask_worker):
    """Memory no value accounts for (kept on the worker object: this module's globals
    travel by value)."""
    dask_worker.test_ballast = b"x" * nbytes
    return nbytes


def shrink(dask_worker):
    del dask_worker.test_ballast
    return 0


def test_a_worker_past_its_pause_threshold_starts_nothing_until_memory_falls():
    limit = 600 * MiB
    with shoal.LocalCluster(n_workers=1, processes=True, memory_limit=limit) as cluster, \
            shoal.Client(cluster) as client:
        (address,) = client.scheduler_info()["workers"]

        def status():
            return client.scheduler_info()["workers"][address]["status"]

        # the interpreter's own (~30 MiB private) and this: past 0.8 x 600 MiB, below 0.95 x
        client.run(grow, 500 * MiB)
        wait_for(lambda: status() == "paused", timeout=30, what="the worker to pause")
        f = client.submit(total, np.ones(10))
        # the scheduler (of this process) holds it back: a paused worker gets no task
        tasks = cluster.scheduler.state.tasks
        wait_for(lambda: f.key in tasks and tasks[f.key].state == "queued", timeout=10, what="the task to queue")
        assert not client.processing()[address]
        client.run(shrink)
        wait_for(lambda: status() == "running", timeout=30, what="the worker to go on")
        assert f.result(timeout=30) == 10.0
        memory = client.scheduler_info()["workers"][address]["memory"]
        assert set(memory) == {"limit", "managed", "shm", "spilled", "unmanaged", "process"}
        assert memory["process"] > 0 and memory["limit"] == limit


def test_in_process_workers_spill_by_the_sizes_of_their_values(tmp_path):
    limit = 64 * MiB
    with shoal.LocalCluster(n_workers=1, processes=False, memory_limit=limit, local_directory=str(tmp_path)) as cluster, \
            shoal.Client(cluster) as client:
        futures = client.map(make, range(12), [8 * MiB] * 12)
        shoal.wait(futures)
        (w,) = client.scheduler_info()["workers"].values()
        wait_for(lambda: next(iter(client.scheduler_info()["workers"].values()))["memory"]["spilled"] > 0,
                 timeout=10, what="spilled bytes to show")
        assert w["memory"]["limit"] == limit
        assert [x[0] for x in client.gather(client.map(first, futures))] == [float(i) for i in range(12)]


def noise(i, nbytes):
    """Values lz4 cannot shrink: they take their full size on disk."""
    return np.random.default_rng(i).random(nbytes // 8)


def test_a_full_disk_keeps_values_in_memory_and_pauses_the_worker():
    with small_tmpfs("1m") as disk:
        limit, size = 300 * MiB, 16 * MiB
        with shoal.LocalCluster(n_workers=1, processes=True, memory_limit=limit, local_directory=str(disk)) as cluster, \
                shoal.Client(cluster) as client:
            (address,) = client.scheduler_info()["workers"]
            futures = client.map(noise, range(12), [size] * 12)  # 192 MiB: past the 180 MiB target

            def worker():
                return client.scheduler_info()["workers"][address]

            # (it may pause before the last tasks ran: a paused worker starts none)
            wait_for(lambda: worker()["status"] == "paused", timeout=60, what="the worker to pause")
            assert worker()["memory"]["spilled"] == 0
            assert "cannot spill" in cluster.get_logs()["worker-0"]
            done = [i for i, f in enumerate(futures) if f.status == "finished"]
            assert len(done) >= 8, done
            # nothing was lost: every value is there, right (a paused worker still
            # serves its values; it runs no task)
            for i, value in zip(done, client.gather([futures[i] for i in done])):
                assert np.array_equal(value, noise(i, size))
            # memory falls below the target: the worker goes on, and runs the rest
            for i in done[2:]:
                futures[i] = None
            wait_for(lambda: worker()["status"] == "running", timeout=30, what="the worker to go on")
            rest = [i for i, f in enumerate(futures) if f is not None]
            for i, value in zip(rest, client.gather([futures[i] for i in rest])):
                assert np.array_equal(value, noise(i, size))
            assert client.submit(total, np.ones(3)).result(timeout=30) == 3.0


def test_a_killed_worker_with_spilled_values_comes_back_without_them_and_they_are_computed_again(tmp_path):
    import signal

    limit, size = 256 * MiB, 16 * MiB
    n = 2 * 2 * limit // size
    with shoal.LocalCluster(n_workers=2, processes=True, memory_limit=limit, local_directory=str(tmp_path)) as cluster, \
            shoal.Client(cluster) as client:
        futures = client.map(make, range(n), [size] * n)
        shoal.wait(futures)
        # (the figures come with the workers' next heartbeat)
        wait_for(lambda: all(w["memory"]["spilled"] > 0 for w in client.scheduler_info()["workers"].values()),
                 timeout=30, what="both workers to report spilled values")
        info = client.scheduler_info()["workers"]
        victim_address = max(info, key=lambda a: info[a]["memory"]["spilled"])
        handle = cluster.workers[info[victim_address]["name"]]
        victim, work_dir = handle.pid, handle.nanny.work_dir
        spill_files = os.listdir(os.path.join(work_dir, "spill"))
        assert spill_files
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: cluster.restarts >= 1, timeout=30, what="the nanny to restart the worker")
        wait_for(lambda: not os.path.exists(work_dir), timeout=30, what="the dead worker's directory to go")
        # the values it held, spilled or not, are computed again
        assert client.gather(client.map(first, futures)) == [(float(i), float(i), size) for i in range(n)]
        assert victim not in client.run(os.getpid).values()


def spill_files(root):
    """The spill files under the workers' directories in ``root``."""
    found = []
    for worker_dir in os.listdir(root):
        spill_dir = os.path.join(root, worker_dir, "spill")
        if os.path.isdir(spill_dir):
            found += [os.path.join(spill_dir, f) for f in os.listdir(spill_dir)]
    return found


def test_after_a_full_disk_releasing_everything_unpauses_and_leaves_no_spill_file():
    with small_tmpfs("40m") as disk:
        limit, size, n = 300 * MiB, 16 * MiB, 40  # 640 MiB of noise for two 180 MiB targets and 40 MiB of disk
        with shoal.LocalCluster(n_workers=2, processes=True, memory_limit=limit, local_directory=str(disk)) as cluster, \
                shoal.Client(cluster) as client:
            futures = client.map(noise, range(n), [size] * n)
            sums = client.map(total, futures)

            def statuses():
                return [w["status"] for w in client.scheduler_info()["workers"].values()]

            wait_for(lambda: statuses() == ["paused", "paused"], timeout=60, what="both workers to pause")
            assert any("cannot spill" in log for log in cluster.get_logs().values())
            done = [i for i, f in enumerate(sums) if f.status == "finished"]
            for i, value in zip(done, client.gather([sums[i] for i in done])):
                assert value == total(noise(i, size))
            del futures, sums
            wait_for(lambda: statuses() == ["running", "running"], timeout=30, what="both workers to go on")
            # what was on disk went with its keys
            wait_for(lambda: not spill_files(disk), timeout=30, what="the spill files to go")
            assert client.submit(total, np.ones(3)).result(timeout=30) == 3.0
