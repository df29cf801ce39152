"""The dask.distributed Client methods that look at and act on the whole cluster, used
as dask users use them, on both cluster kinds (worker threads in this process, and
worker processes): wait_for_workers, nthreads/ncores, has_what, processing, who_has,
scheduler_info, get_versions, replicate, rebalance, scatter(hash=, direct=),
run_on_scheduler, restart, upload_file, shutdown; Future.traceback(),
gather(errors="skip") and as_completed's batches."""

from __future__ import annotations

import asyncio
import os
import traceback
import types
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shoal
from shoal import CancelledError, as_completed, wait
from shoal.testing import wait_for
from shoal.worker import upload


@pytest.fixture(scope="module", autouse=True)
def no_uploads_left() -> Iterator[None]:
    """Worker processes end without removing their directories of uploaded files: once
    the module's clusters are closed, those of processes that are gone are removed."""
    yield
    upload.remove_stale()


def inc(x: int) -> int:
    return x + 1


def fail_loudly() -> None:
    raise ValueError("boom")


def worker_pid() -> int:
    return os.getpid()


def addresses(client: shoal.Client) -> list[str]:
    return sorted(client.scheduler_info()["workers"])


# -- workers and what they hold


def test_wait_for_workers_nthreads_and_ncores(client: shoal.Client) -> None:
    client.wait_for_workers(2, timeout=10)
    a, b = addresses(client)
    assert client.nthreads() == {a: 1, b: 1}
    assert client.ncores() == client.nthreads()
    assert client.nthreads([a]) == {a: 1}
    assert client.nthreads(a) == {a: 1}
    with pytest.raises(TimeoutError):
        client.wait_for_workers(3, timeout=0.2)
    with pytest.raises(ValueError, match="positive integer"):
        client.wait_for_workers(0)


def test_has_what_who_has_and_processing(client: shoal.Client, cluster: shoal.LocalCluster) -> None:
    futures = client.map(inc, range(4))
    wait(futures)
    has_what = client.has_what()
    assert sorted(has_what) == addresses(client)
    assert all(isinstance(keys, tuple) for keys in has_what.values())
    assert sorted(k for keys in has_what.values() for k in keys) == sorted(f.key for f in futures)
    a = addresses(client)[0]
    assert set(client.has_what([a])) == {a}
    who_has = client.who_has(futures)
    assert set(who_has) == {f.key for f in futures}
    for f in futures:
        assert f.key in has_what[who_has[f.key][0]]
    assert client.processing() == {w: () for w in addresses(client)}

    gate = shoal.Event(f"gate-{uuid.uuid4().hex}")
    blocked = client.submit(lambda: gate.wait(30), pure=False)
    try:
        wait_for(lambda: any(blocked.key in keys for keys in client.processing().values()),
                 what="the task to be processing")
    finally:
        gate.set()
    assert blocked.result(timeout=10) is True


def test_scheduler_info_describes_every_worker(client: shoal.Client) -> None:
    info = client.scheduler_info()
    assert info["type"] == "Scheduler" and info["address"]
    assert info["n_workers"] == 2 and info["total_threads"] == 2
    assert len(info["workers"]) == 2
    names = set()
    for address, worker in info["workers"].items():
        assert worker["nthreads"] == 1
        assert worker["resources"] == {}
        assert worker["status"] == "running"
        assert worker["host"] and worker["pid"]
        names.add(worker["name"])
    assert len(names) == 2
    assert len(client.scheduler_info(n_workers=1)["workers"]) == 1
    assert client.scheduler_info(n_workers=-1) == info


# -- versions


def test_get_versions(client: shoal.Client) -> None:
    versions = client.get_versions(check=True)
    assert sorted(versions) == ["client", "scheduler", "workers"]
    assert sorted(versions["workers"]) == addresses(client)
    for part in [versions["client"], versions["scheduler"], *versions["workers"].values()]:
        assert part["host"]["python"] == part["packages"]["python"]
        for name in ("python", "shoal", "msgpack", "msgspec", "cloudpickle", "numpy", "dask"):
            assert part["packages"][name] == versions["client"]["packages"][name]
    assert versions["client"]["packages"]["shoal"] == shoal.__version__
    extra = client.get_versions(packages=["pytest", "surely-no-such-package"])
    assert extra["client"]["packages"]["pytest"] == pytest.__version__
    assert extra["workers"][addresses(client)[0]]["packages"]["surely-no-such-package"] is None


