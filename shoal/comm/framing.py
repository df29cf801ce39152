"""Reading the tcp wire format: the byte stream parsed into lists of frames.

Wire format of one message (all integers little-endian unsigned 64-bit)::

    n_frames | len(frame 0) ... len(frame n-1) | frame 0 | ... | frame n-1

:class:`FrameProtocol` is an ``asyncio.BufferedProtocol``: small pieces land in a reused
scratch buffer; a frame of 64 KiB or more is received straight into its own buffer (the
buffer the deserialized value will live in), so large frames are never copied in user
space. While such a frame comes in over plain tcp, the socket's low-water mark
(``SO_RCVLOWAT``) is 512 KiB, or what is left of the frame if less: the loop wakes
once per 512 KiB instead of once per few packets (a 64 MiB frame: ~130 reads, not
~700). A small message that arrived whole is parsed in one step. Bad input (a frame
count or length over the limits, an allocation that fails) is a
:class:`~shoal.errors.ProtocolError` that aborts the connection.

Checksums (when both ends said so in the handshake, :attr:`FrameProtocol.checksums`):
every frame of :data:`CHECKSUM_MIN` bytes or more is followed, after the message's
last frame, by its xxh3_64 in a trailer (``u64`` each, in frame order). Such a frame is
received into its own buffer anyway. One under :data:`THREAD_HASH_MIN` is hashed on the
loop as its pieces land (at ~15 GB/s, under half a millisecond: less than handing it to
a thread costs); a larger one is hashed in the checksum thread, 4 MiB at a time as they
land (xxh3 releases the GIL: the loop goes on reading, and the hash is done soon after
the last byte), and its message waits in the queue until the reader takes it and the
hash is done. A message whose trailer does not
match is not delivered: the reader gets a :class:`~shoal.errors.CorruptedDataError` for
it instead, and the connection goes on (its framing is intact).

Session tags (when the handshake set up a session, :attr:`FrameProtocol.mac`: plain tcp
between ends with the secret, :mod:`.session`): every message is followed by its tag,
and no checksum trailer. A large frame's chunks are hashed in a thread pool as they
land; a message is handed to the reader only once its tag matches. One that does not
(bytes changed on the way, or a message a stranger injected) closes the connection
with a :class:`~shoal.errors.ProtocolError`: the stream can no longer be trusted.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import mmap
import socket
import struct
import termios
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import xxhash

from .. import config
from ..errors import CommBrokenError, CommClosedError, CorruptedDataError, ProtocolError
from . import session

if TYPE_CHECKING:
    from .tcp import TCPComm

__all__ = ["FrameProtocol", "alloc_buffer", "STRANGER_MAX_BYTES", "HANDSHAKE_MESSAGES", "CHECKSUM_MIN",
           "checksum_trailer", "UNTAGGED_MESSAGES", "THREAD_HASH_MIN"]

logger = logging.getLogger("shoal.comm.tcp")

#: the largest message a peer may send before it is authenticated, and how many it sends
STRANGER_MAX_BYTES = 4096
HANDSHAKE_MESSAGES = 3
#: the handshake messages sent before the session's tags start (the third is tagged)
UNTAGGED_MESSAGES = 2

_SCRATCH = 1 << 16
_DIRECT = 1 << 16  # blocks at least this large are received into their own buffer
_MAX_QUEUED = 64  # complete messages buffered before we stop reading the socket
_U64 = struct.Struct("<Q")


#: frames at least this large carry a checksum when the connection has them (the ones
#: received into their own buffers: _DIRECT)
CHECKSUM_MIN = _DIRECT
#: frames at least this large are hashed in the checksum thread, this much at a time
THREAD_HASH_MIN = 8 << 20
_HASH_STEP = 4 << 20


def checksum_trailer(frames: list[Any]) -> bytes:
    """The checksum trailer of a message of ``frames`` (see the module): the xxh3_64 of
    each frame of :data:`CHECKSUM_MIN` bytes or more; ``b""`` when there is none."""
    digests = [xxhash.xxh3_64_intdigest(f) for f in frames
               if (len(f) if type(f) is bytes else memoryview(f).nbytes) >= CHECKSUM_MIN]
    return struct.pack(f"<{len(digests)}Q", *digests) if digests else b""


_checksum_thread: ThreadPoolExecutor | None = None


def _checksums() -> ThreadPoolExecutor:
    """The thread that hashes large frames' checksums (one: a frame's chunks are hashed
    in order, and xxh3 is faster than any socket it serves)."""
    global _checksum_thread
    if _checksum_thread is None:
        _checksum_thread = ThreadPoolExecutor(1, thread_name_prefix="shoal-checksum")
    return _checksum_thread


class _FrameHash:
    """The xxh3_64 of a large frame coming in, hashed in the checksum thread a chunk at a
    time as its bytes land."""

    __slots__ = ("_hasher", "_view", "_fed")

    def __init__(self, view: memoryview):
        self._hasher = xxhash.xxh3_64()
        self._view = view
        self._fed = 0

    def feed(self, upto: int) -> None:
        """Hash the bytes landed by ``upto`` once they make whole steps."""
        whole = upto - upto % _HASH_STEP
        if whole > self._fed:
            _checksums().submit(self._hasher.update, self._view[self._fed : whole])
            self._fed = whole

    def finish(self) -> Future[int]:
        """The frame's digest, once the rest of it is hashed (the frame is all here)."""
        pool = _checksums()
        if self._fed < len(self._view):
            pool.submit(self._hasher.update, self._view[self._fed :])
        self._view = memoryview(b"")
        return pool.submit(self._hasher.intdigest)


