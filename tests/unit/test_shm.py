"""The shared-memory data plane's pieces: placing, mapping, probing, sweeping."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from shoal.comm import shm
from shoal.protocol import SAME_HOST, dumps, loads, to_serialize


@pytest.fixture(autouse=True)
def no_leftovers():
    yield
    assert not shm.segments_of(os.getpid()), "a test left segments in /dev/shm"


def test_place_and_attach_round_trip_copy_on_write():
    a = np.arange(100_000, dtype=np.float64)
    seg, local = shm.place(a)
    try:
        assert np.array_equal(local, a) and local.flags.writeable
        assert os.path.exists(os.path.join(shm.SHM_DIR, seg.name))
        other = shm.attach(seg.info)
        assert np.array_equal(other, a) and other.flags.writeable
    finally:
        seg.unlink()
    # the name is gone; mapped values stay valid
    assert not os.path.exists(os.path.join(shm.SHM_DIR, seg.name))
    assert local.sum() == a.sum()
    with pytest.raises(FileNotFoundError):
        shm.attach(["shoal-999999999-gone", 4096, 10, [], "0" * 16])


def test_a_large_frame_to_another_host_goes_out_from_the_owners_mapping():
    from shoal.comm.shm_files import buffer_address
    from shoal.comm.tcp import _frames_for
    from shoal.protocol import REMOTE, prepare

    a = np.arange(1 << 18, dtype=np.float64)  # 2 MiB
    seg, local = shm.place(a)
    try:
        frames, replaced = _frames_for(prepare({"x": to_serialize(local)}), REMOTE)
        [big] = [f for f in frames if memoryview(f).nbytes >= 1 << 20]
        # the same bytes, from the owner's mapping (its pages are there), not the
        # value's own copy-on-write one, which stays alive with the message
        assert bytes(big) == a.tobytes()
        assert buffer_address(memoryview(big)) != buffer_address(memoryview(local))
        assert [buffer_address(memoryview(r)) for r in replaced] == [buffer_address(memoryview(local))]
        # same host: no change (the value goes as a segment reference there anyway)
        frames, replaced = _frames_for(prepare({"x": to_serialize(local)}), SAME_HOST)
        assert replaced == []
    finally:
        seg.unlink()
    # a private value (no segment) goes as it is
    frames, replaced = _frames_for(prepare({"x": to_serialize(np.ones(1 << 18))}), REMOTE)
    assert replaced == []


def test_small_or_bufferless_values_are_not_placed():
    assert shm.place(np.arange(10)) is None
    assert shm.place({"a": 1}) is None
    assert shm.place(b"x" * 100) is None


def test_full_shared_memory_is_a_clear_error_and_leaves_nothing(monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(shm.ShmUnavailable, match=r"shared memory is full: .* bytes free\); the value travels over tcp"):
        shm.place(np.zeros(1 << 20))


def test_same_host_family_sends_segment_references_not_bytes():
    a = np.arange(1 << 17, dtype=np.int64)
    seg, local = shm.place(a)
    try:
        frames = dumps({"x": to_serialize(local)}, SAME_HOST)
        assert sum(memoryview(f).nbytes for f in frames) < 4096  # no 1 MB buffer in there
        out = loads(frames)["x"]
        assert np.array_equal(out, a)
        assert shm.locate(memoryview(out).cast("B")) is not None
        # a buffer that is not in a segment still travels as a frame
        plain = dumps({"x": to_serialize(a)}, SAME_HOST)
        assert sum(memoryview(f).nbytes for f in plain) > a.nbytes
        assert np.array_equal(loads(plain)["x"], a)
    finally:
        seg.unlink()


def test_probe_is_seen_in_this_domain_and_token_checked():
    made = shm.probe()
    assert made is not None
    name, token = made
    try:
        assert shm.check_probe(name, token)
        assert not shm.check_probe(name, "0" * 32)
        assert not shm.check_probe("shoal-0-nothing", token)
        assert not shm.check_probe("../etc/passwd", token)
    finally:
        shm.unlink(name)


@pytest.mark.parametrize("fails", ["open", "write"])
@pytest.mark.parametrize("error", [errno.ENOSPC, errno.EMFILE, errno.EIO])
def test_a_probe_that_cannot_be_made_is_none_leaves_nothing_and_warns_once(monkeypatch, caplog, fails, error):
    real_open, real_write = os.open, os.write

    def failing(*args):
        if fails == "open" and str(args[0]).startswith(f"{shm.SHM_DIR}/shoal-"):
            raise OSError(error, os.strerror(error))
        if fails == "write" and args[0] not in (0, 1, 2):
            raise OSError(error, os.strerror(error))
        return (real_open if fails == "open" else real_write)(*args)

    monkeypatch.setattr(shm, "probe_warned", False)
    monkeypatch.setattr(os, fails, failing)
    with caplog.at_level("DEBUG", logger="shoal.comm.shm"):
        assert [shm.probe() for _ in range(3)] == [None] * 3
    monkeypatch.undo()
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and os.strerror(error) in warnings[0].getMessage()
    assert "offer no shared memory" in warnings[0].getMessage()
    assert not shm.segments_of(os.getpid()) and not any("probe" in n for n in shm.owned())
    made = shm.probe()  # room again: probes again, without a word
    assert made is not None
    shm.unlink(made[0])


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("SHOAL_SHM", "0")
    assert not shm.enabled()
    assert shm.probe() is None


def test_sweep_removes_a_dead_process_segments():
    import subprocess
    import sys

    code = (
        "import numpy as np; from shoal.comm import shm; "
        "seg, _ = shm.place(np.zeros(1 << 17)); print(seg.name, flush=True); "
        "import os; os._exit(0)"  # exits without unlinking, as a killed process would
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    name = out.stdout.strip()
    pid = int(name.split("-")[1])
    assert shm.segments_of(pid) == [name]
    assert shm.process_gone(pid)
    assert shm.sweep(pid) == 1
    assert shm.segments_of(pid) == []


def test_segment_names_are_checked():
    with pytest.raises(ValueError, match="not a shoal segment name"):
        shm.attach(["../../etc/passwd", 10, 1, [], "0" * 16])
    with pytest.raises(ValueError, match="malformed"):
        shm.attach(["shoal-1-x", "ten", 1, [], "0" * 16])
    with pytest.raises(ValueError, match="malformed"):
        shm.attach(["shoal-1-x", 10, 1, []])  # the old four-element form


def test_retired_segments_are_reused_only_when_nobody_maps_them():
    import gc

    shm.drain_pool()
    a = np.arange(1 << 18, dtype=np.float64)
    seg, mine = shm.place(a)
    other = shm.attach(seg.info)  # a second mapping, as a reader elsewhere would hold
    first_info = seg.info
    seg.retire()
    # its name goes at once: no process can map the released value by it any more
    assert not os.path.exists(os.path.join(shm.SHM_DIR, first_info[0]))
    # still mapped: not reused, a new segment is made, and the pool gives up as much
    # room (the readers' mappings keep its pages until they let go)
    seg2, v2 = shm.place(a * 2)
    assert not shm.registry.pooled()
    assert np.array_equal(other, a) and np.array_equal(mine, a)  # the readers' data is intact
    del mine, other
    gc.collect()
    # a segment retired while nobody maps it: the next value of a fitting size reuses its memory
    seg2_info = seg2.info
    seg2.retire()
    del v2
    gc.collect()
    assert [name for _, name in shm.registry.pooled()] != [seg2_info[0]] and len(shm.registry.pooled()) == 1
    seg3, v3 = shm.place(a * 3)
    assert not shm.registry.pooled()
    assert np.array_equal(v3, a * 3)
    seg3.unlink()
    shm.drain_pool()


def test_retired_segments_nobody_reuses_are_given_back(monkeypatch):
    import gc

    shm.drain_pool()
    a = np.arange(1 << 18, dtype=np.float64)
    old_seg, v1 = shm.place(a)
    new_seg, v2 = shm.place(a * 2)
    del v1, v2
    gc.collect()
    monkeypatch.setattr(shm.registry, "clock", lambda: 1000.0)
    old_seg.retire()
    monkeypatch.setattr(shm.registry, "clock", lambda: 1100.0)  # 100 s later
    new_seg.retire()
    assert len(shm.registry.pooled()) == 2
    (_, old_name), (_, new_name) = shm.registry.pooled()
    assert shm.trim_pool(30.0) == 1
    assert [n for _, n in shm.registry.pooled()] == [new_name]
    assert not os.path.exists(os.path.join(shm.SHM_DIR, old_name))
    assert not shm.registry.has_writer(old_name) and shm.registry.state(old_name) is None
    assert shm.trim_pool(30.0) == 0  # the recent one stays for reuse
    shm.drain_pool()
    assert not shm.registry.pooled()


def test_a_forked_child_leaves_the_parents_segments_alone():
    import gc

    shm.drain_pool()
    seg, value = shm.place(np.arange(1 << 17, dtype=np.float64))
    pooled, v2 = shm.place(np.arange(1 << 17, dtype=np.float64) * 2)
    del v2
    gc.collect()
    pooled.retire()
    pid = os.fork()
    if pid == 0:  # the child: owns nothing, reuses nothing, removes nothing at exit
        try:
            ok = not shm.owned() and not shm.registry.pooled() and shm.place(np.ones(1 << 17)) is not None
            shm.unlink_all()
            os._exit(0 if ok else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert os.path.exists(os.path.join(shm.SHM_DIR, seg.name)) and len(shm.registry.pooled()) == 1
    assert not shm.segments_of(pid)
    seg.unlink()
    shm.drain_pool()


def test_a_reader_with_a_stale_token_is_refused():
    a = np.arange(1 << 17, dtype=np.float64)
    seg, _ = shm.place(a)
    try:
        name, size, nbytes, layout, token = seg.info
        with pytest.raises(FileNotFoundError, match="no longer holds"):
            shm.map_segment(name, size, "f" * 16)
    finally:
        seg.unlink()


def test_a_segment_being_rewritten_is_refused():
    import fcntl

    a = np.arange(1 << 17, dtype=np.float64)
    seg, _ = shm.place(a)
    try:
        fd = os.open(os.path.join(shm.SHM_DIR, seg.name), os.O_RDWR)
        try:
            del _
            import gc

            gc.collect()
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as the owner reusing it would
            with pytest.raises(FileNotFoundError, match="rewritten"):
                shm.attach(seg.info)
        finally:
            os.close(fd)
    finally:
        seg.unlink()
