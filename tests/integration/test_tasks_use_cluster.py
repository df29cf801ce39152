"""Tasks that use the cluster, written as a dask.distributed user writes them:
``get_worker()`` and ``get_client()`` inside a task, ``secede()``/``rejoin()`` and
``with worker_client():`` so that a task can submit tasks and wait for them without
deadlocking one-thread workers. Both cluster kinds (the shared ``cluster`` fixture has
two workers of one thread each)."""

from __future__ import annotations

import threading
import time

import pytest

import shoal
from shoal import get_worker, rejoin, secede, worker_client
from shoal.testing import wait_for

pytestmark = pytest.mark.timeout(60)


def inc(x: int) -> int:
    return x + 1


def fib(n: int) -> int:
    # dask's docs example: the task gives its thread up while it waits
    if n < 2:
        return n
    with worker_client() as client:
        a_future = client.submit(fib, n - 1)
        b_future = client.submit(fib, n - 2)
        a, b = client.gather([a_future, b_future])
    return a + b


def fan_out(n: int) -> int:
    with worker_client() as client:
        futures = client.map(inc, range(n))
        return sum(client.gather(futures))


def slow_inc(x: int) -> int:
    time.sleep(0.005)  # work that takes a while: the scheduler then gives workers few tasks ahead
    return x + 1


def fan_out_slow(n: int) -> int:
    with worker_client() as client:
        return sum(client.gather(client.map(slow_inc, range(n), pure=False)))


def fan_out_secede(n: int) -> list[int]:
    client = shoal.get_client()
    futures = [client.submit(inc, i) for i in range(n)]
    secede()
    results = client.gather(futures)
    rejoin()
    return results


def whoami() -> tuple[str, int, str]:
    worker = get_worker()
    return worker.address, worker.nthreads, threading.current_thread().name


def client_identity() -> tuple[str, int]:
    return get_worker().address, id(shoal.get_client())


def test_get_worker_inside_a_task(client: shoal.Client, cluster: shoal.LocalCluster) -> None:
    address, nthreads, thread = client.submit(whoami).result(timeout=30)
    assert address in cluster.worker_addresses
    assert nthreads == 1
    assert thread.startswith("shoal-task")


def test_get_worker_outside_a_task_raises() -> None:
    with pytest.raises(ValueError, match="No worker found"):
        get_worker()


def test_secede_rejoin_and_worker_client_outside_a_task_raise() -> None:
    with pytest.raises(ValueError, match="No worker found"):
        secede()
    with pytest.raises(ValueError, match="No worker found"):
        rejoin()
    with pytest.raises(ValueError, match="No worker found"):
        with worker_client():
            pass


def test_a_task_submits_ten_tasks_and_gathers_them(client: shoal.Client) -> None:
    assert client.submit(fan_out, 10).result(timeout=30) == sum(range(1, 11))


def test_fib_recursion_does_not_deadlock_one_thread_workers(client: shoal.Client) -> None:
    # fib(8) keeps up to ~20 tasks waiting on their children at once, on two workers
    # of one thread each
    assert client.submit(fib, 8).result(timeout=45) == 21


def test_more_waiting_tasks_than_the_scheduler_gives_a_worker_ahead(client: shoal.Client) -> None:
    # more tasks wait at once than the workers would take while they held their threads:
    # the scheduler hears they are long-running and gives the workers their children too
    futures = client.map(fan_out_slow, [2] * 12, pure=False)
    assert [f.result(timeout=30) for f in futures] == [3] * 12


def test_secede_then_gather_then_rejoin(client: shoal.Client) -> None:
    futures = client.map(fan_out_secede, [3, 4], pure=False)
    assert [f.result(timeout=30) for f in futures] == [[1, 2, 3], [1, 2, 3, 4]]


def test_get_client_in_tasks_is_one_client_per_worker(client: shoal.Client, cluster: shoal.LocalCluster) -> None:
    a, b = cluster.worker_addresses
    seen = client.gather([client.submit(client_identity, workers=[w], pure=False) for w in (a, a, b, b)])
    by_worker: dict[str, set[int]] = {}
    for address, ident in seen:
        by_worker.setdefault(address, set()).add(ident)
    assert by_worker.keys() == {a, b}
    assert all(len(ids) == 1 for ids in by_worker.values()), by_worker  # reused by the worker's tasks


def test_the_task_client_is_not_the_default_client(client: shoal.Client) -> None:
    client.submit(client_identity).result(timeout=30)
    assert shoal.get_client() is client


def test_the_task_client_closes_with_its_worker() -> None:
    with shoal.LocalCluster(n_workers=1, processes=False) as cluster, shoal.Client(cluster) as c:
        assert c.submit(fan_out, 3).result(timeout=30) == 6
        (worker,) = cluster.workers.values()
        task_client = worker.client
        assert task_client.status == "running" and task_client is not c
    wait_for(lambda: task_client.status == "closed", 10, "the task client to close")
    assert worker.status == "closed"