def test_get_versions_warns_or_raises_on_a_mismatch(client: shoal.Client, cluster: shoal.LocalCluster,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # a scheduler of another msgspec: what the scheduler reports of itself is changed
    ops = cluster.scheduler.ops  # type: ignore[union-attr]

    def versions(comm: Any, packages: list[str] | None = None) -> dict[str, Any]:
        found = ops.versions(comm, packages)
        found["packages"]["msgspec"] = "0.0.1"
        return found

    monkeypatch.setitem(cluster.scheduler.server.handlers, "versions", versions)  # type: ignore[union-attr]
    with pytest.warns(UserWarning, match="msgspec"):
        found = client.get_versions()
    assert found["scheduler"]["packages"]["msgspec"] == "0.0.1"
    with pytest.raises(ValueError, match="msgspec"):
        client.get_versions(check=True)


# -- copies of values


def test_replicate_onto_every_worker_and_back_to_one(client: shoal.Client) -> None:
    x = client.submit(inc, 41)
    assert x.result() == 42
    client.replicate([x])
    assert sorted(client.who_has([x])[x.key]) == addresses(client)
    assert client.submit(inc, x, workers=[addresses(client)[1]]).result() == 43
    client.replicate([x], n=1)
    assert len(client.who_has([x])[x.key]) == 1
    assert x.result() == 42
    with pytest.raises(ValueError, match="delete"):
        client.replicate([x], n=0)


def test_replicate_onto_chosen_workers(client: shoal.Client) -> None:
    a, b = addresses(client)
    [y] = client.scatter([np.arange(1000)], workers=[a])
    client.replicate(y, workers=[b])
    assert sorted(client.who_has([y])[y.key]) == [a, b]
    assert client.submit(lambda v: int(v.sum()), y, workers=[b]).result() == 499500
    with pytest.raises(ValueError, match="no such worker"):
        client.replicate(y, workers=["tcp://127.0.0.1:1"])


def test_rebalance_evens_out_the_bytes_held(client: shoal.Client) -> None:
    a, b = addresses(client)
    arrays = [np.full(10_000, i) for i in range(10)]
    futures = client.scatter(arrays, workers=[a])
    mine = {f.key for f in futures}
    assert {k for k in client.has_what()[b] if k in mine} == set()
    client.rebalance(futures)
    held = client.has_what()
    assert sum(k in mine for k in held[a]) == 5 and sum(k in mine for k in held[b]) == 5
    # each value lives on one worker: copied, then the old copy dropped
    assert all(len(holders) == 1 for holders in client.who_has(futures).values())
    got = client.gather(futures)
    assert all(np.array_equal(g, arr) for g, arr in zip(got, arrays))
    assert client.submit(lambda *vs: sum(int(v[0]) for v in vs), *futures).result() == 45
    client.rebalance()  # everything: nothing is lost either
    assert all(np.array_equal(g, arr) for g, arr in zip(client.gather(futures), arrays))


def test_scatter_with_hash_false_and_direct(client: shoal.Client) -> None:
    same = client.scatter([7, 7])
    assert same[0].key == same[1].key
    fresh = client.scatter([7, 7], hash=False)
    assert fresh[0].key != fresh[1].key != same[0].key
    assert client.gather(fresh) == [7, 7]
    assert client.scatter(5, direct=True).result() == 5
    assert client.scatter({"k": 1}, hash=False, direct=False)["k"].result() == 1


# -- the scheduler in this process


def test_run_on_scheduler(client: shoal.Client) -> None:
    def n_workers(dask_scheduler: Any) -> int:
        return len(dask_scheduler.state.workers)

    async def on_its_loop(dask_scheduler: Any = None) -> bool:
        await asyncio.sleep(0)
        return asyncio.get_running_loop() is dask_scheduler.loop

    assert client.run_on_scheduler(n_workers) == 2
    assert client.run_on_scheduler(on_its_loop) is True
    assert client.run_on_scheduler(lambda x, y=0: x + y, 1, y=2) == 3
    with pytest.raises(ZeroDivisionError):
        client.run_on_scheduler(lambda: 1 / 0)
    assert client.submit(inc, 1).result() == 2  # and the cluster goes on


def test_run_on_scheduler_elsewhere_says_what_to_use(cluster: shoal.LocalCluster) -> None:
    with shoal.Client(cluster.scheduler_address, set_as_default=False) as remote:
        with pytest.raises(NotImplementedError, match=r"client\.run"):
            remote.run_on_scheduler(lambda: 1)
        assert remote.submit(inc, 2).result() == 3


# -- restart


def test_restart_starts_new_workers_and_cancels_every_future(client: shoal.Client,
                                                            cluster: shoal.LocalCluster) -> None:
    futures = client.map(inc, range(3))
    wait(futures)
    names = {w["name"] for w in client.scheduler_info()["workers"].values()}
    pids = client.run(worker_pid)
    objects = set(map(id, cluster.workers.values()))
    with shoal.Client(cluster, set_as_default=False) as other:
        theirs = other.submit(inc, 100)
        assert theirs.result() == 101
        client.restart()
        wait_for(lambda: theirs.status == "cancelled", what="the other client's future to be cancelled")
        with pytest.raises(CancelledError):
            theirs.result()
    for f in futures:
        assert f.status == "cancelled"
        with pytest.raises(CancelledError):
            f.result()
    info = client.scheduler_info()
    assert len(info["workers"]) == 2
    assert {w["name"] for w in info["workers"].values()} == names
    if cluster.processes:
        assert set(client.run(worker_pid).values()).isdisjoint(pids.values())
    else:
        assert set(map(id, cluster.workers.values())).isdisjoint(objects)
    assert client.submit(inc, 0).result() == 1  # the same key as before, computed afresh
    assert client.gather(client.map(inc, range(3))) == [1, 2, 3]


def test_restart_without_a_cluster_object_goes_through_nannies_or_says_why(cluster: shoal.LocalCluster) -> None:
    with shoal.Client(cluster.scheduler_address, set_as_default=False) as remote:
        kept = remote.submit(inc, 5)
        assert kept.result() == 6
        if cluster.processes:
            # worker processes run under nannies: the scheduler asks them
            before = set(remote.run(worker_pid).values())
            remote.restart()
            assert kept.status == "cancelled"
            assert set(remote.run(worker_pid).values()).isdisjoint(before)
            assert remote.submit(inc, 1).result() == 2
            return
        # in-process workers have no nanny: only the cluster object could start new ones
        with pytest.raises(RuntimeError, match="supervisor"):
            remote.restart()
        assert kept.result() == 6  # nothing was cancelled


# -- upload_file


def _module(tmp_path: Path, text: str) -> tuple[Path, str]:
    name = f"uploaded_{uuid.uuid4().hex[:12]}"
    path = tmp_path / f"{name}.py"
    path.write_text(text)
    return path, name


def test_upload_file_then_tasks_import_it(client: shoal.Client, cluster: shoal.LocalCluster,
                                          tmp_path: Path) -> None:
    path, name = _module(tmp_path, "import os\n\ndef answer():\n    return 42\n\nPID = os.getpid()\n")
    client.upload_file(str(path))

    def use() -> tuple[int, int, int]:
        import importlib

        module = importlib.import_module(name)
        return module.answer(), module.PID, os.getpid()

    answer, imported_in, ran_in = client.submit(use, pure=False).result()
    assert answer == 42 and imported_in == ran_in
    if cluster.processes:
        assert ran_in in client.run(worker_pid).values() and ran_in != os.getpid()
    # a new version of the file is imported again
    path.write_text("def answer():\n    return 43\n")
    client.upload_file(path)
    assert set(client.run(lambda: __import__(name).answer()).values()) == {43}


def test_upload_file_of_a_zip_package(client: shoal.Client, tmp_path: Path) -> None:
    package = f"zipped_{uuid.uuid4().hex[:12]}"
    archive = tmp_path / f"{package}.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr(f"{package}/__init__.py", "from .core import double\n")
        z.writestr(f"{package}/core.py", "def double(x):\n    return 2 * x\n")
    client.upload_file(archive)
    assert client.submit(lambda x: __import__(package).double(x), 21).result() == 42


def test_upload_file_reaches_workers_that_join_later(client: shoal.Client, cluster: shoal.LocalCluster,
                                                     tmp_path: Path) -> None:
    path, name = _module(tmp_path, "VALUE = 'late'\n")
    client.upload_file(path)
    before = set(addresses(client))
    cluster.scale(3)
    try:
        client.wait_for_workers(3, timeout=30)
        [new] = set(addresses(client)) - before
        assert client.submit(lambda: __import__(name).VALUE, workers=[new], pure=False).result() == "late"
    finally:
        cluster.scale(2)
        wait_for(lambda: len(addresses(client)) == 2, timeout=30, what="the cluster to be back to 2 workers")


def test_upload_file_errors(client: shoal.Client, tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(ValueError, match=r"\.py, \.zip or \.egg"):
        client.upload_file(text)
    broken, _ = _module(tmp_path, "def broken(:\n")
    with pytest.raises(SyntaxError):
        client.upload_file(broken)
    assert client.submit(inc, 9).result() == 10  # the workers go on


# -- shutdown


@pytest.mark.parametrize("processes", [False, True], ids=["threads", "processes"])
def test_shutdown_closes_the_cluster_and_the_client(processes: bool) -> None:
    cluster = shoal.LocalCluster(n_workers=1, processes=processes)
    try:
        client = shoal.Client(cluster, set_as_default=False)
        assert client.submit(inc, 1).result() == 2
        client.shutdown()
        assert client.status == "closed"
        assert cluster.status == "closed"
    finally:
        cluster.close()
    assert all(p.poll() is not None for p in cluster.procs)


# -- futures


def test_future_traceback_is_a_traceback_object(client: shoal.Client) -> None:
    f = client.submit(fail_loudly)
    wait([f])
    tb = f.traceback()
    assert isinstance(tb, types.TracebackType)
    text = "".join(traceback.format_tb(tb))
    assert "fail_loudly" in text
    assert client.submit(inc, 1).traceback() is None


def test_gather_with_errors_skip_drops_erred_results_from_lists(client: shoal.Client) -> None:
    good, bad, other = client.submit(inc, 1), client.submit(fail_loudly), client.submit(inc, 2)
    wait([good, bad, other])
    assert client.gather([good, bad, other], errors="skip") == [2, 3]
    assert client.gather({"a": bad, "b": good}, errors="skip") == {"a": None, "b": 2}
    assert client.gather((bad, good), errors="skip") == (None, 2)
    with pytest.raises(ValueError, match="boom"):
        client.gather([good, bad])


def test_as_completed_count_batches_and_update(client: shoal.Client) -> None:
    futures = client.map(inc, range(6))
    ac = as_completed(futures[:3])
    ac.update(futures[3:])
    assert ac.count() == 6 and not ac.is_empty()
    seen = []
    for batch in ac.batches():
        assert batch
        seen.extend(batch)
    assert sorted(client.gather(seen)) == [1, 2, 3, 4, 5, 6]
    assert ac.is_empty() and ac.count() == 0 and not ac.has_ready()
    assert ac.next_batch(block=False) == []
    with_results = as_completed(client.map(inc, [10, 20]), with_results=True)
    wait_for(lambda: with_results.has_ready(), what="a result")
    pairs = []
    while not with_results.is_empty():
        pairs.extend(with_results.next_batch())
    assert sorted(r for _, r in pairs) == [11, 21]


# -- an asynchronous client


async def test_the_methods_on_an_asynchronous_client(cluster: shoal.LocalCluster) -> None:
    async with shoal.Client(cluster, asynchronous=True, set_as_default=False) as c:
        await c.wait_for_workers(2, timeout=10)
        nthreads = await c.nthreads()
        assert len(nthreads) == 2
        x = await c.scatter(3, hash=False)
        await c.replicate([x])
        assert len((await c.who_has([x]))[x.key]) == 2
        assert sum(len(keys) for keys in (await c.has_what()).values()) >= 2
        assert await c.processing() == {w: () for w in nthreads}
        assert (await c.get_versions(check=True))["client"]["packages"]["shoal"] == shoal.__version__
        assert await c.run_on_scheduler(lambda dask_scheduler: asyncio.get_running_loop() is dask_scheduler.loop)
        assert await c.run_on_scheduler(lambda dask_scheduler: len(dask_scheduler.state.workers)) == 2
        f = c.submit(fail_loudly)
        await c.gather([f], errors="skip")
        assert isinstance(await f.traceback(), types.TracebackType)
