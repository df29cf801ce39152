"""The worker's spill store (shoal.worker.store, shoal.worker.spill) on a real disk."""

from __future__ import annotations

import errno
import gc
import json
import logging
import os
import pickle
import subprocess
import sys
import threading
import weakref

import numpy as np
import pandas as pd
import pytest

import shoal
from shoal.comm import shm
from shoal_helpers import small_tmpfs
from shoal.worker import spill
from shoal.worker.store import WorkerStore

MB = 1 << 20


@pytest.fixture(autouse=True)
def no_leftovers():
    yield
    gc.collect()
    shm.work_off()
    shm.drain_pool()
    shm.registry.validate()
    assert not shm.segments_of(os.getpid()), "a test left segments in /dev/shm"


@pytest.fixture
def store(tmp_path):
    s = WorkerStore(target=10 * MB, directory=str(tmp_path / "spill"))
    yield s
    s.close()
    assert not os.listdir(tmp_path / "spill") if (tmp_path / "spill").exists() else True


def files(s: WorkerStore) -> list[str]:
    return sorted(os.listdir(s.directory)) if s.directory and os.path.isdir(s.directory) else []


def check_totals(s: WorkerStore) -> None:
    """The running totals agree with what the store holds."""
    managed = sum(n for k, (kind, n) in s._meta.items() if kind == 0)
    owned = sum(n for k, (kind, n) in s._meta.items() if kind == 1)
    mapped = sum(n for k, (kind, n) in s._meta.items() if kind == 2)
    assert (s.managed, s.shm_owned, s.mapped) == (managed, owned, mapped)
    assert s.spilled_disk == sum(entry[1] for entry in s._slow.values())
    assert s.spilled == sum(entry[2] for entry in s._slow.values())
    assert s.spilled_count == len(s._slow) == len(files(s))
    assert s.spilled_disk == sum(os.path.getsize(entry[0]) for entry in s._slow.values())
    assert set(s._lru) <= set(s._data)
    assert len(s) == len(s._data) + len(s._slow) == len(set(s))


