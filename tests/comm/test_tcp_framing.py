"""tcp framing under arbitrary chunking and contended writes.

Covers the fast paths of ``shoal.comm.tcp``: a whole small message parsed in one step
from the scratch buffer, and a write handed to the kernel at once when no other write is
in progress (with the lock-protected path finishing whatever the kernel did not take).
"""

from __future__ import annotations

import asyncio
import random
import socket
import struct

import msgpack
import numpy as np
import pytest

from shoal import config
from shoal.comm import connect, listen
from shoal.comm.security import Security
from shoal.comm.framing import CHECKSUM_MIN, THREAD_HASH_MIN, CorruptMessage, _Checksummed, checksum_trailer
from shoal.comm.tcp import _FrameProtocol
from shoal.errors import CommError, CorruptedDataError, ProtocolError
from shoal.protocol import to_serialize
from shoal_helpers import complete_handshake, raw_socket, recv_frames, secret_of


def _wire(frames: list[bytes]) -> bytes:
    return struct.pack(f"<Q{len(frames)}Q", len(frames), *map(len, frames)) + b"".join(frames)


def _authenticated() -> _FrameProtocol:
    """A frame parser past the handshake (a new one has a stranger's limits)."""
    protocol = _FrameProtocol()
    protocol.set_limits()
    return protocol


def _feed(protocol: _FrameProtocol, data: bytes, rng: random.Random, max_chunk: int) -> None:
    pos = 0
    while pos < len(data):
        buf = protocol.get_buffer(-1)
        n = min(len(buf), len(data) - pos, rng.randint(1, max_chunk))
        buf[:n] = data[pos : pos + n]
        protocol.buffer_updated(n)
        pos += n


def _messages(rng: random.Random, count: int) -> list[list[bytes]]:
    sizes = [0, 1, 7, 100, 4000, 1 << 16, (1 << 16) + 3, 300_000]
    out = []
    for _ in range(count):
        nframes = rng.choice([1, 1, 1, 2, 3, 5])
        out.append([rng.randbytes(rng.choice(sizes)) for _ in range(nframes)])
    return out


@pytest.mark.parametrize("max_chunk", [1, 13, 4096, 70_000, 1 << 20])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_any_chunking_of_the_stream_gives_the_same_frames(max_chunk, seed):
    rng = random.Random(seed)
    msgs = _messages(rng, 60 if max_chunk > 1000 else 12)
    if max_chunk < 1000:  # byte-sized pieces: keep the frames small enough to be quick
        msgs = [[f[:20_000] if max_chunk > 1 else f[:2000] for f in m] for m in msgs]
    protocol = _authenticated()
    got: list[list[bytes]] = []
    for m in msgs:
        _feed(protocol, _wire(m), rng, max_chunk)
        while protocol.messages:  # drain as a reader would (the protocol has no transport)
            got.append([bytes(f) for f in protocol.messages.popleft()])
    assert protocol.error is None
    assert got == msgs


def test_many_messages_in_one_read():
    rng = random.Random(5)
    msgs = [[rng.randbytes(rng.randint(1, 300))] for _ in range(40)]
    protocol = _authenticated()
    _feed(protocol, b"".join(_wire(m) for m in msgs), rng, 1 << 20)
    assert [[bytes(f) for f in m] for m in protocol.messages] == msgs


def test_large_out_of_band_frames_land_in_the_buffers_of_the_allocator():
    """Frames from the third on, of at least the minimum size, are received into what
    the allocator gives; the message's own frames, small frames, and frames it declines
    (``None``) or fails on get the usual buffers, with the same bytes."""
    rng = random.Random(7)
    frames = [rng.randbytes(n) for n in (2_000_000, 300_000, 2_000_000, 1_500_000, 500_000, 1_200_000)]
    asked: list[int] = []
    given: list[np.ndarray] = []

    def allocate(n: int) -> np.ndarray | None:
        asked.append(n)
        if len(asked) == 2:
            return None  # declined
        if len(asked) == 3:
            raise OSError("no room")  # failed
        given.append(np.empty(n, dtype=np.uint8))
        return given[-1]

    protocol = _authenticated()
    protocol.land_frames(allocate, 1_000_000)
    for chunk in (1 << 20, 4096):
        asked.clear()
        given.clear()
        _feed(protocol, _wire(frames), rng, chunk)
        (got,) = protocol.messages
        protocol.messages.clear()
        assert [bytes(f) for f in got] == frames
        # asked for frames 2, 3 and 5: frame 2 landed, 3 was declined, 5 failed
        assert asked == [2_000_000, 1_500_000, 1_200_000] and len(given) == 1
        assert got[2] is given[0]
        assert all(not isinstance(got[i], np.ndarray) for i in (0, 1, 3, 4, 5))
    assert protocol.error is None


