"""The handshake of a byte-stream comm (``tcp://``, ``tls://``): versions, proof of the
cluster's secret, then whether the ends share a shared-memory domain.

Three steps; at each one both ends write before they read, so neither waits for the
other to start (docs/protocol.md §3):

1. ``handshake``: protocol version, a fresh nonce, whether this end authenticates.
2. ``handshake-auth``: the proof (an HMAC over both nonces and the sender's side, and
   over tls the channel binding, see :mod:`.security`), the sender's role (scheduler,
   worker, nanny, client), pid and host, its shared-memory probe, and whether it
   checksums large frames (both ends must: :mod:`.framing`).
3. ``handshake-shm``: whether this end could open the peer's probe.

With the secret over plain tcp, both ends then derive the session's keys from the
secret and the bytes of steps 1 and 2 (:mod:`.session`), and every message from step 3
on carries a tag: a stranger who relayed the first steps can neither speak nor change
them unnoticed. An end that meant to reach a peer of some role (a worker dialing its
scheduler) refuses a peer that proves another.

Until step 2's proof is checked the peer is a stranger: each of its messages must be one
frame of at most :data:`MAX_BYTES`, plain msgpack (no extension types, no out-of-band
values, a few levels deep) that nothing but this module reads; the probe it names is
opened only after the proof. An end that refuses (another version, no secret, a wrong
proof, a malformed step) first tells the peer why (``handshake-refused``), so both sides
raise :class:`~shoal.errors.HandshakeError` with the reason.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from typing import TYPE_CHECKING, Any, TypeVar

import msgpack

from .. import config
from ..errors import AuthenticationError, CommError, HandshakeError, ProtocolError, ShoalError
from ..protocol import NEUTRAL, PROTOCOL_VERSION, REMOTE, SAME_HOST, prepare
from ..protocol.messages import (
    HANDSHAKE,
    HandshakeAuthMsg,
    HandshakeMsg,
    HandshakeRefusedMsg,
    HandshakeShmMsg,
    Msg,
    decode,
    to_wire,
)
from . import session, shm
from .core import host_identity
from .framing import STRANGER_MAX_BYTES
from .security import NONCE_BYTES, Security, check_proof, proof

if TYPE_CHECKING:
    from .tcp import TCPComm

__all__ = ["run_handshake", "MAX_BYTES", "CONNECTOR", "ACCEPTOR", "decode_stranger"]

MAX_BYTES = STRANGER_MAX_BYTES
CONNECTOR = b"connector"
ACCEPTOR = b"acceptor"

_HOW_TO_PASS = (
    "pass the cluster's secret: Client(..., security=shoal.Security.from_file(PATH)), "
    "--auth-file PATH, or the SHOAL_AUTH environment variable"
)


def decode_stranger(frames: list[Any]) -> dict[str, Any]:
    """Decode a message from a peer that has not proven anything yet: one frame of
    plain msgpack, a map with str keys. Raises :class:`ProtocolError` otherwise."""
    if len(frames) != 1:
        raise ProtocolError(f"a handshake message is one frame, got {len(frames)}")
    try:
        msg = msgpack.unpackb(
            frames[0], raw=False, strict_map_key=True, ext_hook=_no_ext, use_list=True,
            max_str_len=MAX_BYTES, max_bin_len=MAX_BYTES, max_array_len=64, max_map_len=64,
        )
    except ProtocolError:
        raise
    except Exception as exc:
        raise ProtocolError(f"malformed handshake message: {type(exc).__name__}: {exc}") from exc
    if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
        raise ProtocolError(f"a handshake message is a map with an 'op' string, got {msg!r:.100}")
    if _depth(msg) > 4:
        raise ProtocolError("handshake message nested too deeply")
    return msg


def _no_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack extension type {code} in a handshake message")


def _depth(obj: Any, level: int = 1) -> int:
    if level > 4:
        return level
    if isinstance(obj, dict):
        return max([level, *(_depth(v, level + 1) for v in obj.values())])
    if isinstance(obj, list):
        return max([level, *(_depth(v, level + 1) for v in obj)])
    return level


class _Altered(Exception):
    """The first tagged message does not match: the ends derived different keys."""


class _Refused(Exception):
    """This end refuses the peer; the text goes to both sides."""

    def __init__(self, text: str, auth: bool = False):
        super().__init__(text)
        self.auth = auth  # about the secret: AuthenticationError


async def run_handshake(comm: TCPComm, role: bytes, security: Security | None, timeout: float,
                        me: str = "", expect: str | None = None) -> None:
    """Run the handshake on a fresh comm as ``role`` (:data:`CONNECTOR` or
    :data:`ACCEPTOR`), telling the peer this end is ``me`` (a role: ``"scheduler"``,
    ``"worker"``, ...) and refusing a peer that is not ``expect`` (``None``: any). On
    success ``comm.peer_info`` and ``comm.destination`` are set, and over plain tcp
    with a secret ``comm.session``. Raises :class:`HandshakeError` (the comm is then
    closed) for a refusal by either side, a timeout, or a peer that breaks the
    protocol."""
    # the frame protocol starts with a stranger's limits (one small frame a message,
    # nothing parsed after the handshake's messages); they are lifted once it is done
    protocol = comm._protocol
    probe: tuple[str, str] | None = None
    peer = comm.peer_address
    try:
        try:
            probe = await _steps(comm, role, security, timeout, me, expect)
        except _Refused as exc:
            await _refuse(comm, str(exc))
            error = AuthenticationError if exc.auth else HandshakeError
            raise error(f"refused connection {_direction(role)} {peer}: {exc}") from None
        except HandshakeError:
            comm.abort()
            raise
        except _Altered as exc:
            comm.abort()
            raise HandshakeError(f"refused connection {_direction(role)} {peer}: {exc}") from None
        except asyncio.TimeoutError:
            comm.abort()
            raise HandshakeError(
                f"refused connection {_direction(role)} {peer}: no handshake within {timeout:.0f}s"
            ) from None
        except (ShoalError, OSError, MemoryError) as exc:
            comm.abort()
            raise HandshakeError(f"refused connection {_direction(role)} {peer}: {exc}") from exc
    except BaseException:
        comm.abort()  # whatever ended it (cancelled, a bug): no half-open connection is left
        raise
    finally:
        if probe is not None:
            shm.unlink(probe[0])
    protocol.set_limits()


#: the one value of ``reads`` (handshake step 2) besides its absence
READS_NEUTRAL = "neutral"
#: the checksums an end offers in step 2 (docs/protocol.md §2.4)
CHECKSUMS = "xxh3-64"


def _direction(role: bytes) -> str:
    return "to" if role == CONNECTOR else "from"


async def _steps(comm: TCPComm, role: bytes, security: Security | None, timeout: float,
                 me: str, expect: str | None) -> tuple[str, str] | None:
    secret = security.secret if security is not None else None
    nonce = secrets.token_bytes(NONCE_BYTES)
    sent_hello = await _write(comm, HandshakeMsg(PROTOCOL_VERSION, nonce, auth=secret is not None))
    hello, got_hello = await _read(comm, HandshakeMsg, timeout)
    theirs = hello.nonce
    if len(theirs) != NONCE_BYTES:
        raise _Refused(f"malformed handshake: 'nonce' must be {NONCE_BYTES} bytes")
    if secret is not None and not hello.auth:
        raise _Refused(f"this end requires authentication and the peer has no secret for this cluster; {_HOW_TO_PASS}",
                       auth=True)
    if secret is None and hello.auth:
        raise _Refused(f"the peer requires authentication and this process has no secret for it; {_HOW_TO_PASS}",
                       auth=True)
    n_connector, n_acceptor = (nonce, theirs) if role == CONNECTOR else (theirs, nonce)
    other = ACCEPTOR if role == CONNECTOR else CONNECTOR
    # None when /dev/shm cannot take one (full, no descriptors left): this connection
    # then offers no shared memory, which the peer's answer (can_map false) records
    probe = shm.probe()
    # over tls the proofs cover the TLS session itself: one relayed between two TLS
    # sessions does not check
    binding = comm.channel_binding()
    # no session tags over tls (its records are authenticated), nor without a secret
    tagged = secret is not None and binding is None
    try:
        offer = CHECKSUMS if comm.offers_checksums and config.get("wire-checksums") and not tagged else None
        mine = HandshakeAuthMsg(
            proof=None if secret is None else proof(secret, role, n_connector, n_acceptor, binding),
            pid=os.getpid(), host=host_identity(), shm_probe=None if probe is None else list(probe),
            checksums=offer, role=me or None,
        )
        sent_auth = await _write(comm, mine)
        info, got_auth = await _read(comm, HandshakeAuthMsg, timeout)
        if secret is not None and not check_proof(secret, other, n_connector, n_acceptor, info.proof, binding):
            raise _Refused("authentication failed: the peer does not know this cluster's secret", auth=True)
        # the peer is one of ours from here on (over tcp: if the session tags agree)
        if tagged:
            assert secret is not None
            first = (sent_hello, got_hello, sent_auth, got_auth) if role == CONNECTOR else \
                (got_hello, sent_hello, got_auth, sent_auth)
            comm.session = session.session_keys(secret, _transcript(first), role == CONNECTOR)
            comm._protocol.mac = comm.session.receive
        if info.reads not in (None, READS_NEUTRAL):
            raise _Refused(f"the peer reads {info.reads!r:.40}; this end knows only {READS_NEUTRAL!r} "
                           "(or no 'reads': every family)")
        if expect is not None and info.role != expect:
            raise _Refused(f"this end meant to reach a {expect} and the peer is {_a(info.role)}: "
                           f"is something else listening at {comm.peer_address}?")
        offered = info.shm_probe
        can_map = offered is not None and len(offered) == 2 and shm.check_probe(*offered)
        await _write(comm, HandshakeShmMsg(can_map))
        # the third message: tagged, when there is a session
        comm._protocol.set_limits(1, STRANGER_MAX_BYTES, messages=1)
        answer, _ = await _read(comm, HandshakeShmMsg, timeout, tagged)
    except BaseException:
        if probe is not None:
            shm.unlink(probe[0])
        raise
    comm.peer_info = {
        "op": "handshake",
        "protocol": hello.protocol,
        "pid": info.pid,
        "host": info.host,
        "authenticated": secret is not None,
        "role": info.role,
        "shm": {"peer_maps_ours": answer.can_map, "we_map_theirs": can_map},
    }
    if info.reads is not None:
        comm.peer_info["reads"] = info.reads
    # both ends said so (any other value, or none: a peer that has no checksums)
    comm.checksums = comm._protocol.checksums = offer is not None and info.checksums == CHECKSUMS
    # a peer that reads only neutral encodings gets them, whatever it can map
    comm.destination = NEUTRAL if info.reads == READS_NEUTRAL else SAME_HOST if answer.can_map else REMOTE
    return probe


def _a(role: str | None) -> str:
    if not role:
        return "an end that did not say its role"
    return f"an {role!r:.40}" if role[:1] in "aeiou" else f"a {role!r:.40}"


def _transcript(messages: tuple[bytes, ...]) -> bytes:
    """Steps 1 and 2 in the order connector, acceptor, connector, acceptor: each
    message's bytes after its length (u64)."""
    return b"".join(len(m).to_bytes(8, "little") + m for m in messages)


