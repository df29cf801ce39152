"""The dask.distributed API as dask users write it, on both cluster kinds: the default
client, persisted collections, the reserved keywords of submit/map, priorities,
annotations and errors at submit. Only the import differs from dask's docs."""

from __future__ import annotations

import concurrent.futures
import fcntl
import os
import threading

import dask
import dask.array as da
import dask.bag as db
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest

import shoal
from shoal import Client, LocalCluster


def ran_on(cluster: LocalCluster, key_prefix: str) -> bool:
    """Whether the cluster's scheduler saw a task whose key starts with ``key_prefix``."""
    for key, *_ in cluster.scheduler.state.log.transitions:
        name = key[0] if isinstance(key, tuple) else key
        if isinstance(name, str) and name.startswith(key_prefix):
            return True
    return False


# -------------------------------------------------------------------- default client


def test_compute_inside_with_client_runs_on_the_cluster(cluster):
    with Client(cluster):
        x = da.arange(1000, chunks=100)
        assert int(x.sum().compute()) == 499500
        assert ran_on(cluster, "sum-")
        (total,) = dask.compute(x.mean())
        assert float(total) == 499.5
        df = dd.from_pandas(pd.DataFrame({"a": range(100)}), npartitions=4)
        assert list(df.head(3)["a"]) == [0, 1, 2]


def test_closing_the_client_restores_the_scheduler_before_it(cluster):
    before = dask.config.get("scheduler", None)
    with Client(cluster) as client:
        assert dask.config.get("scheduler") == client.get
        with Client(cluster) as inner:
            assert shoal.get_client() is inner
        assert shoal.get_client() is client
        assert dask.config.get("scheduler") == client.get
    assert dask.config.get("scheduler", None) == before
    with pytest.raises(ValueError, match="No clients"):
        shoal.get_client()


def test_set_as_default_false_leaves_dask_alone(cluster):
    before = dask.config.get("scheduler", None)
    with Client(cluster, set_as_default=False):
        assert dask.config.get("scheduler", None) == before
        with pytest.raises(ValueError):
            shoal.get_client()


def test_dask_persist_goes_through_the_default_client(cluster):
    with Client(cluster) as client:
        x = da.ones((100, 100), chunks=(10, 10))
        (y,) = dask.persist(x)
        futures = [v for v in dict(y.__dask_graph__()).values() if isinstance(v, shoal.Future)]
        assert len(futures) == 100 and all(f.client is client for f in futures)
        assert float(y.sum().compute()) == 10000.0


# ---------------------------------------------------------- persisted collections


def test_a_persisted_array_is_what_later_graphs_build_on(client):
    x = da.random.default_rng(0).random((200, 200), chunks=(50, 50))
    y = client.persist(x)
    assert np.allclose(y.sum().compute(), x.sum().compute(scheduler="sync"))
    assert np.allclose(client.compute((y + 1).mean(axis=0)).result(), (x + 1).mean(axis=0).compute(scheduler="sync"))


def test_a_persisted_dataframe_bag_and_delayed(client):
    pdf = pd.DataFrame({"a": np.arange(100), "b": np.arange(100) % 3})
    df = client.persist(dd.from_pandas(pdf, npartitions=4))
    assert df.groupby("b").a.sum().compute().to_dict() == pdf.groupby("b").a.sum().to_dict()
    bag = client.persist(db.from_sequence(range(20), npartitions=4).map(lambda v: v * 2))
    assert bag.sum().compute() == 380
    d = client.persist(dask.delayed(sum)([1, 2, 3]))
    assert (d + 1).compute() == 7


def test_compute_with_sync_returns_the_results(client):
    x = da.arange(10, chunks=5)
    assert list(client.compute([x.sum(), x.max()], sync=True)) == [45, 9]


# ------------------------------------------------------------- reserved keywords


def kwargs_of(*args, **kwargs):
    return kwargs


def test_reserved_keywords_never_reach_the_function(client):
    workers = list(client.scheduler_info()["workers"])
    f = client.submit(kwargs_of, 1, key="reserved-1", workers=workers, allow_other_workers=True, resources=None,
                      retries=1, priority=3, pure=False, fifo_timeout="1s", user=5)
    assert f.result() == {"user": 5}
    fs = client.map(kwargs_of, [1, 2, 3], priority=2, retries=0, batch_size=2, resources={}, fifo_timeout=0,
                    allow_other_workers=False, pure=True, user=1)
    assert client.gather(fs) == [{"user": 1}] * 3


def test_map_sends_batches_of_batch_size(client):
    fs = client.map(lambda v: v + 1, range(7), batch_size=3)
    assert client.gather(fs) == list(range(1, 8))


