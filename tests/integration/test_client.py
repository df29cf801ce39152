"""The client API end to end, on an in-process cluster and on one with worker processes."""

from __future__ import annotations

import operator
import threading
import traceback

import numpy as np
import pytest

import shoal
from shoal import protocol
from shoal.errors import GraphError, SerializationError

from shoal.testing import wait_for


def inc(x):
    return x + 1


def add(x, y):
    return x + y


class Unpicklable:
    def __reduce__(self):
        raise RuntimeError("this object refuses to be pickled")


def test_submit_and_result(client):
    f = client.submit(inc, 1)
    assert f.result(timeout=10) == 2
    assert f.status == "finished" and f.done()
    assert f.key.startswith("inc-")
    # pure: same function and arguments, same key
    assert client.submit(inc, 1).key == f.key
    assert client.submit(inc, 1, pure=False).key != f.key


def test_map_gather_keeps_structure(client):
    futures = client.map(inc, range(100))
    assert client.gather(futures) == list(range(1, 101))
    nested = {"a": futures[0], "b": [futures[1], (futures[2],)]}
    assert client.gather(nested) == {"a": 1, "b": [2, (3,)]}
    sums = client.map(add, range(10), range(10))
    assert client.gather(sums) == [2 * i for i in range(10)]


def test_dependencies_nested_in_arguments(client):
    a = client.submit(inc, 1)
    b = client.submit(inc, 2)
    total = client.submit(lambda d: d["x"] + sum(d["ys"]), {"x": a, "ys": [a, b]})
    assert total.result(timeout=10) == 2 + 2 + 3
    chain = a
    for _ in range(20):
        chain = client.submit(inc, chain)
    assert chain.result(timeout=10) == 22


def test_exception_has_type_and_remote_traceback_and_worker_survives(client):
    def fail(x):
        raise ZeroDivisionError(f"no good: {x}")

    f = client.submit(fail, 3)
    with pytest.raises(ZeroDivisionError, match="no good: 3") as info:
        f.result(timeout=10)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "fail" in notes and "traceback on the worker" in notes
    assert f.status == "error"
    assert isinstance(f.exception(), ZeroDivisionError)
    # a traceback object, as dask's: its frames end in the function that raised
    assert "in fail" in "".join(traceback.format_tb(f.traceback()))
    # dependents fail with the same error, and the cluster keeps serving
    g = client.submit(inc, f)
    with pytest.raises(ZeroDivisionError):
        g.result(timeout=10)
    assert client.submit(inc, 41).result(timeout=10) == 42


def test_scheduler_never_deserializes_payloads(client):
    client.gather(client.map(inc, range(20)))
    assert client.scheduler_counters()["payload_deserializations"] == 0


def test_to_serialize_inside_arguments_reaches_the_function_as_the_object(client):
    arr = np.arange(5)
    f = client.submit(lambda d: (type(d["x"]).__name__, int(d["x"].sum())), {"x": protocol.to_serialize(arr)})
    assert f.result(timeout=10) == ("ndarray", 10)


def test_function_deserialized_once_per_worker(client):
    def square(x):
        return x * x

    before = client.run(protocol.function_cache_info)
    futures = client.map(square, range(1000), pure=False)
    assert sum(client.gather(futures)) == sum(i * i for i in range(1000))
    after = client.run(protocol.function_cache_info)
    loaded = {w: after[w]["misses"] - before[w]["misses"] for w in after}
    ran = {w for f in futures for w in client.who_has([f]).get(f.key, [])}
    # every worker that ran a task unpickled `square` at most once (in-process: never)
    assert all(n <= 1 for n in loaded.values()), loaded
    assert ran


def test_scatter_and_use(client):
    [x] = client.scatter([10])
    assert x.status == "finished"
    assert client.submit(inc, x).result(timeout=10) == 11
    d = client.scatter({"k1": 1, "k2": 2})
    assert set(d) == {"k1", "k2"}
    assert client.gather(d) == {"k1": 1, "k2": 2}
    everywhere = client.scatter(np.arange(3), broadcast=True)
    holders = client.who_has([everywhere])[everywhere.key]
    assert sorted(holders) == sorted(client.scheduler_info()["workers"])
    with pytest.raises(ValueError, match="no such worker"):
        client.scatter([1], workers=["tcp://127.0.0.1:1"])


def test_pinned_to_workers(client, cluster):
    for address in cluster.worker_addresses:
        futures = client.map(inc, range(10), workers=[address], pure=False)
        client.gather(futures)
        who = client.who_has(futures)
        assert all(who[f.key] == [address] for f in futures)


def test_unknown_worker_restriction_is_an_error_on_that_task(client):
    f = client.submit(inc, 1, workers=["tcp://127.0.0.1:1"])
    with pytest.raises(ValueError, match="no such worker"):
        f.result(timeout=10)
    assert client.submit(inc, 1, pure=False).result(timeout=10) == 2


def test_run_who_has_scheduler_info(client, cluster):
    info = client.scheduler_info()
    assert info["address"] == cluster.scheduler_address
    assert sorted(info["workers"]) == cluster.worker_addresses
    for w in info["workers"].values():
        assert w["nthreads"] == 1 and isinstance(w["pid"], int) and isinstance(w["host"], str)
    pids = client.run(lambda: __import__("os").getpid())
    assert sorted(pids) == cluster.worker_addresses
    f = client.submit(inc, 5)
    f.result(timeout=10)
    assert client.who_has([f])[f.key][0] in cluster.worker_addresses