_M = TypeVar("_M", bound=Msg)


async def _write(comm: TCPComm, msg: Msg) -> bytes:
    """Send a handshake message; returns its bytes (one frame) as sent."""
    wire = to_wire(msg)
    frames = prepare(wire).frames(REMOTE)
    assert len(frames) == 1
    await comm.write(wire)
    return bytes(frames[0])


async def _read(comm: TCPComm, typ: type[_M], timeout: float, tagged: bool = False) -> tuple[_M, bytes]:
    """The peer's next handshake message, and its bytes."""
    try:
        frames = await asyncio.wait_for(comm._protocol.next_frames(), timeout)
    except ProtocolError:
        if tagged:
            raise _Altered(
                "the handshake was changed on its way: the two ends derived different session keys "
                "(someone between them relays or alters it), so the peer's first tagged message does not match"
            ) from None
        raise
    try:
        msg = decode_stranger(frames)
    except ProtocolError as exc:
        raise _Refused(str(exc)) from None
    op: str = typ.__struct_config__.tag  # type: ignore[assignment]
    got = msg["op"]
    if got == "handshake-refused":
        reason = msg.get("reason")
        text = reason if isinstance(reason, str) else "?"
        error = AuthenticationError if "authentication" in text else HandshakeError
        raise error(f"{comm.peer_address} refused the connection: {text}")
    if got != op:
        if op == "handshake":
            raise _Refused(f"the peer did not start with a shoal handshake (got op {got!r:.50})")
        raise _Refused(f"expected {op!r} in the handshake, got {got!r:.50}")
    if op == "handshake" and msg.get("protocol") != PROTOCOL_VERSION:
        # before anything else: an older peer's message has other fields
        raise _Refused(f"the peer speaks shoal protocol version {msg.get('protocol')!r:.20}; "
                       f"this end speaks version {PROTOCOL_VERSION}")
    try:
        return decode(HANDSHAKE, msg), bytes(frames[0])  # type: ignore[return-value]
    except ProtocolError as exc:
        raise _Refused(str(exc)) from None


async def _refuse(comm: TCPComm, reason: str) -> None:
    """Tell the peer why, then close (what is written is flushed first)."""
    try:
        await asyncio.wait_for(
            comm.write(to_wire(HandshakeRefusedMsg(reason[:1000], PROTOCOL_VERSION))), 1.0
        )
    except (CommError, asyncio.TimeoutError, OSError):
        pass
    try:
        await asyncio.wait_for(comm.close(), 1.0)
    except (asyncio.TimeoutError, OSError):
        comm.abort()