def arr(i: int, mb: int = 2) -> np.ndarray:
    return np.random.default_rng(i).random(mb * MB // 8)


def test_without_a_target_nothing_spills_and_totals_run():
    s = WorkerStore()
    s["a"] = arr(0)
    s["b"] = b"x" * 1000
    s["c"] = {"k": [1, 2, 3]}
    assert s.managed >= 2 * MB + 1000 and s.spilled == s.spilled_count == 0
    assert s.evict() == 0  # no directory, no target: nothing can go
    del s["a"], s["b"]
    assert 0 < s.managed < 2000
    del s["c"]
    assert s.managed == 0 and len(s) == 0
    s.close()


def test_a_value_measured_already_is_counted_by_that_size(store):
    # (a task's thread, or a fetch as the value arrived, measured it: not again here)
    store.put("a", arr(0), 2 * MB)
    store.put("b", pd.DataFrame({"s": ["x"] * 10}), 12_345)
    assert store.nbytes("a") == 2 * MB and store.nbytes("b") == 12_345
    assert store.managed == 2 * MB + 12_345
    store.evict()  # the least recently used goes to disk: its size is kept
    assert store.kind("a") == "spilled" and store.nbytes("a") == 2 * MB
    check_totals(store)
    with pytest.raises(KeyError):
        store.nbytes("c")


def test_values_past_the_target_spill_least_recently_used_first(store):
    for i in range(4):
        store[i] = arr(i)  # 8 MB: all fit
    assert store.spilled_count == 0
    store[0]  # 0 is now the most recently used; 1 the least
    store[4] = arr(4)
    store[5] = arr(5)  # 12 MB: one must go
    assert [k for k in range(6) if store.is_spilled(k)] == [1]
    store[6] = arr(6)
    assert [k for k in range(7) if store.is_spilled(k)] == [1, 2]
    assert store.managed <= store.target
    check_totals(store)
    # reading a spilled value back brings it into memory (the next store makes room)
    got = store[1]
    assert np.array_equal(got, arr(1)) and got.flags.writeable
    assert not store.is_spilled(1) and store.managed > store.target
    check_totals(store)
    store["small"] = b"x"
    assert store.managed <= store.target
    # 1 is held here (``got``): writing it out would free nothing, so the next goes
    assert store.is_spilled(3) and store.is_spilled(2) and not store.is_spilled(1)
    del got
    for k in range(7):
        assert np.array_equal(store[k], arr(k))
    check_totals(store)


def test_values_held_elsewhere_spill_last(store):
    held = [arr(i) for i in range(3)]
    for i in range(3):
        store[i] = held[i]
    del held[1:]  # 0 stays held by the test (a running task's input, say)
    assert store.evict() > 0 and store.is_spilled(1)
    assert store.evict() > 0 and store.is_spilled(2)
    # only held ones are left: the least recently used goes all the same
    assert store.evict() > 0 and store.is_spilled(0)
    assert store.evict() == 0


def test_a_value_heavier_than_the_target_goes_straight_to_disk(store):
    store["small"] = arr(0, 1)
    store["big"] = arr(1, 12)
    assert store.is_spilled("big") and not store.is_spilled("small")
    assert np.array_equal(store["small"], arr(0, 1))
    check_totals(store)


@pytest.mark.parametrize("compress", [True, False])
def test_values_read_back_equal(tmp_path, compress):
    s = WorkerStore(target=1, directory=str(tmp_path), compress=compress)
    values = {
        "random": arr(3),
        "zeros": np.zeros((500, 600)),
        "fortran": np.asfortranarray(np.arange(60_000.0).reshape(200, 300)),
        "strided": np.arange(100_000)[::3],
        "bytes": os.urandom(100_000),
        "bytearray": bytearray(b"ab" * 50_000),
        "dict": {"a": [1, 2.5, "three"], "b": (None, True), "c": np.arange(10)},
        "frame": pd.DataFrame({"x": np.arange(50_000), "y": np.linspace(0, 1, 50_000), "s": ["t"] * 50_000}),
        "series": pd.Series(np.arange(1000.0), name="n"),
        "lambda": lambda x: x + 1,  # plain pickle refuses it: cloudpickle takes it
        "tuple-key": 1,
    }
    for k, v in values.items():
        s[k] = v
    assert s.spilled_count == len(values) and s.managed == 0
    for k, v in values.items():
        got = s[k]
        if isinstance(v, np.ndarray):
            assert got.dtype == v.dtype and got.shape == v.shape and np.array_equal(got, v)
            assert got.flags.writeable
            if k == "fortran":
                assert got.flags.f_contiguous and not got.flags.c_contiguous
        elif isinstance(v, pd.DataFrame):
            pd.testing.assert_frame_equal(got, v)
        elif isinstance(v, pd.Series):
            pd.testing.assert_series_equal(got, v)
        elif k == "lambda":
            assert got(1) == 2
        elif k == "dict":
            assert got["a"] == v["a"] and got["b"] == v["b"] and np.array_equal(got["c"], v["c"])
        else:
            assert got == v and type(got) is type(v)
    s.close()


@pytest.mark.skipif(not spill.lz4_available(), reason="lz4 not installed")
def test_compression_shrinks_what_shrinks_and_leaves_the_rest(tmp_path):
    on = WorkerStore(target=1, directory=str(tmp_path / "on"))
    off = WorkerStore(target=1, directory=str(tmp_path / "off"), compress=False)
    for s in (on, off):
        s["zeros"] = np.zeros(MB)
        s["random"] = arr(1, 1)
    on_zeros, on_random = (on._slow[k][1] for k in ("zeros", "random"))
    off_zeros, off_random = (off._slow[k][1] for k in ("zeros", "random"))
    assert on_zeros < off_zeros // 20  # zeros compress
    assert off_zeros >= 8 * MB
    assert on_random == off_random  # random data is written as it is
    assert np.array_equal(on["zeros"], np.zeros(MB)) and np.array_equal(on["random"], arr(1, 1))
    on.close()
    off.close()


def test_compressed_frames_over_a_chunk_read_back(tmp_path, monkeypatch):
    monkeypatch.setattr(spill, "CHUNK", 1 << 16)
    path = str(tmp_path / "v")
    value = np.tile(np.arange(1000, dtype=np.int64), 300)  # compressible, 2.4 MB
    n = spill.write_value(path, value)
    assert n < value.nbytes // 2 or not spill.lz4_available()
    assert np.array_equal(spill.read_value(path), value)


def test_accounting_after_set_get_delete_and_evict(store):
    store["a"] = arr(0)
    store["b"] = arr(1)
    store["c"] = b"x" * 100
    check_totals(store)
    before = store.managed
    freed = store.evict()
    assert freed >= 2 * MB and store.is_spilled("a")
    assert store.managed == before - freed and store.spilled_count == 1 and store.spilled >= 2 * MB
    check_totals(store)
    del store["a"]  # a spilled value goes without being read back
    assert store.spilled == store.spilled_count == 0 and not files(store)
    store.discard("b")
    store.discard("nothing")
    assert store.managed == 100  # only the small bytes object left
    with pytest.raises(KeyError):
        del store["b"]
    with pytest.raises(KeyError):
        store["b"]
    # overwriting a spilled key drops its file
    store["c"] = arr(2)
    store.evict()
    assert store.is_spilled("c")
    store["c"] = 5
    assert not store.is_spilled("c") and store["c"] == 5 and not files(store)
    check_totals(store)
    assert store.evict() > 0 and store.evict() == 0  # the int went; nothing is left
    check_totals(store)


def test_unpicklable_values_stay_in_memory_and_are_not_retried(store, monkeypatch):
    calls = []
    real = spill.write_value

    def counting(path, obj, compress=True):
        calls.append(type(obj).__name__)
        return real(path, obj, compress)

    monkeypatch.setattr(spill, "write_value", counting)
    store["lock"] = threading.Lock()
    store["file"] = open(os.devnull)  # noqa: SIM115 - closed below
    ids = id(store["lock"]), id(store["file"])
    store["array"] = arr(0)  # the most recently used
    assert store.evict() >= 2 * MB  # the lock and the file are passed over
    assert store.is_spilled("array") and (id(store["lock"]), id(store["file"])) == ids
    assert store.unspillable == {"lock", "file"}
    calls.clear()
    assert store.evict() == 0 and store.evict() == 0
    assert calls == []  # nothing left to try: the lock and the file are not tried again
    # stored anew, a value is tried again
    store["lock"] = 3
    assert store.unspillable == {"file"}
    store["file"].close()
    check_totals(store)


def test_a_full_disk_keeps_values_in_memory_warns_once_and_recovers(caplog):
    caplog.set_level(logging.DEBUG, logger="shoal.worker")
    with small_tmpfs("1m") as path:
        s = WorkerStore(target=4 * MB, directory=os.path.join(path, "spill"))
        s.disk_retry = 0.0  # every eviction tries the disk
        s["small"] = np.zeros(100_000, dtype=np.uint8) + 1  # fits (and compresses)
        for i in range(3):
            s[i] = arr(i)  # 2 MB of random data each: never fits in 1 MB
        assert s.disk_full
        assert s.is_spilled("small") and not any(s.is_spilled(i) for i in range(3))
        assert len(files(s)) == 1  # the partial files are gone
        assert s.evict() == 0
        check_totals(s)
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "cannot spill" in warnings[0].getMessage()
        for i in range(3):
            assert np.array_equal(s[i], arr(i))  # nothing is lost
        # room again: a later spill that fits succeeds and clears the flag
        s["tiny"] = np.ones(1000)
        del s[0], s[1], s[2]
        assert not s.disk_full
        s["again"] = arr(9, 5)  # too big for the disk again: no second warning
        assert s.disk_full
        assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
        assert s.evict() > 0 and not s.disk_full  # the small ones fit
        check_totals(s)
        s.close()
        assert not files(s)


def test_while_the_disk_is_full_evict_tries_it_again_only_after_a_while(tmp_path, monkeypatch):
    s = WorkerStore(target=None, directory=str(tmp_path))
    s["a"] = arr(0)
    writes = []

    def full(fd, buffers):
        writes.append(fd)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "writev", full)
    assert s.evict() == 0 and s.disk_full and not files(s)
    assert s.evict() == 0 and len(writes) == 1  # not tried again at once
    monkeypatch.undo()
    s._retry_at = 0.0  # the while has passed
    assert s.evict() >= 2 * MB and not s.disk_full
    s.close()


