"""Bad input from a peer closes that connection with a clear error; the server keeps
serving everyone else.

The server (an rpc ``Server`` on tcp://127.0.0.1) runs on its own event loop in a
background thread; the tests talk to it with plain blocking sockets speaking the wire
format: little-endian u64 n_frames, n lengths, the frames; frame 0 is the msgpack message;
the first message each way is the handshake.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shoal import config
from shoal.comm.handshake import MAX_BYTES
from shoal.protocol import loads
from shoal.rpc import Server, rpc
from shoal_helpers import (
    complete_handshake,
    frame_bytes,
    log_waiter,
    LogWaiter,
    LoopThread,
    message_bytes,
    raw_connect,
    raw_socket,
    recv_frames,
    recv_until_closed,
    secret_of,
)


def echo(comm: Any, x: Any = None) -> Any:
    return x


@contextlib.contextmanager
def live_server() -> Iterator[str]:
    """A tcp rpc server on its own loop thread; yields its address."""
    with LoopThread(name="bad-input-server") as thread:
        server = Server({"echo": echo}, name="victim")
        thread.run(server.listen("tcp://127.0.0.1:0"))
        try:
            yield server.address
        finally:
            thread.run(server.close())


def raw_call(sock: socket.socket, x: Any) -> Any:
    """One request on a raw, handshaken socket; returns the result."""
    sock.sendall(message_bytes({"op": "echo", "reply": True, "x": x}))
    response = loads(recv_frames(sock))
    assert response == {"status": "OK", "result": x}, response
    return response["result"]


async def _rpc_echo(address: str, x: Any) -> Any:
    async with rpc(address) as r:
        return await r.echo(x=x)


def assert_still_serving(address: str, before: socket.socket) -> None:
    """A connection opened before the bad input still works, and so does a new one."""
    assert raw_call(before, ["still", "here"]) == ["still", "here"]
    assert asyncio.run(_rpc_echo(address, (1, "new"))) == (1, "new")


def assert_closed_by_server(sock: socket.socket) -> bytes:
    """The server closes: we read EOF (or a reset), without having closed ourselves."""
    sock.settimeout(10)
    return recv_until_closed(sock)


@contextlib.contextmanager
def bad_peer_scenario(caplog: pytest.LogCaptureFixture) -> Iterator[tuple[str, socket.socket, socket.socket, LogWaiter]]:
    """(address, a connection opened before the bad input, the bad peer's socket, logs)."""
    caplog.set_level(logging.INFO, logger="shoal")
    with live_server() as address, log_waiter() as logs:
        before = raw_connect(address)
        bad = None
        try:
            assert raw_call(before, "warm") == "warm"
            bad = raw_socket(*_hostport(address), 10)
            yield address, before, bad, logs
        finally:
            before.close()
            if bad is not None:
                bad.close()


def _hostport(address: str) -> tuple[str, int]:
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    return host, int(port)


def _error_logged(caplog: pytest.LogCaptureFixture, *words: str) -> logging.LogRecord:
    for record in caplog.records:
        text = record.getMessage()
        if record.levelno >= logging.WARNING and all(w in text for w in words):
            return record
    raise AssertionError(f"no warning/error log containing {words}: {[r.getMessage() for r in caplog.records]}")


def _handshake_done(bad: socket.socket) -> None:
    host, port = bad.getpeername()[:2]
    complete_handshake(bad, secret_of(f"tcp://{host}:{port}"))


# ------------------------------------------------------------------------ before the handshake


def test_garbage_instead_of_a_handshake(caplog):
    with bad_peer_scenario(caplog) as (address, before, bad, logs):
        bad.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 3)
        assert_closed_by_server(bad)
        logs.wait_for(lambda r: "refused" in r.getMessage())
        record = _error_logged(caplog, "refused connection", "frames")
        assert "shoal protocol" in record.getMessage()  # says what looks wrong
        assert_still_serving(address, before)


def test_wrong_first_message_instead_of_a_handshake(caplog):
    with bad_peer_scenario(caplog) as (address, before, bad, logs):
        bad.sendall(message_bytes({"op": "echo", "x": 1}))
        assert_closed_by_server(bad)
        logs.wait_for(lambda r: "refused" in r.getMessage())
        _error_logged(caplog, "refused connection", "did not start with a shoal handshake")
        assert_still_serving(address, before)


# ------------------------------------------------------------------------ after the handshake


def test_truncated_frame_then_disconnect(caplog):
    with bad_peer_scenario(caplog) as (address, before, bad, logs):
        _handshake_done(bad)
        bad.sendall(struct.pack("<QQ", 1, 1000) + b"only part of it")
        bad.shutdown(socket.SHUT_WR)
        assert_closed_by_server(bad)
        logs.wait_for(lambda r: "middle of a message" in r.getMessage())
        _error_logged(caplog, "middle of a message")
        assert_still_serving(address, before)


def test_truncated_length_table_then_disconnect(caplog):
    with bad_peer_scenario(caplog) as (address, before, bad, logs):
        _handshake_done(bad)
        bad.sendall(struct.pack("<QQ", 3, 10) + b"\x01\x02")  # 3 lengths announced, 1.25 sent
        bad.close()
        logs.wait_for(lambda r: "middle of a message" in r.getMessage())
        assert_still_serving(address, before)


@pytest.mark.parametrize("handshaken", [True, False], ids=["after-handshake", "instead-of-handshake"])
def test_frame_length_above_the_maximum(caplog, handshaken):
    with config.set(max_frame_bytes=1000):
        with bad_peer_scenario(caplog) as (address, before, bad, logs):
            if handshaken:
                _handshake_done(bad)
            # announce 1 GB, send a little: the server must not wait for (or allocate) it
            bad.sendall(struct.pack("<QQ", 1, 1 << 30) + b"x" * 100)
            assert_closed_by_server(bad)
            logs.wait_for(lambda r: "exceeds the maximum" in r.getMessage())
            # before the handshake the stricter limit of a stranger's messages holds
            record = _error_logged(caplog, "exceeds the maximum", "1000" if handshaken else str(MAX_BYTES))
            assert record.levelno == logging.ERROR
            assert_still_serving(address, before)


