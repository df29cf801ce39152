"""The pieces of shoal's shuffle without a cluster: a split (rows sorted by output,
offsets), the rows of one output, the barrier's check of what it got, get-slices'
checks, a split spilled in parts (one output read alone; a flipped bit), and a
worker's state running a ``locate`` task on where its inputs are."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import os
import weakref

import numpy as np
import pandas as pd
import pytest
from test_spill import flip_bit
from worker_harness import Wk, executes, gathers

from shoal.errors import ShuffleError
from shoal.worker import spill as spill_module
from shoal.worker.shuffle import Location, Placement, Split, SplitHead, bundle, join, locate, split
from shoal.worker.shuffle_sources import Sources, serve_outputs, serve_slices
from shoal.worker.store import WorkerStore
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


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint8, float])
@pytest.mark.parametrize("where", [0, 2])
def test_the_column_of_output_numbers_is_not_kept_but_made_again_in_each_output(dtype, where):
    """A split routed by ``_partitions`` (dask's planner's column of output numbers)
    holds no array of it: each output makes it again, of its type and in its place,
    from its own number. A column of floats is kept as it is."""
    rng = np.random.default_rng(3)
    n, outputs = 1000, 6
    df = pd.DataFrame({"a": rng.random(n), "b": rng.integers(0, 9, n)}, index=np.arange(n) * 3)
    df.insert(where, "_partitions", rng.integers(0, outputs, n).astype(dtype))
    value = split(df, "_partitions", outputs)
    integer = np.dtype(dtype).kind in "iu"
    assert len(value.arrays) == (3 if integer else 4)  # a, b and the index (and the floats)
    assert (value.form.numbered == where) == integer
    for j in range(outputs):
        expected = df[df["_partitions"] == j]
        pd.testing.assert_frame_equal(value.rows(j), expected)
        pd.testing.assert_frame_equal(join(bundle([(0, value)], j), None, False, j), expected)
        pd.testing.assert_frame_equal(join(bundle([(0, value)], j), None, True, j), expected.reset_index(drop=True))
    # forms that differ (an int column that is float in another input) join by dask's rules
    other = df.astype({"b": float})
    values = [value, split(other, "_partitions", outputs)]
    for j in range(outputs):
        expected = pd.concat([df[df["_partitions"] == j], other[other["_partitions"] == j]])
        pd.testing.assert_frame_equal(join(bundle(list(enumerate(values)), j), None, False, j), expected)
    # a split with no rows at all: the empty frame of the data's types
    empty = split(df.iloc[:0], "_partitions", outputs)
    pd.testing.assert_frame_equal(join(bundle([(0, empty)], 1), None, False, 1), df.iloc[:0])
    if integer:
        with pytest.raises(ShuffleError, match="no output number"):
            value.form.build(value.arrays)


def test_a_spilled_split_without_its_column_of_output_numbers_reads_back_each_output(store):
    df = frame(3000, 5, seed=4)
    key = _keys(1)[0]
    store[key] = split(df, "_partitions", 5)
    store._spill(key)
    worker = _Worker(store)
    for j in range(5):
        held, rows, lost = _slices(worker, [key], j)
        assert held == [0] and lost == []
        pd.testing.assert_frame_equal(join(rows, None, False, j), df[df["_partitions"] == j])
    whole = store[key]
    assert whole.form.numbered == 0
    for j in range(5):
        pd.testing.assert_frame_equal(whole.rows(j), df[df["_partitions"] == j])


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


class _Worker:
    """What get-slices uses of a worker: its store, and the scheduler it tells of
    values lost."""

    def __init__(self, store: WorkerStore) -> None:
        self.store = store
        self.lost: list = []

    def values_lost(self, keys):
        self.lost.extend(keys)


def _slices(worker, keys, index):
    return asyncio.run(serve_slices(worker, keys, index))


@pytest.fixture
def store(tmp_path):
    s = WorkerStore(directory=str(tmp_path / "spill"))
    yield s
    s.close()


def test_get_slices_serves_splits_only_and_leaves_out_what_it_lacks(store):
    store[("shoal-shuffle-split-abc", 0)] = split(frame(100, 4), "_partitions", 4)
    store["other"] = 1
    worker = _Worker(store)
    held, rows, lost = _slices(worker, [("shoal-shuffle-split-abc", 1), ("shoal-shuffle-split-abc", 0)], 2)
    assert held == [1] and lost == [] and [b.positions.tolist() for b in rows] == [[1]]
    got = join(rows, None, False, 2)
    assert len(got) and (got["_partitions"] == 2).all()
    with pytest.raises(ShuffleError, match="splits only"):
        _slices(worker, ["other"], 0)
    held, outputs, files = serve_outputs(store, [("shoal-shuffle-split-abc", 0), ("shoal-shuffle-split-abc", 1)])
    assert held == [0] and outputs == [[0, 1, 2, 3]] and files == [None]
    with pytest.raises(ShuffleError, match="splits only"):
        serve_outputs(store, ["other"])


def _keys(n):
    return [("shoal-shuffle-split-t", i) for i in range(n)]


@pytest.mark.parametrize("outputs", [1, 5, 300])
def test_a_spilled_split_is_served_one_output_at_a_time_from_its_part_alone(store, monkeypatch, outputs):
    """A split spills in parts (one per output it has rows for): get-slices reads only
    that output's record, and gives the rows it gave from memory; the split read back
    whole is the one written."""
    frames = [frame(2000, outputs, seed) for seed in range(3)]
    keys = _keys(3)
    for key, df in zip(keys, frames):
        store[key] = split(df, "_partitions", outputs)
    kept = {j: join(_slices(_Worker(store), keys, j)[1], None, False, j) for j in range(outputs)}
    for key in keys[:2]:
        store._spill(key)
    assert store.is_spilled(keys[0]) and not store.is_spilled(keys[2])
    assert isinstance(store.parts_file(keys[0])[0], SplitHead)

    read = []
    real = spill_module.read_part
    def counted(path, offset, length, expect=None):
        read.append(length)
        return real(path, offset, length, expect)

    monkeypatch.setattr(spill_module, "read_part", counted)
    worker = _Worker(store)
    for j in range(outputs):
        read.clear()
        held, rows, lost = _slices(worker, keys, j)
        assert held == [0, 1, 2] and lost == []
        pd.testing.assert_frame_equal(join(rows, None, False, j), kept[j])
        # one record per spilled split with rows for j, each a part of its file
        with_rows = [k for k, df in zip(keys[:2], frames) if (df["_partitions"] == j).any()]
        assert len(read) == len(with_rows)
        if outputs > 1:
            assert all(n < store._slow[keys[0]][1] for n in read)
    assert store.is_spilled(keys[0])  # (served, and left on disk)
    held, outputs_of, files = serve_outputs(store, keys)
    assert [f is not None for f in files] == [True, True, False]
    assert outputs_of == [sorted(set(df["_partitions"])) for df in frames]
    whole = store[keys[0]]  # read back whole
    assert isinstance(whole, Split) and not store.is_spilled(keys[0])
    for j in range(outputs):
        pd.testing.assert_frame_equal(whole.rows(j), frames[0][frames[0]["_partitions"] == j])


def test_a_spilled_split_of_every_column_type_reads_back_as_written(store):
    df = _mixed(500, 1, ["a", "b", "c"])
    key = _keys(1)[0]
    store[key] = split(df, "k", 6)
    expected = {j: store[key].rows(j) for j in range(6)}
    store._spill(key)
    worker = _Worker(store)
    for j in range(6):
        held, rows, lost = _slices(worker, [key], j)
        pd.testing.assert_frame_equal(join(rows, df.iloc[:0], False, j), expected[j])
    whole = store[key]
    for j in range(6):
        pd.testing.assert_frame_equal(whole.rows(j), expected[j])


def test_a_flipped_bit_in_a_spilled_split_loses_it_and_never_serves_its_rows(store):
    """A record that fails its checksum is no rows: the split is lost (gone from the
    store, its file removed, the scheduler told) and get-slices says so; the records
    of other outputs were never read and other splits are served."""
    keys = _keys(2)
    frames = [frame(3000, 4, seed) for seed in range(2)]
    for key, df in zip(keys, frames):
        store[key] = split(df, "_partitions", 4)
        store._spill(key)
    path, _, _, (head, records) = store._slow[keys[0]]
    offset, length = records[2]
    flip_bit(path, offset + length - 9)  # one bit, near the end of that record
    worker = _Worker(store)
    held, rows, lost = _slices(worker, keys, 1)  # another record of the same file: fine
    assert held == [0, 1] and lost == []
    held, rows, lost = _slices(worker, keys, 2)
    assert lost == [0] and held == [1] and worker.lost == [keys[0]]
    assert keys[0] not in store and not os.path.exists(path)
    got = join(rows, None, False, 2)
    pd.testing.assert_frame_equal(got, frames[1][frames[1]["_partitions"] == 2])


def test_an_assembly_that_reads_a_flipped_bit_in_its_own_spilled_split_gives_itself_back(store):
    """The same in an assembly's own thread, for a split its worker holds: the split is
    lost (the scheduler told, its file gone) and the task is given back, never run
    without those rows."""
    import threading

    from shoal.errors import Reschedule
    from shoal.worker.shuffle_sources import _piece, _resolve

    key = _keys(1)[0]
    store[key] = split(frame(2000, 3), "_partitions", 3)
    store._spill(key)
    path, _, _, (_, records) = store._slow[key]
    offset, length = records[1]
    flip_bit(path, offset + length - 5)  # one bit, near the end of that record
    worker = _Worker(store)
    worker.loop = asyncio.new_event_loop()
    thread = threading.Thread(target=worker.loop.run_forever, daemon=True)
    thread.start()
    try:
        done, unread = _resolve(worker, [(0, _piece(store, key, 0))], 0)
        assert len(done[0][1].arrays[0]) > 0 and unread == []  # another part: fine
        with pytest.raises(Reschedule, match="lost here"):
            _resolve(worker, [(0, _piece(store, key, 1))], 1)
    finally:
        worker.loop.call_soon_threadsafe(worker.loop.stop)
        thread.join()
        worker.loop.close()
    assert worker.lost == [key] and key not in store and not os.path.exists(path)


def test_a_peer_of_this_host_reads_a_spilled_split_from_its_file_and_asks_when_the_file_is_not_that_one(store):
    """split-outputs names the file of a split spilled in parts; an assembly of this
    host reads its record there (the holder not asked). A file that went, changed or
    fails is not read: the holder is asked (and finds out itself), nothing is lost here."""
    from shoal.worker.shuffle_sources import _resolve

    key = _keys(1)[0]
    df = frame(3000, 4)
    store[key] = split(df, "_partitions", 4)
    store._spill(key)
    _, outputs, files = serve_outputs(store, [key])
    head, path, expect, records = files[0]
    sources = Sources({}, {}, {"w0": {0: np.asarray(outputs[0])}}, None, {}, {0: (key, head, path, expect, records)})
    worker = _Worker(store)
    ask = {"w0": [0]}
    pieces = sources.read_files(ask, 2)
    assert ask == {} and len(pieces) == 1
    done, unread = _resolve(worker, pieces, 2)
    assert unread == []
    pd.testing.assert_frame_equal(join(bundle(done, 2), None, False, 2), df[df["_partitions"] == 2])
    changed = (*expect[:2], expect[2] + 1, expect[3])
    other = Sources({}, {}, {}, None, {}, {0: (key, head, path, changed, records)})
    ask = {"w0": [0]}
    assert _resolve(worker, other.read_files(ask, 2), 2) == ([], [0])
    offset, length = records[1]
    flip_bit(path, offset + length - 3)  # one bit, near the end of that record
    ask = {"w0": [0]}
    assert _resolve(worker, sources.read_files(ask, 1), 1)[1] == [0]
    assert worker.lost == [] and store.is_spilled(key)  # (the holder's to find out)


def test_a_split_spilled_and_read_back_meanwhile_is_served_from_memory(store, monkeypatch):
    """The file of a part went between the lookup and the read (the split was read
    back): get-slices looks again and serves it from memory."""
    key = _keys(1)[0]
    df = frame(1000, 3)
    store[key] = split(df, "_partitions", 3)
    store._spill(key)
    real = spill_module.read_part

    def meanwhile(path, offset, length, expect=None):
        store[key]  # read back: its file goes
        return real(path, offset, length, expect)

    monkeypatch.setattr(spill_module, "read_part", meanwhile)
    held, rows, lost = _slices(_Worker(store), [key], 1)
    assert held == [0] and lost == [] and not store.is_spilled(key)
    pd.testing.assert_frame_equal(join(rows, None, False, 1), df[df["_partitions"] == 1])


def test_what_a_worker_learned_of_a_placement_goes_with_it_without_the_cyclic_collector():
    """The placement holds each worker's Sources (with the splits it keeps mapped):
    dropping the placement must unmap them at once, not when a collection runs."""
    value = split(frame(100, 4), "_partitions", 4)
    placement = Placement([Location(("shoal-shuffle-split-t", 0), ("w",), 100, None)])
    sources = Sources({}, {0: value.outputs.copy()}, {}, None, {0: (value, 100)})
    assert [pos for pos, _ in sources.map(placement, [0], {})] == [0]
    learned: concurrent.futures.Future = concurrent.futures.Future()
    learned.set_result(sources)
    placement._sources["w"] = learned
    kept = weakref.ref(value)
    gc.disable()
    try:
        del placement, sources, learned, value
        assert kept() is None
    finally:
        gc.enable()


def test_splits_mapped_past_the_budget_are_let_go_and_then_asked_of_their_holders():
    """Mapped splits are kept up to the budget (least recently used go first); one let
    go that cannot be mapped again (here: its segment is gone) is asked of its holder."""
    a, b = (split(frame(100, 4, seed), "_partitions", 4) for seed in (1, 2))
    placement = Placement([Location(("shoal-shuffle-split-t", i), (f"w{i}",), 100, None) for i in range(2)])
    sources = Sources({}, {0: a.outputs.copy(), 1: b.outputs.copy()}, {}, 150, {0: (a, 100), 1: (b, 100)})
    ask: dict = {}
    got = sources.map(placement, [1, 0], ask)
    assert [pos for pos, _ in got] == [1] and got[0][1] is b and ask == {"w0": [0]}


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
            got = join(bundle(list(enumerate(splits)), j), inputs[0].iloc[:0], ignore_index, j)
            expected = dask_concat([s.rows(j) for s in splits], uniform=True, ignore_index=ignore_index)
            if ignore_index:  # (dask's concat keeps the index of frames with categories: shoal's does not)
                expected = expected.reset_index(drop=True)
            pd.testing.assert_frame_equal(got, expected)
    series = [df["obj"] for df in same]
    splits = [split(x, [], 3) for x in series]
    for j in range(3):
        got = join(bundle(list(enumerate(splits)), j), series[0].iloc[:0], ignore_index, j)
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
    out = [join(bundle(list(enumerate(splits)), j), df.iloc[:0], False, j) for j in range(5)]
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
    pd.testing.assert_frame_equal(join(rows, None, False, 2), value.rows(2))
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
        whole = join(bundle(list(enumerate(splits)), j), None, False, j)
        even = bundle([(p, s) for p, s in enumerate(splits) if p % 2 == 0], j)
        odd = bundle([(p, s) for p, s in enumerate(splits) if p % 2], j)
        assert len(even[0].chunks[0]) == (1 if rows == 60 else 3)
        pd.testing.assert_frame_equal(join(odd + even, None, False, j), whole)
        expected = pd.concat([s.rows(j) for s in splits])
        pd.testing.assert_frame_equal(whole, expected)
