"""In-process clusters pass objects by reference: nothing is pickled."""

from __future__ import annotations

import threading

import pytest

import shoal


class Unpicklable:
    def __reduce__(self):
        raise RuntimeError("this object refuses to be pickled")


@pytest.fixture(scope="module")
def client():
    with shoal.Client(processes=False, n_workers=2) as c:
        yield c


def test_objects_pass_by_reference(client):
    obj = Unpicklable()
    assert client.submit(lambda x: x, obj).result(timeout=10) is obj
    lock = threading.Lock()
    assert client.submit(lambda x: x, lock, pure=True).result(timeout=10) is lock
    with_lock = client.submit(lambda lk: lk.acquire(blocking=False) and (lk.release() or True), lock)
    assert with_lock.result(timeout=10) is True


def test_values_flow_between_workers_by_reference(client):
    obj = Unpicklable()
    a = client.submit(lambda x: [x], obj, workers=[sorted(client.scheduler_info()["workers"])[0]])
    b = client.submit(lambda lst: lst[0], a, workers=[sorted(client.scheduler_info()["workers"])[1]])
    assert b.result(timeout=10) is obj


def test_scatter_by_reference(client):
    obj = Unpicklable()
    [f] = client.scatter([obj])
    assert f.result(timeout=10) is obj


async def test_asynchronous_client():
    async with shoal.Client(processes=False, n_workers=1, asynchronous=True) as c:
        f = c.submit(lambda x: x * 2, 21)
        assert await f == 42
        futures = c.map(lambda x: x + 1, range(5))
        assert await c.gather(futures) == [1, 2, 3, 4, 5]
        assert (await c.scheduler_info())["workers"]


def test_clients_share_the_loop_of_a_cluster_in_this_process():
    gate = threading.Event()
    with shoal.LocalCluster(n_workers=1, processes=False) as cluster:
        first = shoal.Client(cluster)
        second = shoal.Client(cluster)
        # client and scheduler on one thread: no wake-ups between them
        assert first.loop is second.loop is cluster._loop_thread.loop
        assert first.submit(lambda: 1).result(timeout=10) == 1
        first.close()  # closing one client leaves the shared loop running
        assert second.submit(lambda: 2).result(timeout=10) == 2
        pending = second.submit(gate.wait, 30, pure=False)
    # the cluster closed first (and its loop with it): closing the client still returns
    second.close()
    assert pending.status == "cancelled"
    gate.set()


class Tally:
    def __init__(self) -> None:
        self.n = 0


class CountsItsMeasures:
    """A value that counts the times its size is asked (``__sizeof__``) in ``tally``."""

    def __init__(self, tally: Tally):
        self.tally = tally

    def __sizeof__(self) -> int:
        self.tally.n += 1
        return 1000


def test_a_value_is_measured_once_where_made_and_once_where_fetched(client):
    # measuring is dask's sizeof of the value: 5 ms for a shuffle's split of 23 small
    # frames, and it was measured five times per transfer (the result, its store, the
    # serving, the fetch, the fetcher's store)
    tally = Tally()
    a, b = sorted(client.scheduler_info()["workers"])
    made = client.submit(CountsItsMeasures, tally, workers=[a], pure=False)
    used = client.submit(lambda v: v.tally is tally, made, workers=[b], pure=False)
    assert used.result(timeout=10) is True
    assert tally.n == 2
