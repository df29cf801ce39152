"""Bounds on the dashboard's connections: how many there are, from one host and in
all, and how long one may take to send a request.

Theory of operation
-------------------
aiohttp keeps a connection for as long as its peer keeps it open, and (depending on
its version) waits for a request head for an hour or for ever; a few thousand silent
or slow connections (slowloris) would hold as many file descriptors of the
scheduler's process, which its workers and clients need. So the dashboard listens
through :class:`GuardedSite`, whose protocol (:class:`_Guarded`) stands in front of
aiohttp's for every connection and reports to a :class:`ConnectionGuard`:

- at most ``max_total`` connections, and ``max_per_host`` from one peer host. A new
  connection past either bound makes room by dropping the oldest *idle* connection
  (no request of it being answered) that has not logged in, else the oldest idle one
  that has; when every one is busy, the new one is refused (closed at once). A page
  that logs in while silent connections pile up opens the newest connections, and the
  oldest go first: it loads.
- a connection has ``header_timeout`` seconds from when it opened, or from when its
  previous request was answered, to send a whole request head; then it is closed
  (aborted: nothing of it is kept waiting for the peer). Trickling a byte at a time
  does not renew the time. A logged-in connection still being sent a long answer is
  left to finish it.

The server's middleware tells the guard when a request begins and ends, and whether
it logged in (:meth:`ConnectionGuard.began`, :meth:`ConnectionGuard.ended`).
Which connection to drop is decided by :class:`ConnectionTable` (plain methods, no
IO); the guard acts on it.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from typing import Any, cast

from aiohttp import web

__all__ = ["ConnectionGuard", "ConnectionTable", "GuardedSite", "Tracked"]


class Tracked:
    """One connection as the table sees it: its peer's host, how many of its requests
    are being answered (``busy``) and whether one of them logged in."""

    __slots__ = ("host", "busy", "logged_in", "transport", "timer")

    def __init__(self, host: str, transport: Any = None) -> None:
        self.host = host
        self.busy = 0
        self.logged_in = False
        self.transport = transport
        self.timer: asyncio.TimerHandle | None = None

    def __repr__(self) -> str:
        return f"<Tracked {self.host} busy={self.busy} logged_in={self.logged_in}>"


class ConnectionTable:
    """The connections that are open, oldest first, with the bounds: ``max_total``
    in all, ``max_per_host`` from one host. Raises ``ValueError`` for a bound < 1."""

    def __init__(self, max_total: int, max_per_host: int) -> None:
        if max_total < 1 or max_per_host < 1:
            raise ValueError(f"connection bounds must be >= 1, got {max_total} and {max_per_host}")
        self.max_total = max_total
        self.max_per_host = max_per_host
        self._open: dict[Tracked, None] = {}  # (a dict keeps the order they came in)
        self._per_host: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._open)

    def __contains__(self, conn: object) -> bool:
        return conn in self._open

    def admit(self, conn: Tracked) -> tuple[bool, Tracked | None]:
        """Take ``conn``, a new connection: ``(taken, dropped)``. ``dropped`` is the
        connection that made room for it (removed from the table; the caller closes
        it), or None; ``taken`` is False when no room could be made (every connection
        in the way is busy)."""
        dropped = None
        if self._per_host[conn.host] >= self.max_per_host:
            dropped = self._oldest_idle(conn.host)
        elif len(self._open) >= self.max_total:
            dropped = self._oldest_idle(None)
        else:
            self._add(conn)
            return True, None
        if dropped is None:
            return False, None
        self.remove(dropped)
        self._add(conn)
        return True, dropped

    def remove(self, conn: Tracked) -> None:
        """Forget ``conn`` (one that is not in the table: nothing happens)."""
        if conn in self._open:
            del self._open[conn]
            self._per_host[conn.host] -= 1
            if not self._per_host[conn.host]:
                del self._per_host[conn.host]

    def _add(self, conn: Tracked) -> None:
        self._open[conn] = None
        self._per_host[conn.host] += 1

    def _oldest_idle(self, host: str | None) -> Tracked | None:
        """The oldest idle connection (of ``host``; None: of any) that has not logged
        in, else the oldest idle one that has; None if all are busy."""
        fallback = None
        for c in self._open:
            if c.busy or (host is not None and c.host != host):
                continue
            if not c.logged_in:
                return c
            if fallback is None:
                fallback = c
        return fallback


class _Guarded(asyncio.Protocol):
    """The protocol of one dashboard connection: asks the guard whether it may stay,
    then hands everything to aiohttp's protocol (made only for connections that stay)."""

    def __init__(self, guard: ConnectionGuard, make: Callable[[], asyncio.Protocol]) -> None:
        self.guard = guard
        self.make = make
        self.inner: asyncio.Protocol | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (uvloop's is not a subclass)
        if not self.guard.admit(self.transport):
            self.transport.abort()
            return
        self.inner = self.make()
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.inner is not None:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.transport is not None:
            self.guard.forget(self.transport)
        inner, self.inner = self.inner, None
        if inner is not None:
            inner.connection_lost(exc)


class ConnectionGuard:
    """The bounds of one dashboard's connections (see the module); ``dropped`` and
    ``refused`` count what it closed to keep them. Raises ``ValueError`` for a bound
    < 1 or a negative timeout (0: no timeout)."""

    def __init__(self, max_total: int, max_per_host: int, header_timeout: float) -> None:
        if not header_timeout >= 0:
            raise ValueError(f"the header timeout is a number of seconds >= 0, got {header_timeout!r}")
        self.table = ConnectionTable(max_total, max_per_host)
        self.header_timeout = header_timeout
        self.dropped = 0
        self.refused = 0
        self._by_transport: dict[asyncio.BaseTransport, Tracked] = {}

    def protocol_factory(self, make: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """A protocol factory for ``loop.create_server`` that guards the protocols
        ``make`` makes."""
        return lambda: _Guarded(self, make)

    def admit(self, transport: asyncio.BaseTransport) -> bool:
        """Whether the new connection of ``transport`` may stay (if not, the caller
        closes it); another one may be dropped to make room."""
        peer = transport.get_extra_info("peername")
        host = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        conn = Tracked(host, transport)
        taken, dropped = self.table.admit(conn)
        if dropped is not None:
            self.dropped += 1
            self._drop(dropped)
        if not taken:
            self.refused += 1
            return False
        self._by_transport[transport] = conn
        self._arm(conn)
        return True

    def began(self, transport: Any, logged_in: bool) -> None:
        """A request of ``transport``'s connection is being answered (a whole head came)."""
        conn = self._by_transport.get(transport)
        if conn is None:
            return
        conn.busy += 1
        conn.logged_in = conn.logged_in or logged_in
        if conn.timer is not None:
            conn.timer.cancel()
            conn.timer = None

    def ended(self, transport: Any) -> None:
        """That request's handler is done: the connection's time for its next request starts."""
        conn = self._by_transport.get(transport)
        if conn is None:
            return
        conn.busy -= 1
        if not conn.busy:
            self._arm(conn)

    def forget(self, transport: asyncio.BaseTransport) -> None:
        """``transport``'s connection is closed."""
        conn = self._by_transport.pop(transport, None)
        if conn is not None:
            self.table.remove(conn)
            if conn.timer is not None:
                conn.timer.cancel()
                conn.timer = None

    def close(self) -> None:
        """Close every connection still open (the dashboard closes)."""
        for conn in list(self._by_transport.values()):
            self._drop(conn)

    def _arm(self, conn: Tracked) -> None:
        if self.header_timeout > 0:
            conn.timer = asyncio.get_running_loop().call_later(self.header_timeout, self._expire, conn)

    def _expire(self, conn: Tracked) -> None:
        conn.timer = None
        if conn.busy or conn not in self.table:
            return
        if conn.logged_in and conn.transport.get_write_buffer_size():
            self._arm(conn)  # a logged-in reader still being sent its answer
            return
        self.dropped += 1
        self._drop(conn)

    def _drop(self, conn: Tracked) -> None:
        self._by_transport.pop(conn.transport, None)
        self.table.remove(conn)
        if conn.timer is not None:
            conn.timer.cancel()
            conn.timer = None
        conn.transport.abort()


class GuardedSite(web.BaseSite):
    """aiohttp's TCP site, each connection guarded by ``guard``: listens on ``host``
    (None or "": every interface) and ``port`` (0: a free one)."""

    def __init__(self, runner: web.BaseRunner, host: str | None, port: int, guard: ConnectionGuard,
                 backlog: int = 128) -> None:
        super().__init__(runner, backlog=backlog)
        self._host = host or None
        self._port = port
        self._guard = guard

    @property
    def name(self) -> str:
        return f"http://{self._host or '0.0.0.0'}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._guard.protocol_factory(server), self._host, self._port,
                                                backlog=self._backlog)