@pytest.mark.parametrize(
    "head",
    [
        struct.pack("<Q", 0),  # no frames
        struct.pack("<QQ", 1, 1 << 40),  # frame above max-frame-bytes
    ],
)
def test_bad_headers_are_still_protocol_errors(head):
    with config.set(max_frame_bytes=1 << 30):
        protocol = _authenticated()
        _feed(protocol, head + b"x" * 64, random.Random(0), 1 << 20)
    assert isinstance(protocol.error, ProtocolError)


async def test_concurrent_writers_with_a_slow_reader_keep_every_message_whole():
    """Writers race on one comm while the reader lags, so the kernel takes only part
    of a message and the rest waits for writability; nothing may interleave."""
    received: list[object] = []
    done = asyncio.Event()
    total = 4 * 30

    async def handler(comm):
        try:
            while len(received) < total:
                received.append(await comm.read())
                if len(received) % 10 == 0:
                    await asyncio.sleep(0.01)  # fall behind
            done.set()
        finally:
            await comm.close()

    listener = await listen("tcp://127.0.0.1:0", handler)
    comm = await connect(listener.contact_address)
    try:
        big = np.arange(600_000, dtype=np.float64)

        async def writer(w: int) -> None:
            for i in range(30):
                kind = (w + i) % 3
                if kind == 0:
                    await comm.write({"w": w, "i": i, "x": b"s" * (i + 1)})
                elif kind == 1:
                    await comm.write({"w": w, "i": i, "x": bytes(range(256)) * 400})
                else:
                    await comm.write({"w": w, "i": i, "x": to_serialize(big + i)})

        await asyncio.gather(*(writer(w) for w in range(4)))
        await asyncio.wait_for(done.wait(), 30)
    finally:
        await comm.close()
        listener.stop()
        await asyncio.sleep(0)

    seen: dict[int, list[int]] = {w: [] for w in range(4)}
    for msg in received:
        w, i, x = msg["w"], msg["i"], msg["x"]
        seen[w].append(i)
        kind = (w + i) % 3
        if kind == 0:
            assert x == b"s" * (i + 1)
        elif kind == 1:
            assert x == bytes(range(256)) * 400
        else:
            assert np.array_equal(x, big + i)
    assert all(order == list(range(30)) for order in seen.values())  # per-writer order


async def test_cancelling_a_write_midway_aborts_the_comm():
    """A write cancelled after part of it reached the socket leaves the stream unusable:
    the comm is aborted rather than letting the next message follow half of this one."""
    server_comms = []

    async def handler(comm):
        server_comms.append(comm)
        comm._transport.pause_reading()  # take nothing more: the sender's socket fills
        await asyncio.sleep(3600)

    listener = await listen("tcp://127.0.0.1:0", handler)
    comm = await connect(listener.contact_address)
    comm.destination = "remote"  # bytes through the socket (same-host would use shared memory)
    try:
        task = asyncio.ensure_future(comm.write({"x": to_serialize(np.zeros(64 << 20, dtype=np.uint8))}))
        await asyncio.sleep(0.3)
        assert not task.done()  # blocked on a full socket buffer
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert comm.closed()
        with pytest.raises(CommError):
            await comm.write({"x": 1})
    finally:
        await comm.close()
        for c in server_comms:
            c.abort()
        listener.stop()
        await asyncio.sleep(0)  # let the transports finish closing


# ----------------------------------------------------------------- checksums (§2.4)


def _checked(frames: list[bytes], flip: int | None = None) -> bytes:
    """A message with its checksum trailer; ``flip``: a bit of that frame changed after
    hashing (as on a wire that corrupts it)."""
    data = _wire(frames) + checksum_trailer(frames)
    if flip is None:
        return data
    at = 8 + 8 * len(frames) + sum(map(len, frames[:flip])) + len(frames[flip]) // 2
    return data[:at] + bytes([data[at] ^ 0x04]) + data[at + 1 :]


def _checking() -> _FrameProtocol:
    protocol = _authenticated()
    protocol.checksums = True
    return protocol


def _taken(protocol: _FrameProtocol, message: object) -> object:
    """A queued message as the reader takes it: one whose large frames are hashed in the
    checksum thread is compared once they are."""
    if type(message) is _Checksummed:
        digests = [d if type(d) is int else d.result(30) for d in message.digests]
        return protocol._compare(message.frames, message.lengths, digests, message.sent)
    return message