def test_owned_segment_values_spill_and_their_segment_goes(tmp_path):
    s = WorkerStore(target=3 * MB, directory=str(tmp_path))
    value = arr(0)
    seg, local = shm.place(value)
    name = seg.name
    reader = shm.attach(seg.info)  # a peer's mapping of it, as a reader would hold
    s.expect("k", seg)
    s["k"] = local
    del local
    assert s.kind("k") == "shm" and s.shm_owned == seg.size and s.managed == 0
    assert s.segment_info("k") == seg.info
    s["other"] = arr(1)  # 2 MB more: past the target, the segment's value spills
    assert s.is_spilled("k") and s.shm_owned == 0 and s.segment_info("k") is None
    assert not os.path.exists(os.path.join(shm.SHM_DIR, name))
    assert name not in shm.owned()
    assert np.array_equal(reader, value)  # the reader's mapping stays valid
    got = s["k"]  # back as private memory
    assert np.array_equal(got, value) and s.kind("k") == "managed" and got.flags.writeable
    check_totals(s)
    del reader, got
    s.close()


def test_clear_unlinks_segments_and_removes_spill_files(tmp_path):
    s = WorkerStore(target=3 * MB, directory=str(tmp_path))
    seg, local = shm.place(arr(0))
    s.expect("k", seg)
    s["k"] = local
    seg2, _ = shm.place(arr(2))
    s.expect("never", seg2)
    s.unexpect("never")
    for i in range(3):
        s[i] = arr(i)
    assert files(s)
    del local
    s.clear()
    assert not files(s) and len(s) == 0 and s.managed == s.spilled == s.shm_owned == 0
    assert not shm.owned()


