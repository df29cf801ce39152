"""Sessions bound to the handshake's proof (docs/protocol.md §2.5, §3): a stranger who
sits between two ends that know the secret can relay their handshake, but it cannot
make either end talk to a peer of another role, change the handshake unnoticed, or
say, change, replay or reorder anything after it.

The stranger is :class:`relay.Relay`: a real tcp proxy in threads, which parses the
byte stream into messages so that it can edit, drop, repeat or inject them.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import re
import struct
from typing import Any

import msgpack
import pytest

from shoal.comm import connect, listen, session
from shoal.comm.security import Security
from shoal.errors import AuthenticationError, CommError, HandshakeError
from shoal.rpc import Server
from relay import Edit, relay
from shoal_helpers import log_waiter



async def _logged(logs: Any, *words: str) -> None:
    """Wait (in a thread: the servers run on this loop) for a log record with ``words``."""
    await asyncio.to_thread(logs.wait_for, lambda rec: all(w in rec.getMessage() for w in words))


class _Counted:
    """An echo server that counts the requests it serves."""

    def __init__(self) -> None:
        self.calls: list[Any] = []

    def echo(self, comm: Any, x: Any = None) -> Any:
        self.calls.append(x)
        return x


async def _serving(sec: Security, role: str, scheme: str = "tcp") -> tuple[Server, _Counted]:
    counted = _Counted()
    server = Server({"echo": counted.echo}, name=role, security=sec, role=role)
    await server.listen(f"{scheme}://127.0.0.1:0")
    return server, counted


def _one_message(data: bytes, tagged: bool = True) -> tuple[bytes, bytes]:
    """The header and frame 0 of a one-frame message's bytes (its tag left off)."""
    n, size = struct.unpack_from("<QQ", data)
    assert n == 1
    return data[:16], data[16 : 16 + size]


# --------------------------------------------------------------------- the relays


async def test_a_relayed_handshake_reaches_only_the_role_it_was_meant_for():
    # the attack of issue 35: a stranger took the scheduler's address and relays the
    # worker's handshake to the nanny, which answers it with the secret it has
    sec = Security.new()
    nanny, counted = await _serving(sec, "nanny")
    try:
        with relay(nanny.address) as r:
            with pytest.raises(HandshakeError, match=r"meant to reach a scheduler and the peer is a 'nanny'"):
                await connect(r.address, security=sec, role="worker", expect="scheduler", timeout=10)
            await asyncio.to_thread(r.join_pumps, 10)  # (all it was given has passed)
        assert counted.calls == []
        # the refusal went to the nanny tagged: the relay saw the reason, and could not
        # have forged it
        said = b"".join(r.seen["up"][2:])
        assert b"handshake-refused" in said
    finally:
        await nanny.close()


async def test_the_same_connection_without_a_relay_to_the_right_role_works():
    sec = Security.new()
    sched, counted = await _serving(sec, "scheduler")
    try:
        with relay(sched.address) as r:  # a relay that only passes bytes on is harmless
            comm = await connect(r.address, security=sec, role="worker", expect="scheduler", timeout=10)
            assert comm.peer_info["role"] == "scheduler" and comm.session is not None
            await comm.write({"op": "echo", "reply": True, "x": "through"})
            assert (await comm.read())["result"] == "through"
            await comm.close()
        assert counted.calls == ["through"]
    finally:
        await sched.close()


def _retag_role(role: bytes) -> Edit:
    """An edit that makes the acceptor's step 2 say ``role`` (with the length fixed)."""

    def edit(direction: str, index: int, data: bytes) -> bytes:
        if direction != "down" or index != 1:
            return data
        _, frame = _one_message(data)
        msg = msgpack.unpackb(frame)
        msg["role"] = role.decode()
        frame = msgpack.packb(msg)
        return struct.pack("<QQ", 1, len(frame)) + frame

    return edit


async def test_a_handshake_changed_on_its_way_fails_at_the_first_tag():
    # the stranger makes the nanny's step 2 say "scheduler": the worker believes it
    # for a moment, but its transcript is not the nanny's, so their keys differ
    sec = Security.new()
    nanny, counted = await _serving(sec, "nanny")
    try:
        with log_waiter() as logs, relay(nanny.address, edit=_retag_role(b"scheduler")) as r:
            with pytest.raises(HandshakeError, match="the handshake was changed on its way"):
                await connect(r.address, security=sec, role="worker", expect="scheduler", timeout=10)
            await _logged(logs, "refused connection from", "changed on its way")  # the nanny found it too
        assert counted.calls == []
    finally:
        await nanny.close()


