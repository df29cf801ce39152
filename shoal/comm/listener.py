"""The listener of ``tcp://`` (and, through :mod:`.tls`, of ``tls://``): connections
accepted by :mod:`.accept`, admitted by :mod:`.admission`, handshaken
(:mod:`.handshake`), then handed to the handler.

A connection is a *stranger* from its accept until its handshake is done: over tls the
TLS handshake (``loop.connect_accepted_socket`` with the listener's context, its own
timeout) is part of that phase, then the shoal handshake, whose proof of the secret
ends it. While it is a stranger the listener can evict it (:class:`_Accepted`), to make
room for a newcomer (the oldest first, docs/protocol.md §3.2) or for descriptors.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import threading
from typing import Any

import msgpack

from ..errors import CommBrokenError, CommError, HandshakeError
from ..protocol import PROTOCOL_VERSION
from ..protocol.messages import HandshakeRefusedMsg, to_wire
from . import security as _security
from .accept import Acceptor
from .admission import (
    OUT_OF_DESCRIPTORS,
    AdmissionTable,
    Stranger,
    check_limits,
    descriptor_relief,
    raise_descriptor_limit,
    relieve,
)
from .core import Handler, Listener, run_handler
from .framing import FrameProtocol as _FrameProtocol
from .handshake import ACCEPTOR, run_handshake
from .security import Security
from .tcp import _HANDSHAKE_TIMEOUT, _ONE_FRAME, TCPComm, _format, _split_hostport

__all__ = ["TCPListener"]

logger = logging.getLogger("shoal.comm.tcp")

#: the kernel's queue of connections not yet accepted (capped by net.core.somaxconn):
#: while a flood fills it, a connection beyond it waits for its SYN to be sent again
#: (1 s, then 3 s, ...) instead of its turn
_BACKLOG = 4096


class _Watched(_FrameProtocol):
    """The frame protocol of an accepted connection, which tells the admission table
    when the stranger first speaks: its first whole message (over tls: the TLS
    handshake done, when the connection is made)."""

    def __init__(self, table: AdmissionTable, entry: Stranger, tls: bool):
        super().__init__()
        self._watch: tuple[AdmissionTable, Stranger] | None = (table, entry)
        self._entry = entry
        self._tls = tls

    def connection_lost(self, exc: Exception | None) -> None:
        if self.error is None and self._entry.state == "stranger":
            # a stranger that goes in the middle of its handshake is the listener's to
            # log, a few times in a flood (a warning for each would be a way to fill
            # the log)
            err = CommBrokenError("peer closed the connection during the handshake" + (f": {exc}" if exc else ""))
            err.__cause__ = exc
            self.error = err
        super().connection_lost(exc)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if self._tls:
            self._spoke()

    def buffer_updated(self, nbytes: int) -> None:
        super().buffer_updated(nbytes)
        if self._watch is not None and self.messages:
            self._spoke()

    def _spoke(self) -> None:
        watch, self._watch = self._watch, None
        if watch is not None:
            watch[0].spoke(watch[1])


class _Accepted:
    """A connection a listener accepted, until its handshake is done: what to close
    when it is evicted (:mod:`.admission`)."""

    __slots__ = ("sock", "entry", "task", "comm", "taken")

    def __init__(self, sock: socket.socket, entry: Stranger):
        self.sock: socket.socket | None = sock
        self.entry = entry
        self.task: asyncio.Task[None] | None = None
        self.comm: TCPComm | None = None
        self.taken = False  # the socket is the loop's transport's now

    def evict(self) -> None:
        if self.comm is not None:
            self.comm.abort()
        elif not self.taken and self.sock is not None:
            self.sock.close()  # its task has not started: nothing else will close it
        if self.task is not None:
            self.task.cancel()


class TCPListener(Listener):
    """Accepts tcp connections (:mod:`.accept`) and admits them (:mod:`.admission`): a
    connection is a stranger until its handshake is done, and the oldest strangers make
    room for new ones under ``max-handshaking-per-host``, ``max-handshaking``,
    ``max-connections`` and the descriptor reserve."""

    scheme = "tcp"

    def __init__(self, location: str, handler: Handler, deserialize: bool, security: Security | None = None):
        host, port = _split_hostport(location or "127.0.0.1:0")
        self.host, self.port = host, port
        self.handler = handler
        self.deserialize = deserialize
        self.security = security
        self._acceptor: Acceptor | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        #: connections in their handshake (strangers) and past it, by arrival
        self.admission = AdmissionTable()
        #: how many of each kind of refusal were logged (evictions, refusals)
        self._logged: dict[str, int] = {}

    async def start(self) -> None:
        self._check_plain()
        check_limits()
        raise_descriptor_limit()
        self._loop = self.admission.loop = asyncio.get_running_loop()
        self._acceptor = Acceptor(self._accepted, self._refusal())
        self.port = await self._acceptor.open(self.host, self.port, backlog=_BACKLOG)

    def _check_plain(self) -> None:
        if self.security is not None and self.security.require_encryption:
            raise ValueError("this Security requires encryption: listen on a tls:// address")

    def _accept_kwargs(self) -> dict[str, Any]:
        """What ``loop.connect_accepted_socket`` needs besides the socket (tls: the
        context and the TLS handshake's timeout)."""
        return {}

    def _refusal(self) -> bytes:
        """What a connection refused for want of descriptors is sent: a
        ``handshake-refused`` saying why (docs/protocol.md §3)."""
        text = (f"{OUT_OF_DESCRIPTORS} and has no connection in its handshake to close; try again "
                "later, or raise its limit (ulimit -n)")
        payload = msgpack.packb(to_wire(HandshakeRefusedMsg(text, PROTOCOL_VERSION)), use_bin_type=True)
        return _ONE_FRAME.pack(1, len(payload)) + payload

    def _accepted(self, sock: socket.socket, address: Any) -> None:
        host = _peer_host(address)
        relief = descriptor_relief(sock.fileno())
        if relief:
            # few descriptors left: strangers (of any listener here) make room first
            evicted = relieve(relief, self._loop)
            if evicted:
                self._log_refusal(f"few file descriptors are left: closed {evicted} connection(s) still in their "
                                  "handshake, the oldest first (descriptor-reserve)", "evicted")
        table = self.admission
        entry, evicted_for = table.admit(host)
        for old, why in evicted_for:
            old.evict()
            self._log_refusal(f"closed the oldest connection in its handshake from {old.host} to make room "
                              f"for one from {host} ({why})", "evicted")
        if entry is None:
            self._log_refusal(f"refused a connection from {host}: {table.established} connections are open, "
                              "all past their handshake (max-connections)")
            sock.close()
            return
        conn = _Accepted(sock, entry)
        entry.evict = conn.evict
        assert self._loop is not None
        task = self._loop.create_task(self._serve(conn, host))
        conn.task = task
        self._tasks.add(task)
        task.add_done_callback(functools.partial(self._served, conn))

    def _served(self, conn: _Accepted, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not conn.taken and conn.sock is not None:
            conn.sock.close()  # cancelled before it started (the loop is closing)
        if self._acceptor is not None:
            self._acceptor.wake()  # a descriptor came free
        if not task.cancelled() and task.exception() is not None:
            logger.error("serving a connection failed", exc_info=task.exception())

    async def _serve(self, conn: _Accepted, host: str) -> None:
        entry = conn.entry
        comm: TCPComm | None = None
        try:
            comm = await self._welcome(conn, host)
        finally:
            if comm is None or not self.admission.establish(entry):
                self.admission.leave(entry)
                if comm is not None:
                    comm.abort()
                    comm = None
            conn.sock = conn.comm = conn.task = None
        if comm is None:
            return
        try:
            await run_handler(self.handler, comm)
        finally:
            self.admission.leave(entry)

    async def _welcome(self, conn: _Accepted, host: str) -> TCPComm | None:
        """The stranger phase of a connection: its transport (over tls, after the TLS
        handshake) and the shoal handshake. Returns the comm when both are done; None
        (its connection closed, the refusal logged) otherwise."""
        assert self._loop is not None and conn.sock is not None
        conn.taken = True
        made: list[_FrameProtocol] = []
        kwargs = self._accept_kwargs()

        def protocol_factory() -> _FrameProtocol:
            made.append(_Watched(self.admission, conn.entry, tls="ssl" in kwargs))
            return made[-1]

        try:
            # (uvloop returns its TLS protocol, not ours: ours is the one made here)
            transport, _ = await self._loop.connect_accepted_socket(protocol_factory, conn.sock, **kwargs)
            protocol = made[0]
        except OSError as exc:  # the TLS handshake failed or took too long, the peer went
            self._log_refusal(f"refused a connection from {host}: {type(exc).__name__}" + (f": {exc}" if str(exc) else ""))
            return None
        local = transport.get_extra_info("sockname")
        peer = transport.get_extra_info("peername")
        if peer is None or local is None:
            transport.abort()  # gone as it came
            return None
        try:
            comm = self._make_comm(protocol, _format(local[0], local[1], self.scheme),
                                   _format(peer[0], peer[1], self.scheme))
        except CommError as exc:
            transport.abort()
            self._log_refusal(f"could not take a connection from {host}: {exc}")
            return None
        conn.comm = comm
        try:
            await run_handshake(comm, ACCEPTOR, self.security, _HANDSHAKE_TIMEOUT, self.role)
        except HandshakeError as exc:
            self._log_refusal(str(exc))
            return None
        except Exception:
            # a bug: said loudly, and only this connection pays
            logger.exception("the handshake with %s failed; closing the connection", comm.peer_address)
            comm.abort()
            return None
        return comm

    def _make_comm(self, protocol: _FrameProtocol, local: str, peer: str) -> TCPComm:
        return TCPComm(protocol, local, peer, self.deserialize)

    def _log_refusal(self, text: str, kind: str = "refusal") -> None:
        # a flood is logged a few times, not once per connection (each kind of
        # message on its own: evictions do not hide the refusals)
        n = self._logged[kind] = self._logged.get(kind, 0) + 1
        if n <= 10 or n % 1000 == 0:
            logger.warning("%s (%s %d)", text, kind, n)

    def stop(self) -> None:
        """Stop accepting connections; callable from any thread (the listening sockets
        belong to the loop that started them, and are closed there). Connections already
        taken go on."""
        acceptor, loop = self._acceptor, self._loop
        if self.registered:
            _security.unregister(self.registered)
        if acceptor is None:
            return
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if loop is None or here is loop or loop.is_closed() or not loop.is_running():
            acceptor.close()
            return
        closed = threading.Event()

        def close() -> None:
            try:
                acceptor.close()
            finally:
                closed.set()

        loop.call_soon_threadsafe(close)
        closed.wait(10)

    @property
    def listen_address(self) -> str:
        return _format(self.host or "0.0.0.0", self.port, self.scheme)

    @property
    def contact_address(self) -> str:
        host = self.host
        if host in ("", "0.0.0.0", "::"):
            try:
                host = socket.gethostbyname(socket.gethostname())
            except OSError:
                host = "127.0.0.1"
        return _format(host, self.port, self.scheme)


def _peer_host(address: Any) -> str:
    """The peer's address as limits count it (an IPv4 address mapped into IPv6 is the
    IPv4 address)."""
    host = str(address[0]) if isinstance(address, tuple) and address else "?"
    return host.removeprefix("::ffff:") if host.startswith("::ffff:") and "." in host else host