def test_a_store_without_a_directory_spills_to_its_own_and_removes_it():
    s = WorkerStore(target=MB)
    s["a"] = arr(0)
    assert s.is_spilled("a")
    own = s._own_dir
    assert own is not None and os.listdir(own)
    assert np.array_equal(s["a"], arr(0))
    s.close()
    assert not os.path.exists(own)


PEER = """
import json, sys
import numpy as np
from shoal.comm import shm
seg, _ = shm.place(np.arange(1 << 18, dtype=np.float64))
print(json.dumps(seg.info), flush=True)
sys.stdin.readline()
seg.unlink()
"""


def test_values_in_a_peers_segment_weigh_nothing_and_never_spill(tmp_path):
    peer = subprocess.Popen([sys.executable, "-c", PEER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(peer.stdout.readline())
        s = WorkerStore(target=MB, directory=str(tmp_path))
        mapped = shm.attach(info)
        s["peer"] = mapped
        assert s.kind("peer") == "mapped" and s.mapped == mapped.nbytes and s.managed == 0
        s["mine"] = arr(0)  # past the target: its own value goes, the peer's stays
        assert s.is_spilled("mine") and s.kind("peer") == "mapped"
        assert s.evict() == 0  # nothing that may spill is in memory
        assert np.array_equal(s["peer"], np.arange(1 << 18, dtype=np.float64))
        # an array inside a container is found too
        s["wrapped"] = {"x": mapped}
        assert s.kind("wrapped") == "mapped"
        s["view"] = mapped.reshape(512, 512)[:, ::2]  # a strided view of it: still the peer's memory
        assert s.kind("view") == "mapped"
        del s["view"]
        check_totals(s)
        del s["peer"]
        assert s.mapped == s._meta["wrapped"][1]
        s.close()
        del mapped
    finally:
        peer.stdin.write("\n")
        peer.stdin.close()
        peer.wait(timeout=30)
        peer.stdout.close()
    assert peer.returncode == 0


def test_user_sizeof_that_raises_counts_64_and_the_value_still_spills(store):
    class Odd:
        def __sizeof__(self):
            raise RuntimeError("boom")

        @property
        def nbytes(self):
            raise RuntimeError("boom")

    store["odd"] = Odd()
    assert store.managed == 64
    assert store.evict() == 64 and store.is_spilled("odd")
    assert isinstance(store["odd"], Odd)


def flip_bit(path: str, offset: int | None = None) -> None:
    """Flip one bit of the file at ``offset`` (its middle by default)."""
    with open(path, "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        offset = size // 2 if offset is None else offset
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x08]))


