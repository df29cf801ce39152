"""The pieces of shoal's shuffle without a cluster: a split (rows sorted by output,
offsets), the rows of one output, the barrier's check of what it got, get-slices'
checks, and a worker's state running a ``locate`` task on where its inputs are."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from worker_harness import Wk, executes, gathers

from shoal.errors import ShuffleError
from shoal.worker.shuffle import Location, bundle, join, locate, serve_outputs, serve_slices, split
from shoal.worker.state import ComputeTaskEvent


def frame(n: int, outputs: int, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame({"_partitions": rng.integers(0, outputs, n), "v": np.arange(n, dtype=float)},
                        index=np.arange(n) * 10)


@pytest.mark.parametrize("n, outputs", [(0, 3), (1, 1), (1000, 7), (500, 64), (3000, 300), (500, 70_000)])
def test_a_split_holds_each_outputs_rows_in_their_order(n, outputs):
    df = frame(n, outputs)
    value = split(df, "_partitions", outputs)
    assert sum(stop - start for start, stop in map(value.bounds, range(outputs))) == n
    # (the outputs with rows: all the others are empty)
    for j in sorted(set(df["_partitions"])) or range(outputs):
        expected = df[df["_partitions"] == j]
        pd.testing.assert_frame_equal(value.rows(j), expected)  # same rows, same order, same index


def test_output_numbers_out_of_range_are_a_clear_error():
    df = frame(10, 3)
    with pytest.raises(ShuffleError, match="outside 0..1"):
        split(df, "_partitions", 2)
    value = split(df, "_partitions", 3)
    for bad in (-1, 3):
        with pytest.raises(ShuffleError, match="output partition"):
            value.rows(bad)


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
            pd.testing.assert_frame_equal(value.rows(j), dasks[j])
    series = df["k"]
    value = split(series, [], 4)
    assert sorted(pd.concat([value.rows(j) for j in range(4)])) == sorted(series)


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
    held, rows = serve_slices(store, [("shoal-shuffle-split-abc", 1), ("shoal-shuffle-split-abc", 0)], 2)
    assert held == [1] and [b.positions.tolist() for b in rows] == [[1]]
    got = join(rows, None, False)
    assert len(got) and (got["_partitions"] == 2).all()
    with pytest.raises(ShuffleError, match="splits only"):
        serve_slices(store, ["other"], 0)
    held, outputs = serve_outputs(store, [("shoal-shuffle-split-abc", 0), ("shoal-shuffle-split-abc", 1)])
    assert held == [0] and outputs == [[0, 1, 2, 3]]
    with pytest.raises(ShuffleError, match="splits only"):
        serve_outputs(store, ["other"])


def _mixed(n: int, seed: int, categories: list[str]) -> pd.DataFrame:
    """A frame with a column of each kind a piece carries differently."""
    rng = np.random.default_rng(seed)
    return pd.DataFrame({
        "k": rng.integers(0, 20, n),
        "obj": pd.Series(rng.choice(["a", "b", None], n), dtype=object),
        "s": pd.Series(rng.choice(["x", "yy"], n), dtype="string[pyarrow]"),
        "cat": pd.Categorical(rng.choice(categories, n), categories=categories),
        "i": pd.array(rng.integers(0, 5, n), dtype="Int64"),
        "t": pd.date_range("2026-01-01", periods=n, freq="s", tz="UTC"),
        "f": rng.random(n),
    }, index=pd.Index(rng.integers(0, 50, n), name="ix"))


@pytest.mark.parametrize("ignore_index", [False, True])
def test_joined_pieces_equal_dasks_concat_of_the_same_rows(ignore_index):
    """Column by column (one type per column) or through dask's concat (types that
    differ between inputs: categories, int vs float): the same frame as dask's."""
    from dask.dataframe.methods import concat as dask_concat

    same = [_mixed(60, s, ["a", "b", "c"]) for s in range(3)]
    differ = [_mixed(60, 3, ["a", "b"]), _mixed(60, 4, ["c", "b", "a"]),
              _mixed(60, 5, ["a", "b", "c"]).astype({"f": "float32"})]
    for inputs in (same, differ):
        splits = [split(df, "k", 4) for df in inputs]
        for j in range(4):
            got = join(bundle(list(enumerate(splits)), j), inputs[0].iloc[:0], ignore_index)
            expected = dask_concat([s.rows(j) for s in splits], uniform=True, ignore_index=ignore_index)
            if ignore_index:  # (dask's concat keeps the index of frames with categories: shoal's does not)
                expected = expected.reset_index(drop=True)
            pd.testing.assert_frame_equal(got, expected)
    series = [df["obj"] for df in same]
    splits = [split(x, [], 3) for x in series]
    for j in range(3):
        got = join(bundle(list(enumerate(splits)), j), series[0].iloc[:0], ignore_index)
        expected = dask_concat([s.rows(j) for s in splits], ignore_index=ignore_index)
        if ignore_index:  # (nor does it make a new index for series)
            expected = expected.reset_index(drop=True)
        pd.testing.assert_series_equal(got, expected)
        assert got.dtype == object


