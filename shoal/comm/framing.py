"""Reading the tcp wire format: the byte stream parsed into lists of frames.

Wire format of one message (all integers little-endian unsigned 64-bit)::

    n_frames | len(frame 0) ... len(frame n-1) | frame 0 | ... | frame n-1

:class:`FrameProtocol` is an ``asyncio.BufferedProtocol``: small pieces land in a reused
scratch buffer; a frame of 64 KiB or more is received straight into its own buffer (the
buffer the deserialized value will live in), so large frames are never copied in user
space. A small message that arrived whole is parsed in one step. Bad input (a frame
count or length over the limits, an allocation that fails) is a
:class:`~shoal.errors.ProtocolError` that aborts the connection.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import struct
from collections import deque
from typing import TYPE_CHECKING, Any

from .. import config
from ..errors import CommBrokenError, CommClosedError, ProtocolError

if TYPE_CHECKING:
    from .tcp import TCPComm

__all__ = ["FrameProtocol", "alloc_buffer"]

logger = logging.getLogger("shoal.comm.tcp")

_SCRATCH = 1 << 16
_DIRECT = 1 << 16  # blocks at least this large are received into their own buffer
_MAX_QUEUED = 64  # complete messages buffered before we stop reading the socket
_U64 = struct.Struct("<Q")


def alloc_buffer(n: int) -> Any:
    """A writable buffer of ``n`` bytes for a received frame.

    Large buffers are anonymous mappings advised to use huge pages: fresh memory then
    faults in 2 MiB at a time instead of 4 KiB, which is most of the cost of receiving a
    large value into new memory.
    """
    if n < (1 << 21):
        return bytearray(n)
    buf = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
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
        self._max_frames = config.get("max-frames")
        self._max_frame = config.get("max-frame-bytes")
        self.messages: deque[list[Any]] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.error: BaseException | None = None
        self.paused = False

    # -- asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._loop = asyncio.get_running_loop()
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
                self._direct_pos += nbytes
                if self._direct_pos == len(self._direct):
                    block = self._direct_buf
                    self._direct = self._direct_buf = None
                    self._block_done(block)
                return
            self._end += nbytes
            self._parse()
        except ProtocolError as exc:
            self._fail(exc)

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
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
        return self._lengths[len(self._frames)]

    def _parse(self) -> None:
        while True:
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
                    buf = alloc_buffer(need) if self._lengths is not None else bytearray(need)
                except (MemoryError, OSError) as exc:
                    raise ProtocolError(
                        f"cannot allocate {need:,} bytes for a frame the peer announced ({exc})"
                    ) from exc
                view = memoryview(buf)
                take = min(avail, need)
                view[:take] = self._view[self._start : self._start + take]
                self._start += take
                if self._start == self._end:
                    self._start = self._end = 0
                if take == need:
                    self._block_done(buf)
                    continue
                self._direct, self._direct_buf, self._direct_pos = view, buf, take
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
            else:
                self._frame_done(self._scratch[s : s + need])

    def _parse_whole(self) -> bool:
        """Take a whole small message out of the scratch buffer in one step (the common
        case). Returns False, consuming nothing, for anything else (a message not yet
        complete, a large frame, an empty frame, invalid counts or lengths), which the
        step-by-step parser then handles (and reports)."""
        scratch, s, end = self._scratch, self._start, self._end
        n = _U64.unpack_from(scratch, s)[0]
        if n == 1:
            size = _U64.unpack_from(scratch, s + 8)[0]
            stop = s + 16 + size
            if stop > end or size == 0 or size > self._max_frame:
                return False
            frames: list[Any] = [scratch[s + 16 : stop]]
        else:
            if n < 1 or n > self._max_frames:
                return False
            pos = s + 8 + 8 * n
            if pos > end:
                return False
            lengths = struct.unpack_from(f"<{n}Q", scratch, s + 8)
            stop = pos + sum(lengths)
            if stop > end or max(lengths) > self._max_frame:
                return False
            frames = []
            for size in lengths:
                frames.append(scratch[pos : pos + size] if size else b"")
                pos += size
        if stop == end:
            self._start = self._end = 0
        else:
            self._start = stop
        self._deliver(frames)
        return True

    def _block_done(self, block: Any) -> None:
        if self._lengths is None:
            self._set_lengths(list(struct.unpack_from(f"<{self._count}Q", block, 0)))
        else:
            self._frame_done(block)
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
        if len(self._frames) == self._count:
            frames = self._frames
            self._frames, self._lengths, self._count = [], None, -1
            self._deliver(frames)

    def _deliver(self, frames: list[Any]) -> None:
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
        while not self.messages:
            if self.error is not None:
                raise self.error
            # the loop the transport runs on (get_running_loop() costs a getpid()
            # system call per call on Python < 3.12)
            self.waiter = (self._loop or asyncio.get_running_loop()).create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        frames = self.messages.popleft()
        if self.paused and len(self.messages) < _MAX_QUEUED // 4 and self.transport:
            self.paused = False
            self.transport.resume_reading()
        return frames
