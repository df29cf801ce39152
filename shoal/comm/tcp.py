"""``tcp://``: length-prefixed frames over TCP.

Wire format of one message (all integers little-endian unsigned 64-bit)::

    n_frames | len(frame 0) ... len(frame n-1) | frame 0 | ... | frame n-1

Reading is :mod:`.framing`'s :class:`FrameProtocol`: large frames are received straight
into their own buffers. Writing bypasses the transport's write buffer, which would copy what the kernel
does not take at once: frames go to the socket with ``sendmsg`` (gathered, zero-copy)
through a duplicate of the socket's descriptor, waiting for writability on the loop. A
write that finds no other write in progress is handed to the kernel at once, without a
lock or a task switch (a small message as one buffer); only what the kernel does not
take then waits, in order, behind the write lock.

Messages whose out-of-band buffers exceed ``offload-threshold`` bytes are serialized and
deserialized in a small thread pool, so the event loop keeps serving other peers.

When both ends said so in the handshake (``TCPComm.checksums``; not over tls, whose
records are authenticated already), a message with frames of
:data:`~.framing.CHECKSUM_MIN` bytes or more ends with their checksums
(:func:`~.framing.checksum_trailer`): the sender hashes a small message's before
sending it, a large one's in the thread pool while its frames go out (the trailer
follows them), the reader as they land (:mod:`.framing`). A
message that fails them raises :class:`~shoal.errors.CorruptedDataError` from
:meth:`TCPComm.read`; the connection goes on.
"""

from __future__ import annotations

import asyncio
import contextvars
import errno
import itertools
import logging
import os
import socket
import ssl
import struct
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .. import config
from ..errors import (
    CommError,
    CommBrokenError,
    CommClosedError,
    CommConnectError,
    DeserializationError,
    HandshakeError,
    ProtocolError,
)
from ..protocol import REMOTE, loads, prepare
from .framing import FrameProtocol as _FrameProtocol
from .framing import alloc_buffer, checksum_trailer
from . import session
from .admission import relieve
from .core import Backend, Comm, Handler, register_backend
from .handshake import CONNECTOR, run_handshake
from .liveness import set_liveness, watch_window
from .shm_family import receiving_from
from .shm_registry import registry
from .security import Security

__all__ = ["TCPComm", "TCPListener", "TCPBackend", "offload_executor", "alloc_buffer"]

logger = logging.getLogger("shoal.comm.tcp")

#: the control message a receiver sends back for the leases of values it deserialized
_LEASE_ACK = "shoal-lease-ack"

_IOV_MAX = 512
_HANDSHAKE_TIMEOUT = 10.0
_COALESCE = 1 << 12  # a one-frame message up to this size is sent as a single buffer
_OWNER_VIEW_MIN = 1 << 20  # a frame this large to another host goes from the owner's mapping
_ONE_FRAME = struct.Struct("<QQ")  # the length prefix of a one-frame message

_executor: ThreadPoolExecutor | None = None


def offload_executor() -> ThreadPoolExecutor:
    """The thread pool that (de)serializes large messages off the event loop."""
    global _executor
    if _executor is None:
        _executor = ThreadPoolExecutor(2, thread_name_prefix="shoal-serialize")
    return _executor


def _nbytes(frame: Any) -> int:
    return len(frame) if type(frame) is bytes else memoryview(frame).nbytes


