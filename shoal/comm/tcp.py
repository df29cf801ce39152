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
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import struct
import threading
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
    ShoalError,
)
from ..protocol import REMOTE, SAME_HOST, loads, prepare
from . import shm
from .framing import FrameProtocol as _FrameProtocol
from .framing import alloc_buffer
from .core import (
    Backend,
    Comm,
    Handler,
    Listener,
    check_handshake,
    local_info,
    register_backend,
    run_handler,
)

__all__ = ["TCPComm", "TCPListener", "TCPBackend", "offload_executor", "alloc_buffer"]

logger = logging.getLogger("shoal.comm.tcp")

#: the control message a receiver sends back for the leases of values it deserialized
_LEASE_ACK = "shoal-lease-ack"

_IOV_MAX = 512
_HANDSHAKE_TIMEOUT = 10.0
_COALESCE = 1 << 12  # a one-frame message up to this size is sent as a single buffer
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
    def __init__(self, protocol: _FrameProtocol, local: str, peer: str, deserialize: bool):
        super().__init__(deserialize)
        self._protocol = protocol
        protocol.comm = self
        transport = protocol.transport
        assert transport is not None
        self._transport = transport
        self.local_address = local
        self.peer_address = peer
        sock = transport.get_extra_info("socket")
        # our own descriptor for writing, so sends never pass through the transport's
        # (copying) write buffer
        self._wsock = socket.socket(fileno=os.dup(sock.fileno()))
        self._wsock.setblocking(False)
        try:
            self._wsock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
        self._loop = asyncio.get_running_loop()
        self._write_lock = asyncio.Lock()
        self._writers = 0  # writes that are sending or waiting for the lock
        self._writable: asyncio.Future[None] | None = None
        self._closed = False
        #: leases of values we sent, held until the peer acknowledges them
        self._leases: dict[int, Any] = {}
        self._rest: asyncio.Future[None] | None = None
        self._lost = False

    # -- reading

    async def read(self) -> Any:
        while True:
            if self._closed:
                if isinstance(self._protocol.error, ProtocolError):
                    raise self._protocol.error  # we closed it because the peer broke the protocol
                raise CommClosedError(f"{self!r} was closed")
            frames = await self._protocol.next_frames()
            acks: list[int] = []
            try:
                if sum(map(len, frames)) > config.get("offload-threshold"):
                    msg = await self._loop.run_in_executor(
                        offload_executor(), loads, frames, self.deserialize, acks
                    )
                else:
                    msg = loads(frames, self.deserialize, acks)
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

    def write_nowait(self, msg: Any) -> bool:
        """Send a small message at once if nothing else is being sent; ``False`` (and
        nothing done) when it has to wait for its turn or needs the thread pool. What
        the kernel does not take at once goes out in order in the background. Raises
        like :meth:`write`."""
        if self._writers:
            return False
        self._check_writable()
        prepared = prepare(msg)
        if prepared.values and prepared.nbytes > config.get("offload-threshold"):
            return False
        frames = prepared.frames(self.destination)
        buffers, size = _buffers(frames)
        if len(buffers) > _IOV_MAX:
            prepared.end_leases("not sent")
            return False
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
            self._writers += 1
            task = asyncio.ensure_future(self._send_rest(views, sent > 0))
            self._rest = task
        return True

    async def _send_rest(self, views: deque[Any], started: bool) -> None:
        try:
            async with self._write_lock:
                await self._send(views, started)
        except CommError:
            pass  # the connection is gone; readers see it
        finally:
            self._writers -= 1

    async def write(self, msg: Any) -> int:
        self._check_writable()
        prepared = prepare(msg)
        if prepared.values and prepared.nbytes > config.get("offload-threshold"):
            # serialized in the thread pool; the lock keeps later messages behind it
            self._writers += 1
            try:
                async with self._write_lock:
                    frames = await self._loop.run_in_executor(
                        offload_executor(), prepared.frames, self.destination
                    )
                    buffers, size = _buffers(frames)
                    if self.closed():
                        prepared.end_leases("closed")  # closed while serializing
                    self._check_writable()
                    self._hold_leases(prepared.leases)
                    await self._send(deque(buffers), False)
            finally:
                self._writers -= 1
            return size
        frames = prepared.frames(self.destination)
        buffers, size = _buffers(frames)
        if prepared.leases:
            self._hold_leases(prepared.leases)
        sent = 0
        if not self._writers and len(buffers) <= _IOV_MAX:
            # nobody else is sending or waiting to: hand the message to the kernel now,
            # without a lock or a task switch; only what it does not take waits below
            self._check_writable()
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
        started = sent > 0
        if started:
            _advance(views, sent)
            if not views:
                return size
        self._writers += 1
        try:
            async with self._write_lock:
                if not started:
                    self._check_writable()
                await self._send(views, started)
        finally:
            self._writers -= 1
        return size

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
        # let a write in progress finish so the peer gets whole messages
        if self._write_lock.locked():
            try:
                await asyncio.wait_for(self._write_lock.acquire(), 5.0)
                self._write_lock.release()
            except (asyncio.TimeoutError, Exception):
                pass
        self._closed = True
        self._end_all_leases("closed")
        self._close_wsock()
        self._transport.close()

    def abort(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._end_all_leases("closed")
        self._close_wsock()
        self._transport.abort()

    def closed(self) -> bool:
        return self._closed or self._lost


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


def _buffers(frames: list[Any]) -> tuple[list[Any], int]:
    """The buffers that put ``frames`` on the wire (length prefix first), and the size."""
    if len(frames) == 1:
        frame = frames[0]
        size = _nbytes(frame)
        head = _ONE_FRAME.pack(1, size)
        # a small message goes out as one buffer (one cheap copy, a plain send)
        return ([head + frame] if size <= _COALESCE else [head, frame]), size
    lengths = [_nbytes(f) for f in frames]
    return [struct.pack(f"<Q{len(lengths)}Q", len(lengths), *lengths), *frames], sum(lengths)


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


def _format(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


async def _handshake(comm: TCPComm, timeout: float) -> None:
    """Exchange handshakes, then learn whether the peer shares our shared-memory domain:
    each side offers a probe segment, tries to open the other's, and says whether it
    could. The destination is ``same-host`` when the peer can map what we create."""
    probe = shm.probe()
    try:
        mine = local_info()
        if probe is not None:
            mine["shm_probe"] = list(probe)
        await comm.write(mine)
        info = await asyncio.wait_for(comm.read(), timeout)
        comm.peer_info = check_handshake(info, comm.peer_address)
        offered = info.get("shm_probe")
        can_map = isinstance(offered, list) and len(offered) == 2 and shm.check_probe(*offered)
        await comm.write({"op": "handshake-shm", "can_map": can_map})
        answer = await asyncio.wait_for(comm.read(), timeout)
        if not isinstance(answer, dict) or answer.get("op") != "handshake-shm":
            raise HandshakeError(f"{comm.peer_address} did not answer the shared-memory probe (got {answer!r:.100})")
    except HandshakeError:
        comm.abort()
        raise
    except (ShoalError, asyncio.TimeoutError) as exc:
        comm.abort()
        raise HandshakeError(f"handshake with {comm.peer_address} failed: {exc!r}") from exc
    finally:
        if probe is not None:
            shm.unlink(probe[0])
    comm.peer_info["shm"] = {"peer_maps_ours": bool(answer.get("can_map")), "we_map_theirs": can_map}
    comm.destination = SAME_HOST if answer.get("can_map") is True else REMOTE


class TCPListener(Listener):
    def __init__(self, location: str, handler: Handler, deserialize: bool):
        host, port = _split_hostport(location or "127.0.0.1:0")
        self.host, self.port = host, port
        self.handler = handler
        self.deserialize = deserialize
        self.server: asyncio.base_events.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        loop = self._loop = asyncio.get_running_loop()
        self.server = await loop.create_server(
            lambda: _FrameProtocol(self._on_connection),
            self.host or None,
            self.port,
            backlog=1024,
            reuse_address=True,
        )
        self.port = self.server.sockets[0].getsockname()[1]

    def _on_connection(self, protocol: _FrameProtocol) -> None:
        transport = protocol.transport
        assert transport is not None
        peer = transport.get_extra_info("peername")
        local = transport.get_extra_info("sockname")
        comm = TCPComm(protocol, _format(*local[:2]), _format(*peer[:2]), self.deserialize)
        task = asyncio.ensure_future(self._serve(comm))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, comm: TCPComm) -> None:
        try:
            await _handshake(comm, _HANDSHAKE_TIMEOUT)
        except HandshakeError as exc:
            logger.warning("refused connection from %s: %s", comm.peer_address, exc)
            return
        await run_handler(self.handler, comm)

    def stop(self) -> None:
        """Stop accepting connections; callable from any thread (the server belongs to
        the loop that started it, and is closed there)."""
        server, loop = self.server, self._loop
        if server is None:
            return
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if loop is None or here is loop or loop.is_closed() or not loop.is_running():
            server.close()
            return
        closed = threading.Event()

        def close() -> None:
            try:
                server.close()
            finally:
                closed.set()

        loop.call_soon_threadsafe(close)
        closed.wait(10)

    @property
    def listen_address(self) -> str:
        return _format(self.host or "0.0.0.0", self.port)

    @property
    def contact_address(self) -> str:
        host = self.host
        if host in ("", "0.0.0.0", "::"):
            try:
                host = socket.gethostbyname(socket.gethostname())
            except OSError:
                host = "127.0.0.1"
        return _format(host, self.port)


class TCPBackend(Backend):
    async def connect(self, location: str, deserialize: bool, timeout: float) -> TCPComm:
        host, port = _split_hostport(location)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        delay = 0.005
        while True:
            try:
                remaining = max(deadline - loop.time(), 0.001)
                transport, protocol = await asyncio.wait_for(
                    loop.create_connection(_FrameProtocol, host, port), remaining
                )
                break
            except (OSError, asyncio.TimeoutError) as exc:
                if loop.time() + delay >= deadline:
                    raise CommConnectError(
                        f"could not connect to {_format(host, port)} within {timeout}s: {exc!r}"
                    ) from exc
                await asyncio.sleep(delay)  # retry backoff for a peer that is starting
                delay = min(delay * 2, 0.25)
        local = transport.get_extra_info("sockname")
        comm = TCPComm(protocol, _format(*local[:2]), _format(host, port), deserialize)
        await _handshake(comm, max(deadline - loop.time(), _HANDSHAKE_TIMEOUT))
        return comm

    def listener(self, location: str, handler: Handler, deserialize: bool) -> TCPListener:
        return TCPListener(location, handler, deserialize)


register_backend("tcp", TCPBackend())
