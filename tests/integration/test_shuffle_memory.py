"""shoal's shuffle of three times what its workers may hold: every row arrives where
it belongs (each output's rows against the rows dask's planner routes there), no
worker passes its memory limit (none is restarted by its nanny), and the worker
processes' memory stays within their limits above what they hold idle. And with
every value on disk (a memory target of one byte): every exchange against pandas,
and shuffles under kill -9 at random moments.

Splits spill like any value, in parts (one per output partition), and an assembly
reads only its own part of each; this is what lets the exchange go on with the data
on disk rather than fail or be killed."""

from __future__ import annotations

import random
import threading

import dask
import numpy as np
import pandas as pd
import psutil
import pytest

import shoal
from shoal import config
from shoal.chaos import kill_a_worker, run_chaos

dd = pytest.importorskip("dask.dataframe")

pytestmark = pytest.mark.timeout(420)

WORKERS = 2
LIMIT = 300_000_000
FLOATS = 10
#: a row: an int key and FLOATS floats
ROW_BYTES = 8 * (1 + FLOATS)
INPUTS = 96
#: three times the workers' memory limits, in all
ROWS = 3 * WORKERS * LIMIT // ROW_BYTES // INPUTS


def make(i: int) -> pd.DataFrame:
    rng = np.random.default_rng(1000 + i)
    columns = {"k": rng.integers(0, 1 << 40, ROWS, dtype=np.int64)}
    columns.update({f"f{j}": rng.random(ROWS) for j in range(FLOATS)})
    return pd.DataFrame(columns)


def fingerprint(df: pd.DataFrame) -> tuple[int, int]:
    """Rows, and the sum (mod 2**64) of each row's hash: the same for the same rows in
    any order; another for a row lost, doubled or changed."""
    hashes = pd.util.hash_pandas_object(df, index=False).to_numpy()
    return len(df), int(hashes.sum(dtype=np.uint64))


def summary(df: pd.DataFrame) -> pd.DataFrame:
    rows, h = fingerprint(df)
    return pd.DataFrame({"rows": [rows], "hash": [np.uint64(h)]})


class Peak:
    """The largest sum of the proportional set sizes (PSS: a page shared by two
    processes counts half in each) of ``processes``, sampled in a thread."""

    def __init__(self, processes: list[psutil.Process]) -> None:
        self.processes = processes
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def total(self) -> int:
        total = 0
        for p in self.processes:
            try:
                total += p.memory_full_info().pss
            except psutil.NoSuchProcess:  # killed past its limit: the test fails on that
                pass
        return total

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, self.total())

    def __enter__(self) -> Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _pid() -> int:
    import os

    return os.getpid()


def test_a_shuffle_of_three_times_the_memory_limit_is_right_and_stays_within_it(tmp_path):
    from dask.dataframe.dask_expr._shuffle import AssignPartitioningIndex

    outputs = INPUTS
    assert INPUTS * ROWS * ROW_BYTES > 2.9 * WORKERS * LIMIT
    with shoal.LocalCluster(n_workers=WORKERS, threads_per_worker=1, processes=True, dashboard_address=None,
                            memory_limit=LIMIT, local_directory=str(tmp_path)) as cluster, \
            shoal.Client(cluster) as client:
        ddf = dd.from_map(make, range(INPUTS))
        assert ddf.npartitions == INPUTS
        # (what the workers hold idle, with pandas and dask loaded: a small shuffle first)
        small = dd.from_pandas(make(0).iloc[:1000], npartitions=4).shuffle("k", shuffle_method="shoal")
        assert len(client.compute(small).result()) == 1000
        pids = client.run(_pid)
        processes = [psutil.Process(pid) for pid in pids.values()]
        meter = Peak(processes)
        idle = meter.total()

        got = ddf.shuffle("k", npartitions=outputs, shuffle_method="shoal").map_partitions(
            summary, meta={"rows": "i8", "hash": "u8"})
        with meter:
            lines = client.compute(got).result()
        assert client.run(_pid) == pids, "a worker was restarted (past its memory limit)"

    # what each output partition must hold: the rows dask's own planner routes there
    expected_rows = np.zeros(outputs, dtype=np.int64)
    expected_hash = np.zeros(outputs, dtype=np.uint64)
    for i in range(INPUTS):
        df = make(i)
        where = AssignPartitioningIndex.operation(df, ["k"], "_partitions", outputs, df.iloc[:0], False)
        where = where["_partitions"].to_numpy()
        hashes = pd.util.hash_pandas_object(df, index=False).to_numpy()
        expected_rows += np.bincount(where, minlength=outputs)
        np.add.at(expected_hash, where, hashes)
    assert lines["rows"].sum() == INPUTS * ROWS
    np.testing.assert_array_equal(lines["rows"].to_numpy(), expected_rows)
    np.testing.assert_array_equal(lines["hash"].to_numpy().astype(np.uint64), expected_hash)
    print(f"peak {meter.peak / 1e6:.0f} MB of PSS, {idle / 1e6:.0f} MB idle; limits {WORKERS * LIMIT / 1e6:.0f} MB")
    assert meter.peak - idle <= WORKERS * LIMIT, f"{(meter.peak - idle) / 1e6:.0f} MB above idle"


