"""How long the kernel keeps a TCP connection whose peer acknowledges nothing.

A connection is broken when the peer's kernel stops answering, after ``tcp-timeout``
seconds: ``TCP_USER_TIMEOUT`` for data it does not acknowledge, keepalive probes for an
idle connection. Without it a peer behind a partition keeps a fetch waiting for as long
as the kernel retransmits (a quarter of an hour).

A peer that is alive but does not read (a client stopped in a debugger, a process
suspended with SIGSTOP, a busy loop) is another matter: its kernel answers every probe,
advertising a window of zero. Linux counts ``TCP_USER_TIMEOUT`` from the first such
zero-window probe all the same, and breaks the connection after ``tcp-timeout`` although
nothing is wrong with it. So a :class:`WindowWatch` per event loop looks at its
connections every quarter of the timeout (``TCP_INFO``, one ``getsockopt`` each) and
lifts the user timeout of a connection whose peer advertises a zero window, and puts it
back once the window opens. A peer that stops answering the probes too (its host went
away while its window was closed) gets the user timeout back once no acknowledgement
came for longer than the kernel's longest pause between two probes plus the timeout.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import weakref
from typing import Any

__all__ = ["set_liveness", "WindowWatch", "watch_window"]

#: where ``struct tcp_info`` (linux/tcp.h, an append-only layout) keeps the time since
#: the last acknowledgement (ms) and the peer's advertised window (bytes, Linux >= 5.4)
_LAST_ACK_RECV = 56
_SND_WND = 228
_TCP_INFO_BYTES = _SND_WND + 4
#: the longest the kernel waits between two zero-window probes (TCP_RTO_MAX), in ms
_PROBE_GAP_MAX_MS = 120_000


def set_liveness(sock: socket.socket, timeout: float) -> None:
    """Have the kernel break the connection when the peer acknowledges nothing for about
    ``timeout`` seconds: unacknowledged data (``TCP_USER_TIMEOUT``) and, on an idle
    connection, unanswered keepalive probes."""
    if timeout <= 0:
        return
    idle = max(1, int(timeout / 2))
    probes = 3
    interval = max(1, int((timeout - idle) / probes))
    options = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", probes),
                        ("TCP_USER_TIMEOUT", int(timeout * 1000))):
        if hasattr(socket, name):  # Linux has them all; others keep their defaults
            options.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    for level, option, value in options:
        try:
            sock.setsockopt(level, option, value)
        except OSError:  # not a TCP socket after all, or an option this kernel lacks
            pass


def window_state(sock: socket.socket) -> tuple[int, int] | None:
    """``(advertised window, ms since the last acknowledgement)`` of ``sock``'s peer,
    or None where the kernel does not tell (not Linux, a kernel before 5.4, closed)."""
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES)
    except (OSError, AttributeError):
        return None
    if len(raw) < _TCP_INFO_BYTES:
        return None
    return struct.unpack_from("I", raw, _SND_WND)[0], struct.unpack_from("I", raw, _LAST_ACK_RECV)[0]


class WindowWatch:
    """The connections of one event loop whose user timeout is lifted while their peer's
    window is closed (see the module's docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout: float):
        self.loop = loop
        self.timeout = timeout
        self.interval = max(0.05, timeout / 4)
        self.socks: weakref.WeakSet[socket.socket] = weakref.WeakSet()
        #: sockets whose user timeout is lifted now
        self.lifted: weakref.WeakSet[socket.socket] = weakref.WeakSet()
        self._timer: asyncio.TimerHandle | None = None

    def add(self, sock: socket.socket) -> None:
        self.socks.add(sock)
        if self._timer is None:
            self._timer = self.loop.call_later(self.interval, self.tick)

    def discard(self, sock: socket.socket) -> None:
        self.socks.discard(sock)
        self.lifted.discard(sock)

    def tick(self) -> None:
        """Look at every connection once; come again while any is left."""
        self._timer = None
        silent_ms = _PROBE_GAP_MAX_MS + self.timeout * 1000
        for sock in list(self.socks):
            if sock.fileno() < 0:
                self.discard(sock)
                continue
            state = window_state(sock)
            if state is None:
                self.discard(sock)  # nothing to learn about it, now or later
                continue
            window, since_ack = state
            closed = window == 0 and since_ack < silent_ms
            if closed and sock not in self.lifted:
                if _set_user_timeout(sock, 0):
                    self.lifted.add(sock)
            elif not closed and sock in self.lifted:
                _set_user_timeout(sock, int(self.timeout * 1000))
                self.lifted.discard(sock)
        if len(self.socks) and not self.loop.is_closed():
            self._timer = self.loop.call_later(self.interval, self.tick)


def _set_user_timeout(sock: socket.socket, ms: int) -> bool:
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, ms)
    except (OSError, AttributeError):
        return False
    return True


_watches: weakref.WeakKeyDictionary[Any, WindowWatch] = weakref.WeakKeyDictionary()


def watch_window(sock: socket.socket, timeout: float) -> WindowWatch | None:
    """Watch ``sock`` (its user timeout set to ``timeout`` by :func:`set_liveness`) from
    the running loop's :class:`WindowWatch`; returns it, or None when there is nothing
    to watch (no timeout, or a kernel without the figures)."""
    if timeout <= 0 or not hasattr(socket, "TCP_USER_TIMEOUT") or window_state(sock) is None:
        return None
    loop = asyncio.get_running_loop()
    watch = _watches.get(loop)
    if watch is None or watch.timeout != timeout:
        watch = _watches[loop] = WindowWatch(loop, timeout)
    watch.add(sock)
    return watch
