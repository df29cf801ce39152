"""The listening sockets of ``tcp://`` and ``tls://`` listeners, accepted from by hand.

:class:`Acceptor` binds the sockets, has the event loop tell it when they are readable,
accepts at most :data:`ACCEPT_BATCH` connections each time and hands each socket to the
listener, which wraps it in a transport (``loop.connect_accepted_socket``), over tls
after a TLS handshake that the listener counts as part of the stranger's time
(:mod:`.admission`). asyncio's ``create_server`` does not do here, for three reasons:

- it runs the TLS handshake before any protocol of ours sees the connection: peers that
  never finish it were not counted, and used every descriptor;
- it accepts up to ``backlog`` connections per wake-up: a flood from one address then
  brings that many newcomers, each making room for itself, between two turns of a
  legitimate stranger's handshake; 16 at a time, a stranger gets its turns of the loop
  (to send its first message, which keeps it over the silent ones) well within
  ``max-handshaking-per-host`` newcomers;
- when ``accept`` fails for want of descriptors, asyncio stops accepting for a second
  (and uvloop accepts the waiting connections only to close them, saying nothing).

Here, an accept without a descriptor first evicts the oldest strangers of the process
(:func:`.admission.relieve`) and pauses a moment while their connections close. With no
stranger left the process is truly out: it closes a descriptor kept in reserve, accepts
one waiting connection, sends it ``refusal`` (a ``handshake-refused`` over tcp, saying
so) and closes it, so that the peer gets a clear error at once instead of a timeout, then
pauses, longer each time (up to a second), until a connection of the listener closes.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
from collections.abc import Callable
from typing import Any

from . import admission

__all__ = ["Acceptor", "ACCEPT_BATCH"]

logger = logging.getLogger("shoal.comm.tcp")

#: connections accepted per wake-up of the loop, at most
ACCEPT_BATCH = 16
#: strangers evicted when an accept finds no descriptor, and the pause while they close
_RELIEF = 4
_RELIEF_PAUSE = 0.01
#: the first and the longest pause of accepting while the process is out of descriptors
_OUT_PAUSES = (0.05, 1.0)

_NO_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
#: accept errors about the connection at hand only (it went before we took it)
_CONNECTION_GONE = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.ECONNRESET, errno.EPERM})


class Acceptor:
    """Listening sockets whose connections go to ``on_accept(sock, address)`` (a
    non-blocking socket the callee owns). ``refusal``: what a connection refused for want
    of descriptors is sent before it is closed."""

    def __init__(self, on_accept: Callable[[socket.socket, Any], None], refusal: bytes = b"") -> None:
        self._on_accept = on_accept
        self._refusal = refusal
        self.sockets: list[socket.socket] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._paused = False
        self._resume_handle: asyncio.TimerHandle | None = None
        self._pause_after_out = _OUT_PAUSES[0]
        self._spare: int | None = None
        self._closed = False
        self._logged = 0
        #: how often accepting found no descriptor (tests read it)
        self.out_of_descriptors = 0

    async def open(self, host: str, port: int, backlog: int) -> int:
        """Bind and listen on ``host`` (``""``: every interface) and ``port`` (0: a free
        one, the same for every address), and start accepting. Returns the port. Raises
        ``OSError`` when an address cannot be bound."""
        loop = self._loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host or None, port, family=socket.AF_UNSPEC,
                                       type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        seen = set()
        try:
            for family, kind, proto, _, address in infos:
                if (family, address) in seen:
                    continue
                seen.add((family, address))
                try:
                    sock = socket.socket(family, kind, proto)
                except OSError:
                    continue  # a family this machine does not have (IPv6 turned off)
                self.sockets.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                if port == 0 and len(self.sockets) > 1:
                    # the port the first address got, for the others too
                    address = (address[0], self.sockets[0].getsockname()[1], *address[2:])
                try:
                    sock.bind(address)
                except OSError as exc:
                    where = f"{address[0]!s}:{address[1]!s}"
                    raise OSError(exc.errno, f"cannot listen on {where}: {exc.strerror}") from exc
                sock.listen(backlog)
                sock.setblocking(False)
            if not self.sockets:
                raise OSError(errno.EADDRNOTAVAIL, f"no address to listen on for {host!r}")
        except BaseException:
            for sock in self.sockets:
                sock.close()
            self.sockets = []
            raise
        self._spare = _open_spare()
        self._watch()
        return int(self.sockets[0].getsockname()[1])

    def _watch(self) -> None:
        assert self._loop is not None
        for sock in self.sockets:
            self._loop.add_reader(sock.fileno(), self._ready, sock)

    def _unwatch(self) -> None:
        assert self._loop is not None
        for sock in self.sockets:
            try:
                self._loop.remove_reader(sock.fileno())
            except (RuntimeError, ValueError, OSError):
                pass  # the loop is closed already

    def _ready(self, lsock: socket.socket) -> None:
        for _ in range(ACCEPT_BATCH):
            if self._paused or self._closed:
                return
            try:
                sock, address = lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _NO_DESCRIPTORS:
                    self._no_descriptors(lsock, exc)
                    return
                if exc.errno in _CONNECTION_GONE:
                    continue
                logger.warning("accepting a connection on %s failed: %s", _name(lsock), exc)
                self._pause(_OUT_PAUSES[0])
                return
            self._pause_after_out = _OUT_PAUSES[0]
            try:
                sock.setblocking(False)
                self._on_accept(sock, address)
            except Exception:
                # a bug: said loudly, and only this connection pays
                logger.exception("taking a connection from %s failed; closing it", address)
                sock.close()

    def _no_descriptors(self, lsock: socket.socket, exc: OSError) -> None:
        self.out_of_descriptors += 1
        self._logged += 1
        evicted = admission.relieve(_RELIEF, self._loop)
        if evicted:
            if self._logged <= 10 or self._logged % 1000 == 0:
                logger.warning("%s: closed %d connection(s) still in their handshake, the oldest first, to "
                               "accept new ones on %s", exc.strerror, evicted, _name(lsock))
            # their descriptors come free as their transports close, on the next turns
            self._pause(_RELIEF_PAUSE)
            return
        if exc.errno not in (errno.EMFILE, errno.ENFILE):
            if self._logged <= 10 or self._logged % 1000 == 0:
                logger.warning("%s: cannot accept a connection on %s; trying again shortly", exc.strerror, _name(lsock))
        else:
            if self._logged <= 10 or self._logged % 1000 == 0:
                logger.warning("%s: no descriptor to accept a connection on %s, and no connection in its "
                               "handshake to close; refusing new connections until some close (raise the "
                               "limit: ulimit -n)", exc.strerror, _name(lsock))
            self._refuse_one(lsock)
        self._pause(self._pause_after_out)
        self._pause_after_out = min(2 * self._pause_after_out, _OUT_PAUSES[1])

    def _refuse_one(self, lsock: socket.socket) -> None:
        """Accept one waiting connection with the reserve descriptor, tell it why it is
        refused, close it."""
        if self._spare is None:
            self._spare = _open_spare()
            return
        os.close(self._spare)
        self._spare = None
        try:
            sock, _ = lsock.accept()
        except OSError:
            pass
        else:
            try:
                sock.setblocking(False)
                if self._refusal:
                    sock.send(self._refusal)  # a fresh socket's buffer takes a small message
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            sock.close()
        self._spare = _open_spare()

    def _pause(self, delay: float) -> None:
        if self._paused or self._closed or self._loop is None:
            return
        self._paused = True
        self._unwatch()
        self._resume_handle = self._loop.call_later(delay, self._resume)

    def _resume(self) -> None:
        if self._resume_handle is not None:
            self._resume_handle.cancel()
            self._resume_handle = None
        if self._paused and not self._closed:
            self._paused = False
            self._watch()

    def wake(self) -> None:
        """A connection of the listener closed: if accepting is paused for want of
        descriptors, try again now."""
        if self._paused:
            self._resume()

    @property
    def paused(self) -> bool:
        return self._paused

    def close(self) -> None:
        """Stop accepting and close the listening sockets (on the loop's thread)."""
        if self._closed:
            return
        self._closed = True
        if self._resume_handle is not None:
            self._resume_handle.cancel()
            self._resume_handle = None
        if not self._paused and self._loop is not None:
            self._unwatch()
        for sock in self.sockets:
            sock.close()
        if self._spare is not None:
            os.close(self._spare)
            self._spare = None


def _open_spare() -> int | None:
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


def _name(sock: socket.socket) -> str:
    try:
        host, port = sock.getsockname()[:2]
    except OSError:
        return "?"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