def test_a_join_keeps_duplicate_labels_a_multiindex_and_the_types_of_no_rows():
    rng = np.random.default_rng(7)
    df = pd.DataFrame(rng.random((40, 3)), columns=["a", "a", "b"],
                      index=pd.MultiIndex.from_arrays([rng.integers(0, 3, 40), np.arange(40)], names=["x", "y"]))
    df["p"] = rng.integers(0, 3, 40)
    splits = [split(df.iloc[:20], "p", 5), split(df.iloc[20:], "p", 5)]
    out = [join(bundle(list(enumerate(splits)), j), df.iloc[:0], False) for j in range(5)]
    pd.testing.assert_frame_equal(pd.concat(out).sort_index(), df.sort_index())
    assert list(out[4].columns) == ["a", "a", "b", "p"] and len(out[4]) == 0  # (no rows: still the data's types)
    assert out[4].dtypes.tolist() == df.dtypes.tolist()
    assert join([], df.iloc[:0], False) is not None


def test_bundles_splits_and_placements_pickle_without_what_a_worker_learned():
    import pickle

    value = split(_mixed(30, 1, ["a", "b"]), "k", 3)
    again = pickle.loads(pickle.dumps(value, protocol=5))
    pd.testing.assert_frame_equal(again.rows(1), value.rows(1))
    rows = pickle.loads(pickle.dumps(bundle([(0, value)], 2), protocol=5))
    pd.testing.assert_frame_equal(join(rows, None, False), value.rows(2))
    placement = locate(Location("k", ("w1",)))
    placement._sources["w1"] = object()
    copy = pickle.loads(pickle.dumps(placement))
    assert copy == placement and copy._sources == {}


def test_a_locate_task_fetches_nothing_and_runs_at_once():
    w = Wk()
    ev = ComputeTaskEvent(w.sid(), "L", "payload-L", {"s0": ["p1"], "s1": ["p2", "p3"]}, {"s0": 10, "s1": 20}, (0,),
                          shm={"s1": {"name": "seg"}}, locate=True)
    out = w(ev)
    assert executes(out) == ["L"] and not gathers(out)
    assert w.state.tasks["L"].located == {"s0": (["p1"], 10, None), "s1": (["p2", "p3"], 20, {"name": "seg"})}
    assert set(w.state.tasks) == {"L"}, "its inputs are no tasks of this worker"


@pytest.mark.parametrize("rows", [60, 10_000])
def test_bundles_of_interleaved_holders_join_in_input_order(rows):
    """An assembly joins bundles from several holders (the splits at even positions
    here, the odd ones there), small ones joined by their holder, large ones as
    chunks: rows come out in input order, as from one bundle of all."""
    inputs = [_mixed(rows, s, ["a", "b", "c"]) for s in range(6)]
    splits = [split(df, "k", 3) for df in inputs]
    for j in range(3):
        whole = join(bundle(list(enumerate(splits)), j), None, False)
        even = bundle([(p, s) for p, s in enumerate(splits) if p % 2 == 0], j)
        odd = bundle([(p, s) for p, s in enumerate(splits) if p % 2], j)
        assert len(even[0].chunks[0]) == (1 if rows == 60 else 3)
        pd.testing.assert_frame_equal(join(odd + even, None, False), whole)
        expected = pd.concat([s.rows(j) for s in splits])
        pd.testing.assert_frame_equal(whole, expected)