class TCPComm(Comm):
    #: whether this kind of comm offers checksums in its handshake (tls: its records
    #: are authenticated already)
    offers_checksums = True

    def __init__(self, protocol: _FrameProtocol, local: str, peer: str, deserialize: bool):
        super().__init__(deserialize)
        transport = protocol.transport
        assert transport is not None
        sock = transport.get_extra_info("socket")
        if sock is None or transport.is_closing():
            raise CommBrokenError(f"the connection to {peer} closed as it was made")
        self._wsock = self._open_writer(sock, transport, peer)
        self._protocol = protocol
        protocol.comm = self
        self._transport = transport
        self.local_address = local
        self.peer_address = peer
        self._loop = asyncio.get_running_loop()
        #: the turn of the last write: done once its message is out (see "writing")
        self._tail: asyncio.Future[None] | None = None
        self._writable: asyncio.Future[None] | None = None
        self._closed = False
        #: leases of values we sent, held until the peer acknowledges them
        self._leases: dict[int, Any] = {}
        self._lost = False
        #: large frames carry checksums both ways (both ends agreed in the handshake)
        self.checksums = False
        #: the session's keys: every message carries a tag (plain tcp with the secret)
        self.session: session.SessionKeys | None = None

    def _open_writer(self, sock: socket.socket, transport: asyncio.Transport, peer: str) -> socket.socket:
        """Our own descriptor for writing, so sends never pass through the transport's
        (copying) write buffer."""
        try:
            fd = os.dup(sock.fileno())
        except OSError as exc:
            transport.abort()
            raise _descriptor_error(exc, peer) from exc
        wsock = socket.socket(fileno=fd)
        wsock.setblocking(False)
        try:
            wsock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
        timeout = config.get("tcp-timeout")
        set_liveness(wsock, timeout)
        # a peer that is alive but not reading keeps its connection (liveness.py)
        self._window_watch = watch_window(wsock, timeout)
        return wsock

    # -- reading

    async def read(self) -> Any:
        while True:
            if self._closed:
                if isinstance(self._protocol.error, ProtocolError):
                    raise self._protocol.error  # we closed it because the peer broke the protocol
                raise CommClosedError(f"{self!r} was closed")
            frames = await self._protocol.next_frames()
            acks: list[int] = []
            # transfers (shared memory the sender hands over) are taken over only from
            # files named after the peer this connection authenticated
            pid = self.peer_info.get("pid")
            try:
                if sum(map(len, frames)) > config.get("offload-threshold"):
                    ctx = contextvars.copy_context()  # the pool thread does not inherit it
                    ctx.run(receiving_from.set, pid)
                    msg = await self._loop.run_in_executor(
                        offload_executor(), ctx.run, loads, frames, self.deserialize, acks
                    )
                else:
                    token = receiving_from.set(pid)
                    try:
                        msg = loads(frames, self.deserialize, acks)
                    finally:
                        receiving_from.reset(token)
            except ProtocolError as exc:
                logger.error("closing connection from %s: %s", self.peer_address, exc)
                self.abort()
                raise
            except Exception as exc:
                raise DeserializationError(
                    f"cannot deserialize a message from {self.peer_address}: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            if acks:
                # we have the values: the sender may free what it kept for us
                try:
                    await self.write({"op": _LEASE_ACK, "ids": acks})
                except CommError:
                    pass  # the sender ends its leases when the connection goes
            if type(msg) is dict and msg.get("op") == _LEASE_ACK:
                self._end_leases(msg.get("ids"), "acknowledged")
                continue
            return msg

    # -- leases

    def _hold_leases(self, leases: list[Any]) -> None:
        for lz in leases:
            self._leases[lz.id] = lz
            if lz.timeout:
                self._loop.call_later(lz.timeout, self._end_leases, [lz.id], "timeout")

    def _end_leases(self, ids: Any, reason: str) -> None:
        for i in ids if isinstance(ids, list) else []:
            lz = self._leases.pop(i, None) if isinstance(i, int) else None
            if lz is not None:
                lz.end(reason)

    def _end_all_leases(self, reason: str) -> None:
        self._end_leases(list(self._leases), reason)

    # -- writing
    #
    # Messages go out whole, in the order they were written. A write that finds none
    # in progress hands its message to the kernel at once (no lock, no task switch);
    # otherwise it takes a turn: a future the write before it completes once its last
    # byte is out, taken synchronously, so a turn's order is the order of the calls.

    def _idle(self) -> bool:
        tail = self._tail
        return tail is None or tail.done()

    def _take_turn(self) -> tuple[asyncio.Future[None] | None, asyncio.Future[None]]:
        prev = self._tail
        mine: asyncio.Future[None] = self._loop.create_future()
        self._tail = mine
        return (None if prev is None or prev.done() else prev), mine

    @staticmethod
    def _pass_turn(prev: asyncio.Future[None] | None, mine: asyncio.Future[None]) -> None:
        """The next write may go: now, or once ``prev`` is done (a write cancelled while
        it waited must not let the next one overtake the one before it)."""
        if mine.done():
            return
        if prev is None or prev.done():
            mine.set_result(None)
        else:
            prev.add_done_callback(lambda _: _set_done(mine))

    def _trailer(self, frames: list[Any], buffers: list[Any]) -> bytes:
        """What follows a message sent now: its session tag (its large frames hashed
        here), or its checksums, or nothing."""
        keys = self.session
        if keys is not None:
            digests = {i + 1: session.digest_now(f) for i, f in enumerate(frames) if _nbytes(f) >= session.LARGE}
            return keys.send.tag_buffers(buffers, digests)
        return checksum_trailer(frames) if self.checksums else b""

    def write_nowait(self, msg: Any) -> bool:
        """Send a small message at once if nothing else is being sent; ``False`` (and
        nothing done) when it has to wait for its turn or needs the thread pool. What
        the kernel does not take at once goes out in order in the background. Raises
        like :meth:`write`."""
        if not self._idle():
            return False
        self._check_writable()
        prepared = prepare(msg)
        if prepared.values and prepared.nbytes > config.get("offload-threshold"):
            return False
        frames = prepared.frames(self.destination)
        buffers, size = _buffers(frames)
        if len(buffers) >= _IOV_MAX:
            prepared.end_leases("not sent")
            return False
        trailer = self._trailer(frames, buffers)
        if trailer:
            buffers.append(trailer)
        self._hold_leases(prepared.leases)
        try:
            sent = self._wsock.send(buffers[0]) if len(buffers) == 1 else self._wsock.sendmsg(buffers)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            self.abort()
            raise CommBrokenError(f"connection to {self.peer_address} broke: {exc}") from exc
        views: deque[Any] = deque(buffers)
        _advance(views, sent)
        if views:
            # the rest waits for the socket, ahead of any later write
            _, mine = self._take_turn()
            asyncio.ensure_future(self._send_rest(views, sent > 0, mine))
        return True

    async def _send_rest(self, views: deque[Any], started: bool, mine: asyncio.Future[None]) -> None:
        try:
            await self._send(views, started)
        except CommError:
            pass  # the connection is gone; readers see it
        finally:
            _set_done(mine)

    async def write(self, msg: Any) -> int:
        self._check_writable()
        prepared = prepare(msg)
        if prepared.values and prepared.nbytes > config.get("offload-threshold"):
            return await self._write_large(prepared)
        frames = prepared.frames(self.destination)
        buffers, size = _buffers(frames)
        if prepared.leases:
            self._hold_leases(prepared.leases)
        sent = 0
        if self._idle() and len(buffers) < _IOV_MAX:
            # nobody else is sending or waiting to: hand the message to the kernel now,
            # without a lock or a task switch; only what it does not take waits below
            trailer = self._trailer(frames, buffers)
            if trailer:
                buffers.append(trailer)
            try:
                if len(buffers) == 1:
                    sent = self._wsock.send(buffers[0])
                    if sent == len(buffers[0]):
                        return size
                else:
                    sent = self._wsock.sendmsg(buffers)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                self.abort()
                raise CommBrokenError(f"connection to {self.peer_address} broke: {exc}") from exc
            views: deque[Any] = deque(buffers)
            _advance(views, sent)
            if not views:
                return size
            _, mine = self._take_turn()
            try:
                await self._send(views, sent > 0)
            finally:
                _set_done(mine)
            return size
        prev, mine = self._take_turn()
        try:
            if prev is not None:
                await prev
            self._check_writable()
            trailer = self._trailer(frames, buffers)
            if trailer:
                buffers.append(trailer)
            await self._send(deque(buffers), False)
        finally:
            self._pass_turn(prev, mine)
        return size

    async def _write_large(self, prepared: Any) -> int:
        """A message serialized in the thread pool (while earlier writes go out), then
        sent in its turn; its session tag or checksums are computed in the pool while
        its frames go out (the sender waits for the socket most of the time: hashing
        then costs no time of its own), and follow them."""
        prev, mine = self._take_turn()
        try:
            # (``kept``: the frames replaced, alive until sent: their mapping holds
            # the segment's lock, so the owner cannot reuse it meanwhile)
            frames, kept = await self._loop.run_in_executor(
                offload_executor(), _frames_for, prepared, self.destination
            )
            buffers, size = _buffers(frames)
            if prev is not None:
                await prev
            if self.closed():
                prepared.end_leases("closed")  # closed while serializing
            self._check_writable()
            self._hold_leases(prepared.leases)
            await self._send_hashed(frames, buffers)
        finally:
            self._pass_turn(prev, mine)
        return size

    async def _send_hashed(self, frames: list[Any], buffers: list[Any]) -> None:
        keys = self.session
        if keys is None and not self.checksums:
            return await self._send(deque(buffers), False)
        if keys is not None:
            chunks = {i + 1: session.chunk_digests(f) for i, f in enumerate(frames) if _nbytes(f) >= session.LARGE}
            hashed: Any = None
        else:
            hashed = self._loop.run_in_executor(offload_executor(), checksum_trailer, frames)
        try:
            await self._send(deque(buffers), False)
            if keys is not None:
                for futures in chunks.values():
                    for fut in futures:
                        if not fut.done():
                            await asyncio.wrap_future(fut)
                trailer = keys.send.tag_buffers(buffers, {i: session.frame_digest(c) for i, c in chunks.items()})
            else:
                trailer = await hashed
            if trailer:
                await self._send(deque([trailer]), True)
        except BaseException:
            if hashed is not None and not hashed.done():
                hashed.cancel()
            if not self._closed:
                self.abort()  # the frames may be out without their trailer: the stream is unusable
            raise

    def _check_writable(self) -> None:
        if self._closed:
            raise CommClosedError(f"{self!r} was closed")
        if self._lost:
            err = self._protocol.error
            if isinstance(err, CommBrokenError):
                raise CommBrokenError(str(err))
            raise CommBrokenError(f"connection to {self.peer_address} is broken")

    async def _send(self, views: deque[Any], started: bool = False) -> None:
        """Send ``views`` (consumed); ``started``: part of the message is already out."""
        sock = self._wsock
        try:
            while views:
                try:
                    sent = sock.sendmsg(list(itertools.islice(views, _IOV_MAX)))
                except (BlockingIOError, InterruptedError):
                    await self._wait_writable()
                    continue
                started = True
                _advance(views, sent)
        except OSError as exc:
            self.abort()
            raise CommBrokenError(f"connection to {self.peer_address} broke: {exc}") from exc
        except BaseException:
            if started and views:
                # half a message is on the wire: the stream is unusable
                self.abort()
            raise

    async def _wait_writable(self) -> None:
        if self._closed:
            raise CommClosedError(f"{self!r} was closed")
        fut = self._loop.create_future()
        self._writable = fut
        fd = self._wsock.fileno()
        self._loop.add_writer(fd, _set_done, fut)
        try:
            await fut
        finally:
            self._writable = None
            if not self._wsock._closed:  # type: ignore[attr-defined]
                self._loop.remove_writer(fd)

    # -- closing

    def _on_lost(self) -> None:
        self._lost = True
        self._end_all_leases("connection lost")
        fut = self._writable
        if fut is not None and not fut.done():
            fut.set_exception(CommBrokenError(f"connection to {self.peer_address} was lost"))
        self._close_wsock()

    def _close_wsock(self) -> None:
        sock = self._wsock
        if sock._closed:  # type: ignore[attr-defined]
            return
        if self._window_watch is not None:
            self._window_watch.discard(sock)
        fut = self._writable
        if fut is not None and not fut.done():
            try:
                self._loop.remove_writer(sock.fileno())
            except Exception:
                pass
            fut.set_exception(
                CommClosedError(f"{self!r} was closed") if self._closed and not self._lost
                else CommBrokenError(f"connection to {self.peer_address} was lost")
            )
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()

    async def close(self) -> None:
        if self._closed:
            return
        # let the writes in progress finish so the peer gets whole messages
        if not self._idle():
            assert self._tail is not None
            try:
                await asyncio.wait_for(asyncio.shield(self._tail), 5.0)
            except (asyncio.TimeoutError, Exception):
                pass
        self._closed = True
        self._end_all_leases("closed")
        self._close_wsock()
        self._transport.close()

    def abort(self) -> None:
        if self._closed:
            self._transport.abort()  # closing gracefully, and not to wait for that any more
            return
        self._closed = True
        self._end_all_leases("closed")
        self._close_wsock()
        self._transport.abort()

    def closed(self) -> bool:
        return self._closed or self._lost

    def channel_binding(self) -> bytes | None:
        """What the handshake's proofs bind to besides the nonces: the TLS session
        (tls://); None over plain tcp, whose messages carry session tags instead."""
        return None

    def set_idle_timeout(self, seconds: float) -> None:
        self._protocol.set_idle_timeout(seconds)

    def receive_large_frames_into(self, allocate: Any, min_bytes: int) -> None:
        self._protocol.land_frames(allocate, min_bytes)


def _advance(views: deque[Any], sent: int) -> None:
    """Drop the first ``sent`` bytes from ``views`` (and any empty buffers after them)."""
    while sent:
        head = views[0]
        size = _nbytes(head)
        if sent >= size:
            views.popleft()
            sent -= size
        else:
            views[0] = memoryview(head).cast("B")[sent:]
            sent = 0
    while views and _nbytes(views[0]) == 0:
        views.popleft()


def _frames_for(prepared: Any, destination: str) -> tuple[list[Any], list[Any]]:
    """A large message's frames for ``destination``, and the frames replaced. To
    another host, a large frame that lies in a segment this process owns goes out from
    the owner's mapping of it: the same bytes, with its pages mapped, where the value's
    own (copy-on-write) mapping is new and faults every 64 KiB while the kernel copies
    from it."""
    frames = list(prepared.frames(destination))
    replaced = []
    if destination == REMOTE:
        for i, frame in enumerate(frames):
            if type(frame) is not bytes and _nbytes(frame) >= _OWNER_VIEW_MIN:
                view = registry.owner_view(memoryview(frame).cast("B"))
                if view is not None:
                    replaced.append(frame)
                    frames[i] = view
    return frames, replaced


def _buffers(frames: list[Any], trailer: bytes = b"") -> tuple[list[Any], int]:
    """The buffers that put ``frames`` on the wire (length prefix first, ``trailer``
    last), and the size of the frames."""
    if len(frames) == 1:
        frame = frames[0]
        size = _nbytes(frame)
        head = _ONE_FRAME.pack(1, size)
        # a small message goes out as one buffer (one cheap copy, a plain send)
        out = [head + frame] if size <= _COALESCE else [head, frame]
    else:
        lengths = [_nbytes(f) for f in frames]
        out, size = [struct.pack(f"<Q{len(lengths)}Q", len(lengths), *lengths), *frames], sum(lengths)
    if trailer:
        out.append(trailer)
    return out, size


def _set_done(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _split_hostport(location: str) -> tuple[str, int]:
    host, sep, port = location.rpartition(":")
    if not sep:
        raise ValueError(f"tcp address needs host:port, got {location!r}")
    host = host.strip("[]")
    try:
        return host, int(port)
    except ValueError:
        raise ValueError(f"tcp address has a bad port: {location!r}") from None


def _format(host: str, port: int, scheme: str = "tcp") -> str:
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


class TCPBackend(Backend):
    scheme = "tcp"

    async def connect(self, location: str, deserialize: bool, timeout: float,
                      security: Security | None = None, *, role: str = "client",
                      expect: str | None = None) -> TCPComm:
        self._check(security)
        host, port = _split_hostport(location)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        delay = 0.005
        address = _format(host, port, self.scheme)
        while True:
            try:
                remaining = max(deadline - loop.time(), 0.001)
                transport, protocol = await asyncio.wait_for(
                    loop.create_connection(_FrameProtocol, host, port, **self._connect_kwargs(security)),
                    remaining,
                )
                if isinstance(protocol.error, ProtocolError):
                    # the peer's first bytes were not shoal's
                    transport.abort()
                    raise HandshakeError(f"refused connection to {address}: {protocol.error}")
                local = transport.get_extra_info("sockname")
                try:
                    comm = self._make_comm(protocol, _format(local[0], local[1], self.scheme), address, deserialize)
                except CommConnectError as exc:
                    cause = exc.__cause__
                    if isinstance(cause, OSError) and cause.errno in _OUT_OF_RESOURCES:
                        raise cause from None  # out of descriptors for the writer's: as below
                    raise
                break
            except ssl.SSLError as exc:
                # the peer's certificate (or ours, to the peer) is not the cluster's
                raise HandshakeError(f"refused connection to {address}: TLS handshake failed: {exc}") from exc
            except OSError as exc:
                if exc.errno in _OUT_OF_RESOURCES:
                    if exc.errno in _NO_DESCRIPTORS and loop.time() + delay < deadline and relieve(_RELIEF, loop):
                        # strangers of this process's listeners made room: their
                        # descriptors come free as their connections close, shortly
                        await asyncio.sleep(delay)
                        delay = min(delay * 2, 0.25)
                        continue
                    # this process's trouble, not the peer's: waiting here would not help
                    raise _descriptor_error(exc, address) from exc
                if loop.time() + delay >= deadline:
                    raise CommConnectError(f"could not connect to {address} within {timeout}s: {exc!r}") from exc
                await asyncio.sleep(delay)  # retry backoff for a peer that is starting
                delay = min(delay * 2, 0.25)
            except (asyncio.TimeoutError, CommBrokenError) as exc:
                if loop.time() + delay >= deadline:
                    raise CommConnectError(f"could not connect to {address} within {timeout}s: {exc!r}") from exc
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.25)
        await run_handshake(comm, CONNECTOR, security, max(deadline - loop.time(), _HANDSHAKE_TIMEOUT),
                            role, expect)
        return comm

    def _check(self, security: Security | None) -> None:
        if security is not None and security.require_encryption:
            raise CommConnectError("this Security requires encryption: connect to a tls:// address")

    def _connect_kwargs(self, security: Security | None) -> dict[str, Any]:
        return {}

    def _make_comm(self, protocol: _FrameProtocol, local: str, peer: str, deserialize: bool) -> TCPComm:
        return TCPComm(protocol, local, peer, deserialize)

    def listener(self, location: str, handler: Handler, deserialize: bool,
                 security: Security | None = None) -> TCPListener:
        return TCPListener(location, handler, deserialize, security)


#: errors of this process's own resources: they fail the connection at hand at once
#: (out of descriptors: once no stranger of a listener here is left to make room)
_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
_NO_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE})
#: strangers evicted each time an outgoing connection finds no descriptor
_RELIEF = 4


def _descriptor_error(exc: OSError, peer: str) -> CommError:
    if exc.errno in (errno.EMFILE, errno.ENFILE):
        return CommConnectError(
            f"cannot open a connection to {peer}: this process is out of file descriptors "
            f"({exc.strerror}); raise the limit (ulimit -n) or open fewer connections"
        )
    if exc.errno in (errno.ENOMEM, errno.ENOBUFS):
        return CommConnectError(f"cannot open a connection to {peer}: out of memory for a socket ({exc.strerror})")
    return CommBrokenError(f"connection to {peer} failed as it was set up: {exc}")


# (the listener builds on TCPComm)
from .listener import TCPListener  # noqa: E402

register_backend("tcp", TCPBackend())
