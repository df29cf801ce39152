"""A "foreign" worker written from docs/protocol.md alone joins a real shoal cluster.

The worker is in ``foreign_worker.py`` beside this file. It uses only the standard library
(``socket``, ``struct``, ``mmap``, ``fcntl``, ``pickle``, ...), ``msgpack`` and
``cloudpickle`` (nothing from shoal): framing (§2), the handshake with both steps,
offering a shared-memory probe and checking the peer's (§3), message encoding with the
out-of-band table, its optional lease ids, and the ``pickle``, ``bytes``,
``shoal.runspec`` and ``shoal.same-host`` families (§4), leases and
``shoal-lease-ack`` (§4.8), requests (§5), batched streams (§6), the scheduler <->
worker ops with their optional fields (§7), ``get-data`` both ways and ``update-data``
(§8), and the shared-memory data plane (§4.7): mapping the segments named in
``compute-task`` and in ``shoal.same-host`` refs (a shared ``flock`` held while
mapped, the header's token checked), placing its own large results in segments with
the 64-byte header, reported in ``task-finished``, renaming them away when their keys
are freed and reusing them only under an exclusive ``flock``. It runs in threads of
the test process, with blocking sockets and a deadline on every socket operation, on
loopback only. The shared-memory parts can be turned off (``shm=False``): the worker
then declines shared memory in the handshake, as a worker without the data plane does.

This module starts a scheduler (and, for peer transfers, one ordinary shoal worker)
with the command line, and a normal ``shoal.Client`` submits tasks to the foreign
worker: successes, a failure, dependencies fetched in both directions between the
foreign and the Python worker (by ``get-data``, and by mapping segments in both
directions), values scattered to the foreign worker and fetched from the Python worker
as transfer segments with leases (acknowledged), results with out-of-band buffers,
tuple keys, and ``free-keys`` / ``unregister`` / ``close``. A test without a cluster
checks the segment rules of §4.7 against shoal's own reader and owner, both ways.
"""


from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from foreign_wire import (
    SEG_HEADER,
    SHM_DIR,
    SHM_PREFIX,
    Connection,
    SegmentGone,
    SegmentPool,
    attach,
    get_data,
    request,
    segment_header,
    shm_path,
    stats,
    value_of,
)
from foreign_worker import (
    ForeignWorker,
)

# =====================================================================================
# The foreign worker (docs/protocol.md only; no shoal imports in this part)
# =====================================================================================
import shoal
from shoal_helpers import read_line


class _Procs:
    def __init__(self, tmp_path: Any):
        self.tmp_path = tmp_path
        self.procs: list[tuple[subprocess.Popen[bytes], Any]] = []

    def start(self, *args: str, banner: str, timeout: float = 60.0) -> tuple[subprocess.Popen[bytes], str]:
        """``python -m shoal ARGS``; returns the process and the address it prints."""
        log = open(self.tmp_path / f"{args[0]}-{len(self.procs)}.log", "wb")  # noqa: SIM115 - closed in close()
        proc = subprocess.Popen([sys.executable, "-m", "shoal", *args], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=log)
        self.procs.append((proc, log))
        line = read_line(proc, time.monotonic() + timeout)
        assert line.startswith(banner), f"{args[0]} printed {line!r}; log: {self.log_of(proc)}"
        return proc, line.split()[-1]

    def log_of(self, proc: subprocess.Popen[bytes]) -> str:
        for p, log in self.procs:
            if p is proc:
                log.flush()
                with open(log.name, errors="replace") as f:
                    return f.read()[-4000:]
        return ""

    def close(self) -> None:
        for proc, _ in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc, log in self.procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
            log.close()


@pytest.fixture
def procs(tmp_path: Any) -> Iterator[_Procs]:
    p = _Procs(tmp_path)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def workers() -> Iterator[list[ForeignWorker]]:
    started: list[ForeignWorker] = []
    try:
        yield started
    finally:
        for w in started:
            w.stop()


def _scheduler(procs: _Procs) -> tuple[subprocess.Popen[bytes], str]:
    proc, address = procs.start("scheduler", "--host", "127.0.0.1", "--port", "0", banner="shoal scheduler at ")
    assert address.startswith("tcp://127.0.0.1:")
    return proc, address


#: whether this run can use shared memory (the Python processes decide the same way)
SHM = os.path.isdir(SHM_DIR) and os.environ.get("SHOAL_SHM", "1") != "0"