class _Checksummed:
    """Stands in the queue for a message whose large frames are still being hashed:
    its checksums are compared when the reader takes it."""

    __slots__ = ("frames", "lengths", "digests", "sent")

    def __init__(self, frames: list[Any], lengths: list[int], digests: list[Any], sent: tuple[int, ...]):
        self.frames, self.lengths, self.digests, self.sent = frames, lengths, digests, sent


class _Tagged:
    """Stands in the queue for a message whose large frames are still being hashed:
    its tag is checked when the reader takes it (:meth:`FrameProtocol.next_frames`)."""

    __slots__ = ("frames", "lengths", "chunks", "running", "tag")

    def __init__(self, frames: list[Any], lengths: list[int], chunks: dict[int, list[Any]], running: Any, tag: bytes):
        self.frames, self.lengths, self.chunks, self.running, self.tag = frames, lengths, chunks, running, tag


class CorruptMessage:
    """Stands in the queue for a message whose frames failed their checksums."""

    __slots__ = ("text",)

    def __init__(self, text: str):
        self.text = text


_LAZY = 1 << 18  # blocks at least this large are mappings, committed as bytes arrive
#: while a large block comes in over plain tcp, the socket wakes the loop only once
#: this much of it is there (SO_RCVLOWAT), not for every few packets
_LOWAT = 1 << 19


def alloc_buffer(n: int) -> Any:
    """A writable buffer of ``n`` bytes for a received frame.

    From 256 KiB on it is an anonymous mapping, whose pages are committed only as the
    frame's bytes arrive: a peer that announces a large frame and sends nothing costs
    address space, not memory. From 2 MiB on the mapping is advised to use huge pages:
    fresh memory then faults in 2 MiB at a time instead of 4 KiB, which is most of the
    cost of receiving a large value into new memory.
    """
    if n < _LAZY:
        return bytearray(n)
    buf = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if n >= (1 << 21) and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return buf


