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


def test_the_barrier_takes_locations_only():
    loc = Location("k", ("w1",), 10, None)
    assert locate(loc, loc) == [loc, loc]
    with pytest.raises(ShuffleError, match="does not know 'locate'"):
        locate(loc, pd.DataFrame())


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