def test_bad_options_fail_at_submit(client):
    with pytest.raises(TypeError, match="priority"):
        client.submit(kwargs_of, priority="high")
    with pytest.raises(ValueError, match="resources"):
        client.submit(kwargs_of, resources={"GPU": -1})
    with pytest.raises(TypeError, match="resources"):
        client.submit(kwargs_of, resources=["GPU"])
    with pytest.raises(ValueError, match="allow_other_workers"):
        client.submit(kwargs_of, allow_other_workers=True)
    with pytest.raises(TypeError, match="workers"):
        client.submit(kwargs_of, workers=[1, 2])
    with pytest.raises(ValueError, match="batch_size"):
        client.map(kwargs_of, [1], batch_size=0)
    assert client.submit(kwargs_of, 1).result() == {}  # the client carries on


def test_workers_may_be_a_worker_name(cluster, client):
    info = client.scheduler_info()["workers"]
    address, meta = sorted(info.items())[0]
    f = client.submit(lambda: shoal.get_worker().address if hasattr(shoal, "get_worker") else None,
                      workers=meta["name"], pure=False)
    assert f.result() in (address, None)
    assert address in client.who_has(f)[f.key]


# ------------------------------------------------------------------- priorities


def _gate(path: str, started: str | None = None) -> None:
    """Block until the test releases its exclusive lock on ``path`` (having created
    ``started``, if given, to say it runs)."""
    if started is not None:
        open(started, "w").close()
    with open(path) as fh:
        fcntl.flock(fh, fcntl.LOCK_SH)
        fcntl.flock(fh, fcntl.LOCK_UN)


def _record(path: str, name: str) -> str:
    with open(path, "a") as fh:
        fh.write(name + "\n")
    return name


@pytest.mark.parametrize("processes", [False, True], ids=["threads", "processes"])
def test_higher_priority_first_and_ties_in_submission_order(tmp_path, processes):
    gate, log = str(tmp_path / "gate"), str(tmp_path / "log")
    open(gate, "w").close()
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=processes) as cluster, Client(cluster) as client:
        with open(gate) as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            started = str(tmp_path / "started")
            blocker = client.submit(_gate, gate, started, pure=False)
            wait_until(lambda: os.path.exists(started))  # the one thread is taken
            order = [("low-a", 0), ("high", 10), ("low-b", 0), ("mid", 5), ("low-c", 0), ("top", 20)]
            tasks = []
            for name, p in order:  # one graph: the scheduler has them all at once
                with dask.annotate(priority=p):
                    tasks.append(dask.delayed(_record, pure=True)(log, name, dask_key_name=name))
            futures = client.compute(tasks, optimize_graph=False)
            names = {name for name, _ in order}
            wait_until(lambda: names <= cluster.scheduler.state.tasks.keys())
            fcntl.flock(held, fcntl.LOCK_UN)
        client.gather([blocker, *futures])
    with open(log) as fh:
        assert fh.read().split() == ["top", "high", "mid", "low-a", "low-b", "low-c"]


def submitted(cluster: LocalCluster, since: int = 0) -> dict:
    """``{key: NewTask}`` of the graphs the cluster's scheduler took (from its log),
    after its first ``since`` events."""
    from shoal.scheduler.state import UpdateGraphEvent

    events = list(cluster.scheduler.state.log.events)[since:]
    return {t.key: t for ev in events if isinstance(ev, UpdateGraphEvent) for t in ev.tasks}


def test_dask_annotate_reaches_the_scheduler(cluster, client):
    with dask.annotate(priority=7, retries=2, resources={"CPU": 0, "unused": 0}):
        v = dask.delayed(lambda a: a + 1, pure=True)(1, dask_key_name="annotated-inc")
    w = dask.delayed(lambda a: a * 2)(v, dask_key_name="plain-double")
    assert client.compute(w, optimize_graph=False).result() == 4
    tasks = submitted(cluster)
    assert (tasks["annotated-inc"].priority, tasks["annotated-inc"].retries) == (7, 2)
    assert tasks["annotated-inc"].resources is None  # asking for none of a resource restricts nothing
    assert (tasks["plain-double"].priority, tasks["plain-double"].retries) == (0, 0)


def test_a_big_graph_goes_in_parts_and_leaves_only_its_result(cluster, client, monkeypatch):
    """A graph of more than ``GRAPH_CHUNK`` tasks reaches the scheduler as several
    update-graphs; the values later parts need are kept until those parts arrive, and
    released after: once the result is in, the scheduler holds no other value, and
    once it is released, nothing."""
    from shoal.client import graphs
    from shoal.scheduler.state import UpdateGraphEvent

    monkeypatch.setattr(graphs, "GRAPH_CHUNK", 40)
    since = len(cluster.scheduler.state.log.events)
    x = da.ones(300, chunks=1)
    total = client.compute((x + 1).sum(split_every=4))
    assert int(total.result()) == 600
    parts = [ev for ev in list(cluster.scheduler.state.log.events)[since:]
             if isinstance(ev, UpdateGraphEvent) and ev.tasks]
    assert len(parts) >= 5 and all(len(ev.tasks) >= 40 for ev in parts[:-1])
    assert parts[-1].wanted[0] == total.key
    state = cluster.scheduler.state
    keys = {t.key for ev in parts for t in ev.tasks}

    def held() -> set:
        return {k for k in keys if (ts := state.tasks.get(k)) is not None and (ts.state == "memory" or ts.who_wants)}

    wait_until(lambda: held() == {total.key})
    total.release()
    wait_until(lambda: not keys & state.tasks.keys())