@pytest.fixture
def lease_ends(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, str]]:
    """``(lease id, reason)`` of every lease this process (the client) ends."""
    from shoal.protocol.leases import Lease

    ended: list[tuple[int, str]] = []
    original = Lease.end

    def end(self: Lease, reason: str) -> bool:
        done = original(self, reason)
        if done:
            ended.append((self.id, reason))
        return done

    monkeypatch.setattr(Lease, "end", end)
    return ended


def _foreign_files() -> set[str]:
    """Files in /dev/shm the foreign worker (this process) created: segments, probes."""
    prefix = f"{SHM_PREFIX}{os.getpid()}-f"
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith(prefix)}
    except OSError:
        return set()


@pytest.mark.timeout(180)
def test_foreign_worker_runs_tasks_and_serves_data(procs: _Procs, workers: list[ForeignWorker],
                                                   lease_ends: list[tuple[int, str]]) -> None:
    _, address = _scheduler(procs)
    py_proc, py_address = procs.start("worker", address, "--no-nanny", "--name", "python", "--host", "127.0.0.1",
                                      banner="shoal worker at ")
    fw = ForeignWorker(address, name="foreign", shm=SHM)
    workers.append(fw)  # stopped by the fixture even if start() fails
    fw.start()
    here = [fw.address]
    there = [py_address]
    # §3: on one host each end can open the other's probe (unless shared memory is off)
    assert fw.scheduler_handshake["we_map_theirs"] is SHM
    assert fw.scheduler_handshake["peer_maps_ours"] is SHM
    before = stats.copy()

    with shoal.Client(address, timeout=30) as c:
        info = c.scheduler_info()
        assert info["workers"][fw.address]["name"] == "foreign"
        assert info["workers"][fw.address]["nthreads"] == 1
        assert py_address in info["workers"]

        # a task, its value fetched by the client from the foreign worker (get-data)
        f1 = c.submit(lambda x: x + 1, 41, workers=here)
        assert f1.result(timeout=30) == 42
        assert c.who_has([f1]) == {f1.key: [fw.address]}
        assert f1.key in fw.served

        # a tuple key, keyword arguments and an argument whose pickle has an out-of-band
        # buffer (a numpy array: frames[2:] of the runspec entry)
        arr = np.arange(50_000, dtype="int64")
        f2 = c.submit(lambda x, *, scale: (int(x.sum()), scale), arr, scale=3,
                      key=("foreign", 2), workers=here)
        assert f2.result(timeout=30) == (int(arr.sum()), 3)

        # an argument of 1 MiB or more: with shared memory it lies in a segment the
        # scheduler's process keeps while it knows the task, named in the payload's refs
        big = np.full((2 << 20) // 8, 3.0)
        with pytest.warns(UserWarning, match="MB of arguments"):  # the client's advice to scatter
            f_big = c.submit(lambda x: float(x.sum()), big, workers=here, pure=False)
        assert f_big.result(timeout=30) == 3.0 * big.size

        # an argument wrapped with to_serialize travels pickled inside the payload
        assert c.submit(lambda x: x * 2, shoal.to_serialize(21), workers=here).result(timeout=30) == 42

        # a value with out-of-band pickle buffers on the way back; with shared memory the
        # foreign worker put it in a segment of its own and said so in task-finished: the
        # client maps it (key-in-memory "shm") instead of asking for it
        f3 = c.submit(lambda n: np.full(n, 7, dtype="float64"), 300_000, workers=here)
        out = f3.result(timeout=30)
        assert out.dtype == np.float64 and out.shape == (300_000,) and (out == 7).all()
        if SHM:
            assert f3.key in fw.segments and f3.key not in fw.served
            # and a Python worker maps it too (compute-task "shm"), without asking either
            assert c.submit(lambda x: float(x.sum()), f3, workers=there).result(timeout=30) == 2_100_000.0
            assert f3.key not in fw.served

        # a failing task: the same exception type, with the worker's traceback
        def fail(x: int) -> None:
            raise ValueError(f"boom {x} from the foreign worker")

        bad = c.submit(fail, 7, workers=here)
        with pytest.raises(ValueError, match="boom 7 from the foreign worker") as excinfo:
            bad.result(timeout=30)
        notes = "".join(getattr(excinfo.value, "__notes__", []))
        assert "traceback on the worker" in notes and "fail" in notes
        # a dependent of a failed task fails with the same error
        with pytest.raises(ValueError, match="boom 7"):
            c.submit(lambda v: v, bad, workers=here).result(timeout=30)

        # dependencies across workers: Python -> foreign (bytes and pickle or same-host
        # families), foreign -> foreign (local), foreign -> Python (the Python worker's
        # get-data)
        a = c.submit(lambda: b"abc" * 1000, workers=there)
        d = c.submit(lambda: {"k": [1, 2]}, workers=there)
        b = c.submit(lambda v: len(v), a, workers=here)
        e = c.submit(lambda n, m, nested: (n, m["k"], nested), b, d, [b, {"again": d}], workers=here)
        g = c.submit(lambda t: t[0] * 2, e, workers=there)
        assert g.result(timeout=30) == 6000
        assert e.result(timeout=30) == (3000, [1, 2], [3000, {"again": {"k": [1, 2]}}])

        # a large input that the Python worker placed in shared memory: compute-task says
        # where ("shm"); the foreign worker maps it (or, without shared memory, there is
        # no "shm" and it fetches the value with get-data)
        big = c.submit(lambda: np.arange(200_000, dtype="int64"), workers=there)
        total = c.submit(lambda x: int(x.sum()), big, workers=here)
        assert total.result(timeout=30) == int(np.arange(200_000, dtype="int64").sum())
        if SHM:
            assert fw.shm_hints >= 1
            assert stats["segments-mapped"] > before["segments-mapped"]

        # scatter to the foreign worker: a large private buffer crosses as a transfer
        # segment with a lease (§4.7, §4.8); the foreign worker maps it, removes its
        # name and acknowledges before answering, so the client's lease has ended,
        # acknowledged, by the time scatter returns
        arr2 = np.arange(300_000, dtype="int64")  # 2.4 MB: over the 1 MiB of a transfer
        n_ended = len(lease_ends)
        [s_here] = c.scatter([arr2], workers=here)
        if SHM:
            assert [reason for _, reason in lease_ends[n_ended:]] == ["acknowledged"]
        assert c.submit(lambda x: int(x.sum()), s_here, workers=here).result(timeout=30) == int(arr2.sum())

        # scatter to the Python worker, then a foreign task that needs it: the Python
        # worker kept the transfer segment the value came in under a name of its own and
        # made it a value segment (§8.2), so compute-task says where it lies ("shm") and
        # the foreign worker maps it without asking anyone; nothing is copied
        arr3 = np.arange(400_000, dtype="int64") * 3
        [s_there] = c.scatter([arr3], workers=there)
        mid = stats.copy()
        assert c.submit(lambda x: int(x[::2].sum()), s_there, workers=here).result(timeout=30) == int(arr3[::2].sum())
        if SHM:
            assert stats["segments-mapped"] > mid["segments-mapped"]
            assert stats["transfers-mapped"] == mid["transfers-mapped"]
            assert stats["lease-ids-received"] == mid["lease-ids-received"]

        # requests of our own to the Python worker, on one connection
        with Connection(py_address, "doc-test", shm=SHM, secret=fw.secret) as conn:
            assert conn.handshake["we_map_theirs"] is SHM and conn.handshake["peer_maps_ours"] is SHM
            # a value in its result segment: a flag-0 ref, no lease; the segment stays
            entry = conn.call("get-data", keys=[big.key])["result"]["data"][big.key]
            acks: list[int] = []
            assert (value_of(entry, acks) == np.arange(200_000, dtype="int64")).all()
            assert acks == []
            if SHM:
                assert entry.family == "shoal.same-host" and not entry.lease_ids
                [ref] = entry.header["refs"]
                assert len(ref) == 6 and ref[4] == 0
                # the segment is still there, with the header of the ref's token (§4.7)
                with open(os.path.join(SHM_DIR, ref[0]), "rb") as f:
                    assert f.read(SEG_HEADER) == segment_header(ref[5])
            # the scattered value: a flag-0 ref to the segment the worker kept, named
            # after its own process
            entry = conn.call("get-data", keys=[s_there.key])["result"]["data"][s_there.key]
            acks = []
            assert (value_of(entry, acks) == arr3).all()
            if SHM:
                assert entry.family == "shoal.same-host" and not entry.lease_ids and not acks
                [ref] = entry.header["refs"]
                assert len(ref) == 6 and ref[4] == 0 and ref[0].startswith(f"shoal-{py_proc.pid}-")
                assert os.path.exists(os.path.join(SHM_DIR, ref[0]))
            conn.ack(acks)
            # the acknowledgment is not a request: no response, and the connection serves on
            ident = conn.call("identity")
            assert ident["status"] == "OK" and ident["result"]["address"] == py_address
        # declining shared memory: the same values as plain pickles, no leases
        mid = stats.copy()
        plain = get_data(py_address, "doc-test", [d.key, s_there.key], shm=False, secret=fw.secret)
        assert plain[d.key] == {"k": [1, 2]} and (plain[s_there.key] == arr3).all()
        assert stats["family:pickle"] >= mid["family:pickle"] + 2
        assert stats["lease-ids-received"] == mid["lease-ids-received"]

        # many tasks at once (more than nthreads: the worker queues them)
        squares = c.map(lambda i: i * i, range(30), workers=here)
        assert c.gather(squares) == [i * i for i in range(30)]

        # an op the foreign worker does not serve: an error response, not a hang
        with pytest.raises(shoal.RemoteError, match="no handler for op 'run'"):
            c.run(os.getpid, workers=here)

        # free-keys once the client lets go
        key = f1.key
        f1.release()
        assert fw.wait_freed(key, timeout=30), fw.ops_received[-20:]
        assert key not in fw.data

    # the client closed: everything it held is freed on the foreign worker, and the
    # names of the segments it placed went with their keys (§4.7); their memory is kept
    # for reuse under names no message carried
    assert fw.wait_freed(f2.key, timeout=30)
    assert fw.wait_freed(e.key, timeout=30)
    assert fw.wait_freed(f3.key, timeout=30)
    assert fw.wait_freed(s_here.key, timeout=30)
    assert not fw.segments
    assert {n for n in _foreign_files() if "-fpool" not in n} == set()
    assert bool(fw.pool.released) is SHM

    # every family of §4.5 and §4.7 was decoded, and a payload carried out-of-band buffers
    expected = {"family:pickle", "family:bytes", "family:shoal.runspec", "runspec-buffers"}
    if SHM:
        expected |= {"family:shoal.same-host", "refs-mapped", "transfers-mapped", "segments-mapped", "runspec-refs-mapped",
                     "segments-placed", "lease-ids-received", "acks-sent"}
    assert expected <= {k for k, v in (stats - before).items() if v > 0}, stats - before
    # everyone on this host could open our probe, and we theirs
    assert fw.peer_handshakes
    for hs in fw.peer_handshakes:
        assert hs["we_map_theirs"] is SHM and hs["peer_maps_ours"] is SHM, hs

    # a clean leave: unregister, the scheduler closes the stream and forgets the worker
    fw.leave()
    ident = request(address, "test", "identity", secret=fw.secret)
    assert ident["status"] == "OK"
    assert fw.address not in ident["result"]["workers"]
    assert py_address in ident["result"]["workers"]
    assert {"compute-task", "free-keys"} <= set(fw.ops_received)
    assert not fw.errors, fw.errors
    assert py_proc.poll() is None
    fw.stop()  # and the released segments go when the worker stops
    assert _foreign_files() == set()


@pytest.mark.timeout(120)
def test_foreign_worker_is_closed_by_scheduler_shutdown(procs: _Procs, workers: list[ForeignWorker]) -> None:
    # a worker without the shared-memory data plane: no probe, "can_map": false (§3, §11)
    sched, address = _scheduler(procs)
    fw = ForeignWorker(address, name="foreign-2", shm=False)
    workers.append(fw)
    fw.start()
    assert fw.scheduler_handshake["we_map_theirs"] is False
    assert fw.scheduler_handshake["peer_maps_ours"] is False
    before = stats.copy()
    with shoal.Client(address, timeout=30) as c:
        big = c.submit(lambda n: np.ones(n), 100_000, workers=[fw.address])
        assert c.submit(lambda: "hi", workers=[fw.address]).result(timeout=30) == "hi"
        assert float(big.result(timeout=30).sum()) == 100_000.0
    # nothing placed in, or received through, shared memory; nothing to acknowledge
    assert not fw.segments and big.key in fw.served
    assert stats["lease-ids-received"] == before["lease-ids-received"]
    assert stats["family:shoal.same-host"] == before["family:shoal.same-host"]
    for hs in fw.peer_handshakes:
        assert hs["we_map_theirs"] is False and hs["peer_maps_ours"] is False, hs
    sched.terminate()  # the scheduler shuts down: it sends close to every worker
    assert fw.closed_by_scheduler.wait(30), fw.ops_received
    assert fw.stream_ended.wait(30)
    assert sched.wait(30) == 0
    assert not fw.errors, fw.errors


def _pool_files(pid: int, kind: str) -> set[str]:
    prefix = f"{SHM_PREFIX}{pid}-{kind}"
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith(prefix)}
    except OSError:
        return set()