@pytest.mark.parametrize("read", ["getitem", "peek"])
@pytest.mark.parametrize("damage", ["flip", "truncate", "remove", "header"])
def test_a_damaged_spill_file_loses_its_key_with_an_error_naming_key_and_file(store, read, damage):
    store["a"] = arr(0, 8)  # 8 MB of noise: written raw
    store["b"] = np.full(MB, 2.0)  # compresses
    store.evict()
    store.evict()
    assert store.is_spilled("a") and store.is_spilled("b")
    path = store._slow["a"][0]
    if damage == "flip":
        flip_bit(path)
    elif damage == "header":
        flip_bit(path, 20)  # a length in the header
    elif damage == "truncate":
        os.truncate(path, os.path.getsize(path) - 1)
    else:
        os.unlink(path)
    with pytest.raises(spill.CorruptSpillFile) as info:
        store["a"] if read == "getitem" else store.peek("a")
    assert info.value.key == "a" and info.value.path == path
    assert "'a'" in str(info.value) and path in str(info.value)
    assert isinstance(info.value, shoal.CorruptedDataError)
    # the value is gone, its file too; the rest is as it was
    assert "a" not in store and not os.path.exists(path)
    check_totals(store)
    assert np.array_equal(store["b"], np.full(MB, 2.0))


def test_every_bit_flipped_in_a_spill_file_is_caught(tmp_path):
    """Any one bit, anywhere (header, table, raw and compressed frames): an error,
    never a different value."""
    value = {"noise": arr(1, 1)[:1000], "zeros": np.zeros(200_000), "text": "x" * 5000}
    path = str(tmp_path / "v.spill")
    size = spill.write_value(path, value)
    with open(path, "rb") as f:
        good = f.read()
    rng = np.random.default_rng(0)
    offsets = sorted({*range(0, 120), *rng.integers(0, size, 300).tolist(), size - 1})
    for offset in offsets:
        with open(path, "wb") as f:
            f.write(good)
        flip_bit(path, offset)
        with pytest.raises(spill.CorruptSpillFile):
            spill.read_value(path)


def test_a_value_whose_unpickling_raises_is_lost_like_a_corrupt_file(store):
    store["odd"] = Breaks()
    store.evict()
    Breaks.broken = True
    try:
        with pytest.raises(spill.CorruptSpillFile, match="cannot be read back"):
            store["odd"]
    finally:
        Breaks.broken = False
    assert "odd" not in store
    check_totals(store)


class Breaks:
    broken = False

    def __init__(self):
        self.payload = bytes(1000)

    def __setstate__(self, state):
        if Breaks.broken:
            raise RuntimeError("cannot come back")
        self.__dict__.update(state)


def test_actors_never_spill(store):
    from shoal.worker.actor import ActorRef

    class Counter:
        n = 0

    ref = ActorRef("Counter", "a", "inproc://w", Counter())
    store["actor"] = ref
    del ref
    store["big"] = arr(0, 12)
    assert store.evict() == 0  # the big one went straight to disk; the actor stays
    assert not store.is_spilled("actor") and isinstance(store["actor"].instance, Counter)


def test_big_buffers_are_written_from_where_they_are():
    a = arr(0)
    frames = spill.dump_frames({"a": a})
    assert len(frames) == 2
    assert np.frombuffer(frames[1], dtype=np.uint8).ctypes.data == a.ctypes.data  # a view, not a copy


def test_without_lz4_files_are_raw_and_a_compressed_one_says_why(tmp_path, monkeypatch):
    zeros = np.zeros(MB)
    compressed = str(tmp_path / "c")
    spill.write_value(compressed, zeros)
    monkeypatch.setattr(spill, "_lz4", None)
    raw = str(tmp_path / "r")
    assert spill.write_value(raw, zeros) >= zeros.nbytes
    assert np.array_equal(spill.read_value(raw), zeros)
    if os.path.getsize(compressed) < zeros.nbytes:  # lz4 was there when it was written
        with pytest.raises(spill.CorruptSpillFile, match="lz4"):
            spill.read_value(compressed)


