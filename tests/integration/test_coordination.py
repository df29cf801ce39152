"""Coordination primitives held by the scheduler, written as a dask.distributed user
writes them: Variable, Queue, Lock, Event, Semaphore, Pub/Sub and the dataset methods,
used from the client and from tasks (through the worker's client), on both cluster
kinds (the shared ``cluster`` fixture: two workers of one thread each)."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest

import shoal
from shoal import Event, Lock, Pub, Queue, Semaphore, Sub, Variable
from shoal.testing import wait_for
from shoal_helpers import start_scheduler

pytestmark = pytest.mark.timeout(60)


def inc(x: int) -> int:
    return x + 1


def wanted_by(cluster: shoal.LocalCluster, key: object) -> set[str]:
    ts = cluster.scheduler.state.tasks.get(key)
    return set() if ts is None else set(ts.who_wants)


def forgotten(cluster: shoal.LocalCluster, key: object) -> bool:
    return key not in cluster.scheduler.state.tasks


# -- tasks (module level: they travel to worker processes by reference)


def locked_increment(i: int) -> int:
    with Lock("counter-lock"):
        counter = Variable("counter")
        counter.set(counter.get() + 1)
    return i


def put_in(q: Queue, value: int) -> None:
    q.put(value)


def set_variable(name: str, value: object) -> None:
    Variable(name).set(value)


def read_future_of_variable(name: str) -> int:
    # a future read inside a task is bound to the worker's client
    return Variable(name).get(timeout=10).result(timeout=10) + 1


def wait_for_event(name: str) -> bool:
    return Event(name).wait(timeout=30)


def leases_seen(sem: Semaphore) -> int:
    with sem:
        return sem.get_value()


def publish(name: str, msg: object) -> None:
    Pub(name).put(msg)


def share_futures(name: str, n: int) -> int:
    # futures of the worker's client, shared and dropped at once: the queue and the
    # variable keep them alive (their graphs reach the scheduler before the requests)
    client = shoal.get_client()
    q = Queue(name)
    for i in range(n):
        q.put(client.submit(inc, i, pure=False))
    Variable(name).set(client.submit(inc, 100, pure=False))
    return n


# -- Variable


def test_variable_set_get_delete(client):
    x = Variable("x")
    x.set(123)
    assert x.get() == 123
    assert Variable("x").get() == 123  # the same name is the same variable
    x.set({"a": [1, 2]})
    assert Variable("x").get(timeout=1) == {"a": [1, 2]}
    x.delete()
    with pytest.raises(TimeoutError):
        x.get(timeout=0.05)


def test_variable_get_times_out_with_timeout_error(client):
    with pytest.raises(TimeoutError):
        Variable("never-set").get(timeout=0.05)
    with pytest.raises(TimeoutError):
        Variable("never-set").get(timeout="20ms")


def test_variable_get_waits_until_a_task_sets_it(client):
    future = client.submit(set_variable, "set-by-a-task", 42)
    assert Variable("set-by-a-task").get(timeout=10) == 42
    future.result(timeout=10)


def test_variable_keeps_a_future_alive_after_the_client_released_it(client, cluster):
    future = client.submit(inc, 1, key="inc-held-by-variable")
    v = Variable("holds-a-future")
    v.set(future)
    key = future.key
    del future
    gc.collect()
    wait_for(lambda: client.id not in wanted_by(cluster, key), what="the client's release")
    assert cluster.scheduler.state.tasks[key].state in ("waiting", "queued", "processing", "memory")
    again = v.get()
    assert isinstance(again, shoal.Future) and again.client is client
    assert again.result(timeout=10) == 2
    del again
    v.delete()
    wait_for(lambda: forgotten(cluster, key), what="the key to be forgotten after delete")


def test_variable_future_read_by_another_client_and_by_a_task(client, cluster):
    v = Variable("shared-future")
    v.set(client.submit(inc, 10))
    with shoal.Client(cluster, set_as_default=False) as other:
        f = Variable("shared-future", client=other).get(timeout=10)
        assert f.client is other
        assert f.result(timeout=10) == 11
    assert client.submit(read_future_of_variable, "shared-future").result(timeout=20) == 12
    v.delete()


def test_variable_set_from_a_task_and_read_in_another(client):
    client.submit(set_variable, "from-task", [1, 2, 3]).result(timeout=10)
    assert Variable("from-task").get(timeout=5) == [1, 2, 3]


def test_futures_a_task_submits_and_shares(client):
    assert client.submit(share_futures, "shared-by-a-task", 10).result(timeout=20) == 10
    futures = Queue("shared-by-a-task").get(batch=10, timeout=10)
    assert all(f.client is client for f in futures)
    assert sorted(client.gather(futures)) == list(range(1, 11))
    assert Variable("shared-by-a-task").get(timeout=10).result(timeout=10) == 101


# -- Queue


def test_queue_put_get_batches_and_qsize(client):
    q = Queue("numbers")
    for i in range(5):
        q.put(i)
    assert q.qsize() == 5
    assert q.get() == 0
    assert q.get(batch=2) == [1, 2]
    assert q.get(batch=True) == [3, 4]
    assert q.get(batch=True) == []
    assert Queue("numbers").qsize() == 0


def test_queue_fed_by_tasks(client):
    q = Queue("fed-by-tasks")
    futures = client.map(put_in, [q] * 6, range(6))
    assert sorted(q.get(batch=6, timeout=20)) == list(range(6))
    client.gather(futures)


def test_queue_get_and_put_time_out(client):
    q = Queue("small", maxsize=1)
    with pytest.raises(TimeoutError):
        q.get(timeout=0.05)
    with pytest.raises(TimeoutError):
        q.get(batch=2, timeout=0.05)
    q.put("a")
    with pytest.raises(TimeoutError):
        q.put("b", timeout=0.05)  # full
    assert q.get(timeout=1) == "a"
    q.put("b", timeout=1)
    assert q.get(batch=True) == ["b"]
    with pytest.raises(ValueError):
        q.get(batch=-1)


def test_queue_keeps_futures_alive_until_taken(client, cluster):
    q = Queue("futures")
    futures = [client.submit(inc, i, key=f"inc-queued-{i}") for i in range(3)]
    for f in futures:
        q.put(f)
    keys = [f.key for f in futures]
    del f, futures
    gc.collect()
    wait_for(lambda: all(client.id not in wanted_by(cluster, k) for k in keys), what="the client's releases")
    assert not any(forgotten(cluster, k) for k in keys)
    first = q.get(timeout=5)
    assert first.result(timeout=10) == 1
    rest = q.get(batch=True)
    assert [f.result(timeout=10) for f in rest] == [2, 3]
    del first, rest
    gc.collect()
    wait_for(lambda: all(forgotten(cluster, k) for k in keys), what="taken futures to be forgotten once dropped")


# -- Lock


def test_a_lock_serializes_tasks_on_all_workers(client):
    Variable("counter").set(0)
    futures = client.map(locked_increment, range(10))
    assert client.gather(futures) == list(range(10))
    assert Variable("counter").get() == 10
    assert not Lock("counter-lock").locked()


def test_lock_acquire_release_and_errors(client):
    lock = Lock("errors-lock")
    assert lock.acquire()
    assert lock.locked()
    other = Lock("errors-lock")
    assert other.acquire(blocking=False) is False
    assert other.acquire(timeout=0.05) is False
    with pytest.raises(RuntimeError, match="Released too often"):
        other.release()  # it holds nothing
    with pytest.raises(ValueError, match="timeout"):
        other.acquire(blocking=False, timeout=1)
    lock.release()
    assert not lock.locked()
    with pytest.raises(RuntimeError, match="Released too often"):
        lock.release()
    with Lock("errors-lock") as held:
        assert held.locked()
    assert not lock.locked()


def test_a_lock_passed_to_a_task(client):
    def locked_in_task(lock: Lock) -> bool:
        with lock:
            return lock.locked()

    assert client.submit(locked_in_task, Lock("passed")).result(timeout=20) is True
    assert not Lock("passed").locked()


# -- Event


def test_event_set_clear_wait(client):
    ev = Event("go")
    assert not ev.is_set()
    assert ev.wait(timeout=0.05) is False
    waiting = client.submit(wait_for_event, "go")
    ev.set()
    assert waiting.result(timeout=30) is True
    assert ev.is_set() and ev.wait() is True
    ev.clear()
    assert not Event("go").is_set()
    assert Event("go").wait(timeout=0.05) is False


# -- Semaphore


def test_semaphore_leases(client):
    sem = Semaphore(max_leases=2, name="two")
    assert sem.acquire() and sem.acquire()
    assert sem.get_value() == 2
    assert sem.acquire(timeout=0.05) is False
    assert sem.release() is True
    assert sem.get_value() == 1
    sem.release()
    with pytest.raises(RuntimeError, match="Released too often"):
        sem.release()
    with pytest.raises(ValueError, match="Inconsistent max leases"):
        Semaphore(max_leases=3, name="two").acquire()
    with pytest.raises(ValueError):
        Semaphore(max_leases=0)


def test_a_semaphore_limits_tasks(client):
    sem = Semaphore(max_leases=1, name="one-at-a-time")
    assert client.gather(client.map(leases_seen, [sem] * 6)) == [1] * 6
    assert sem.get_value() == 0


def test_leases_of_a_closed_client_are_released(client, cluster):
    other = shoal.Client(cluster, set_as_default=False)
    try:
        assert Semaphore(1, name="closed-holder", client=other).acquire()
        assert Lock("closed-lock", client=other).acquire()
    finally:
        other.close()
    assert Semaphore(1, name="closed-holder").acquire(timeout=10)
    assert Lock("closed-lock").acquire(timeout=10)


def test_leases_of_a_client_whose_connection_broke_are_released(client, cluster):
    other = shoal.Client(cluster, set_as_default=False)
    try:
        assert Lock("broken-lock", client=other).acquire()
        assert Lock("broken-lock").acquire(blocking=False) is False
        # the connection breaks, as when the client's process dies: the scheduler sees
        # its stream end without a close
        other.loop.call_soon_threadsafe(other._comm.abort)
        assert Lock("broken-lock").acquire(timeout=10)
    finally:
        other.close()


_HOLDER = """
import sys
import shoal
client = shoal.Client(sys.argv[1], set_as_default=False)
assert shoal.Semaphore(1, name="held-by-a-dead-process", client=client).acquire(timeout=10)
print("acquired", flush=True)
sys.stdin.read()
"""


def test_the_lease_of_a_killed_client_process_is_released(processes):
    _, address = start_scheduler(processes)
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, address], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    processes.append(holder)
    assert holder.stdout.readline().strip() == "acquired"
    with shoal.Client(address, set_as_default=False) as c:
        sem = Semaphore(1, name="held-by-a-dead-process", client=c)
        assert sem.get_value() == 1
        holder.kill()
        holder.wait(10)
        assert sem.acquire(timeout=20)
        sem.release()


def test_a_lease_needs_a_connected_client(client):
    with pytest.raises(ValueError, match="connected"):
        client._sync(client._scheduler_rpc().semaphore_acquire, name="nobody", max_leases=1, lease="l",
                     client="client-that-does-not-exist", timeout=0)


# -- Pub/Sub


def test_pub_sub_reaches_every_subscriber(client):
    sub = Sub("news")
    futures = client.map(publish, ["news"] * 4, range(4))
    client.gather(futures)
    assert sorted(sub.get(timeout=10) for _ in range(4)) == [0, 1, 2, 3]
    late = Sub("news")  # messages published from now on
    pub = Pub("news")
    pub.put("hello")
    pub.put({"n": 1})
    assert sub.get(timeout=10) == "hello"
    assert late.get(timeout=10) == "hello"
    for msg in late:
        assert msg == {"n": 1}
        break
    assert sub.get(timeout=10) == {"n": 1}
    with pytest.raises(TimeoutError):
        sub.get(timeout=0.05)


# -- datasets


def test_publish_get_list_unpublish(client):
    future = client.submit(inc, 1)
    client.publish_dataset(one=future, two=[1, 2])
    client.publish_dataset(future, name="three")
    client.publish_dataset({"four": "value"})
    assert client.list_datasets() == ["four", "one", "three", "two"]
    assert client.get_dataset("one").result(timeout=10) == 2
    assert client.get_dataset(["two", "four"]) == [[1, 2], "value"]
    with pytest.raises(KeyError, match="already exists"):
        client.publish_dataset(two=[3])
    client.publish_dataset(two=[3], override=True)
    assert client.datasets["two"] == [3]
    with pytest.raises(KeyError):
        client.get_dataset("missing")
    assert client.get_dataset("missing", default=None) is None
    client.unpublish_dataset("one")
    del client.datasets["four"]
    client.unpublish_dataset(["two", "three", "never-published"])
    assert client.list_datasets() == []
    assert len(client.datasets) == 0


def test_a_dataset_keeps_futures_alive_after_its_publisher_left(client, cluster):
    with shoal.Client(cluster, set_as_default=False) as publisher:
        publisher.publish_dataset(answer=publisher.submit(inc, 41, key="inc-published"))
    assert "inc-published" in cluster.scheduler.state.tasks
    got = client.get_dataset("answer")
    assert got.client is client
    assert got.result(timeout=10) == 42
    del got
    client.unpublish_dataset("answer")
    gc.collect()
    wait_for(lambda: forgotten(cluster, "inc-published"), what="the key to be forgotten after unpublish")


def test_a_persisted_collection_outlives_its_publisher(cluster):
    import dask.array as da

    with shoal.Client(cluster) as publisher:
        x = publisher.persist(da.arange(100, chunks=10))
        publisher.publish_dataset(x=x)
        del x
    with shoal.Client(cluster) as reader:
        y = reader.get_dataset("x")
        assert int(y.sum().compute()) == sum(range(100))
        reader.unpublish_dataset("x")


# -- asynchronous clients


async def test_primitives_on_an_asynchronous_client(cluster):
    async with shoal.Client(cluster.scheduler_address, asynchronous=True, set_as_default=False) as c:
        v = Variable("async-variable", client=c)
        await v.set(1)
        assert await v.get() == 1
        await v.set(c.submit(inc, 1))
        assert await (await v.get()) == 2
        await v.delete()
        q = Queue("async-queue", client=c)
        await q.put(5)
        assert await q.qsize() == 1
        assert await q.get(timeout=5) == 5
        with pytest.raises(TimeoutError):
            await q.get(timeout=0.05)
        lock = Lock("async-lock", client=c)
        async with lock:
            assert await lock.locked()
        assert not await lock.locked()
        ev = Event("async-event", client=c)
        await ev.set()
        assert await ev.wait(timeout=1)
        sub = Sub("async-channel", client=c)
        Pub("async-channel", client=c).put("m")
        assert await sub.get(timeout=5) == "m"
        await c.publish_dataset(d=c.submit(inc, 2))
        assert await c.list_datasets() == ["d"]
        assert await (await c.get_dataset("d")) == 3
        await c.unpublish_dataset("d")


def test_primitives_pickle_by_name():
    import pickle

    lock = pickle.loads(pickle.dumps(Lock("by-name")))
    assert isinstance(lock, Lock) and lock.name == "by-name"
    q = pickle.loads(pickle.dumps(Queue("q", maxsize=3)))
    assert (q.name, q.maxsize) == ("q", 3)
    sem = pickle.loads(pickle.dumps(Semaphore(4, name="s")))
    assert (sem.name, sem.max_leases) == ("s", 4)
