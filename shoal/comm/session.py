"""Sessions bound to the handshake's proof: the keys both ends derive from it, and the
MAC every later message carries over plain ``tcp://`` (docs/protocol.md §2.5).

The proofs of the handshake show that *someone* on the path knows the secret. That is
not enough: a stranger who relays the two ends' handshake messages between them (or
to a third listener that answers them) could speak once they are done. So both ends
derive a session key from the secret and the handshake's transcript (every byte of
both ends' first two messages), and every message after that carries an HMAC-SHA256
tag under the key of its direction, over its sequence number and its bytes. A stranger
knows no key: whatever it sends, alters, replays or reorders fails its tag, and a
relayed handshake whose messages it changed leaves the ends with different keys, so
the first tagged message fails. ``tls://`` needs none of this: its records are
authenticated, and its handshake proofs include the TLS channel binding.

What is tagged: the sequence number (u64, per direction, from 0), then the message's
bytes as sent (the count, the lengths, the frames), except that a frame of
:data:`LARGE` bytes or more enters as its 32-byte digest: SHA-256 over the SHA-256 of
each :data:`CHUNK` of it. The chunks are hashed in a thread pool (``hashlib`` releases
the GIL), as they land on the receiving side and while the frames go out on the
sending side, so the event loop does not hash a large value and several cores can.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

__all__ = ["SessionKeys", "MessageMac", "session_keys", "chunk_digests", "frame_digest", "digest_now", "check",
           "hash_pool", "TAG_BYTES", "LARGE", "CHUNK"]

#: the tag that follows each message
TAG_BYTES = 16
#: frames this large enter the tag as their digest (the ones received into buffers of
#: their own)
LARGE = 1 << 16
#: the piece of a large frame hashed at a time (by one thread)
CHUNK = 1 << 20
_SESSION_LABEL = b"shoal-session-1"
_SEQ = struct.Struct("<Q")

_pool: ThreadPoolExecutor | None = None


def hash_pool() -> ThreadPoolExecutor:
    """The threads that hash the chunks of large frames."""
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max(2, min(8, os.cpu_count() or 2)), thread_name_prefix="shoal-hash")
    return _pool


def _sha256(data: Any) -> bytes:
    return hashlib.sha256(data).digest()


def chunk_digests(frame: Any, start: int = 0, stop: int | None = None) -> list[Future[bytes]]:
    """Start hashing the chunks of ``frame`` (a buffer) from ``start`` (a multiple of
    :data:`CHUNK`) to ``stop`` (the end, or a multiple of it) in the pool."""
    view = memoryview(frame).cast("B")
    stop = len(view) if stop is None else stop
    pool = hash_pool()
    return [pool.submit(_sha256, view[i : min(i + CHUNK, stop)]) for i in range(start, stop, CHUNK)]


def frame_digest(chunks: list[Any]) -> bytes:
    """A large frame's digest from its chunks' (futures, or digests)."""
    return hashlib.sha256(b"".join(c if type(c) is bytes else c.result() for c in chunks)).digest()


def digest_now(frame: Any) -> bytes:
    """A large frame's digest, computed here (the chunks one after another)."""
    view = memoryview(frame).cast("B")
    return frame_digest([_sha256(view[i : i + CHUNK]) for i in range(0, len(view), CHUNK)])


class MessageMac:
    """The tags of one direction of a connection: HMAC-SHA256 under its key (the inner
    and outer pads hashed once), cut to :data:`TAG_BYTES`, with the sequence number."""

    __slots__ = ("_inner", "_outer", "seq")

    def __init__(self, key: bytes):
        block = key.ljust(64, b"\0")
        self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in block))
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in block))
        self.seq = 0

    def start(self) -> Any:
        """A running tag for the next message (its sequence number taken)."""
        h = self._inner.copy()
        h.update(_SEQ.pack(self.seq))
        self.seq += 1
        return h

    def finish(self, h: Any) -> bytes:
        outer = self._outer.copy()
        outer.update(h.digest())
        return outer.digest()[:TAG_BYTES]

    def tag_buffers(self, buffers: list[Any], digests: dict[int, bytes] | None = None) -> bytes:
        """The tag of the next message, sent as ``buffers`` (header and frames as they go
        to the socket); ``digests[i]`` stands for buffer ``i`` (a large frame)."""
        h = self.start()
        if digests:
            for i, b in enumerate(buffers):
                h.update(digests.get(i, b))
        else:
            for b in buffers:
                h.update(b)
        return self.finish(h)


class SessionKeys:
    """The two directions' MACs of one connection, for the end in ``role``."""

    __slots__ = ("send", "receive")

    def __init__(self, send: MessageMac, receive: MessageMac):
        self.send = send
        self.receive = receive


def session_keys(secret: bytes, transcript: bytes, connector: bool) -> SessionKeys:
    """The session of an end (the connector's, or the acceptor's): a key per direction,
    derived from the secret and the handshake's transcript."""
    prk = hmac.new(secret, _SESSION_LABEL + b"|" + hashlib.sha256(transcript).digest(), hashlib.sha256).digest()
    to_acceptor = MessageMac(hmac.new(prk, b"connector", hashlib.sha256).digest())
    to_connector = MessageMac(hmac.new(prk, b"acceptor", hashlib.sha256).digest())
    return SessionKeys(to_acceptor, to_connector) if connector else SessionKeys(to_connector, to_acceptor)


def check(expected: bytes, got: Any) -> bool:
    """Whether tag ``got`` is ``expected`` (constant time)."""
    return hmac.compare_digest(expected, bytes(got))
