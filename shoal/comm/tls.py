"""``tls://``: the tcp wire format inside mutual TLS (Python's ``ssl``).

Both ends present a certificate signed by the cluster's CA and check the other's
(:meth:`Security.ssl_context`); the handshake of :mod:`.handshake`, the cluster's secret
included, then runs inside the encrypted session. Reading is the same frame parser as
tcp's; writing goes through the TLS transport, which encrypts into buffers of its own
(there is no zero-copy path to a socket that encrypts), waiting for the transport to
drain when it holds more than its high-water mark. Large messages are still serialized
and deserialized off the event loop, and same-host peers still move large buffers
through shared memory: the probe in the handshake decides that, as over tcp.
"""

from __future__ import annotations

import asyncio
import socket
from collections import deque
from typing import Any

from .. import config
from ..errors import CommBrokenError, CommConnectError
from ..protocol import prepare
from .core import register_backend
from .framing import FrameProtocol
from .security import Security
from .listener import TCPListener
from .tcp import TCPBackend, TCPComm, _buffers, offload_executor

__all__ = ["TLSComm", "TLSListener", "TLSBackend"]

_HANDSHAKE_TIMEOUT = 10.0
#: how long a closing TLS connection waits for the peer to close its side (asyncio: 30 s)
_SHUTDOWN_TIMEOUT = 2.0


class TLSComm(TCPComm):
    """A :class:`TCPComm` whose bytes go through its TLS transport."""

    offers_checksums = False  # each TLS record is authenticated already

    def _open_writer(self, sock: socket.socket, transport: asyncio.Transport, peer: str) -> Any:
        return None  # the transport encrypts: nothing may bypass it

    def channel_binding(self) -> bytes | None:
        ssl_object = self._transport.get_extra_info("ssl_object")
        binding = ssl_object.get_channel_binding("tls-unique") if ssl_object is not None else None
        return binding or b""

    async def close(self) -> None:
        """Close, and wait (up to the TLS shutdown's timeout) until the peer closed
        its side of the session too: the connection is then gone, not closing."""
        await super().close()
        try:
            await asyncio.wait_for(self._protocol.gone.wait(), _SHUTDOWN_TIMEOUT)
        except asyncio.TimeoutError:
            self._transport.abort()

    def _close_wsock(self) -> None:
        self._protocol.wake_writers(CommBrokenError(f"connection to {self.peer_address} was lost"))

    def write_nowait(self, msg: Any) -> bool:
        if not self._idle() or self._protocol.write_paused:
            return False
        self._check_writable()
        prepared = prepare(msg)
        if prepared.values and prepared.nbytes > config.get("offload-threshold"):
            return False
        buffers, _ = _buffers(prepared.frames(self.destination))
        self._hold_leases(prepared.leases)
        self._transport.writelines(buffers)
        return True

    async def write(self, msg: Any) -> int:
        self._check_writable()
        prepared = prepare(msg)
        offload = bool(prepared.values) and prepared.nbytes > config.get("offload-threshold")
        if not offload and self._idle():
            buffers, size = _buffers(prepared.frames(self.destination))
            self._hold_leases(prepared.leases)
            self._transport.writelines(buffers)
            await self._protocol.drain()
            return size
        # behind a write that serializes in the thread pool, in order
        prev, mine = self._take_turn()
        try:
            if offload:
                frames = await self._loop.run_in_executor(offload_executor(), prepared.frames, self.destination)
            else:
                frames = prepared.frames(self.destination)
            buffers, size = _buffers(frames)
            if prev is not None:
                await prev
            if self.closed():
                prepared.end_leases("closed")
            self._check_writable()
            self._hold_leases(prepared.leases)
            self._transport.writelines(buffers)
            await self._protocol.drain()
        finally:
            self._pass_turn(prev, mine)
        return size

    async def _send(self, views: deque[Any], started: bool = False) -> None:
        self._transport.writelines(list(views))
        views.clear()
        await self._protocol.drain()


class TLSListener(TCPListener):
    scheme = "tls"

    async def start(self) -> None:
        if self.security is None or not self.security.tls:
            raise ValueError("a tls:// listener needs a Security with ca_file=, cert= and key=")
        await super().start()

    def _check_plain(self) -> None:
        pass

    def _accept_kwargs(self) -> dict[str, Any]:
        # the TLS handshake is the first part of a stranger's time, with its own timeout
        assert self.security is not None
        return {"ssl": self.security.ssl_context(server=True), "ssl_handshake_timeout": _HANDSHAKE_TIMEOUT,
                "ssl_shutdown_timeout": _SHUTDOWN_TIMEOUT}

    def _refusal(self) -> bytes:
        return b""  # no TLS session to say it in: the connection is closed

    def _make_comm(self, protocol: FrameProtocol, local: str, peer: str) -> TCPComm:
        return TLSComm(protocol, local, peer, self.deserialize)


class TLSBackend(TCPBackend):
    scheme = "tls"

    def _check(self, security: Security | None) -> None:
        if security is None or not security.tls:
            raise CommConnectError(
                "tls:// needs a Security with ca_file=, cert= and key= (Client(..., security=...), "
                "or --tls-ca-file/--tls-cert/--tls-key)"
            )

    def _connect_kwargs(self, security: Security | None) -> dict[str, Any]:
        assert security is not None
        return {"ssl": security.ssl_context(server=False), "ssl_handshake_timeout": _HANDSHAKE_TIMEOUT,
                "ssl_shutdown_timeout": _SHUTDOWN_TIMEOUT}

    def _make_comm(self, protocol: FrameProtocol, local: str, peer: str, deserialize: bool) -> TCPComm:
        return TLSComm(protocol, local, peer, deserialize)

    def listener(self, location: str, handler: Any, deserialize: bool,
                 security: Security | None = None) -> TLSListener:
        return TLSListener(location, handler, deserialize, security)


register_backend("tls", TLSBackend())