@pytest.mark.skipif(not SHM, reason="needs /dev/shm and SHOAL_SHM not 0")
@pytest.mark.timeout(60)
def test_segment_rules_hold_against_shoals_own_reader_and_owner() -> None:
    """§4.7 both ways, without a cluster: the foreign reader (shared flock, token) on
    segments shoal places and reuses, and shoal's reader on segments the foreign owner
    places, releases and reuses."""
    import gc

    from shoal.comm import shm as py_shm

    py_shm.drain_pool()
    gc.collect()
    pid = os.getpid()
    arr = np.arange(1 << 17, dtype="float64")  # 1 MiB of buffer: worth a segment

    # -- shoal owns, the foreign reader maps ------------------------------------------
    def py_place(value: Any) -> tuple[Any, Any]:
        placed = py_shm.place(value)
        assert placed is not None
        return placed

    seg, own = py_place(arr)
    try:
        info = seg.info
        assert len(info) == 5 and info[1] >= SEG_HEADER
        with open(shm_path(info[0]), "rb") as f:
            assert f.read(SEG_HEADER) == segment_header(info[4])
        mine = attach(info)
        assert np.array_equal(mine, arr)
        with pytest.raises(SegmentGone, match="no longer holds"):
            attach([*info[:4], "0" * 16])  # another token: not the value we were given
        # released while we map it: its name goes at once, its memory is not reused
        del own
        gc.collect()
        seg.retire()
        assert not os.path.exists(shm_path(info[0]))
        assert len(_pool_files(pid, "pool")) == 1
        seg2, v2 = py_place(arr * 2)
        # our shared lock kept it out of reuse, and the new value's room went out of the pool
        assert _pool_files(pid, "pool") == set()
        assert np.array_equal(mine, arr) and np.array_equal(v2, arr * 2)
        del mine
        # a value released while nobody maps it: the next value of that size reuses its
        # memory, under a new name and token
        info = seg2.info
        seg2.retire()
        del v2
        gc.collect()
        assert len(_pool_files(pid, "pool")) == 1
        seg3, v3 = py_place(arr * 3)
        assert _pool_files(pid, "pool") == set()
        assert seg3.name != info[0] and seg3.info[4] != info[4]
        with pytest.raises(SegmentGone, match="is gone"):
            attach(info)  # the old name
        with pytest.raises(SegmentGone, match="no longer holds"):
            attach([seg3.name, *seg3.info[1:4], info[4]])  # the reused file, the old token
        assert np.array_equal(attach(seg3.info), arr * 3)
        # an owner rewriting a segment holds an exclusive lock: no reader may map it then
        del v3
        gc.collect()
        fd = os.open(shm_path(seg3.name), os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with pytest.raises(SegmentGone, match="being rewritten"):
                attach(seg3.info)
        finally:
            os.close(fd)
        seg2.unlink()
        seg3.unlink()
    finally:
        seg.unlink()
        py_shm.drain_pool()

    # -- the foreign owner places, shoal's reader maps ---------------------------------
    before = _foreign_files()
    pool = SegmentPool()
    try:
        info = pool.place(arr)
        assert info is not None and len(info) == 5
        theirs = py_shm.attach(info)
        assert np.array_equal(theirs, arr)
        pool.release(info)  # the key is freed: the name goes at once
        assert not os.path.exists(shm_path(info[0])) and len(pool.released) == 1
        n_refused = stats["segments-reuse-refused"]
        info2 = pool.place(arr * 2)  # shoal's reader still maps the released one
        assert info2 is not None and len(pool.released) == 1
        assert stats["segments-reuse-refused"] == n_refused + 1
        assert np.array_equal(theirs, arr)
        del theirs
        gc.collect()
        n_reused = stats["segments-reused"]
        info3 = pool.place(arr * 3)  # nobody maps it now: reused, new name, new token
        assert info3 is not None and not pool.released
        assert stats["segments-reused"] == n_reused + 1
        assert info3[0] not in (info[0], info2[0]) and info3[4] != info[4]
        with pytest.raises(FileNotFoundError):
            py_shm.attach(info)  # the old name
        with pytest.raises(FileNotFoundError, match="no longer holds"):
            py_shm.attach([info3[0], *info3[1:4], info[4]])  # the reused file, the old token
        assert np.array_equal(py_shm.attach(info3), arr * 3)
        assert np.array_equal(py_shm.attach(info2), arr * 2)
        pool.release(info2)
        pool.release(info3)
    finally:
        pool.drain()
        gc.collect()
    assert _foreign_files() - before == set()
