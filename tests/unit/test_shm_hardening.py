"""A hostile or buggy peer on the same host cannot freeze, misdirect or abuse the
shared-memory data plane: names it sends are checked, files it points at are opened
without following symlinks or waiting on FIFOs and used only if they are this user's
regular files, and a transfer ref makes the receiver remove or take over a file only
when it came under a lease from the process named in it."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import numpy as np
import pytest

from shoal.comm import shm, shm_family, shm_files, shm_handover
from shoal.examples import device_array
from shoal.protocol import SAME_HOST, deserialize, to_serialize
from shoal.protocol.core import loads, prepare
from shoal.taskspec import RunSpec, run

MB = 1 << 20
#: what "returns at once" means for a call that must not block
DEADLINE = 5.0
NOBODY = 65534


class Made:
    """Files a test put in /dev/shm; each one is removed when the test ends."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    def name(self, kind: str) -> str:
        """A fresh name in shoal's form, as this process would make it."""
        return shm_files.new_name(f"test{kind}")

    def path(self, name: str) -> str:
        path = os.path.join(shm.SHM_DIR, name)
        self.paths.append(path)
        return path

    def fifo(self, kind: str = "fifo") -> str:
        name = self.name(kind)
        os.mkfifo(self.path(name), 0o600)
        return name

    def file(self, data: bytes, kind: str = "file", name: str | None = None) -> str:
        name = name or self.name(kind)
        with open(self.path(name), "xb") as f:
            f.write(data)
        return name

    def symlink(self, target: str, kind: str = "link") -> str:
        name = self.name(kind)
        os.symlink(target, self.path(name))
        return name

    def remove_all(self) -> None:
        for path in self.paths:
            try:
                if os.path.isdir(path) and not os.path.islink(path):
                    os.rmdir(path)
                else:
                    os.unlink(path)
            except FileNotFoundError:
                pass


@pytest.fixture
def made() -> Iterator[Made]:
    m = Made()
    try:
        yield m
    finally:
        m.remove_all()


@pytest.fixture(autouse=True)
def no_leftovers() -> Iterator[None]:
    yield
    shm.work_off()
    shm.drain_pool()
    assert not shm.segments_of(os.getpid()), "a test left files in /dev/shm"


@pytest.fixture
def root_only() -> None:
    if os.geteuid() != 0:
        pytest.skip("making a file of another user needs root")


def _segment_bytes(token: str, size: int = 4096) -> bytes:
    """A file that passes every check of the segment format for ``token``."""
    return shm_files.segment_header(token).ljust(size, b"\0")