def test_call_options_and_context_apply_to_every_task(cluster, client):
    since = len(cluster.scheduler.state.log.events)
    with dask.annotate(retries=1):
        x = da.arange(10, chunks=5) + 1
        assert int(client.compute(x.sum(), priority=4).result()) == 55
        f = client.submit(kwargs_of, key="annotated-submit")
        assert f.result() == {}
    tasks = submitted(cluster, since)
    sums = [t for k, t in tasks.items() if isinstance(k, tuple) and str(k[0]).startswith("sum-")]
    assert sums and all((t.priority, t.retries) == (4, 1) for t in sums)
    assert tasks["annotated-submit"].retries == 1


# ---------------------------------------------------------------- errors at submit


def test_an_argument_that_cannot_travel_fails_at_submit(cluster, client):
    lock = threading.Lock()
    if cluster.processes:
        with pytest.raises(TypeError, match=r"args\[0\].*lock"):
            client.submit(lambda v: v, lock)
        with pytest.raises(shoal.SerializationError, match="kwargs"):
            client.submit(kwargs_of, handle=lock)
    else:  # in one process nothing is pickled: the lock itself reaches the task
        assert client.submit(lambda v: v is lock, lock).result() is True
    assert client.submit(lambda v: v + 1, 1).result() == 2


def test_cancelled_error_is_the_concurrent_futures_one(client):
    f = client.submit(_gate, "/nonexistent-never-read", pure=False, resources={"NOWHERE": 1})
    f.cancel()
    with pytest.raises(concurrent.futures.CancelledError):
        f.result(timeout=10)
    assert issubclass(shoal.CancelledError, concurrent.futures.CancelledError)