def test_frame_count_above_the_maximum(caplog):
    with config.set(max_frames=10):
        with bad_peer_scenario(caplog) as (address, before, bad, logs):
            _handshake_done(bad)
            bad.sendall(struct.pack("<Q", 11) + bytes(88))
            assert_closed_by_server(bad)
            logs.wait_for(lambda r: "announces 11 frames" in r.getMessage())
            _error_logged(caplog, "announces 11 frames")
            assert_still_serving(address, before)


@pytest.mark.parametrize(
    "frames",
    [
        [b"\xc1\xc1\xc1"],  # not msgpack
        [b"\x93\x01"],  # msgpack cut short
        [msgpack.packb({"op": "echo"}), b"\xc1"],  # bad out-of-band table
        [msgpack.packb({"op": "echo"}), msgpack.packb([["pickle", {}, 9, True]])],  # missing frames
        [msgpack.packb(msgpack.ExtType(42, b"?"))],  # unknown extension
    ],
    ids=["garbage", "truncated-msgpack", "bad-table", "table-names-missing-frames", "unknown-ext"],
)
def test_malformed_message_in_well_formed_frames(caplog, frames):
    with bad_peer_scenario(caplog) as (address, before, bad, logs):
        _handshake_done(bad)
        bad.sendall(frame_bytes(frames))
        assert_closed_by_server(bad)
        logs.wait_for(lambda r: "closing connection" in r.getMessage())
        record = _error_logged(caplog, "closing connection")
        assert record.levelno == logging.ERROR
        assert_still_serving(address, before)


@pytest.mark.parametrize(
    "msg", [[1, 2, 3], "just a string", {"no": "op"}, {"op": 17}], ids=["list", "str", "no-op", "op-not-str"]
)
def test_message_that_is_not_a_request(caplog, msg):
    with bad_peer_scenario(caplog) as (address, before, bad, logs):
        _handshake_done(bad)
        bad.sendall(message_bytes(msg))
        assert_closed_by_server(bad)
        logs.wait_for(lambda r: "closing connection" in r.getMessage())
        _error_logged(caplog, "closing connection", "must be a map with an 'op'")
        assert_still_serving(address, before)


def test_unknown_op(caplog):
    with bad_peer_scenario(caplog) as (address, before, bad, logs):
        _handshake_done(bad)
        bad.sendall(message_bytes({"op": "no-such-op", "reply": True}))
        response = loads(recv_frames(bad))  # told why ...
        assert response["status"] == "error"
        assert "no handler for op 'no-such-op'" in response["message"]
        assert_closed_by_server(bad)  # ... then closed
        logs.wait_for(lambda r: "unknown op" in r.getMessage())
        _error_logged(caplog, "unknown op 'no-such-op'")
        assert_still_serving(address, before)


def test_bad_arguments_are_an_error_reply_not_a_closed_connection():
    with live_server() as address:
        sock = raw_connect(address)
        try:
            sock.sendall(message_bytes({"op": "echo", "reply": True, "unexpected": 1}))
            response = loads(recv_frames(sock))
            assert response["status"] == "error" and "bad arguments for op 'echo'" in response["message"]
            assert raw_call(sock, 5) == 5  # the same connection keeps working
        finally:
            sock.close()


def test_value_that_cannot_be_deserialized_is_an_error_reply_not_a_closed_connection(caplog):
    # a pickle of a class from a module this process does not have
    payload = b"cno_such_module_for_shoal_tests\nThing\n)\x81."
    header = msgpack.packb({"op": "echo", "reply": True, "x": msgpack.ExtType(2, (0).to_bytes(4, "little"))})
    table = msgpack.packb([["pickle", {}, 1, True]])
    with live_server() as address:
        sock = raw_connect(address)
        try:
            sock.sendall(frame_bytes([header, table, payload]))
            response = loads(recv_frames(sock))
            assert response["status"] == "error"
            assert "ModuleNotFoundError" in response["message"] and "no_such_module_for_shoal_tests" in response["message"]
            assert raw_call(sock, 5) == 5  # the same connection keeps working
        finally:
            sock.close()
    assert any("bad request" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------------ fuzzing


@pytest.mark.parametrize("handshaken", [False, True], ids=["instead-of-handshake", "after-handshake"])
def test_random_garbage_never_takes_the_server_down(handshaken):
    with config.set(max_frame_bytes=1 << 20, max_frames=1000), live_server() as address:
        before = raw_connect(address)
        try:

            @settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck), database=None)
            @given(garbage=st.binary(min_size=1, max_size=300) | st.builds(_framed_garbage, st.binary(max_size=40), st.integers(0, 4)))
            def send_garbage(garbage: bytes) -> None:
                sock = raw_connect(address, handshake=handshaken)
                try:
                    sock.sendall(garbage)
                    sock.shutdown(socket.SHUT_WR)  # whatever it parsed as, the message ends here
                    assert_closed_by_server(sock)
                finally:
                    sock.close()
                assert raw_call(before, "ok") == "ok"

            send_garbage()
            assert asyncio.run(_rpc_echo(address, "after fuzzing")) == "after fuzzing"
        finally:
            before.close()


def _framed_garbage(payload: bytes, n_extra: int) -> bytes:
    """Well-framed messages whose frames are random bytes."""
    return frame_bytes([payload] + [payload[: i + 1] for i in range(n_extra)])
