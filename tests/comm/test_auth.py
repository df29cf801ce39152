"""Authentication in the handshake, and what a stranger may make a listener do.

Real tcp listeners and connections in this process; raw sockets for peers that break
the rules. A stranger (a peer that has not proven the cluster's secret) gets no further
than the handshake, and the listener keeps serving everyone else.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import os
import pickle
import re
import socket
import struct
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest

from shoal import config
from shoal.comm import connect, security
from shoal.comm.handshake import MAX_BYTES
from shoal.comm.security import Security
from shoal.errors import AuthenticationError, HandshakeError
from shoal.protocol import PROTOCOL_VERSION
from shoal.rpc import Server, rpc
from shoal_helpers import (
    complete_handshake,
    frame_bytes,
    handshake_bytes,
    log_waiter,
    LoopThread,
    message_bytes,
    one_frame_messages,
    raw_socket,
    recv_frames,
    recv_until_closed,
)


def echo(comm: Any, x: Any = None) -> Any:
    return x


async def _echo_server(sec: Security | None) -> Server:
    server = Server({"echo": echo}, name="guarded", security=sec)
    await server.listen("tcp://127.0.0.1:0")
    return server


async def test_same_secret_connects_and_the_peer_is_authenticated():
    sec = Security.new()
    server = await _echo_server(sec)
    try:
        async with rpc(server.address, security=sec) as r:
            assert await r.echo(x=(1, "a")) == (1, "a")
        comm = await connect(server.address, security=sec)
        assert comm.peer_info["authenticated"] is True
        assert comm.peer_info["pid"] == os.getpid()
        await comm.close()
    finally:
        await server.close()


def test_no_secret_is_refused_with_a_reason_on_both_sides(caplog):
    with _served(Security.new()) as (thread, server):
        with log_waiter() as logs:
            with pytest.raises(AuthenticationError, match="requires authentication.*SHOAL_AUTH"):
                asyncio.run(connect(server.address, security=Security.disabled(), timeout=5))
            record = logs.wait_for(lambda r: "refused connection from" in r.getMessage())
        assert record.levelno >= logging.WARNING and "no secret" in record.getMessage()


async def test_a_wrong_secret_is_refused():
    server = await _echo_server(Security.new())
    try:
        with pytest.raises(AuthenticationError, match="does not know this cluster's secret"):
            await connect(server.address, security=Security.new(), timeout=5)
    finally:
        await server.close()


async def test_an_end_with_a_secret_refuses_a_listener_without_one():
    server = await _echo_server(Security.disabled())
    try:
        with pytest.raises(AuthenticationError, match="the peer has no secret"):
            await connect(server.address, security=Security.new(), timeout=5)
        comm = await connect(server.address, security=Security.disabled())  # both without: fine
        assert comm.peer_info["authenticated"] is False
        await comm.close()
    finally:
        await server.close()


async def test_a_listener_without_security_makes_a_secret_only_this_process_knows():
    server = Server({"echo": echo})
    await server.listen("tcp://127.0.0.1:0")
    try:
        found = security.for_address(server.address)
        assert found is not None and found.auth
        async with rpc(server.address) as r:  # found without being told
            assert await r.echo(x=3) == 3
        with pytest.raises(AuthenticationError):
            await connect(server.address, security=Security.new(), timeout=5)
    finally:
        await server.close()
    assert security.for_address(server.address) is None  # unregistered when it stopped


# ------------------------------------------------------------------ raw peers


@contextlib.contextmanager
def _served(sec: Security) -> Iterator[tuple[LoopThread, Server]]:
    """A loop thread serving echo with ``sec``: ``(thread, server)``, stopped on leaving."""
    thread = LoopThread(name="auth-server")
    thread.__enter__()
    try:
        server = thread.run(_echo_server(sec))
        try:
            yield thread, server
        finally:
            thread.run(server.close())
    finally:
        thread.__exit__(None, None, None)


def _raw(address: str) -> socket.socket:
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    return raw_socket(host, int(port), 10)


def test_the_secret_never_crosses_the_wire_and_a_raw_peer_with_it_gets_in():
    sec = Security("a-secret-that-must-not-travel")
    with _served(sec) as (thread, server):
        with _raw(server.address) as sock:
            info = complete_handshake(sock, sec.secret)
            assert info["op"] == "handshake-auth" and isinstance(info["proof"], bytes)
            sock.sendall(message_bytes({"op": "echo", "reply": True, "x": "in"}))
            (response,) = recv_frames(sock)
            assert msgpack.unpackb(response) == {"status": "OK", "result": "in"}
            assert sec.secret not in response and sec.secret not in info["proof"]


def test_a_proof_made_for_the_other_role_is_refused():
    """A peer cannot pass our own kind of proof back to us: the role is in the HMAC."""
    sec = Security.new()
    with _served(sec) as (thread, server):
        with _raw(server.address) as sock:
            nonce = os.urandom(32)
            sock.sendall(handshake_bytes(nonce=nonce))
            (hello,) = recv_frames(sock)
            theirs = msgpack.unpackb(hello)["nonce"]
            wrong = security.proof(sec.secret, b"acceptor", nonce, theirs)
            sock.sendall(message_bytes({"op": "handshake-auth", "proof": wrong, "pid": 1, "host": "x"}))
            rest = recv_until_closed(sock)
            assert b"handshake-refused" in rest and b"authentication failed" in rest
        assert thread.run(_echo_via(server.address, sec)) == "ok"  # serves on


async def _echo_via(address: str, sec: Security) -> Any:
    async with rpc(address, security=sec) as r:
        return await r.echo(x="ok")


class _Canary:
    """Unpickling this writes a file named after the unpickling process."""

    def __init__(self, directory: str):
        self.directory = directory

    def __reduce__(self) -> Any:
        return (_touch, (self.directory,))


def _touch(directory: str) -> None:
    open(os.path.join(directory, f"ran-in-{os.getpid()}"), "w").close()


@pytest.mark.parametrize("where", ["table-entry", "second-frame", "ext-in-header", "oversized"])
def test_a_stranger_s_first_message_is_never_decoded(tmp_path, where):
    """The handshake message of a stranger is one small frame of plain msgpack: a
    pickle placed in it as an out-of-band table entry (or anything else) runs nowhere."""
    canary = pickle.dumps(_Canary(str(tmp_path)))
    header = msgpack.packb({"op": "handshake", "protocol": PROTOCOL_VERSION, "nonce": b"n" * 32,
                            "auth": True, "x": msgpack.ExtType(2, (0).to_bytes(4, "little"))})
    table = msgpack.packb([["pickle", {}, 1, False]])
    frames = {
        "table-entry": [header, table, canary],
        "second-frame": [msgpack.packb({"op": "handshake"}), canary],
        "ext-in-header": [header],
        "oversized": [msgpack.packb({"op": "handshake", "pad": b"x" * (MAX_BYTES + 1)})],
    }[where]
    with _served(Security.new()) as (thread, server):
        with _raw(server.address) as sock:
            sock.sendall(frame_bytes(frames))
            recv_until_closed(sock)
        assert thread.run(_echo_via(server.address, server.security)) == "ok"
    assert os.listdir(tmp_path) == []


def test_nothing_after_the_handshake_messages_is_parsed_before_the_proof(tmp_path):
    """A stranger that sends its requests right behind a bad proof gets none of them read."""
    sec = Security.new()
    with _served(sec) as (thread, server):
        with _raw(server.address) as sock:
            sock.sendall(handshake_bytes(nonce=os.urandom(32)))
            recv_frames(sock)
            bogus = message_bytes({"op": "handshake-auth", "proof": b"0" * 32, "pid": 1, "host": "x"})
            big = struct.pack("<QQ", 1, 1 << 30)  # would be a 1 GiB frame, if it were read
            sock.sendall(bogus + message_bytes({"op": "handshake-shm", "can_map": False}) + big)
            rest = recv_until_closed(sock)
            assert b"authentication failed" in rest


def test_a_peer_of_another_version_is_told_both_versions():
    with _served(Security.new()) as (thread, server):
        with _raw(server.address) as sock:
            sock.sendall(handshake_bytes(protocol=PROTOCOL_VERSION - 1, nonce=os.urandom(32)))
            data = recv_until_closed(sock)
        refusal = [m for m in one_frame_messages(data) if m["op"] == "handshake-refused"]
        assert refusal and f"version {PROTOCOL_VERSION - 1}" in refusal[0]["reason"]
        assert f"version {PROTOCOL_VERSION}" in refusal[0]["reason"]


# ------------------------------------------------------------------ limits on strangers


def test_a_stranger_beyond_the_limit_closes_the_oldest_and_the_rest_serve_on():
    """At ``max-handshaking`` a newcomer is taken and the oldest stranger closed (not the
    newcomer refused); a real peer gets in while the strangers are held."""
    with config.set(max_handshaking=3):
        with _served(Security.new()) as (thread, server):
            strangers: list[socket.socket] = []
            try:
                with log_waiter() as logs:
                    for _ in range(3):  # connected, silent: each holds a handshake slot
                        strangers.append(_raw(server.address))
                        strangers[-1].recv(4096)  # its step 1 arrived: the slot is taken
                    late = _raw(server.address)
                    strangers.append(late)
                    assert late.recv(4096)  # taken: its step 1 came
                    assert recv_until_closed(strangers[0]) == b""  # the oldest was closed
                    logs.wait_for(lambda r: "max-handshaking" in r.getMessage())
                for s in strangers[1:]:
                    s.setblocking(False)
                    with pytest.raises(BlockingIOError):  # still open, waiting for its step 1
                        s.recv(1)
                # the real peer closes the oldest of the three left, and gets in
                assert thread.run(_echo_via(server.address, server.security)) == "ok"
                strangers[1].settimeout(10)
                assert recv_until_closed(strangers[1]) == b""
            finally:
                for s in strangers:
                    s.close()


@pytest.mark.parametrize("sent", [
    struct.pack("<QQ", 1, 100) + b"\x81",  # 1 byte of 100
    # 100 KiB of a 4 MiB frame: a large frame is read with a low-water mark (the loop
    # wakes per 512 KiB); bytes below it that never grow are taken in by the stall
    # check, then the stall counts
    struct.pack("<QQ", 1, 4 << 20) + b"\x81" * (100 << 10),
], ids=["small", "large"])
def test_a_peer_that_stops_in_the_middle_of_a_message_is_closed(sent: bytes):
    with config.set(partial_message_timeout=0.2):
        sec = Security.new()
        with _served(sec) as (thread, server):
            with log_waiter() as logs, _raw(server.address) as sock:
                complete_handshake(sock, sec.secret)
                sock.sendall(sent)
                assert recv_until_closed(sock) == b""
                logs.wait_for(lambda r: "stopped in the middle of a message" in r.getMessage())
            assert thread.run(_echo_via(server.address, sec)) == "ok"


def test_a_large_frame_that_trickles_in_is_not_taken_for_a_stall():
    # pieces far below the low-water mark, for longer in all than the stall timeout:
    # the stall check takes them in, and the message is answered
    with config.set(partial_message_timeout=1.0):
        sec = Security.new()
        with _served(sec) as (thread, server):
            with _raw(server.address) as sock:
                complete_handshake(sock, sec.secret)
                data = message_bytes({"op": "echo", "reply": True, "x": "a" * (4 << 20)})
                piece = 16 << 10
                for i in range(12):  # 12 pieces of 16 KiB, 0.25 s apart: 3 s
                    sock.sendall(data[i * piece:(i + 1) * piece])
                    time.sleep(0.25)  # the slow peer itself, not a wait for a condition
                sock.sendall(data[12 * piece:])
                [frame] = recv_frames(sock)
                reply = msgpack.unpackb(frame)
                assert reply["status"] == "OK" and reply["result"] == "a" * (4 << 20)


def test_an_idle_request_connection_is_closed_but_a_busy_one_is_not():
    with config.set(idle_timeout=0.3):
        sec = Security.new()
        with _served(sec) as (thread, server):
            with _raw(server.address) as idle:
                complete_handshake(idle, sec.secret)
                idle.sendall(message_bytes({"op": "echo", "reply": True, "x": 1}))
                recv_frames(idle)
                assert recv_until_closed(idle) == b""  # then nothing: closed by the server
            # a pool does not hand out a connection its server is about to close
            assert thread.run(_echo_via(server.address, sec)) == "ok"


# ------------------------------------------------------------------ the documented example


def test_the_proof_in_the_protocol_document():
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "protocol.md")) as f:
        doc = f.read()
    shown = re.search(r"which is\s+`([0-9a-f]{64})`", doc)
    assert shown is not None
    expected = hmac.new(b"example-secret", b"shoal-auth-1|connector|" + bytes(range(32)) + b"|"
                        + bytes(range(32, 64)), hashlib.sha256).hexdigest()
    assert shown.group(1) == expected
    assert security.proof(b"example-secret", b"connector", bytes(range(32)), bytes(range(32, 64))).hex() == expected


# ------------------------------------------------------------------ secrets on disk


def test_auth_files_are_private_and_bad_ones_are_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("SHOAL_AUTH_DIR", str(tmp_path / "auth"))
    sec = Security.new()
    path = security.write_auth_file("tcp://127.0.0.1:4321", sec)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert os.stat(os.path.dirname(path)).st_mode & 0o777 == 0o700
    assert security.for_address("tcp://127.0.0.1:4321").secret == sec.secret
    os.chmod(path, 0o644)
    with pytest.raises(ValueError, match="other users"):
        security.read_secret(path)
    os.unlink(path)
    os.symlink("/etc/hostname", path)
    with pytest.raises(OSError):
        security.read_secret(path)
    os.unlink(path)
    monkeypatch.setenv("SHOAL_AUTH_FILE", str(tmp_path / "missing"))
    with pytest.raises(OSError):  # told where it is and not there: an error, not no-auth
        security.for_address("tcp://127.0.0.1:4321")


def test_security_never_shows_its_secret():
    sec = Security("hunter2-hunter2")
    assert "hunter2" not in repr(sec) and "hunter2" not in str(sec)
    with pytest.raises(ValueError):
        Security("")
    with pytest.raises(ValueError):
        Security(cert="/nonexistent.pem", key="/nonexistent.pem")