def test_release_forgets_the_key(client):
    f = client.submit(inc, 100, pure=False)
    key = f.key
    f.result(timeout=10)
    assert key in client.who_has()
    del f
    wait_for(lambda: key not in client.who_has(), what="the scheduler to forget the key")


def test_bad_inputs(client):
    with pytest.raises(TypeError, match="callable"):
        client.submit(42)
    with pytest.raises(TypeError, match="callable"):
        client.map("nope", [1])
    with pytest.raises(KeyError):
        client.get({"x": 1}, "y")
    with pytest.raises(GraphError, match="cycle"):
        client.get({"a": (inc, "b"), "b": (inc, "a")}, "a")
    with pytest.raises(TypeError, match="key"):
        client.submit(inc, 1, key=object())
    # the cluster goes on
    assert client.submit(inc, 1, pure=False).result(timeout=10) == 2


def test_get_runs_dask_style_graphs(client):
    dsk = {"x": 1, "y": (inc, "x"), "z": (add, "x", "y"), "w": [(inc, "z"), "y"], "alias": "z"}
    assert client.get(dsk, "z") == 3
    assert client.get(dsk, ["w", ["y", "alias"]]) == [[4, 2], [2, 3]]


def test_cancel_and_close_do_not_hang(cluster):
    gate = threading.Event()
    with shoal.Client(cluster) as c:
        if cluster.processes:
            import time

            blocker = c.submit(time.sleep, 3, pure=False)
        else:
            blocker = c.submit(gate.wait, 30, pure=False)
        waiting = c.submit(inc, blocker)
        waiting.cancel()
        wait_for(lambda: waiting.status == "cancelled", what="cancellation")
        with pytest.raises(shoal.CancelledError):
            waiting.result(timeout=10)
        pending = c.submit(inc, blocker)
    # closing with pending work returned; the future is cancelled, not hanging
    assert pending.status == "cancelled"
    gate.set()


def test_wait_as_completed_and_callbacks(client):
    futures = client.map(inc, range(10), pure=False)
    done, not_done = shoal.wait(futures, timeout=10)
    assert len(done) == 10 and not not_done
    seen = [f for f in shoal.as_completed(client.map(inc, range(5), pure=False))]
    assert len(seen) == 5 and all(f.done() for f in seen)
    pairs = list(shoal.as_completed(client.map(inc, range(3), pure=False), with_results=True))
    assert sorted(r for _, r in pairs) == [1, 2, 3]
    called = threading.Event()
    got = []
    f = client.submit(inc, 7, pure=False)
    f.add_done_callback(lambda fut: (got.append(fut.key), called.set()))
    assert called.wait(10) and got == [f.key]


def test_retries(client, tmp_path):
    marker = tmp_path / "attempts"

    def flaky(path):
        n = int(path.read_text()) if path.exists() else 0
        path.write_text(str(n + 1))
        if n < 2:
            raise OSError("transient")
        return n

    assert client.submit(flaky, marker, retries=2, pure=False).result(timeout=10) == 2


def test_large_payload_warns_once(cluster):
    with shoal.Client(cluster) as c:
        big = b"x" * 2_000_000
        with pytest.warns(UserWarning, match="scatter"):
            f = c.submit(len, big)
        assert f.result(timeout=10) == 2_000_000
        # a second large task does not warn again
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert c.submit(len, big + b"y").result(timeout=10) == 2_000_001


def test_operator_functions(client):
    assert client.submit(operator.mul, 6, 7).result(timeout=10) == 42


def test_result_that_cannot_be_serialized_is_a_clear_error(cluster):
    with shoal.Client(cluster) as c:
        f = c.submit(threading.Lock, pure=False)
        if cluster.processes:
            with pytest.raises(SerializationError, match="lock"):
                f.result(timeout=10)
        else:
            assert type(f.result(timeout=10)) is type(threading.Lock())
        assert c.submit(inc, 1, pure=False).result(timeout=10) == 2


def _type_name(value):
    return type(value).__name__


def test_a_task_whose_input_cannot_travel_to_its_worker_errs_clearly(cluster):
    """A value that does not serialize, needed on another worker: the task that needs
    it fails with the reason (it used to be fetched, recomputed and fetched forever)."""
    a, b = cluster.worker_addresses
    with shoal.Client(cluster) as c:
        x = c.submit(threading.Lock, workers=[a], pure=False)
        y = c.submit(_type_name, x, workers=[b])
        if cluster.processes:
            with pytest.raises(SerializationError, match=r"cannot send .* here: .*lock"):
                y.result(timeout=30)
            assert x.status == "finished"  # the value stays where it is, usable there
            assert c.submit(_type_name, x, workers=[a], pure=False).result(timeout=30) == "lock"
        else:
            assert y.result(timeout=30) == "lock"
        assert c.submit(inc, 1, workers=[b], pure=False).result(timeout=10) == 2


def test_small_results_come_back_with_their_report(client):
    """A small value a client waits for travels with task-finished: gathering it asks no worker."""
    before = client.transfer_stats()
    f = client.submit(lambda: {"answer": 42}, pure=False)
    assert f._state is not None and f.result(timeout=10) == {"answer": 42}
    assert f._state.has_value
    after = client.transfer_stats()
    assert {w: s["tcp"] + s["inproc"] for w, s in after.items()} == {w: s["tcp"] + s["inproc"] for w, s in before.items()}