def wait_until(predicate, timeout: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        threading.Event().wait(0.005)





def test_fire_and_forget_runs_to_the_end_without_a_future(cluster, client, tmp_path):
    path = str(tmp_path / "side-effect")
    gate = str(tmp_path / "gate")
    open(gate, "w").close()
    with open(gate) as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        blocker = client.submit(_gate, gate, pure=False)
        f = client.submit(_record, path, "done", key="forgotten-but-run", pure=False)
        g = client.submit(lambda _, __: None, f, blocker, pure=False)
        shoal.fire_and_forget(g)
        shoal.fire_and_forget([f])
        wait_until(lambda: "forgotten-but-run" in cluster.scheduler.state.tasks)
        del f, g
        fcntl.flock(held, fcntl.LOCK_UN)
    blocker.result()
    wait_until(lambda: os.path.exists(path) and "forgotten-but-run" not in cluster.scheduler.state.tasks)
    with open(path) as fh:
        assert fh.read() == "done\n"


# ------------------------------------------------------------- scheduler plugins


class Recorder(shoal.SchedulerPlugin):
    name = "recorder"

    def __init__(self):
        self.events = []
        self.transitions = []

    async def start(self, scheduler):
        self.events.append(("start", scheduler.address))

    def update_graph(self, scheduler, *, client, keys, tasks, **kwargs):
        self.events.append(("update_graph", sorted(map(str, keys))))

    def transition(self, key, start, finish, *args, **kwargs):
        self.transitions.append((key, start, finish))

    def close(self):
        self.events.append(("close",))


class Broken(shoal.SchedulerPlugin):
    def transition(self, key, start, finish, *args, **kwargs):
        raise RuntimeError("a plugin that fails")


def test_a_scheduler_plugin_sees_graphs_and_transitions(cluster, client, caplog):
    plugin = Recorder()
    client.register_plugin(plugin)
    client.register_plugin(Broken(), name="broken")
    assert client.submit(lambda: 1, key="plugin-seen").result() == 1
    assert ("update_graph", ["plugin-seen"]) in plugin.events
    assert ("plugin-seen", "processing", "memory") in plugin.transitions
    assert plugin.events[0] == ("start", cluster.scheduler.address)
    assert "a plugin that fails" in caplog.text  # logged; the scheduler carried on
    client.unregister_scheduler_plugin("recorder")
    client.unregister_scheduler_plugin("broken")
    assert plugin.events[-1] == ("close",)
    with pytest.raises(KeyError):
        client.unregister_scheduler_plugin("recorder")


def test_a_scheduler_plugin_needs_the_scheduler_in_this_process(processes):
    from shoal_helpers import start_scheduler

    _, address = start_scheduler(processes)
    with Client(address) as client:
        with pytest.raises(ValueError, match="another"):
            client.register_plugin(Recorder())
        with pytest.raises(TypeError, match="SchedulerPlugin or a WorkerPlugin"):
            client.register_plugin(object())


# ------------------------------------------------------------ futures in objects


class Box:
    def __init__(self, future):
        self.future = future


def open_box(box):
    return box.future.result() + 1


def test_a_future_inside_any_object_is_usable_in_a_task(client):
    inner = client.submit(lambda: 41, key="boxed-value")
    box = Box(inner)
    assert client.submit(open_box, box, pure=False).result(timeout=30) == 42


# ------------------------------------------------------------------------ actors


class Counter:
    n = 0

    def __init__(self, start=0):
        self.n = start
        self.calls = []

    def increment(self, by=1):
        self.n += by
        self.calls.append(by)
        return self.n

    def fail(self):
        raise ZeroDivisionError("from the actor")

    def where(self):
        import os

        return os.getpid()


def test_an_actor_lives_on_one_worker_and_runs_its_calls_in_order(cluster, client):
    future = client.submit(Counter, 10, actor=True)
    counter = future.result()
    assert isinstance(counter, shoal.Actor)
    futures = [counter.increment(i) for i in range(1, 21)]
    assert [f.result(timeout=30) for f in futures] == [10 + sum(range(1, i + 1)) for i in range(1, 21)]
    assert counter.n == 220
    assert counter.calls == list(range(1, 21))
    pids = {counter.where().result() for _ in range(3)}
    assert len(pids) == 1
    if cluster.processes:
        assert pids != {os.getpid()}
    with pytest.raises(ZeroDivisionError, match="from the actor"):
        counter.fail().result()
    assert counter.increment().result() == 221  # it survived its own exception


def test_an_actor_handle_travels_into_tasks(client):
    counter = client.submit(Counter, actor=True).result()

    def bump(c):
        return c.increment(5).result()

    assert client.submit(bump, counter, pure=False).result(timeout=30) == 5
    assert counter.n == 5


def test_actor_needs_a_class(client):
    with pytest.raises(TypeError, match="class"):
        client.submit(lambda: 1, actor=True)


# ------------------------------------------------------------ small dask idioms


def test_future_cancelled_and_wait_on_a_persisted_collection(client):
    f = client.submit(_gate, "/nonexistent-never-read", pure=False, resources={"NOWHERE": 1})
    assert not f.cancelled()
    f.cancel()
    assert f.cancelled()
    x = client.persist(da.ones(100, chunks=10))
    done, not_done = shoal.wait(x)
    assert len(done) == 10 and not not_done


def test_client_passes_cluster_keywords_to_its_own_cluster():
    with Client(n_workers=1, processes=False, threads_per_worker=2, dashboard_address=":0",
                resources={"GPU": 1}) as client:
        assert client.cluster.dashboard_address == ":0"
        assert client.submit(kwargs_of, resources={"GPU": 1}).result(timeout=30) == {}
        assert list(client.nthreads().values()) == [2]
    with pytest.raises(TypeError, match="n_wrkers"):
        Client(n_wrkers=1, processes=False)


def test_cluster_keywords_with_an_address_are_refused(cluster):
    with pytest.raises(TypeError, match="LocalCluster"):
        Client(cluster.scheduler_address, resources={"GPU": 1})


def test_a_task_in_one_process_submits_what_cannot_be_pickled(cluster, client):
    def submit_a_lock():
        lock = threading.Lock()
        return shoal.get_client().submit(lambda v: v is lock, lock).result(timeout=30)

    if cluster.processes:
        with pytest.raises(shoal.SerializationError, match="lock"):
            client.submit(submit_a_lock, pure=False).result(timeout=30)
    else:  # the task's client shares the process with every worker: nothing is pickled
        assert client.submit(submit_a_lock, pure=False).result(timeout=30) is True


def _compute_inside():
    return float(da.ones(10, chunks=5).sum().compute())


def _wait_on_a_subtask(x):
    return shoal.get_client().submit(lambda v: v + 1, x, pure=False).result(timeout=30)


@pytest.mark.parametrize("processes", [False, True], ids=["threads", "processes"])
def test_a_task_that_waits_on_the_cluster_gives_its_thread_up(processes):
    """On one-thread workers: a task that calls .compute() or waits for a task it
    submitted leaves the thread pool while it waits (no deadlock, no worker_client)."""
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=processes) as cluster, Client(cluster) as client:
        assert client.submit(_compute_inside, pure=False).result(timeout=30) == 10.0
        assert client.gather(client.map(_wait_on_a_subtask, range(3), pure=False)) == [1, 2, 3]
