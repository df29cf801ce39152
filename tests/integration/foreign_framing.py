"""The foreign worker's transport (docs/protocol.md §2: framing, limits, session tags),
written from the document alone: nothing from shoal."""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct
import time
import weakref
from typing import Any

MAX_FRAMES = 1 << 20  # §2.2
MAX_FRAME_BYTES = 1 << 36  # §2.2
POLL = 0.05  # how often a blocked read looks at its stop flag (a socket timeout, not a sleep)
OP_TIMEOUT = 30.0  # the deadline of one exchange (a handshake, a request, a message)


class WireError(Exception):
    """The peer broke the protocol (or the connection broke)."""


class Stopped(Exception):
    """The worker is stopping."""


class EOF(Exception):
    """The peer closed the connection between two messages."""


# -- §2 framing ----------------------------------------------------------------------


def _recv_exact(sock: socket.socket, n: int, deadline: float, stop: Any,
                at_boundary: bool = False) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        # the stop flag is looked at only between messages, never inside one
        if at_boundary and stop is not None and stop.is_set():
            raise Stopped()
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"no data within the deadline ({got} of {n} bytes)")
        sock.settimeout(min(remaining, POLL))
        try:
            k = sock.recv_into(view[got:])
        except TimeoutError:  # socket.timeout: the poll interval passed
            continue
        except OSError as exc:
            raise WireError(f"connection broke: {exc}") from exc
        if k == 0:
            if got == 0 and at_boundary:
                raise EOF()
            raise WireError("peer closed in the middle of a message")
        got += k
        # once a message has started, the rest of it must come within one exchange
        if at_boundary:
            deadline = min(deadline, time.monotonic() + OP_TIMEOUT)
            at_boundary = False
    return bytes(buf)


def recv_frames(sock: socket.socket, deadline: float, stop: Any = None) -> list[bytes]:
    """One message's frames (§2.1), its tag checked on a connection with a session
    (§2.5); raises EOF at a clean end of the connection and Stopped if
    ``stop.is_set()`` while no message has started."""
    head = _recv_exact(sock, 8, deadline, stop, at_boundary=True)
    (n,) = struct.unpack("<Q", head)
    deadline = min(deadline, time.monotonic() + OP_TIMEOUT)
    if not 1 <= n <= MAX_FRAMES:
        raise WireError(f"message announces {n} frames")
    head += _recv_exact(sock, 8 * n, deadline, None)
    lengths = struct.unpack_from(f"<{n}Q", head, 8)
    if max(lengths) > MAX_FRAME_BYTES:
        raise WireError(f"frame of {max(lengths)} bytes")
    frames = [_recv_exact(sock, size, deadline, None) if size else b"" for size in lengths]
    session = SESSIONS.get(sock)
    if session is not None:
        got = _recv_exact(sock, TAG_BYTES, deadline, None)
        if not hmac.compare_digest(got, session.tag(False, head, frames)):
            raise WireError("a message whose session tag does not match (§2.5)")
    return frames


def send_frames(sock: socket.socket, frames: list[Any], deadline: float) -> None:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("no time left to send")
    sock.settimeout(remaining)
    lengths = [memoryview(f).nbytes for f in frames]
    head = struct.pack(f"<Q{len(frames)}Q", len(frames), *lengths)
    session = SESSIONS.get(sock)
    try:
        # one message's bytes, contiguous on the stream (one writer per socket)
        sock.sendall(head)
        for f in frames:
            if lengths and memoryview(f).nbytes:
                sock.sendall(f)
        if session is not None:
            sock.sendall(session.tag(True, head, frames))
    except OSError as exc:
        raise WireError(f"connection broke while sending: {exc}") from exc


# -- §2.5 session tags -----------------------------------------------------------------

TAG_BYTES = 16
LARGE_FRAME = 1 << 16
TAG_PIECE = 1 << 20


class Session:
    """The keys and sequence numbers of a connection whose ends proved the secret."""

    def __init__(self, secret: bytes, transcript: bytes, connector: bool):
        prk = hmac.new(secret, b"shoal-session-1|" + hashlib.sha256(transcript).digest(), hashlib.sha256).digest()
        by_connector = hmac.new(prk, b"connector", hashlib.sha256).digest()
        by_acceptor = hmac.new(prk, b"acceptor", hashlib.sha256).digest()
        self.keys = {True: by_connector, False: by_acceptor} if connector else \
            {True: by_acceptor, False: by_connector}
        self.seq = {True: 0, False: 0}

    def tag(self, sending: bool, head: bytes, frames: list[Any]) -> bytes:
        """The tag of the next message this end sends (or receives)."""
        h = hmac.new(self.keys[sending], struct.pack("<Q", self.seq[sending]) + head, hashlib.sha256)
        self.seq[sending] += 1
        for f in frames:
            view = memoryview(f).cast("B")
            if view.nbytes < LARGE_FRAME:
                h.update(view)
            else:
                pieces = b"".join(hashlib.sha256(view[i : i + TAG_PIECE]).digest()
                                  for i in range(0, view.nbytes, TAG_PIECE))
                h.update(hashlib.sha256(pieces).digest())
        return h.digest()[:TAG_BYTES]


#: the sessions of the connections that have one
SESSIONS: weakref.WeakKeyDictionary[socket.socket, Session] = weakref.WeakKeyDictionary()