@pytest.mark.skipif(not spill.lz4_available(), reason="lz4 not installed")
def test_a_frame_whose_sample_shrinks_but_whole_does_not_is_written_raw(tmp_path, monkeypatch):
    monkeypatch.setattr(spill, "CHUNK", 1 << 16)
    piece = spill._SAMPLE_PIECE
    value = np.frombuffer(os.urandom(MB), dtype=np.uint8).copy()
    for at in (0, MB // 2, MB - piece):  # where the sample is taken: zeros
        value[at : at + piece] = 0
    path = str(tmp_path / "v")
    written = spill.write_value(path, value)
    assert MB <= written == os.path.getsize(path) < MB + 4096
    assert np.array_equal(spill.read_value(path), value)


HAND_OVER = """
import json, pickle, sys
import numpy as np
from shoal.comm import shm
from shoal.comm.shm_files import DATA_OFFSET, HEADER
bufs = []
data = pickle.dumps(np.arange(1 << 18, dtype=np.float64), protocol=5, buffer_callback=bufs.append)
raw = bufs[0].raw()
name, size, token = shm.fill_segment(DATA_OFFSET + raw.nbytes, [(HEADER, memoryview(data)), (DATA_OFFSET, raw)],
                                     keep=False)
print(json.dumps([name, size, token, len(data), raw.nbytes]), flush=True)
sys.stdin.readline()
"""


def test_a_value_in_a_transfer_segment_taken_over_counts_as_owned_and_spills_with_it(tmp_path):
    from shoal.comm.shm_files import DATA_OFFSET, HEADER
    from shoal.comm.shm_registry import SegmentState

    peer = subprocess.Popen([sys.executable, "-c", HAND_OVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        name, size, token, n, length = json.loads(peer.stdout.readline())
        view = shm.map_segment(name, size, token, adopt=True)  # as a worker keeps what it is sent
        ours = shm.locate(view)[0]
        assert shm.registry.state(ours) is SegmentState.ADOPTED
        value = pickle.loads(view[HEADER : HEADER + n], buffers=[view[DATA_OFFSET : DATA_OFFSET + length]])
        del view
        s = WorkerStore(target=None, directory=str(tmp_path))
        s["k"] = value
        assert s.kind("k") == "shm" and s.shm_owned == value.nbytes and s.mapped == 0
        del value
        assert s.evict() == 1 << 21 and s.is_spilled("k")
        assert not os.path.exists(os.path.join(shm.SHM_DIR, ours)) and ours not in shm.owned()
        assert np.array_equal(s["k"], np.arange(1 << 18, dtype=np.float64))
        s.close()
    finally:
        peer.stdin.write("\n")
        peer.stdin.close()
        peer.wait(timeout=30)
        peer.stdout.close()
    assert peer.returncode == 0


def test_whether_a_new_value_fits_counts_the_store_and_the_rest_of_the_process(store) -> None:
    """A result that would take the worker past its target is soon spilled, so the worker
    gives it no shared-memory segment first; what fits counts the store's values now and
    what else the process held at the monitor's last look."""
    from shoal.worker.memory import Thresholds
    from shoal.worker.monitor import MemoryMonitor

    assert store.fits(10 * MB) and not store.fits(10 * MB + 1)
    store["a"] = np.ones(MB, dtype="u1")
    assert store.fits(9 * MB) and not store.fits(9 * MB + 1)

    limit = 1 << 40  # far above this process: the monitor spills nothing, pauses nothing
    monitor = MemoryMonitor(store, Thresholds(limit, limit // 2, None, None, None), own_process=True,
                            pause=lambda paused: None)
    monitor.check()
    rest = monitor.unmanaged
    assert rest > 0  # the interpreter and what it imported
    room = limit // 2 - rest - MB
    assert monitor.fits(room) and not monitor.fits(room + 1)
    store["b"] = np.ones(MB, dtype="u1")  # counted at once, before the next look
    assert monitor.fits(room - MB) and not monitor.fits(room - MB + 1)

    unlimited = MemoryMonitor(store, Thresholds(limit, None, None, None, None), own_process=True,
                              pause=lambda paused: None)
    assert unlimited.fits(limit)


def test_memory_turns_tight_where_a_result_arrives_that_one_more_would_pass_the_target(tmp_path) -> None:
    """A worker hands no task ahead of a free thread once another result of the size of
    the last would pass its target: decided where that result arrives (before the state
    machine hands out the next task), and lifted by the periodic look only when one
    more would fit again."""
    from shoal.worker.memory import Thresholds
    from shoal.worker.monitor import MemoryMonitor
    from shoal.worker.store import WorkerStore

    target = 10 * MB
    store = WorkerStore(target=target, directory=str(tmp_path / "spill"))
    told: list[bool] = []
    # a worker sharing its process goes by the store's figures: exact
    monitor = MemoryMonitor(store, Thresholds(2 * target, target, None, None, None), own_process=False,
                            pause=lambda paused: None, tight=told.append)
    monitor.result_arrives(3 * MB)  # store empty: this one and one more fit
    assert told == [] and not monitor.tight
    store["a"] = np.ones(3 * MB, dtype="u1")
    monitor.result_arrives(3 * MB)  # 3 held + this 3 + one more 3 = 9: fits
    assert told == []
    store["b"] = np.ones(3 * MB, dtype="u1")
    monitor.result_arrives(3 * MB)  # 6 + 3 + 3 = 12 > 10: tight before it is stored
    assert told == [True] and monitor.tight
    monitor.result_arrives(3 * MB)  # already tight: said once
    assert told == [True]
    store["c"] = np.ones(3 * MB, dtype="u1")
    monitor.check()  # 9 held, the next 3 would pass: still tight
    assert told == [True]
    del store["b"], store["c"]
    monitor.check()  # 3 held + 3 expected: room again
    assert told == [True, False] and not monitor.tight
    monitor.result_arrives(64)  # small results: nothing changes
    monitor.check()
    assert told == [True, False]

    untargeted = MemoryMonitor(store, Thresholds(2 * target, None, None, None, None), own_process=False,
                               pause=lambda paused: None, tight=told.append)
    untargeted.result_arrives(1 << 40)
    assert told == [True, False]
    store.clear()


_HEAP_SCRIPT = """
from concurrent.futures import ThreadPoolExecutor
import numpy as np
import psutil
from shoal.worker.monitor import keep_heap_small, private_memory

print(keep_heap_small())
def private():
    return private_memory(psutil.Process().memory_info())
def task(i):
    out = np.empty(16 << 17)  # 16 MiB
    out.fill(i)
    return out
# as a worker does: tasks in a thread make arrays; the store keeps the last six
# (the older ones "spill": dropped) and small records of its own besides
with ThreadPoolExecutor(1) as pool:
    before = private()
    arrays, records = {}, []
    for i in range(24):
        arrays[i] = pool.submit(task, i).result()
        arrays.pop(i - 6, None)
        records.append(bytearray(4096))
    middle = private()
    arrays.clear()
    print(before, middle, private())
"""


def _run_heap_script(env: dict[str, str]) -> tuple[str, list[int]]:
    out = subprocess.run([sys.executable, "-c", _HEAP_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=60, check=True).stdout.split("\n")
    return out[0], [int(x) for x in out[1].split()]


def test_a_worker_process_gives_freed_arrays_back_to_the_system() -> None:
    from shoal.worker.monitor import _glibc

    if _glibc() is None:
        pytest.skip("glibc's allocator only: other C libraries have no trim threshold to set")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    was_set, (before, middle, after) = _run_heap_script(env)
    assert was_set == "True"
    assert middle - before >= 90 << 20, "the arrays were resident"
    assert after - before < 8 << 20, f"{(after - before) >> 20} MiB kept after the arrays were freed"


def test_the_users_malloc_setting_wins_and_zero_turns_it_off() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    for name in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_"):
        assert _run_heap_script({**env, name: "1000000"})[0] == "False"
    assert _run_heap_script({**env, "SHOAL_MALLOC_THRESHOLD": "0"})[0] == "False"


def test_past_spill_values_held_only_by_cycles_are_collected(tmp_path) -> None:
    """Past spill, a value that only a reference cycle still holds (the collector runs
    rarely while shoal serves) is freed by a full collection, at most once a second."""
    from shoal.worker.memory import Thresholds
    from shoal.worker.monitor import MemoryMonitor
    from shoal.worker.store import WorkerStore

    class Node:
        def __init__(self) -> None:
            self.me = self
            self.value = np.ones(20 * MB, dtype="u1")

    store = WorkerStore(target=None, directory=str(tmp_path / "spill"))
    gc.disable()  # the cycle stays until someone collects it
    try:
        store["kept"] = np.ones(MB, dtype="u1")
        node = Node()
        held = weakref.ref(node)
        del node
        # a worker sharing its process goes by the store's figures; these thresholds
        # put it past spill whatever the store holds
        monitor = MemoryMonitor(store, Thresholds(4, None, 1, None, None), own_process=False,
                                pause=lambda paused: None)
        monitor.check()
        assert held() is None and monitor.collections == 1
        Node()  # another cycle, within the second: not collected by this look
        monitor.check()
        assert monitor.collections == 1
    finally:
        gc.enable()
        gc.collect()
        store.clear()
