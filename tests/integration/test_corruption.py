"""Bytes that change where a value rests or travels never make a wrong result: a real
worker's spill file with a bit flipped in its middle (or cut short) is caught by its
checksums, the value is computed again and the worker goes on serving; a scattered
value, which cannot be computed again, is a clear ``LostDataError``."""

from __future__ import annotations

import os

import pytest

import shoal

np = pytest.importorskip("numpy")

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20


def noise(i, nbytes):
    """Values lz4 cannot shrink: a spill file as large as the value."""
    return np.random.default_rng(i).random(nbytes // 8)


def total(arr):
    return float(arr.sum())


def spill_now(key, dask_worker):
    """Write ``key``'s value to disk now; its spill file's path."""
    store = dask_worker.store
    if not store.is_spilled(key):
        assert store._spill(key), f"{key!r} did not spill"
    return store._slow[key][0]


def damage(path: str, how: str) -> None:
    if how == "flip":  # one bit, in the middle of the file
        with open(path, "r+b") as f:
            middle = os.path.getsize(path) // 2
            f.seek(middle)
            byte = f.read(1)[0]
            f.seek(middle)
            f.write(bytes([byte ^ 0x10]))
    else:
        os.truncate(path, os.path.getsize(path) // 2)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # a limit gives the workers a spill directory; nothing spills on its own below 600 MiB
    directory = tmp_path_factory.mktemp("spill")
    with shoal.LocalCluster(n_workers=1, processes=True, memory_limit="1GiB", local_directory=str(directory)) as c:
        yield c


@pytest.fixture
def client(cluster):
    with shoal.Client(cluster) as c:
        yield c


@pytest.mark.parametrize("how", ["flip", "truncate"])
@pytest.mark.parametrize("read", ["dependency", "gather"])
def test_a_damaged_spill_file_is_caught_and_its_value_computed_again(client, read, how):
    size = 8 * MiB
    (pid,) = client.run(os.getpid).values()
    futures = client.map(noise, range(3), [size] * 3, pure=False)
    shoal.wait(futures, timeout=60)
    key = futures[1].key
    (path,) = client.run(spill_now, key).values()
    assert os.path.getsize(path) > size
    damage(path, how)
    if read == "dependency":
        got = client.submit(total, futures[1]).result(timeout=60)
        assert got == total(noise(1, size))
    else:
        assert np.array_equal(futures[1].result(timeout=60), noise(1, size))
    assert not os.path.exists(path)
    # the others are untouched, and the worker (the same process) goes on
    assert [total(v) for v in client.gather(futures, errors="raise")] == [total(noise(i, size)) for i in range(3)]
    assert client.submit(total, np.ones(4)).result(timeout=30) == 4.0
    assert list(client.run(os.getpid).values()) == [pid]
    assert "spill file" in client.cluster.get_logs()["worker-0"]


def test_a_scattered_value_whose_spill_file_is_damaged_is_a_clear_error(client):
    value = noise(7, 4 * MiB)
    future = client.scatter(value)
    (path,) = client.run(spill_now, future.key).values()
    damage(path, "flip")
    with pytest.raises(shoal.LostDataError, match="lost"):
        client.submit(total, future).result(timeout=60)
    with pytest.raises(shoal.LostDataError):
        future.result(timeout=60)
    assert client.submit(total, np.ones(2)).result(timeout=30) == 2.0


# ------------------------------------------------------------ bytes on the wire


class FlipOnTheWire:
    """Wraps ``shoal.comm.tcp._buffers``: the next ``left`` messages with a frame of
    ``size`` bytes or more leave with one bit of that frame flipped, after the sender
    hashed it (as a wire or a card that changes bytes would)."""

    def __init__(self, buffers, size):
        self._buffers = buffers
        self.size = size
        self.left = 0
        self.flipped = 0

    def __call__(self, frames, trailer=b""):
        if self.left:
            for i, frame in enumerate(frames):
                view = memoryview(frame).cast("B")
                if view.nbytes >= self.size:
                    changed = bytearray(view)
                    changed[len(changed) // 2] ^= 0x01
                    frames = [*frames[:i], changed, *frames[i + 1:]]
                    self.left -= 1
                    self.flipped += 1
                    break
        return self._buffers(frames, trailer)


@pytest.mark.async_timeout(60)
async def test_a_value_corrupted_on_the_wire_is_fetched_again(monkeypatch):
    from shoal.comm import tcp
    from shoal.scheduler.server import Scheduler
    from shoal.worker.server import Worker

    monkeypatch.setenv("SHOAL_SHM", "0")  # values cross the socket, not shared memory
    size = 8 * MiB
    flip = FlipOnTheWire(tcp._buffers, size)
    monkeypatch.setattr(tcp, "_buffers", flip)
    scheduler = await Scheduler().start("tcp://127.0.0.1:0")
    workers = [Worker(scheduler.address, name=f"w{i}") for i in range(2)]
    for w in workers:
        await w.start()
    try:
        async with shoal.Client(scheduler.address, asynchronous=True) as client:
            a = client.submit(noise, 1, size, workers=[workers[0].address])
            # a worker fetches it for a task: the first answer fails its checksums, the
            # next is right
            flip.left = 1
            b = client.submit(total, a, workers=[workers[1].address])
            assert await b.result(timeout=30) == total(noise(1, size))
            assert flip.flipped == 1
            # the client gathers it: the same
            flip.left = 1
            (value,) = await client.gather([a])
            assert np.array_equal(value, noise(1, size))
            assert flip.flipped == 2
    finally:
        for w in workers:
            await w.close()
        await scheduler.close()


# ------------------------------------------------------ bytes in shared memory


def segment_of(key, dask_worker):
    """The segment info of ``key``'s value on this worker (None: not in one)."""
    return dask_worker.store.segment_info(key)


def flip_in_segment(info) -> None:
    """One bit flipped in the middle of the value's largest buffer, in /dev/shm."""
    name, _, _, spans, *_ = info
    offset, length = max(spans, key=lambda s: s[1])
    with open(os.path.join("/dev/shm", name), "r+b") as f:
        f.seek(offset + length // 2)
        byte = f.read(1)[0]
        f.seek(offset + length // 2)
        f.write(bytes([byte ^ 0x20]))


@pytest.fixture(scope="module")
def verifying_cluster():
    if not shoal.comm.shm.enabled():
        pytest.skip("no shared memory here")
    mp = pytest.MonkeyPatch()
    mp.setenv("SHOAL_SHM_VERIFY", "1")  # the worker processes' setting
    try:
        with shoal.LocalCluster(n_workers=2, processes=True, memory_limit=None) as c:
            yield c
    finally:
        mp.undo()


@pytest.mark.parametrize("read", ["dependency", "gather"])
def test_with_shm_verify_a_changed_segment_is_caught_and_its_value_computed_again(verifying_cluster, read):
    size = 8 * MiB
    with shoal.Client(verifying_cluster) as client:
        w0, w1 = sorted(client.scheduler_info()["workers"])
        a = client.submit(noise, 2, size, workers=[w0], pure=False)
        shoal.wait([a], timeout=60)
        info = client.run(segment_of, a.key, workers=[w0])[w0]
        assert info is not None and len(info) == 6, info  # placed with its checksum
        flip_in_segment(info)
        if read == "dependency":  # a peer maps it for a task
            assert client.submit(total, a, workers=[w1]).result(timeout=60) == total(noise(2, size))
        else:  # the client maps it
            assert np.array_equal(a.result(timeout=60), noise(2, size))
        assert "does not match its checksum" in "".join(verifying_cluster.get_logs().values())
        assert client.submit(total, np.ones(5), workers=[w0]).result(timeout=30) == 5.0
