"""shoal's own shuffle (``shuffle_method="shoal"``) on real clusters: every exchange a
dataframe user runs matches pandas, on in-process workers and on worker processes; it
makes 2n + 1 tasks; and a worker killed (-9) at the worst moment, after the barrier
said where the splits are, leaves the result right."""

from __future__ import annotations

import os
import random
import signal

import numpy as np
import pandas as pd
import pytest

import shoal
from shoal import config
from shoal.chaos import kill_a_worker, run_chaos
from shoal.scheduler.plugin import SchedulerPlugin

dd = pytest.importorskip("dask.dataframe")
import dask  # noqa: E402

pytestmark = pytest.mark.timeout(180)


def frames() -> tuple[pd.DataFrame, pd.DataFrame]:
    rng = np.random.default_rng(3)
    n = 20_000
    left = pd.DataFrame({"k": rng.integers(0, 3_000, n), "g": rng.integers(0, 7, n), "v": rng.random(n)})
    right = pd.DataFrame({"k": rng.integers(0, 3_000, n // 4), "w": rng.random(n // 4)})
    return left, right


def sort(df: pd.DataFrame) -> pd.DataFrame:
    df = df.reset_index() if df.index.name else df.reset_index(drop=True)
    return df.sort_values(list(df.columns)).reset_index(drop=True)


def exchanges(client: shoal.Client) -> None:
    """Each exchange through shoal's shuffle, against pandas."""
    left, right = frames()
    dl = dd.from_pandas(left, npartitions=12)
    dr = dd.from_pandas(right, npartitions=5)
    m = "shoal"

    shuffled = dl.shuffle("k", shuffle_method=m)
    parts = client.compute(shuffled.map_partitions(lambda d: pd.DataFrame({"k": [sorted(set(d.k))]}))).result()
    seen = [k for ks in parts.k for k in ks]
    assert len(seen) == len(set(seen)) == left.k.nunique(), "a key in one output partition only"
    pd.testing.assert_frame_equal(sort(client.compute(shuffled).result()), sort(left))

    fewer = dl.shuffle("k", npartitions=3, shuffle_method=m)
    assert fewer.npartitions == 3
    pd.testing.assert_frame_equal(sort(client.compute(fewer).result()), sort(left))

    for how in ("inner", "left"):
        got = client.compute(dl.merge(dr, on="k", how=how, shuffle_method=m)).result()
        pd.testing.assert_frame_equal(sort(got), sort(left.merge(right, on="k", how=how)))

    indexed = client.compute(dl.set_index("k", shuffle_method=m)).result()
    assert indexed.index.is_monotonic_increasing
    pd.testing.assert_frame_equal(sort(indexed), sort(left.set_index("k")))

    by_v = client.compute(dl.sort_values("v", shuffle_method=m)).result()
    np.testing.assert_array_equal(by_v.v.values, np.sort(left.v.values))

    sums = client.compute(dl.groupby("k").v.sum(split_out=4, shuffle_method=m)).result()
    pd.testing.assert_series_equal(sums.sort_index(), left.groupby("k").v.sum().sort_index(), check_names=False)

    unique = client.compute(dl[["k", "g"]].drop_duplicates(split_out=4, shuffle_method=m)).result()
    pd.testing.assert_frame_equal(sort(unique), sort(left[["k", "g"]].drop_duplicates()))

    empty = dl[dl.v > 2.0]  # every partition empty
    assert len(client.compute(empty.shuffle("k", shuffle_method=m)).result()) == 0


def test_every_exchange_matches_pandas_on_in_process_workers():
    with shoal.Client(n_workers=2, processes=False, dashboard_address=None) as client:
        exchanges(client)


def test_every_exchange_matches_pandas_on_worker_processes():
    with shoal.Client(n_workers=2, processes=True, dashboard_address=None) as client:
        exchanges(client)


def test_the_default_method_of_the_config_is_used():
    left, _ = frames()
    with shoal.Client(n_workers=2, processes=False, dashboard_address=None) as client:
        with dask.config.set({"dataframe.shuffle.method": "shoal"}):
            shuffled = dd.from_pandas(left, npartitions=6).shuffle("k")
            keys = [k for k in dict(shuffled.__dask_graph__()) if isinstance(k, tuple)]
            assert any(str(k[0]).startswith("shoal-shuffle-split") for k in keys)
            pd.testing.assert_frame_equal(sort(client.compute(shuffled).result()), sort(left))


def test_a_shuffle_is_two_tasks_per_partition_and_one():
    n = 300
    df = pd.DataFrame({"k": np.arange(3 * n) % 97, "v": np.arange(3 * n)})
    ddf = dd.from_pandas(df, npartitions=n, sort=False)
    assert ddf.npartitions == n
    shuffled = ddf.shuffle("k", shuffle_method="shoal")
    graph = dict(shuffled.__dask_graph__())
    names = [str(k[0] if isinstance(k, tuple) else k) for k in graph]
    assert sum(x.startswith("shoal-shuffle-split") for x in names) == n
    assert sum(x.startswith("shoal-shuffle-locate") for x in names) == 1
    with shoal.Client(n_workers=2, processes=False, dashboard_address=None) as client:
        pd.testing.assert_frame_equal(sort(client.compute(shuffled).result()), sort(df))


def test_fewer_outputs_than_inputs_split_every_input_where_it_is():
    """Into fewer partitions (a groupby's split_out) each input partition is split
    where it is: none is joined to others first (dask's task shuffle repartitions to
    keep its n x m tasks down; that would move the inputs before their rows move)."""
    n = 24
    df = pd.DataFrame({"k": np.arange(40 * n) % 53, "v": np.arange(40 * n, dtype=float)})
    ddf = dd.from_pandas(df, npartitions=n, sort=False)
    with shoal.Client(n_workers=2, processes=False, dashboard_address=None) as client:
        grouped = ddf.groupby("k").sum(split_out=4, shuffle_method="shoal")
        shuffled = ddf.shuffle("k", npartitions=3, shuffle_method="shoal")
        for value in (grouped, shuffled):
            names = [str(k[0] if isinstance(k, tuple) else k) for k in dict(value.__dask_graph__())]
            assert sum(x.startswith("shoal-shuffle-split") for x in names) == n
            assert not any("repartition" in x for x in names)
        got = client.compute(grouped).result()
        pd.testing.assert_frame_equal(got.sort_index(), df.groupby("k").sum())
        out = client.compute(shuffled).result()
        assert shuffled.npartitions == 3
        pd.testing.assert_frame_equal(sort(out), sort(df))


def test_many_sparse_partitions_come_out_right_and_in_input_order():
    """100 partitions into 400 on worker processes: most splits have rows for few
    outputs (an assembly asks only the holders with rows for it), strings and
    categories travel as arrays, and each output holds its rows in input order (the
    original row numbers, kept in the index, increase within every output). A worker
    fetches the barrier once, however many outputs it assembles."""
    rng = np.random.default_rng(11)
    n = 6_000
    df = pd.DataFrame({"k": rng.integers(0, 50_000, n), "s": rng.choice(["ab", "c", "dé"], n),
                       "c": pd.Categorical(rng.choice(["x", "y"], n)), "v": rng.random(n)})
    shuffled = dd.from_pandas(df, npartitions=100, sort=False).shuffle("k", npartitions=400, shuffle_method="shoal")
    with shoal.Client(n_workers=2, processes=True, dashboard_address=None) as client:
        with shoal.get_task_stream(client) as stream:
            parts = client.gather(client.compute(shuffled.to_delayed()))
    fetched = [(r["worker"], t["key"]) for r in stream.data for t in r["transfers"] or []
               if str(t["key"]).startswith("shoal-shuffle-locate")]
    assert len(fetched) == len(set(fetched)) <= 2, fetched
    assert len(parts) == 400
    for part in parts:
        assert part.index.is_monotonic_increasing, "rows of an output in input order"
    got = pd.concat(parts).sort_index()
    pd.testing.assert_frame_equal(got, df.astype({"s": got.s.dtype}), check_categorical=False)
    owner = {k: i for i, part in enumerate(parts) for k in part.k}
    assert len(owner) == df.k.nunique() and all(owner[k] == i for i, part in enumerate(parts) for k in part.k)


class KillAtTheBarrier(SchedulerPlugin):
    """Kills (-9) the worker holding the first split the moment the barrier is in
    memory (the assemblies about to start), once; counts the barrier's runs."""

    name = "kill-at-the-barrier"

    def __init__(self, pids: dict[str, int]):
        self.pids = pids
        self.killed: str | None = None
        self.barriers = 0

    def start(self, scheduler):
        self.scheduler = scheduler

    def transition(self, key, start, finish, *args, **kwargs):
        if not (isinstance(key, str) and key.startswith("shoal-shuffle-locate") and finish == "memory"):
            return
        self.barriers += 1
        if self.killed is not None:
            return
        tasks = self.scheduler.state.tasks
        splits = sorted((k for k in tasks if isinstance(k, tuple) and str(k[0]).startswith("shoal-shuffle-split")),
                        key=lambda k: k[1])
        holder = sorted(ws.address for ws in tasks[splits[0]].who_has)[0]
        self.killed = holder
        os.kill(self.pids[holder], signal.SIGKILL)


def test_a_split_holder_killed_after_the_barrier_leaves_the_result_right():
    left, right = frames()
    with config.set(nanny_max_restarts=100):
        with shoal.Client(n_workers=2, processes=True, dashboard_address=None) as client:
            pids = client.run(os.getpid)
            plugin = KillAtTheBarrier(pids)
            client.register_scheduler_plugin(plugin)
            dl = dd.from_pandas(left, npartitions=8)
            got = client.compute(dl.merge(dd.from_pandas(right, npartitions=4), on="k", shuffle_method="shoal"))
            pd.testing.assert_frame_equal(sort(got.result(timeout=120)), sort(left.merge(right, on="k")))
            assert plugin.killed is not None
            assert plugin.barriers >= 2, "the barrier ran again, on where the splits are now"


def test_shuffles_stay_right_while_workers_are_killed():
    with config.set(nanny_max_restarts=10_000), dask.config.set({"dataframe.shuffle.method": "shoal"}):
        with shoal.Client(n_workers=2, processes=True, dashboard_address=None, memory_limit="300MB") as client:
            report = run_chaos(client, kill_a_worker(client, random.Random(9)), graphs=10, seed=9,
                               kill_every=(0.5, 2.0), deadline=60, min_kills=1,
                               kinds=["groupby_split", "shuffle", "merge", "set_index"])
    report.check()
    assert report.total >= 10 and report.kills >= 1, report.summary()
