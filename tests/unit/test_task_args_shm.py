"""A task's large arguments travel to a same-host worker through shared memory: the
runspec family places them once per payload, the worker maps them copy-on-write."""

from __future__ import annotations

import errno
import gc
import os

import numpy as np
import pytest

from shoal.comm import shm, shm_handover
from shoal.protocol import REMOTE, SAME_HOST, Serialized, deserialize, serialize, to_serialize
from shoal.protocol.core import loads, prepare
from shoal.taskspec import Ref, RunSpec, run

MB = 1 << 20


@pytest.fixture(autouse=True)
def no_leftovers():
    yield
    gc.collect()
    shm.work_off()
    shm.drain_pool()
    assert not shm.segments_of(os.getpid()), "a test left segments in /dev/shm"


def _sum_all(*arrays, extra=0.0):
    return float(sum(a.sum() for a in arrays)) + extra


def _refs(s: Serialized) -> list:
    return [r for r in s.header.get("refs", []) if r is not None]


def test_large_arguments_are_placed_once_and_mapped_copy_on_write():
    big = np.full(2 * MB // 8, 3.0)
    small = np.arange(1000, dtype=np.float64)  # below the threshold: stays a frame
    spec = RunSpec(_sum_all, (big, small), {"extra": 1.0})
    s = serialize(spec, SAME_HOST)
    (ref,) = _refs(s)
    name, size, offset, length, flag, _token = ref
    assert length == big.nbytes and flag == 0  # the sender keeps it: a resend copies nothing
    assert name in shm.owned()
    assert sum(memoryview(f).nbytes for f in s.frames) < MB  # the big buffer is not a frame
    assert _refs(serialize(spec, SAME_HOST)) == [ref]

    got = deserialize(s)
    assert run(got, {}) == _sum_all(big, small, extra=1.0)
    arg = got.args[0]
    assert arg.flags.writeable
    arg[:] = -1.0  # a private copy of the touched pages only
    assert float(deserialize(Serialized(s.family, s.header, s.frames)).args[0][0]) == 3.0
    assert float(big[0]) == 3.0


def test_remote_destinations_get_frames():
    spec = RunSpec(_sum_all, (np.ones(2 * MB // 8),))
    s = serialize(spec, REMOTE)
    assert not _refs(s)
    assert run(deserialize(s), {}) == 2 * MB // 8


def test_refs_to_dependencies_still_work():
    spec = RunSpec(_sum_all, (np.ones(2 * MB // 8), Ref("x")))
    got = deserialize(serialize(spec, SAME_HOST))
    assert run(got, {"x": np.ones(10)}) == 2 * MB // 8 + 10


def test_the_segment_goes_back_to_the_pool_when_the_payload_is_gone():
    spec = RunSpec(_sum_all, (np.ones(4 * MB // 8),))
    (ref,) = _refs(serialize(spec, SAME_HOST))
    del spec
    gc.collect()
    shm.work_off()
    assert ref[0] not in shm.owned()  # its name went; its pages wait in the pool
    before = set(shm.segments_of(os.getpid()))
    assert len(before) == 1 and "-pool" in next(iter(before))
    spec2 = RunSpec(_sum_all, (np.ones(4 * MB // 8),))
    (ref2,) = _refs(serialize(spec2, SAME_HOST))
    # the next payload of that size reuses the pooled segment (renamed): no new pages
    assert set(shm.segments_of(os.getpid())) == {ref2[0]}
    assert ref2[1] == ref[1]


def test_a_payload_whose_segment_is_gone_fails_with_a_clear_error():
    spec = RunSpec(_sum_all, (np.ones(2 * MB // 8),))
    s = serialize(spec, SAME_HOST)
    (ref,) = _refs(s)
    shm.unlink(ref[0])
    with pytest.raises(FileNotFoundError, match="an argument of this task was in shared memory that is gone"):
        deserialize(s)


@pytest.mark.parametrize("refs", [
    "not a list",
    [["shoal-1-x", 100, 0]],
    [["shoal-1-x", 100, 50, 60, 0, "t"]],  # beyond the segment
    [None],  # names a frame that was not sent
])
def test_malformed_refs_are_an_error_of_that_payload(refs):
    frames = serialize(RunSpec(_sum_all, ()), REMOTE).frames[:2]
    with pytest.raises((ValueError, TypeError)):
        deserialize(Serialized("shoal.runspec", {"refs": refs}, frames))


def test_full_shared_memory_sends_the_arguments_as_frames(monkeypatch, caplog):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    shm.drain_pool()
    monkeypatch.setattr(os, "posix_fallocate", full)
    monkeypatch.setattr("shoal.taskspec._shm_warned", [])
    big = np.full(2 * MB // 8, 5.0)
    with caplog.at_level("WARNING", logger="shoal.taskspec"):
        s = serialize(RunSpec(_sum_all, (big,)), SAME_HOST)
    assert not _refs(s)
    assert "shared memory is full" in caplog.text and "tcp" in caplog.text
    assert run(deserialize(s), {}) == 5.0 * (2 * MB // 8)


def test_shared_memory_turned_off_sends_frames(monkeypatch):
    monkeypatch.setenv("SHOAL_SHM", "0")
    s = serialize(RunSpec(_sum_all, (np.ones(2 * MB // 8),)), SAME_HOST)
    assert not _refs(s)


# ----------------------------------------------- handed over to a scheduler that forwards


def _sent_by_a_client_of_another_process(big):
    """A payload as a client whose scheduler is another process writes it: its large
    arguments in a transfer segment (flag 1) under a lease."""
    spec = RunSpec(_sum_all, (big,))
    spec.handoff = True
    prepared = prepare({"op": "update-graph", "payload": to_serialize(spec)})
    return prepared, prepared.frames(SAME_HOST)


def test_a_forwarding_receiver_adopts_handed_over_arguments_and_acknowledges():
    big = np.full(2 * MB // 8, 4.0)
    prepared, frames = _sent_by_a_client_of_another_process(big)
    (lease,) = prepared.leases
    (sent,) = [r for r in loads(frames, deserialize=False)["payload"].header["refs"] if r]
    assert sent[4] == 1
    acks: list[int] = []
    s = loads(frames, deserialize=False, leases=acks)["payload"]  # the scheduler's read
    assert acks == [lease.id]
    (ref,) = _refs(s)
    assert ref[4] == 0 and ref[0] != sent[0] and ref[0] in shm.owned()
    assert not os.path.exists(os.path.join(shm.SHM_DIR, sent[0]))  # renamed, not copied
    lease.end("acknowledged")  # the sender lets go: removing its old name changes nothing
    assert os.path.exists(os.path.join(shm.SHM_DIR, ref[0]))
    assert run(deserialize(s), {}) == 4.0 * (2 * MB // 8)  # what a worker does with it
    del s
    gc.collect()
    shm.work_off()
    assert not os.path.exists(os.path.join(shm.SHM_DIR, ref[0]))  # gone with the payload


def test_a_forwarded_payload_goes_to_a_remote_worker_as_frames():
    big = np.full(2 * MB // 8, 6.0)
    _, frames = _sent_by_a_client_of_another_process(big)
    s = loads(frames, deserialize=False, leases=[])["payload"]
    same_host = loads(prepare({"payload": s}).frames(SAME_HOST), deserialize=False)["payload"]
    assert _refs(same_host) == _refs(s)  # a same-host worker maps it
    remote = loads(prepare({"payload": s}).frames(REMOTE), deserialize=False)["payload"]
    assert "refs" not in remote.header and remote.nbytes >= big.nbytes
    assert run(deserialize(remote), {}) == 6.0 * (2 * MB // 8)


def test_a_decoding_receiver_of_handed_over_arguments_removes_the_name():
    _, frames = _sent_by_a_client_of_another_process(np.ones(2 * MB // 8))
    (sent,) = [r for r in loads(frames, deserialize=False)["payload"].header["refs"] if r]
    spec = loads(frames)["payload"]
    assert run(spec, {}) == 2 * MB // 8
    assert not os.path.exists(os.path.join(shm.SHM_DIR, sent[0]))


@pytest.mark.parametrize("handoff", [False, True], ids=["kept", "handed-over"])
def test_several_large_arguments_share_one_segment_mapped_once(handoff):
    a, b = np.full(2 * MB // 8, 1.0), np.full(3 * MB // 8, 2.0)
    spec = RunSpec(_sum_all, (a, b))
    spec.handoff = handoff
    prepared = prepare({"p": to_serialize(spec)})
    s = loads(prepared.frames(SAME_HOST), deserialize=False)["p"]
    refs = _refs(s)
    assert len(refs) == 2 and refs[0][0] == refs[1][0] and refs[0][4] == refs[1][4] == int(handoff)
    got = deserialize(s)
    assert run(got, {}) == _sum_all(a, b)
    # both arguments are views of one mapping: as far apart as in the segment
    address = [x.__array_interface__["data"][0] for x in got.args]
    assert address[1] - address[0] == refs[1][2] - refs[0][2]
    # decoded outside the entry that leased it, a transfer is not removed by its
    # receiver: the sender's lease ends (as a transport ends it) and removes it
    prepared.end_leases("closed")


def test_a_ref_whose_file_holds_something_else_is_not_adopted():
    _, frames = _sent_by_a_client_of_another_process(np.ones(2 * MB // 8))
    (sent,) = [r for r in loads(frames, deserialize=False)["payload"].header["refs"] if r]
    with open(os.path.join(shm.SHM_DIR, sent[0]), "r+b") as f:
        f.write(b"SHOALSEG" + b"f" * 16)  # another generation now
    acks: list[int] = []
    s = loads(frames, deserialize=False, leases=acks)["payload"]
    assert acks == [] and _refs(s)[0][0] == sent[0]  # left alone, and not acknowledged
    with pytest.raises(FileNotFoundError):
        deserialize(s)
    shm.unlink(sent[0])


def test_an_adopted_segment_goes_back_to_its_maker_for_its_next_arguments(monkeypatch):
    monkeypatch.setattr(shm_handover, "return_to", {os.getpid()})  # the maker is a client of ours
    big = np.full(2 * MB // 8, 4.0)
    _, frames = _sent_by_a_client_of_another_process(big)
    s = loads(frames, deserialize=False, leases=[])["payload"]
    (ref,) = _refs(s)
    inode = os.stat(os.path.join(shm.SHM_DIR, ref[0])).st_ino
    del s  # the scheduler forgets the task
    gc.collect()
    shm.work_off()
    (returned,) = [n for n in os.listdir(shm.SHM_DIR) if n.startswith(f"shoal-{os.getpid()}-ret")]
    # the maker's next hand-over takes it in and fills it: the same pages, no new ones
    _, frames = _sent_by_a_client_of_another_process(big)
    (sent,) = [r for r in loads(frames, deserialize=False)["payload"].header["refs"] if r]
    assert os.stat(os.path.join(shm.SHM_DIR, sent[0])).st_ino == inode
    assert not os.path.exists(os.path.join(shm.SHM_DIR, returned))
    shm.unlink(sent[0])
