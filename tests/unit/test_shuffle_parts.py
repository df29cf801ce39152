"""The pieces of shoal's shuffle without a cluster: a split (rows sorted by output,
offsets), the rows of one output, the barrier's check of what it got, get-slices'
checks, and a worker's state running a ``locate`` task on where its inputs are."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from worker_harness import Wk, executes, gathers

from shoal.errors import ShuffleError
from shoal.worker.shuffle import Location, locate, rows_of, serve_slices, split
from shoal.worker.state import ComputeTaskEvent


def frame(n: int, outputs: int, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame({"_partitions": rng.integers(0, outputs, n), "v": np.arange(n, dtype=float)},
                        index=np.arange(n) * 10)


@pytest.mark.parametrize("n, outputs", [(0, 3), (1, 1), (1000, 7), (500, 64)])
def test_a_split_holds_each_outputs_rows_in_their_order(n, outputs):
    df = frame(n, outputs)
    value = split(df, "_partitions", outputs)
    got = [rows_of(value, j) for j in range(outputs)]
    assert sum(map(len, got)) == n
    for j, rows in enumerate(got):
        expected = df[df["_partitions"] == j]
        pd.testing.assert_frame_equal(rows, expected)  # same rows, same order, same index


def test_output_numbers_out_of_range_are_a_clear_error():
    df = frame(10, 3)
    with pytest.raises(ShuffleError, match="outside 0..1"):
        split(df, "_partitions", 2)
    value = split(df, "_partitions", 3)
    for bad in (-1, 3):
        with pytest.raises(ShuffleError, match="output partition"):
            rows_of(value, bad)


def test_the_barrier_takes_locations_or_splits_not_both():
    loc = Location("k", ("w1",), 10, None)
    assert locate(loc, loc) == [loc, loc]
    with pytest.raises(ShuffleError, match="both splits and the locations"):
        locate(loc, pd.DataFrame())


def test_rows_go_where_dasks_own_shuffle_sends_them():
    """Columns other than "_partitions" are hashed as dask hashes them (so a shuffle
    on a column puts each row in the same output partition as dask's would)."""
    from dask.dataframe.shuffle import shuffle_group

    rng = np.random.default_rng(1)
    df = pd.DataFrame({"k": rng.integers(0, 50, 300), "s": rng.choice(["a", "b", "c"], 300), "v": rng.random(300)})
    for on in ("k", ["k", "s"], []):
        value = split(df, on, 5)
        dasks = shuffle_group(df, on, 0, 5, 5, False, 5)
        for j in range(5):
            pd.testing.assert_frame_equal(rows_of(value, j), dasks[j])
    series = df["k"]
    value = split(series, [], 4)
    assert sorted(pd.concat([rows_of(value, j) for j in range(4)])) == sorted(series)


@pytest.mark.parametrize("ignore_index", [False, True])
def test_a_shuffle_runs_right_on_dasks_own_schedulers(ignore_index):
    """Under a scheduler that does not know 'locate' (dask's sync and threads, as in a
    test's compute(scheduler="sync")), the barrier passes the splits themselves."""
    import dask
    import dask.dataframe as dd

    from shoal.client import shuffle as shoal_shuffle

    assert shoal_shuffle.install()
    rng = np.random.default_rng(2)
    pdf = pd.DataFrame({"k": rng.integers(0, 100, 2000), "v": rng.random(2000)})
    ddf = dd.from_pandas(pdf, npartitions=7)
    for scheduler in ("sync", "threads"):
        with dask.config.set({"dataframe.shuffle.method": "shoal"}):
            out = ddf.shuffle("k", npartitions=5, ignore_index=ignore_index).compute(scheduler=scheduler)
            groups = ddf.groupby("k").v.sum(split_out=3).compute(scheduler=scheduler)
        assert len(out) == len(pdf)
        pd.testing.assert_frame_equal(out.sort_values(["k", "v"]).reset_index(drop=True),
                                      pdf.sort_values(["k", "v"]).reset_index(drop=True))
        if not ignore_index:
            assert sorted(out.index) == sorted(pdf.index)
        pd.testing.assert_series_equal(groups.sort_index(), pdf.groupby("k").v.sum().sort_index())


class _Store(dict):
    def peek(self, key):
        return self[key]


def test_get_slices_serves_splits_only_and_leaves_out_what_it_lacks():
    store = _Store({("shoal-shuffle-split-abc", 0): split(frame(100, 4), "_partitions", 4), "other": 1})
    got = serve_slices(store, [("shoal-shuffle-split-abc", 0), ("shoal-shuffle-split-abc", 1)], 2)
    assert list(got) == [("shoal-shuffle-split-abc", 0)]
    assert (got[("shoal-shuffle-split-abc", 0)]["_partitions"] == 2).all()
    with pytest.raises(ShuffleError, match="splits only"):
        serve_slices(store, ["other"], 0)


def test_a_locate_task_fetches_nothing_and_runs_at_once():
    w = Wk()
    ev = ComputeTaskEvent(w.sid(), "L", "payload-L", {"s0": ["p1"], "s1": ["p2", "p3"]}, {"s0": 10, "s1": 20}, (0,),
                          shm={"s1": {"name": "seg"}}, locate=True)
    out = w(ev)
    assert executes(out) == ["L"] and not gathers(out)
    assert w.state.tasks["L"].located == {"s0": (["p1"], 10, None), "s1": (["p2", "p3"], 20, {"name": "seg"})}
    assert set(w.state.tasks) == {"L"}, "its inputs are no tasks of this worker"