class FrameProtocol(asyncio.BufferedProtocol):
    """Parses the byte stream into lists of frames; owned by one
    :class:`~shoal.comm.tcp.TCPComm` (``self.comm``), which it tells when the connection
    is lost (``comm._on_lost()``) and aborts on a protocol error."""

    def __init__(self, on_connection: Any = None):
        self.on_connection = on_connection
        self.comm: TCPComm | None = None
        self.transport: asyncio.Transport | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._scratch = bytearray(_SCRATCH)
        self._view = memoryview(self._scratch)
        self._start = 0
        self._end = 0
        self._direct: memoryview | None = None
        self._direct_buf: Any = None
        self._direct_pos = 0
        # parse state: waiting for the count (None), the lengths, or frame i
        self._lengths: list[int] | None = None
        self._count = -1
        self._frames: list[Any] = []
        #: whether large frames carry checksums (set once the handshake agreed on it),
        #: the hash of the frame coming in, and those of the message's frames so far
        self.checksums = False
        self._hasher: Any = None
        self._digests: list[Any] = []  # ints, or futures of the checksum thread
        #: the session's MAC of the peer's messages (set by the handshake), and the
        #: chunks of the message's large frames being hashed: {frame index: futures}
        self.mac: session.MessageMac | None = None
        self._chunks: dict[int, list[Any]] = {}
        self._chunked = -1  # bytes of the frame coming in whose hashing has started
        # a new connection's peer is a stranger: its handshake messages are one small
        # frame each, and nothing after them is parsed until the handshake lifts this
        # (set_limits())
        self._max_frames = 1
        self._max_frame = self._max_message = STRANGER_MAX_BYTES
        # a message that stalls half-way (no bytes for this long) closes the connection
        self._stall_timeout = config.get("partial-message-timeout")
        self._stall_timer: asyncio.TimerHandle | None = None
        self._last_bytes = 0.0
        self._idle_timeout = 0.0
        self._idle_timer: asyncio.TimerHandle | None = None
        self._wait_started = 0.0
        # messages to parse before reading stops (0: no such limit), and whether it has
        self._hold_after = UNTAGGED_MESSAGES
        self._held = False
        self.messages: deque[Any] = deque()  # lists of frames (or CorruptMessage)
        self.waiter: asyncio.Future[None] | None = None
        self.error: BaseException | None = None
        #: set once the connection is gone (closed by either end, or lost)
        self.gone = asyncio.Event()
        self.paused = False
        #: makes the buffers of large out-of-band frames (see :meth:`land_frames`)
        self._land: Any = None
        self._land_min = 0
        #: the plain tcp socket (None over tls) and its receive low-water mark
        self._sock: Any = None
        self._lowat = 1

    def land_frames(self, allocate: Any, min_bytes: int) -> None:
        """Receive every out-of-band frame (frame 2 on) of at least ``min_bytes`` into
        ``allocate(nbytes)``'s buffer, or the usual one where it gives ``None``."""
        self._land, self._land_min = allocate, min_bytes

    def set_limits(self, max_frames: int | None = None, max_frame_bytes: int | None = None,
                   messages: int = 0) -> None:
        """Limit the frames of the next messages (``None``: the configured limits).
        With ``messages``, only that many are parsed under these limits; then reading
        stops until the limits are set again. The handshake admits one small frame per
        message until the peer is authenticated, and nothing after its own messages."""
        self._max_frames = config.get("max-frames") if max_frames is None else max_frames
        self._max_frame = config.get("max-frame-bytes") if max_frame_bytes is None else max_frame_bytes
        self._max_message = config.get("max-message-bytes") if max_frame_bytes is None else max_frame_bytes
        self._hold_after = messages
        if self._held:
            self._held = False
            if not self.paused and self.transport is not None and not self.transport.is_closing():
                self.transport.resume_reading()
            try:
                self._parse()
            except ProtocolError as exc:
                self._fail(exc)

    # -- asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._loop = asyncio.get_running_loop()
        if transport.get_extra_info("sslcontext") is None:
            self._sock = transport.get_extra_info("socket")
        if self.on_connection is not None:
            self.on_connection(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._direct is not None:
            return self._direct[self._direct_pos :]
        if self._end == _SCRATCH:
            self._compact()
        return self._view[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        try:
            if self._direct is not None:
                hasher = self._hasher
                if hasher is not None and type(hasher) is not _FrameHash:  # the bytes just landed: in cache
                    hasher.update(self._direct[self._direct_pos : self._direct_pos + nbytes])
                self._direct_pos += nbytes
                if type(hasher) is _FrameHash:
                    hasher.feed(self._direct_pos)
                if self._chunked >= 0 and self._direct_pos - self._chunked >= session.CHUNK:
                    self._hash_chunks(self._direct_pos)
                if self._direct_pos == len(self._direct):
                    block = self._direct_buf
                    self._direct = self._direct_buf = None
                    self._block_done(block)
            else:
                self._end += nbytes
                self._parse()
        except ProtocolError as exc:
            self._fail(exc)
            return
        self._last_bytes = time.monotonic()
        if self._sock is not None:
            self._set_lowat()
        if self._count >= 0 or self._end > self._start or self._direct is not None:
            # in the middle of a message: it must not stall
            if self._stall_timer is None and self._loop is not None and self._stall_timeout > 0:
                self._stall_timer = self._loop.call_later(self._stall_timeout, self._check_stalled)

    def _set_lowat(self, want: int | None = None) -> None:
        """Wake on ``_LOWAT`` bytes while a large block comes (never more than is left
        of it, or its last bytes would not wake the loop), on any byte otherwise (or on
        ``want`` bytes)."""
        if want is None:
            left = len(self._direct) - self._direct_pos if self._direct is not None else 0
            want = min(left, _LOWAT) if left >= 2 * _DIRECT else 1
        if want != self._lowat:
            try:
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
            except OSError:
                self._sock = None  # not a socket that takes it: wake on every byte
                return
            self._lowat = want

    def _check_stalled(self) -> None:
        self._stall_timer = None
        if not (self._count >= 0 or self._end > self._start or self._direct is not None):
            return
        if self.transport is None or self.transport.is_closing():
            return
        if self._lowat > 1 and self._queued():
            # bytes came, fewer than wake the loop: take them now (setting the mark
            # wakes it), and the stall is measured from here
            self._set_lowat(1)
            self._last_bytes = time.monotonic()
        quiet = time.monotonic() - self._last_bytes
        if quiet >= self._stall_timeout:
            self._fail(ProtocolError(
                f"the peer stopped in the middle of a message: no bytes for {quiet:.0f}s "
                "(partial-message-timeout)"
            ))
        elif self._loop is not None:
            self._stall_timer = self._loop.call_later(self._stall_timeout - quiet, self._check_stalled)

    def _queued(self) -> int:
        """Bytes waiting in the socket (0 when that cannot be told)."""
        try:
            raw = fcntl.ioctl(self._sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
        except (OSError, AttributeError):
            return 0
        return int(struct.unpack("i", raw)[0])

    def eof_received(self) -> bool:
        return False

    # -- flow control of writes through the transport (tls://; tcp writes bypass it)

    write_paused = False
    _drain_waiters: list[asyncio.Future[None]] | None = None

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self.wake_writers(None)

    def wake_writers(self, exc: BaseException | None) -> None:
        """Let writers waiting in :meth:`drain` go on (or fail with ``exc``)."""
        waiters, self._drain_waiters = self._drain_waiters, None
        for fut in waiters or ():
            if not fut.done():
                if exc is None:
                    fut.set_result(None)
                else:
                    fut.set_exception(exc)

    async def drain(self) -> None:
        """Wait while the transport holds more than its high-water mark of our writes.
        Raises :class:`CommBrokenError` if the connection is lost meanwhile."""
        if not self.write_paused:
            return
        if self.transport is None or self.transport.is_closing():
            raise CommBrokenError("the connection was lost while writing")
        fut = (self._loop or asyncio.get_running_loop()).create_future()
        if self._drain_waiters is None:
            self._drain_waiters = []
        self._drain_waiters.append(fut)
        await fut

    def set_idle_timeout(self, seconds: float) -> None:
        """Close the connection when a reader has waited ``seconds`` for a message and
        no byte arrived meanwhile (0: never). For request connections, which a peer
        may otherwise keep open, idle, forever."""
        self._idle_timeout = seconds
        if seconds > 0 and self._idle_timer is None and self._loop is not None:
            self._idle_timer = self._loop.call_later(seconds, self._check_idle)

    def _check_idle(self) -> None:
        self._idle_timer = None
        if self._idle_timeout <= 0 or self.transport is None or self.transport.is_closing():
            return
        now = time.monotonic()
        if self.waiter is not None and not self.messages:
            quiet = now - max(self._last_bytes, self._wait_started)
            if quiet >= self._idle_timeout:
                logger.info("closing connection from %s: idle for %.0fs (idle-timeout)",
                            self.comm.peer_address if self.comm else "?", quiet)
                self.error = CommClosedError(f"closed after {quiet:.0f}s idle (idle-timeout)")
                self.transport.close()
                self._wake()
                return
            delay = self._idle_timeout - quiet
        else:
            delay = self._idle_timeout  # busy serving: look again later
        if self._loop is not None:
            self._idle_timer = self._loop.call_later(delay, self._check_idle)

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._stall_timer, self._idle_timer):
            if timer is not None:
                timer.cancel()
        self._stall_timer = self._idle_timer = None
        if self.error is None:
            comm = self.comm
            if comm is not None and comm._closed:
                self.error = CommClosedError(f"{comm!r} was closed")
            else:
                partial = self._count >= 0 or self._end > self._start or self._direct is not None
                what = "in the middle of a message" if partial else "the connection"
                err = CommBrokenError(f"peer closed {what}" + (f": {exc}" if exc else ""))
                if exc is not None:
                    err.__cause__ = exc
                self.error = err
                if partial:  # a truncated message is bad input: say so, not only to the reader
                    peer = comm.peer_address if comm is not None else "?"
                    logger.warning("connection from %s lost: %s", peer, err)
        if self.comm is not None:
            self.comm._on_lost()
        self.gone.set()
        self._wake()

    # -- parsing

    def _compact(self) -> None:
        n = self._end - self._start
        if self._start:
            self._scratch[:n] = self._scratch[self._start : self._end]
            self._start, self._end = 0, n

    def _need(self) -> int:
        if self._count < 0:
            return 8
        if self._lengths is None:
            return 8 * self._count
        if len(self._frames) < self._count:
            return self._lengths[len(self._frames)]
        return self._trailer_bytes()

    def _trailer_bytes(self) -> int:
        """The size of what follows a message's frames: its tag, or its checksums."""
        return session.TAG_BYTES if self.mac is not None else 8 * len(self._digests)

    def _parse(self) -> None:
        while not self._held:
            if self._count < 0:  # between messages
                avail = self._end - self._start
                if not avail:
                    self._start = self._end = 0
                    return
                if avail >= 16 and self._parse_whole():
                    continue
            need = self._need()
            avail = self._end - self._start
            if need >= _DIRECT:
                try:
                    buf = self._landing(need) if self._land is not None else None
                    if buf is None:
                        buf = alloc_buffer(need)
                except (MemoryError, OSError) as exc:
                    raise ProtocolError(
                        f"cannot allocate {need:,} bytes for a frame the peer announced ({exc})"
                    ) from exc
                view = memoryview(buf)
                take = min(avail, need)
                view[:take] = self._view[self._start : self._start + take]
                if self._lengths is not None and len(self._frames) < self._count:
                    if self.mac is not None:
                        self._chunks[len(self._frames)] = []
                        self._chunked = 0
                    elif self.checksums and need >= THREAD_HASH_MIN:
                        self._hasher = _FrameHash(view)
                        self._hasher.feed(take)
                    elif self.checksums:
                        self._hasher = xxhash.xxh3_64()
                        self._hasher.update(view[:take])
                self._start += take
                if self._start == self._end:
                    self._start = self._end = 0
                if take == need:
                    self._block_done(buf)
                    continue
                self._direct, self._direct_buf, self._direct_pos = view, buf, take
                if self._chunked >= 0 and take >= session.CHUNK:
                    self._hash_chunks(take)
                return
            if avail < need:
                if self._start == self._end:
                    self._start = self._end = 0
                elif _SCRATCH - self._start < need:
                    self._compact()
                return
            s = self._start
            self._start += need
            if self._count < 0:
                self._set_count(struct.unpack_from("<Q", self._scratch, s)[0])
            elif self._lengths is None:
                self._set_lengths(list(struct.unpack_from(f"<{self._count}Q", self._scratch, s)))
            elif len(self._frames) < self._count:
                self._frame_done(self._scratch[s : s + need])
            else:
                self._trailer_done(self._scratch[s : s + need])

    def _parse_whole(self) -> bool:
        """Take a whole small message out of the scratch buffer in one step (the common
        case). Returns False, consuming nothing, for anything else (a message not yet
        complete, a large frame, an empty frame, invalid counts or lengths), which the
        step-by-step parser then handles (and reports)."""
        scratch, s, end = self._scratch, self._start, self._end
        tag = session.TAG_BYTES if self.mac is not None else 0
        n = _U64.unpack_from(scratch, s)[0]
        if n == 1:
            size = _U64.unpack_from(scratch, s + 8)[0]
            stop = s + 16 + size
            if stop + tag > end or size == 0 or size > self._max_frame:
                return False
            frames: list[Any] = [scratch[s + 16 : stop]]
        else:
            if n < 1 or n > self._max_frames:
                return False
            pos = s + 8 + 8 * n
            if pos > end:
                return False
            lengths = struct.unpack_from(f"<{n}Q", scratch, s + 8)
            total = sum(lengths)
            stop = pos + total
            if stop + tag > end or max(lengths) > self._max_frame or total > self._max_message:
                return False
            frames = []
            for size in lengths:
                frames.append(scratch[pos : pos + size] if size else b"")
                pos += size
        if tag:
            assert self.mac is not None
            running = self.mac.start()
            running.update(self._view[s:stop])
            if not session.check(self.mac.finish(running), self._view[stop : stop + tag]):
                raise self._forged(stop - s)
            stop += tag
        if stop == end:
            self._start = self._end = 0
        else:
            self._start = stop
        self._deliver(frames)
        return True

    def _landing(self, need: int) -> Any:
        """A buffer for the frame about to come from the allocator of
        :meth:`land_frames`, if it is an out-of-band frame it wants; else ``None``."""
        if self._lengths is None or not 2 <= len(self._frames) < self._count or need < self._land_min:
            return None
        try:
            return self._land(need)
        except Exception as exc:  # noqa: BLE001 - no landing: the usual buffer will do
            logger.debug("cannot land a frame of %d bytes: %s", need, exc)
            return None

    def _block_done(self, block: Any) -> None:
        if self._lengths is None:
            self._set_lengths(list(struct.unpack_from(f"<{self._count}Q", block, 0)))
        elif len(self._frames) < self._count:
            hasher = self._hasher
            if hasher is not None:
                self._digests.append(hasher.finish() if type(hasher) is _FrameHash else hasher.intdigest())
                self._hasher = None
            chunks = self._chunks.get(len(self._frames))
            if chunks is not None:  # the chunks not yet hashed, the last one too
                chunks += session.chunk_digests(block, self._chunked)
                self._chunked = -1
            self._frame_done(block)
        else:
            self._trailer_done(block)
        if self._direct is None and self._end > self._start:
            self._parse()

    def _set_count(self, n: int) -> None:
        if n == 0 or n > self._max_frames:
            raise ProtocolError(
                f"message announces {n} frames; allowed are 1 to {self._max_frames} "
                "(is the peer speaking the shoal protocol?)"
            )
        self._count = n

    def _set_lengths(self, lengths: list[int]) -> None:
        big = max(lengths)
        if big > self._max_frame:
            raise ProtocolError(
                f"frame length {big} exceeds the maximum of {self._max_frame} bytes "
                "(max-frame-bytes)"
            )
        total = sum(lengths)
        if total > self._max_message:
            raise ProtocolError(
                f"message of {total} bytes exceeds the maximum of {self._max_message} bytes "
                "(max-message-bytes)"
            )
        self._lengths = lengths
        self._skip_empty()

    def _frame_done(self, frame: Any) -> None:
        self._frames.append(frame)
        self._skip_empty()

    def _skip_empty(self) -> None:
        lengths = self._lengths
        assert lengths is not None
        while len(self._frames) < self._count and lengths[len(self._frames)] == 0:
            self._frames.append(b"")
        if len(self._frames) == self._count and not self._trailer_bytes():
            frames = self._frames
            self._frames, self._lengths, self._count = [], None, -1
            self._deliver(frames)
        # (else the checksum trailer comes next)

    def _hash_chunks(self, upto: int) -> None:
        """Start hashing the whole chunks of the frame coming in that have landed by
        ``upto`` bytes."""
        assert self._direct is not None
        whole = upto - upto % session.CHUNK
        if whole > self._chunked:
            self._chunks[len(self._frames)] += session.chunk_digests(self._direct, self._chunked, whole)
            self._chunked = whole

    def _tag_done(self, data: Any) -> None:
        frames, lengths, chunks = self._frames, self._lengths, self._chunks
        assert lengths is not None and self.mac is not None
        self._frames, self._lengths, self._count, self._chunks = [], None, -1, {}
        running = self.mac.start()
        running.update(struct.pack(f"<Q{len(lengths)}Q", len(lengths), *lengths))
        tagged = _Tagged(frames, lengths, chunks, running, bytes(data))
        if chunks:
            self._deliver(tagged)  # checked when taken, once its chunks are hashed
        else:
            self._deliver(self._check_tag(tagged))

    def _check_tag(self, tagged: _Tagged) -> list[Any]:
        """The frames of ``tagged``, once its tag matched (its chunks are hashed)."""
        assert self.mac is not None
        running = tagged.running
        for i, frame in enumerate(tagged.frames):
            chunks = tagged.chunks.get(i)
            running.update(frame if chunks is None else session.frame_digest(chunks))
        if not session.check(self.mac.finish(running), tagged.tag):
            raise self._forged(sum(tagged.lengths))
        return tagged.frames

    def _forged(self, nbytes: int) -> ProtocolError:
        peer = self.comm.peer_address if self.comm else "?"
        return ProtocolError(
            f"a message of {nbytes:,} bytes from {peer} does not match its session tag (changed on its way, "
            "or sent by someone without the session's key); closing the connection"
        )

    def _trailer_done(self, data: Any) -> None:
        if self.mac is not None:
            return self._tag_done(data)
        digests, frames, lengths = self._digests, self._frames, self._lengths
        assert lengths is not None
        self._frames, self._lengths, self._count, self._digests = [], None, -1, []
        sent = struct.unpack_from(f"<{len(digests)}Q", data, 0)
        if any(type(d) is not int for d in digests):
            self._deliver(_Checksummed(frames, lengths, digests, sent))  # compared when taken
            return
        self._deliver(self._compare(frames, lengths, digests, sent))

    def _compare(self, frames: list[Any], lengths: list[int], digests: list[int], sent: tuple[int, ...]) -> Any:
        """``frames``, if their checksums are the ones sent; else a :class:`CorruptMessage`."""
        if list(sent) == digests:
            return frames
        large = [i for i, n in enumerate(lengths) if n >= CHECKSUM_MIN]
        bad = [(i, lengths[i]) for i, a, b in zip(large, digests, sent) if a != b]
        peer = self.comm.peer_address if self.comm else "?"
        text = (f"a message of {sum(lengths):,} bytes from {peer} arrived changed: frame(s) "
                f"{', '.join(f'{i} ({n:,} bytes)' for i, n in bad)} do not match their checksums; "
                "it is dropped (the connection goes on)")
        logger.warning("%s", text)
        return CorruptMessage(text)

    def _deliver(self, frames: Any) -> None:
        if self._hold_after:
            self._hold_after -= 1
            if not self._hold_after:
                self._held = True
                if self.transport is not None:
                    self.transport.pause_reading()
        self.messages.append(frames)
        if len(self.messages) >= _MAX_QUEUED and not self.paused and self.transport:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def _fail(self, exc: ProtocolError) -> None:
        peer = self.comm.peer_address if self.comm else "?"
        logger.error("closing connection from %s: %s", peer, exc)
        self.error = exc
        self._wake()
        if self.comm is not None:
            self.comm.abort()
        elif self.transport is not None:
            self.transport.abort()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def next_frames(self) -> list[Any]:
        """The next message's frames. Raises the connection's error once it is gone
        (:class:`CommBrokenError`, :class:`ProtocolError`, ...), and
        :class:`CorruptedDataError` for a message whose frames failed their checksums
        (the connection goes on)."""
        while not self.messages:
            if self.error is not None:
                raise self.error
            # the loop the transport runs on (get_running_loop() costs a getpid()
            # system call per call on Python < 3.12)
            self.waiter = (self._loop or asyncio.get_running_loop()).create_future()
            if self._idle_timeout:
                self._wait_started = time.monotonic()
            try:
                await self.waiter
            finally:
                self.waiter = None
        frames = self.messages.popleft()
        if self.paused and len(self.messages) < _MAX_QUEUED // 4 and self.transport:
            self.paused = False
            self.transport.resume_reading()
        if type(frames) is _Tagged:
            return await self._checked(frames)
        if type(frames) is _Checksummed:
            frames = await self._compared(frames)
        if type(frames) is CorruptMessage:
            raise CorruptedDataError(frames.text)
        return frames

    async def _compared(self, message: _Checksummed) -> Any:
        digests = [d if type(d) is int else await asyncio.wrap_future(d) for d in message.digests]
        return self._compare(message.frames, message.lengths, digests, message.sent)

    async def _checked(self, tagged: _Tagged) -> list[Any]:
        for futures in tagged.chunks.values():
            for fut in futures:
                if not fut.done():
                    await asyncio.wrap_future(fut)
        try:
            return self._check_tag(tagged)
        except ProtocolError as exc:
            self._fail(exc)
            raise