def _spilled_here() -> int:
    import gc

    from shoal.worker.server import Worker

    return sum(w.store.spilled_count for w in gc.get_objects() if isinstance(w, Worker))


@pytest.fixture
def every_value_on_disk(monkeypatch):
    """Worker processes whose stores write every value to disk as it comes (a
    memory target of one byte): each split is served from its parts on disk."""
    monkeypatch.setenv("SHOAL_MEMORY_TARGET", "1e-9")


def test_every_exchange_is_right_with_every_split_on_disk(every_value_on_disk):
    rng = np.random.default_rng(5)
    left = pd.DataFrame({"k": rng.integers(0, 5_000, 40_000), "s": rng.choice(["a", "bb", None], 40_000),
                         "v": rng.random(40_000)})
    right = pd.DataFrame({"k": rng.integers(0, 5_000, 8_000), "w": rng.random(8_000)})
    with shoal.Client(n_workers=2, processes=True, dashboard_address=None, memory_limit="1GB") as client:
        dl, dr = dd.from_pandas(left, npartitions=10), dd.from_pandas(right, npartitions=4)
        shuffled = dl.shuffle("k", shuffle_method="shoal").persist()
        shoal.wait(shuffled)
        assert sum(client.run(_spilled_here).values()) >= 10, "the values are on disk"
        got = client.compute(shuffled).result()
        pd.testing.assert_frame_equal(_sorted(got), _sorted(left))
        merged = client.compute(dl.merge(dr, on="k", shuffle_method="shoal")).result()
        pd.testing.assert_frame_equal(_sorted(merged), _sorted(left.merge(right, on="k")))
        sums = client.compute(dl.groupby("k").v.sum(split_out=4, shuffle_method="shoal")).result()
        pd.testing.assert_series_equal(sums.sort_index(), left.groupby("k").v.sum().sort_index(), check_names=False)


def _sorted(df: pd.DataFrame) -> pd.DataFrame:
    """Rows in one order; strings compared as text (dask keeps them as Arrow strings,
    its missing value <NA> where pandas has NaN)."""
    df = df.assign(s=df["s"].astype(object).where(df["s"].notna(), "<none>").astype(str))
    return df.sort_values(list(df.columns)).reset_index(drop=True)


def test_shuffles_with_every_split_on_disk_stay_right_while_workers_are_killed(every_value_on_disk):
    with config.set(nanny_max_restarts=10_000), dask.config.set({"dataframe.shuffle.method": "shoal"}):
        with shoal.Client(n_workers=2, processes=True, dashboard_address=None, memory_limit="1GB") as client:
            report = run_chaos(client, kill_a_worker(client, random.Random(13)), graphs=8, seed=13,
                               kill_every=(0.5, 2.0), deadline=60, min_kills=1,
                               kinds=["groupby_split", "shuffle", "merge", "set_index"])
    report.check()
    assert report.total >= 8 and report.kills >= 1, report.summary()
