"""A peer that is alive but stops reading keeps its connection; a silent one does not.

Linux breaks a connection whose peer advertises a zero window for longer than
``TCP_USER_TIMEOUT``, although that peer's kernel answers every probe (a client stopped
in a debugger lost its connection to the scheduler after ``tcp-timeout``).
"""

from __future__ import annotations

import asyncio
import errno
import socket
import sys
import time

import pytest

from shoal import config
from comm_pairs import comm_pair
from shoal.comm.liveness import set_liveness, window_state, watch_window

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's TCP_INFO and TCP_USER_TIMEOUT")

TIMEOUT = 0.5  # tcp-timeout in these tests, seconds
IDLE = 8 * TIMEOUT  # how long the reader stays away: many times the timeout


def _filled_pair(timeout: float) -> tuple[socket.socket, socket.socket, socket.socket, int]:
    """(listener, writer, reader): the writer's user timeout is ``timeout`` and it sent
    until the kernel took no more (the reader reads nothing); and the bytes it sent."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    writer = socket.create_connection(srv.getsockname())
    reader, _ = srv.accept()
    set_liveness(writer, timeout)
    writer.setblocking(False)
    sent = 0
    chunk = bytes(range(256)) * 256
    try:
        while True:
            sent += writer.send(chunk)
    except BlockingIOError:
        pass
    return srv, writer, reader, sent


def _drain(reader: socket.socket, n: int) -> bytes:
    reader.settimeout(10)
    parts = []
    got = 0
    while got < n:
        data = reader.recv(1 << 20)
        if not data:
            break
        parts.append(data)
        got += len(data)
    return b"".join(parts)


def _wait_for(condition, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_the_kernel_breaks_a_zero_window_connection_without_the_watch():
    """The premise: with the user timeout left in place, a reader that is alive but
    away loses the connection (if this kernel ever stops doing so, the watch is moot)."""
    srv, writer, reader, sent = _filled_pair(TIMEOUT)
    try:
        errors: list[int] = []
        _wait_for(lambda: errors.append(writer.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)) or errors[-1] != 0)
        assert errors[-1] == errno.ETIMEDOUT
        assert window_state(writer) is not None
    finally:
        for s in (srv, writer, reader):
            s.close()


async def test_the_watch_keeps_a_connection_whose_reader_is_away():
    srv, writer, reader, sent = _filled_pair(TIMEOUT)
    try:
        watch = watch_window(writer, TIMEOUT)
        assert watch is not None
        # the watch sees the closed window and lifts the user timeout
        deadline = time.monotonic() + 10
        while writer not in watch.lifted:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        await asyncio.sleep(IDLE)  # the reader stays away for many timeouts
        assert writer.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
        data = await asyncio.get_running_loop().run_in_executor(None, _drain, reader, sent)
        assert len(data) == sent
        assert data == (bytes(range(256)) * 256 * (sent // 65536 + 1))[:sent]
        # the window is open again: the user timeout is back
        deadline = time.monotonic() + 10
        while writer in watch.lifted:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        watch.discard(writer)
    finally:
        for s in (srv, writer, reader):
            s.close()


async def test_a_comm_whose_reader_stops_reading_for_many_timeouts_delivers_every_message():
    """Over shoal's tcp: the server end reads nothing while the client writes 256 KiB
    messages until its writes block, for many times ``tcp-timeout``; then every message
    arrives whole and in order, and both ends still work."""
    with config.set(tcp_timeout=TIMEOUT):
        async with comm_pair("tcp://127.0.0.1:0") as (client, server):
            sent = 0
            stop = asyncio.Event()

            def payload(i: int) -> bytes:
                return bytes([i % 251]) * (256 << 10)

            async def write_all() -> None:
                # until the test says so: the writes block once the reader's queue and
                # the kernel's buffers are full
                nonlocal sent
                while not stop.is_set():
                    await client.write({"i": sent, "data": payload(sent)})
                    sent += 1

            writing = asyncio.ensure_future(write_all())
            wsock = client._wsock  # type: ignore[attr-defined]
            watch = client._window_watch  # type: ignore[attr-defined]
            assert watch is not None
            deadline = time.monotonic() + 20
            while wsock not in watch.lifted:
                assert time.monotonic() < deadline and not writing.done()
                await asyncio.sleep(0.02)
            await asyncio.sleep(IDLE)  # the reader stays away for many timeouts
            assert not client.closed() and not server.closed()
            stop.set()
            i = 0
            while not (writing.done() and i == sent):
                msg = await asyncio.wait_for(server.read(), 30)
                assert msg["i"] == i and bytes(msg["data"]) == payload(i)
                i += 1
            await writing
            assert sent > 64  # more than the reader's queue holds
            await server.write({"back": 1})
            assert (await asyncio.wait_for(client.read(), 10)) == {"back": 1}