@pytest.mark.parametrize("what", ["inject", "replay", "drop", "flip-a-tag", "swap"])
async def test_nothing_after_the_handshake_can_be_said_changed_replayed_or_reordered(what):
    sec = Security.new()
    sched, counted = await _serving(sec, "scheduler")
    frame = msgpack.packb({"op": "echo", "reply": True, "x": "stranger"})
    forged = struct.pack("<QQ", 1, len(frame)) + frame

    def edit(direction: str, index: int, data: bytes) -> bytes:
        if direction != "up" or index < 3:
            return data
        if what == "inject" and index == 3:  # the stranger's own request after a real one
            return data + forged + os.urandom(session.TAG_BYTES)
        if what == "replay" and index == 3:
            return data + data
        if what == "drop" and index == 3:
            return b""
        if what == "flip-a-tag" and index == 4:
            return data[:-1] + bytes([data[-1] ^ 1])
        if what == "swap" and index == 3:
            edit.held = data  # type: ignore[attr-defined]
            return b""
        if what == "swap" and index == 4:
            return data + edit.held  # type: ignore[attr-defined]
        return data

    try:
        with log_waiter() as logs, relay(sched.address, edit=edit) as r:
            comm = await connect(r.address, security=sec, role="client", expect="scheduler", timeout=10)
            try:
                for x in ("first", "second"):
                    await comm.write({"op": "echo", "reply": True, "x": x})
                # the reads end with the connection the server closed
                with pytest.raises(CommError):
                    for _ in range(2):
                        await comm.read()
            finally:
                comm.abort()
            await _logged(logs, "does not match its session tag")
        # a message of the stranger's, or one out of its place, was never served
        assert "stranger" not in counted.calls
        assert counted.calls in ([], ["first"]) if what != "flip-a-tag" else counted.calls == ["first"]
        assert r.seen["up"]
    finally:
        await sched.close()


@pytest.mark.parametrize("flip", [False, True])
async def test_tags_cover_large_frames_piece_by_piece(flip):
    # a frame of 3 MiB and a bit more enters the tag as the digest of its 1 MiB pieces,
    # hashed as they land; one bit changed in the middle of it fails the message
    sec = Security.new()
    sched, counted = await _serving(sec, "scheduler")
    big = os.urandom((3 << 20) + 12345)

    def edit(direction: str, index: int, data: bytes) -> bytes:
        if flip and direction == "up" and index == 3:
            at = len(data) // 2
            return data[:at] + bytes([data[at] ^ 0x10]) + data[at + 1 :]
        return data

    try:
        with log_waiter() as logs, relay(sched.address, edit=edit) as r:
            comm = await connect(r.address, security=sec, expect="scheduler", timeout=10)
            try:
                await comm.write({"op": "echo", "reply": True, "x": big})
                if flip:
                    with pytest.raises(CommError):
                        await comm.read()
                    await _logged(logs, "does not match its session tag")
                else:
                    assert (await comm.read())["result"] == big  # both ways: the answer is as large
            finally:
                comm.abort()
        assert len(max(r.seen["up"], key=len)) > len(big)  # it did cross as one large frame
        assert counted.calls == ([] if flip else [big])
    finally:
        await sched.close()


async def test_a_proof_relayed_between_two_tls_sessions_does_not_check():
    # a stranger with the cluster's certificate (not its secret) ends TLS on both sides
    # and relays the handshake inside: the proofs bind the TLS session each end sees
    sec = Security.temporary()
    sched, counted = await _serving(sec, "scheduler", "tls")
    try:
        with relay(sched.address, tls=sec, tagged=False) as r:
            with pytest.raises(AuthenticationError, match="does not know this cluster's secret"):
                await connect(r.address, security=sec, expect="scheduler", timeout=10)
            # (both ends close their TLS sessions with the relay meanwhile)
            await asyncio.to_thread(r.join_pumps, 10)
        assert counted.calls == []  # (straight to it, TLS with the secret works: test_tls.py)
    finally:
        await sched.close()


def test_the_session_in_the_protocol_document():
    # docs/protocol.md §12.3: the keys and the tag of step 3, from the values shown
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "protocol.md")) as f:
        doc = f.read()
    example = doc[doc.index("### 12.3"):doc.index("### 12.4")]
    secret = b"example-secret"
    from shoal.comm import security

    def step2(side: bytes, pid: int, host: str, role: str) -> bytes:
        proof = security.proof(secret, side, bytes(range(32)), bytes(range(32, 64)))
        return msgpack.packb({"op": "handshake-auth", "proof": proof, "pid": pid, "host": host, "role": role})

    def hello(nonce: bytes) -> bytes:
        return msgpack.packb({"op": "handshake", "protocol": 5, "nonce": nonce, "auth": True})

    first = [hello(bytes(range(32))), hello(bytes(range(32, 64))), step2(b"connector", 4242, "w1/", "worker"),
             step2(b"acceptor", 1, "s/", "scheduler")]
    transcript = b"".join(len(m).to_bytes(8, "little") + m for m in first)
    digest = hashlib.sha256(transcript).hexdigest()
    prk = hmac.new(secret, b"shoal-session-1|" + hashlib.sha256(transcript).digest(), hashlib.sha256).digest()
    key = hmac.new(prk, b"connector", hashlib.sha256).digest()
    step3 = msgpack.packb({"op": "handshake-shm", "can_map": False})
    message = struct.pack("<QQ", 1, len(step3)) + step3
    tag = hmac.new(key, struct.pack("<Q", 0) + message, hashlib.sha256).digest()[:16]
    for value in (digest, prk.hex(), key.hex()):
        assert value in example
    shown = re.search(r"\n((?:[0-9a-f]{2} ){15}[0-9a-f]{2}) +the tag", example)
    assert shown is not None and bytes.fromhex(shown.group(1).replace(" ", "")) == tag
    # and shoal's own code agrees
    keys = session.session_keys(secret, transcript, connector=True)
    assert keys.send.tag_buffers([message]) == tag