def _returns_at_once(fn: Callable[[], Any], fifo: str | None = None) -> Any:
    """``fn()``'s result, which must come within the deadline. Should it block (on
    ``fifo``), the FIFO is opened for writing so that the stuck thread ends."""
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    thread.start()
    thread.join(DEADLINE)
    if thread.is_alive() and fifo is not None:
        fd = os.open(os.path.join(shm.SHM_DIR, fifo), os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        thread.join(DEADLINE)
    assert result, f"{fn} blocked"
    return result[0]


def _raises_at_once(fn: Callable[[], Any], fifo: str | None = None) -> BaseException:
    def call() -> Any:
        try:
            fn()
        except BaseException as exc:
            return exc
        return None

    exc = _returns_at_once(call, fifo)
    assert exc is not None, f"{fn} did not refuse"
    return exc


# ------------------------------------------------------------------------- names


@pytest.mark.parametrize("name", [
    "../etc/passwd",
    "shoal-../../etc/passwd",
    "shoal-1/../../etc/passwd",
    "shoal-1-..",
    "shoal-1-x\0y",
    "shoal-" + "x" * 250,
    "shoal-",
    "other-1-x",
    "",
    7,
    None,
])
def test_a_name_not_in_shoal_form_is_refused_before_any_open(name: Any) -> None:
    with pytest.raises(ValueError, match="not a shoal segment name"):
        shm_files.segment_path(name)
    with pytest.raises(ValueError, match="not a shoal segment name"):
        shm.map_segment(name, 4096, "0" * 16)
    assert not shm.check_probe(name, "0" * 16)
    assert shm_handover.adopt_segment(name, "0" * 16) is None


def test_shoal_own_names_pass() -> None:
    for kind in ("", "pool", "probe", "ret"):
        name = shm_files.new_name(kind)
        assert shm_files.segment_path(name) == f"{shm.SHM_DIR}/{name}"


def test_a_ref_with_a_bad_name_fails_that_message_and_the_next_one_decodes() -> None:
    prepared = prepare({"x": to_serialize(np.ones(2 * MB // 8))})
    frames = prepared.frames(SAME_HOST)
    try:
        bad = _rewrite_refs(frames, lambda ref: ["../../etc/passwd", *ref[1:]])
        with pytest.raises(ValueError, match="not a shoal segment name"):
            loads(bad)
        assert float(loads(frames)["x"].sum()) == 2 * MB // 8  # nothing was lost
    finally:
        prepared.end_leases("closed")


def test_spans_outside_the_segment_are_malformed() -> None:
    with pytest.raises(ValueError, match="outside the segment"):
        shm.attach(["shoal-1-x", 4096, 10, [[4000, 200]], "0" * 16])
    with pytest.raises(ValueError, match="outside the segment"):
        shm.attach(["shoal-1-x", 4096, 5000, [], "0" * 16])
    with pytest.raises(ValueError, match="less than its header"):
        shm.map_segment("shoal-1-x", -1, "0" * 16)


# --------------------------------------------------------- files that are no segments


def test_a_probe_that_is_a_fifo_is_refused_at_once(made: Made) -> None:
    fifo = made.fifo()
    assert _returns_at_once(lambda: shm.check_probe(fifo, "0" * 32), fifo) is False


def test_a_segment_that_is_a_fifo_is_refused_at_once(made: Made) -> None:
    fifo = made.fifo()
    exc = _raises_at_once(lambda: shm.map_segment(fifo, 4096, "0" * 16), fifo)
    assert isinstance(exc, FileNotFoundError) and "not a shoal segment" in str(exc)
    exc = _raises_at_once(lambda: shm.attach([fifo, 4096, 0, [], "0" * 16]), fifo)
    assert isinstance(exc, FileNotFoundError)
    assert _returns_at_once(lambda: shm_handover.adopt_segment(fifo, "0" * 16), fifo) is None
    assert os.path.exists(os.path.join(shm.SHM_DIR, fifo))  # left alone


def test_a_symlink_is_refused_even_to_a_real_segment(made: Made) -> None:
    placed = shm.place(np.arange(1 << 17, dtype=np.float64))
    assert placed is not None
    seg = placed[0]
    probe = shm.probe()
    assert probe is not None
    try:
        to_segment = made.symlink(os.path.join(shm.SHM_DIR, seg.name))
        with pytest.raises(FileNotFoundError, match="not a shoal segment"):
            shm.attach([to_segment, *seg.info[1:]])
        assert shm_handover.adopt_segment(to_segment, seg.info[4]) is None
        to_probe = made.symlink(os.path.join(shm.SHM_DIR, probe[0]))
        assert not shm.check_probe(to_probe, probe[1])
        to_passwd = made.symlink("/etc/passwd")
        assert not shm.check_probe(to_passwd, "root")
        with pytest.raises(FileNotFoundError, match="not a shoal segment"):
            shm.map_segment(to_passwd, 64, "0" * 16)
        assert np.array_equal(shm.attach(seg.info), np.arange(1 << 17, dtype=np.float64))  # the real one
    finally:
        seg.unlink()
        shm.unlink(probe[0])


def test_a_directory_is_refused(made: Made) -> None:
    name = made.name("dir")
    os.mkdir(made.path(name))
    with pytest.raises(FileNotFoundError, match="not a shoal segment"):
        shm.map_segment(name, 4096, "0" * 16)
    assert not shm.check_probe(name, "0" * 16)


def test_a_file_of_another_user_is_refused(made: Made, root_only: None) -> None:
    token = "ab" * 8
    segment = made.file(_segment_bytes(token))
    probe = made.file(b"cd" * 16, kind="probe")
    for name in (segment, probe):
        os.chown(os.path.join(shm.SHM_DIR, name), NOBODY, NOBODY)
    with pytest.raises(FileNotFoundError, match=f"uid {NOBODY}"):
        shm.map_segment(segment, 4096, token)
    with pytest.raises(FileNotFoundError):
        shm.attach([segment, 4096, 0, [], token])
    assert not shm.check_probe(probe, "cd" * 16)
    assert shm_handover.adopt_segment(segment, token) is None
    assert os.path.exists(os.path.join(shm.SHM_DIR, segment))
    os.chown(os.path.join(shm.SHM_DIR, segment), os.geteuid(), os.getegid())
    assert len(shm.map_segment(segment, 4096, token)) == 4096  # the same file, now ours


def test_sweep_removes_only_this_user_regular_files(made: Made, root_only: None) -> None:
    gone = 999_999_999  # no such process
    mine = made.file(b"x", name=f"shoal-{gone}-mine")
    theirs = made.file(b"x", name=f"shoal-{gone}-theirs")
    os.chown(os.path.join(shm.SHM_DIR, theirs), NOBODY, NOBODY)
    target = made.file(b"keep me")
    link = f"shoal-{gone}-link"
    os.symlink(os.path.join(shm.SHM_DIR, target), made.path(link))
    fifo = f"shoal-{gone}-fifo"
    os.mkfifo(made.path(fifo))
    assert shm.sweep(gone) == 1
    assert not os.path.exists(os.path.join(shm.SHM_DIR, mine))
    assert sorted(shm.segments_of(gone)) == sorted([theirs, link, fifo])
    with open(os.path.join(shm.SHM_DIR, target), "rb") as f:
        assert f.read() == b"keep me"


def test_given_back_files_that_are_no_segments_are_not_taken_in(made: Made) -> None:
    prefix = f"shoal-{os.getpid()}-ret"
    target = made.file(b"x" * 4096)
    link = made.path(f"{prefix}0-link")
    os.symlink(os.path.join(shm.SHM_DIR, target), link)
    fifo = made.path(f"{prefix}1-fifo")
    os.mkfifo(fifo)
    real = made.file(_segment_bytes("ef" * 8), name=f"{prefix}2-real")
    assert shm_handover.reclaim_returned() == 1
    assert not _exists(real)  # in the pool now
    assert os.path.islink(link) and os.path.exists(fifo)  # left where they were


# ---------------------------------------------------------------- transfer refs


def _rewrite_table(frames: list[Any], change: Callable[[list[Any]], None]) -> list[Any]:
    """``frames`` with each entry of the out-of-band table changed by ``change``."""
    table = msgpack.unpackb(frames[1], raw=False)
    for entry in table:
        change(entry)
    return [frames[0], msgpack.packb(table, use_bin_type=True), *frames[2:]]


def _without_leases(frames: list[Any]) -> list[Any]:
    return _rewrite_table(frames, lambda entry: entry.__delitem__(slice(4, None)))


def _rewrite_refs(frames: list[Any], change: Callable[[list[Any]], list[Any]]) -> list[Any]:
    def each(entry: list[Any]) -> None:
        entry[1]["refs"] = [None if r is None else change(r) for r in entry[1]["refs"]]

    return _rewrite_table(frames, each)


def _transfer(value: Any) -> tuple[Any, list[Any], str]:
    """A message carrying ``value`` through a transfer segment, as a transport sends
    it: ``(prepared, frames, segment name)``; the caller ends the leases."""
    prepared = prepare({"x": to_serialize(value)})
    frames = prepared.frames(SAME_HOST)
    (entry,) = msgpack.unpackb(frames[1], raw=False)
    (ref,) = [r for r in entry[1]["refs"] if r is not None]
    assert ref[4] == 1 and len(entry) == 5 and entry[4]
    return prepared, frames, ref[0]


def _total(a: np.ndarray) -> float:
    return float(a.sum())


def _exists(name: str) -> bool:
    return os.path.exists(os.path.join(shm.SHM_DIR, name))


@pytest.fixture(params=[False, True], ids=["remover", "adopter"])
def adopting(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """A receiver that removes transfers (a client) or keeps them (a worker)."""
    monkeypatch.setattr(shm.registry, "adopt_transfers", request.param)
    return bool(request.param)


def test_a_leased_transfer_is_taken(adopting: bool) -> None:
    value = np.arange(2 * MB // 8, dtype=np.float64)
    prepared, frames, name = _transfer(value)
    try:
        got = loads(frames)["x"]
        assert np.array_equal(got, value)
        assert not _exists(name)  # removed, or renamed to a name of this process
        where = shm.locate(memoryview(got).cast("B"))
        assert where is not None and (where[0] != name) == adopting  # kept under a new name
    finally:
        prepared.end_leases("acknowledged")


def test_a_transfer_without_lease_ids_is_only_mapped(adopting: bool) -> None:
    value = np.arange(2 * MB // 8, dtype=np.float64)
    prepared, frames, name = _transfer(value)
    try:
        for unleased in (_without_leases(frames), _rewrite_table(frames, lambda e: e.__setitem__(4, []))):
            assert np.array_equal(loads(unleased)["x"], value)
            assert _exists(name)  # neither removed nor renamed
        acks: list[int] = []
        kept = loads(_without_leases(frames), deserialize=False, leases=acks)["x"]
        (ref,) = kept.header["refs"]
        assert acks == [] and ref[0] == name and ref[4] == 1 and _exists(name)  # not adopted either
    finally:
        prepared.end_leases("closed")
    assert not _exists(name)  # the sender's lease still removes it


def test_a_transfer_decoded_outside_a_leased_entry_is_only_mapped() -> None:
    """A payload kept serialized and decoded later (a worker with its scheduler's
    payloads) came without leases on this connection: its refs are only mapped."""
    spec = RunSpec(_total, (np.ones(2 * MB // 8),))
    spec.handoff = True
    prepared = prepare({"p": to_serialize(spec)})
    frames = prepared.frames(SAME_HOST)
    try:
        kept = loads(_without_leases(frames), deserialize=False)["p"]
        (ref,) = [r for r in kept.header["refs"] if r is not None]
        assert ref[4] == 1
        assert run(deserialize(kept), {}) == 2 * MB // 8
        assert _exists(ref[0])
    finally:
        prepared.end_leases("closed")


def test_a_transfer_named_after_another_process_than_the_peer_is_left_alone(
    adopting: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(shm_family, "warned_foreign", [])
    value = np.arange(2 * MB // 8, dtype=np.float64)
    prepared, frames, name = _transfer(value)
    another = os.getpid() + 1  # the peer says it is this process; the file says otherwise
    reset = shm_family.receiving_from.set(another)
    try:
        with caplog.at_level(logging.WARNING, logger="shoal.comm.shm_family"):
            for _ in range(2):
                assert np.array_equal(loads(frames)["x"], value)
                assert _exists(name)
            acks: list[int] = []
            kept = loads(frames, deserialize=False, leases=acks)["x"]
            assert acks == [] and kept.header["refs"][0][0] == name and _exists(name)  # not adopted
        warnings = [r for r in caplog.records if "not named after it" in r.getMessage()]
        assert len(warnings) == 1 and str(another) in warnings[0].getMessage()
    finally:
        shm_family.receiving_from.reset(reset)
        prepared.end_leases("closed")
    assert not _exists(name)


def test_a_transfer_named_after_the_peer_is_taken(adopting: bool) -> None:
    value = np.arange(2 * MB // 8, dtype=np.float64)
    prepared, frames, name = _transfer(value)
    reset = shm_family.receiving_from.set(os.getpid())  # the peer made it
    try:
        assert np.array_equal(loads(frames)["x"], value)
        assert not _exists(name)
    finally:
        shm_family.receiving_from.reset(reset)
        prepared.end_leases("acknowledged")
        shm.work_off()


@pytest.mark.parametrize("claims", ["another process", "the owner"])
def test_a_transfer_ref_naming_a_value_segment_leaves_it_alone(made: Made, adopting: bool, claims: str) -> None:
    """The attack itself: a leased transfer ref that names a value segment the peer
    did not make (its name and token are what the owner's clients learn). A peer that
    says it is another process: the receiver maps the segment (the value is what the
    file holds) and keeps its hands off the file. A peer that claims to be the owner
    (the pid is only claimed): the segment's header says it is a value's, not a
    transfer, so decoding fails and the file is left alone, adopted by no one."""
    placed = shm.place(np.full(2 * MB // 8, 7.0))
    assert placed is not None
    victim = placed[0]
    prepared, frames, mine = _transfer(np.zeros(2 * MB // 8))
    forged = _rewrite_refs(frames, lambda ref: [victim.name, victim.size, victim.info[3][0][0],
                                                victim.info[3][0][1], 1, victim.info[4]])
    reset = shm_family.receiving_from.set(999_999_999 if claims == "another process" else os.getpid())
    try:
        if claims == "another process":
            assert float(loads(forged)["x"][0]) == 7.0
        else:
            with pytest.raises(ValueError, match="not a transfer"):
                loads(forged)
        acks: list[int] = []
        kept = loads(forged, deserialize=False, leases=acks)["x"]
        assert acks == [] and kept.header["refs"][0][0] == victim.name  # not adopted
        assert _exists(victim.name)
        assert np.array_equal(shm.attach(victim.info), np.full(2 * MB // 8, 7.0))
    finally:
        shm_family.receiving_from.reset(reset)
        prepared.end_leases("closed")
        victim.unlink()
    assert not _exists(mine)


def test_an_adopted_transfer_is_a_value_segment_then() -> None:
    """A segment a receiver adopted (a scheduler keeping a payload) is its own: the
    same ref sent again cannot make another receiver take it."""
    value = np.arange(2 * MB // 8, dtype=np.float64)
    prepared, frames, name = _transfer(value)
    try:
        acks: list[int] = []
        kept = loads(frames, deserialize=False, leases=acks)["x"]
        (ref,) = kept.header["refs"]
        assert acks and ref[0] != name and ref[4] == 0 and _exists(ref[0])  # adopted
        again = _rewrite_refs(frames, lambda r: [ref[0], *r[1:]])
        with pytest.raises(ValueError, match="not a transfer"):
            loads(again)
        assert loads(again, deserialize=False)["x"].header["refs"][0][:5:4] == [ref[0], 1]  # not adopted
        assert _exists(ref[0])
        assert np.array_equal(deserialize(kept), value)
    finally:
        prepared.end_leases("acknowledged")
        del kept
        shm.work_off()


# ----------------------------------------------------------- the device-array example


@pytest.mark.parametrize("handle", [
    "../etc/passwd",
    "shoal-../../etc/passwd",
    "shoal-1/../../../etc/passwd",
    "/etc/passwd",
    "shoal-1-x\0",
    "shoal-" + "x" * 300,
    None,
])
def test_the_device_array_example_refuses_a_handle_outside_dev_shm(handle: Any) -> None:
    with pytest.raises(ValueError, match="not a device-array handle"):
        device_array._loads({"handle": handle, "nbytes": 10}, [])


def test_the_device_array_example_refuses_files_that_are_no_exports(made: Made) -> None:
    fifo = made.fifo()
    exc = _raises_at_once(lambda: device_array._loads({"handle": fifo, "nbytes": 10}, []), fifo)
    assert isinstance(exc, ValueError) and "not a device-array export" in str(exc)
    link = made.symlink("/etc/passwd")
    with pytest.raises(ValueError, match="cannot import device array"):
        device_array._loads({"handle": link, "nbytes": 10}, [])
    short = made.file(b"abc")
    with pytest.raises(ValueError, match="holds 3 bytes, not the 1099511627776 announced"):
        device_array._loads({"handle": short, "nbytes": 1 << 40}, [])
    assert device_array._loads({"handle": short, "nbytes": 3}, []).to_host() == b"abc"


def test_the_device_array_example_refuses_another_user_export(made: Made, root_only: None) -> None:
    name = made.file(b"abc")
    os.chown(os.path.join(shm.SHM_DIR, name), NOBODY, NOBODY)
    with pytest.raises(ValueError, match="not a device-array export of this user"):
        device_array._loads({"handle": name, "nbytes": 3}, [])