@pytest.mark.parametrize("max_chunk", [13, 4096, 70_000, 1 << 20, 5 << 20])
@pytest.mark.parametrize("seed", [0, 1])
def test_with_checksums_any_chunking_gives_the_same_frames_and_catches_every_flip(max_chunk, seed):
    rng = random.Random(seed)
    msgs = _messages(rng, 40)
    if max_chunk < 1000:
        msgs = [[f[:100_000] for f in m] for m in msgs]
    else:  # frames of THREAD_HASH_MIN or more are hashed in the checksum thread as they land
        msgs += [[b"h", rng.randbytes(n)] for n in (THREAD_HASH_MIN, THREAD_HASH_MIN + 5, 9 << 20, 12 << 20)]
        rng.shuffle(msgs)
    # every other message with a large frame is corrupted in one of its large frames
    sent: list[object] = []
    data = b""
    for i, m in enumerate(msgs):
        large = [j for j, f in enumerate(m) if len(f) >= CHECKSUM_MIN]
        flip = rng.choice(large) if large and i % 2 else None
        data += _checked(m, flip)
        sent.append("corrupt" if flip is not None else m)
    protocol = _checking()
    got: list[object] = []
    pos = 0
    while pos < len(data):  # fed in pieces, drained as a reader would
        piece = rng.randint(1, max_chunk)
        _feed(protocol, data[pos : pos + piece], rng, max_chunk)
        pos += piece
        while protocol.messages:
            m = _taken(protocol, protocol.messages.popleft())
            got.append("corrupt" if isinstance(m, CorruptMessage) else [bytes(f) for f in m])  # type: ignore[attr-defined]
    assert protocol.error is None
    assert got == sent
    assert "corrupt" in sent
    if max_chunk > 1000:
        assert any("corrupt" == g and max(map(len, m)) >= THREAD_HASH_MIN for g, m in zip(sent, msgs))


def test_without_checksums_agreed_no_trailer_is_read_or_written():
    frames = [b"h", bytes(200_000)]
    protocol = _authenticated()  # checksums off (a peer that did not offer them)
    _feed(protocol, _wire(frames), random.Random(0), 1 << 20)
    assert [bytes(f) for f in protocol.messages.popleft()] == frames
    assert checksum_trailer([b"x" * (CHECKSUM_MIN - 1)]) == b""
    assert len(checksum_trailer([b"x" * CHECKSUM_MIN, b"y", memoryview(bytes(CHECKSUM_MIN))])) == 16


def _raw_peer(address: str, checksums: bool) -> socket.socket:
    """A socket to ``address`` that did the handshake by hand, offering checksums or not."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    sock = raw_socket(host, int(port), 10)
    complete_handshake(sock, None, **({"checksums": "xxh3-64"} if checksums else {}))
    return sock


async def test_a_message_corrupted_on_the_wire_is_a_clear_error_and_the_connection_goes_on():
    received: list[object] = []
    done = asyncio.Event()

    async def handler(comm):
        while True:
            try:
                msg = await comm.read()
            except CorruptedDataError as exc:
                received.append(exc)
                continue
            except CommError:
                return
            received.append(msg)
            if msg == "last":
                done.set()

    # checksums are what ends without the secret have (with it, session tags: test_sessions.py)
    listener = await listen("tcp://127.0.0.1:0", handler, deserialize=True, security=Security.disabled())
    loop = asyncio.get_running_loop()
    sock = await loop.run_in_executor(None, _raw_peer, listener.contact_address, True)
    try:
        # 256 KiB (hashed on the loop) and 9 MiB (in the checksum thread), out of band
        # (docs/protocol.md §4.2)
        big, huge = bytes(range(256)) * 1024, bytes(range(256)) * 36 * 1024
        ref = msgpack.ExtType(2, (0).to_bytes(4, "little"))
        header = msgpack.packb([["bytes", {"kind": "bytes"}, 1, False]])
        good = [msgpack.packb({"op": "x", "data": ref}), header, big]
        large = [msgpack.packb({"op": "y", "data": ref}), header, huge]
        last = [msgpack.packb("last")]
        data = (_checked(good, flip=2) + _checked(good) + _checked(large, flip=2) + _checked(large)
                + _checked(last))
        await loop.run_in_executor(None, sock.sendall, data)
        await asyncio.wait_for(done.wait(), 10)
    finally:
        sock.close()
        listener.stop()
    first, second, third, fourth, fifth = received
    assert isinstance(first, CorruptedDataError) and "frame(s) 2 (262,144 bytes)" in str(first)
    assert second == {"op": "x", "data": big}
    assert isinstance(third, CorruptedDataError) and "frame(s) 2 (9,437,184 bytes)" in str(third)
    assert fourth == {"op": "y", "data": huge} and fifth == "last"


async def test_a_shoal_sender_puts_the_trailer_only_for_a_peer_that_offered_checksums():
    got: dict[bool, bytes] = {}
    for offer in (True, False):
        comms: list[object] = []

        async def handler(comm):
            comms.append(comm)
            await comm.write({"op": "y", "data": bytearray(100_000)})

        listener = await listen("tcp://127.0.0.1:0", handler, deserialize=True, security=Security.disabled())
        loop = asyncio.get_running_loop()
        sock = await loop.run_in_executor(None, _raw_peer, listener.contact_address, offer)
        try:
            frames = await loop.run_in_executor(None, recv_frames, sock)
            sock.settimeout(0.5)
            try:
                got[offer] = sock.recv(64)
            except socket.timeout:  # nothing more comes: no trailer
                got[offer] = b""
        finally:
            sock.close()
            listener.stop()
        assert [len(f) for f in frames][2:] == [100_000]
    assert got[True] == checksum_trailer([bytes(100_000)]) and got[False] == b""
