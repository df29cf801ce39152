"""Worker resources, as a dask.distributed user declares and asks for them: a worker
offers ``resources={"GPU": 1}``; a task submitted with ``resources={"GPU": 1}`` runs
only where it is free and holds it while it runs, so a worker with one GPU and two
threads never runs two such tasks at once (the tasks note, in files, which of them run
at any moment: that works across processes too)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import shoal
from shoal.scheduler.server import Scheduler
from shoal.worker.server import Worker

pytestmark = pytest.mark.timeout(60)


def hold(directory: str, name: str, seconds: float = 0.03) -> int:
    """Run for a while, marked as running in ``directory``; returns how many marked
    tasks this one saw running at once (itself included)."""
    marker = Path(directory, name)
    marker.touch()
    try:
        seen = len(os.listdir(directory))
        time.sleep(seconds)  # work: a second task on the same GPU would show up meanwhile
        return max(seen, len(os.listdir(directory)))
    finally:
        marker.unlink()


def meet(directory: str, name: str, others: int) -> str:
    """Wait (30 s at most) until ``others`` more tasks are marked as running with this
    one: proof that they run at once."""
    Path(directory, name).touch()
    deadline = time.monotonic() + 30
    while len(os.listdir(directory)) < others + 1:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name}: the other tasks never ran at the same time")
        time.sleep(0.005)
    return shoal.get_worker().address


@pytest.fixture(scope="module", params=[False, True], ids=["threads", "processes"])
def gpu_cluster(request: pytest.FixtureRequest) -> Iterator[shoal.LocalCluster]:
    with shoal.LocalCluster(n_workers=1, threads_per_worker=2, processes=request.param,
                            resources={"GPU": 1}) as cluster:
        yield cluster


def test_two_gpu_tasks_never_run_at_once_on_a_one_gpu_worker(gpu_cluster: shoal.LocalCluster,
                                                              tmp_path: Path) -> None:
    with shoal.Client(gpu_cluster) as client:
        futures = [client.submit(hold, str(tmp_path), f"gpu-{i}", resources={"GPU": 1}, pure=False)
                   for i in range(6)]
        assert [f.result(timeout=30) for f in futures] == [1] * 6


def test_the_worker_runs_two_tasks_at_once_when_they_need_no_gpu(gpu_cluster: shoal.LocalCluster,
                                                                 tmp_path: Path) -> None:
    # the check above is not a one-thread worker's: two tasks that ask for nothing meet
    with shoal.Client(gpu_cluster) as client:
        futures = [client.submit(meet, str(tmp_path), f"cpu-{i}", 1, pure=False) for i in range(2)]
        assert len({f.result(timeout=30) for f in futures}) == 1


def test_a_task_without_resources_runs_beside_a_gpu_task(gpu_cluster: shoal.LocalCluster, tmp_path: Path) -> None:
    with shoal.Client(gpu_cluster) as client:
        gpu = client.submit(meet, str(tmp_path), "gpu", 1, resources={"GPU": 1}, pure=False)
        cpu = client.submit(meet, str(tmp_path), "cpu", 1, pure=False)
        assert gpu.result(timeout=30) == cpu.result(timeout=30)


async def test_gpu_tasks_run_only_on_the_worker_that_has_gpus(tmp_path: Path) -> None:
    # Worker objects started by hand against a scheduler of this process, as one does
    # with `shoal worker --resources GPU=2`
    scheduler = Scheduler()
    await scheduler.start("inproc://")
    gpu = Worker(scheduler.address, nthreads=2, name="gpu", resources={"GPU": 2})
    cpu = Worker(scheduler.address, nthreads=2, name="cpu")
    await gpu.start()
    await cpu.start()
    try:
        async with shoal.Client(scheduler.address, asynchronous=True) as client:
            futures = [client.submit(hold, str(tmp_path), f"gpu-{i}", 0.01, resources={"GPU": 1}, pure=False)
                       for i in range(8)]
            seen = await client.gather(futures)
            assert max(seen) <= 2  # two GPUs: at most two at once
            where = await client.gather([client.submit(_worker_name, resources={"GPU": 2}, pure=False)
                                         for _ in range(3)])
            assert where == ["gpu"] * 3
            assert gpu.state is not None and gpu.state.available_resources == {"GPU": 2.0}
    finally:
        await gpu.close()
        await cpu.close()
        await scheduler.close()


def _worker_name() -> str:
    return shoal.get_worker().name


def test_a_worker_checks_its_resources() -> None:
    with pytest.raises(ValueError, match="resources"):
        Worker("inproc://nowhere", resources={"GPU": -1})
    with pytest.raises(TypeError, match="resources"):
        Worker("inproc://nowhere", resources={"GPU": "two"})
    with pytest.raises(TypeError, match="resources"):
        Worker("inproc://nowhere", resources=[("GPU", 1)])  # type: ignore[arg-type]
