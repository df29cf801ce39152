"""One conformance suite, run against every transport (inproc://, tcp:// and tls://).

Where transports differ by design (inproc passes objects by reference, tcp serializes),
a test checks each one's promise; tests that only make sense for a byte transport
(handshake versions on the wire, the offload thread pool) say so.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import AsyncIterator
from importlib.metadata import EntryPoint
from typing import Any

import numpy as np
import pytest

import shoal.comm.core
import shoal.rpc.pool
from shoal import config
from shoal.comm import Backend, connect, get_backend, listen, register_backend
from shoal.comm.core import Comm
from shoal.errors import (
    CommBrokenError,
    CommClosedError,
    CommConnectError,
    CommError,
    HandshakeError,
    SerializationError,
    ShoalError,
)
from shoal.protocol import (
    PROTOCOL_VERSION,
    SAME_HOST,
    SAME_PROCESS,
    Serialize,
    Serialized,
    register_serializer,
    serialize,
    to_serialize,
)
from shoal.rpc import ConnectionPool, Server, rpc
from comm_pairs import comm_pair, is_inproc
from shoal_helpers import LoopThread, assert_same, log_waiter, message_bytes, one_frame_messages

async def echo_once(client: Comm, server: Comm, msg: Any) -> Any:
    await client.write(msg)
    got = await server.read()
    await server.write(got)
    return await client.read()


# ------------------------------------------------------------------------ values


class Opaque:
    """Pickles fine; compared by value."""

    def __init__(self, value: Any):
        self.value = value

    def __eq__(self, other: object) -> bool:
        return type(other) is Opaque and other.value == self.value


class RefusesPickle:
    def __reduce__(self) -> Any:
        raise RuntimeError("I travel by reference only")


def nested_message() -> dict[str, Any]:
    return {
        "op": "data",
        "small": np.arange(10, dtype=np.int16),
        "zero_d": np.array(3.5),
        "non_contiguous": np.arange(400.0).reshape(20, 20)[::3, 1::2],
        "structured": np.array([(1, 2.0)], dtype=[("a", "<i8"), ("b", "<f4")]),
        "nested": [(1, b"bytes", {"k": (np.arange(3), bytearray(b"ba"))}), {("t", 1): None}],
        "big_bytes": b"\x01" * 200_000,
        "memoryview": memoryview(b"abcdef"),
        "memoryview_2d": memoryview(bytearray(range(24))).cast("i", (2, 3)),
        "serialize": to_serialize(Opaque([1, 2])),
        "big_int": 1 << 100,
    }


def expected_after_transport(msg: dict[str, Any]) -> dict[str, Any]:
    out = dict(msg)
    out["serialize"] = msg["serialize"].data
    out["non_contiguous"] = np.ascontiguousarray(msg["non_contiguous"])
    return out


async def test_echo_nested_message(address):
    async with comm_pair(address) as (client, server):
        msg = nested_message()
        out = await echo_once(client, server, msg)
        if is_inproc(address):
            assert out["small"] is msg["small"]
            assert out["serialize"] is msg["serialize"].data
        assert_same(out, expected_after_transport(msg))


async def test_echo_many_messages_in_order(address):
    async with comm_pair(address) as (client, server):
        for i in range(100):
            await client.write({"i": i, "pad": b"x" * (i * 1000)})
        for i in range(100):
            msg = await server.read()
            assert msg["i"] == i and len(msg["pad"]) == i * 1000


async def test_echo_frame_size_boundaries(address):
    # sizes around the reader's thresholds: scratch buffer, own buffer (64 KiB), mmap (2 MiB)
    sizes = [0, 1, 4095, 4096, 4097, 65535, 65536, 65537, 2**21 - 1, 2**21, 2**21 + 1]
    values = [bytearray((i % 251 for i in range(n))) for n in sizes]
    async with comm_pair(address) as (client, server):
        # all in one message, then each alone, then all back to back
        assert_same(await echo_once(client, server, {"all": values}), {"all": values})
        for value in values:
            assert_same(await echo_once(client, server, [value]), [value])
        for value in values:
            await client.write([value])
        for value in values:
            assert_same(await server.read(), [value])


async def test_echo_message_with_many_frames(address):
    # more frames than one sendmsg takes, and a length table larger than 64 KiB
    values = [bytearray(i % 4) for i in range(10_000)]
    msg = {"many": values, "empty_array": np.zeros((0, 3)), "empty_ba": bytearray()}
    async with comm_pair(address) as (client, server):
        assert_same(await echo_once(client, server, msg), msg)


async def test_echo_100mb_array(address):
    arr = np.arange(100 * 2**20 // 8, dtype=np.int64)
    async with comm_pair(address) as (client, server):
        out = await echo_once(client, server, {"arr": arr, "tag": "big"})
        assert out["tag"] == "big"
        if is_inproc(address):
            assert out["arr"] is arr
        else:
            assert not np.shares_memory(out["arr"], arr)
            assert out["arr"].dtype == arr.dtype and np.array_equal(out["arr"], arr)


async def test_inproc_passes_the_very_same_objects(address):
    lock = threading.Lock()
    refuses = RefusesPickle()
    msg = {"lock": lock, "refuses": refuses, "list": [lock]}
    async with comm_pair(address) as (client, server):
        if is_inproc(address):
            await client.write(msg)
            got = await server.read()
            assert got is msg
            assert got["lock"] is lock and got["refuses"] is refuses
            wrapped = {"x": to_serialize(refuses)}
            await server.write(wrapped)
            assert (await client.read())["x"] is refuses
        else:
            # a byte transport refuses them before anything is sent; the comm stays usable
            with pytest.raises(SerializationError, match=r"_thread.lock' at lock"):
                await client.write(msg)
            with pytest.raises(SerializationError, match="RefusesPickle"):
                await client.write({"x": to_serialize(refuses)})
            await client.write({"after": "errors"})
            assert await server.read() == {"after": "errors"}


@pytest.mark.parametrize("listener_in_thread", [True, False], ids=["listener-thread", "client-thread"])
async def test_ends_on_different_loops_in_different_threads(address, listener_in_thread):
    lock = threading.Lock()
    msg = {"lock": lock} if is_inproc(address) else {"arr": np.arange(5)}
    handler_threads: list[int] = []

    async def echo(comm: Comm) -> None:
        handler_threads.append(threading.get_ident())
        try:
            while True:
                await comm.write(await comm.read())
        except CommError:
            pass

    async def roundtrip(addr: str) -> Any:
        comm = await connect(addr)
        try:
            await comm.write(msg)
            return await comm.read()
        finally:
            await comm.close()

    with LoopThread() as other:
        if listener_in_thread:
            listener = await other.arun(listen(address, echo))
            try:
                out = await roundtrip(listener.contact_address)
            finally:
                listener.stop()
            assert handler_threads == [other.thread.ident]
        else:
            listener = await listen(address, echo)
            try:
                out = await other.arun(roundtrip(listener.contact_address))
            finally:
                listener.stop()
            assert handler_threads == [threading.get_ident()]
    if is_inproc(address):
        assert out is msg and out["lock"] is lock
    else:
        assert_same(out, msg)


async def test_handshake_info_and_destination(address):
    async with comm_pair(address) as (client, server):
        for comm in (client, server):
            assert comm.peer_info["protocol"] == PROTOCOL_VERSION
            assert comm.peer_info["pid"] == os.getpid()
            assert comm.destination == (SAME_PROCESS if is_inproc(address) else SAME_HOST)
            if not is_inproc(address):
                # the shared-memory probe found the same /dev/shm both ways
                assert comm.peer_info["shm"] == {"peer_maps_ours": True, "we_map_theirs": True}
        assert client.peer_address == server.local_address
        if not is_inproc(address):
            assert server.peer_address == client.local_address


# ------------------------------------------------------------------------ Serialized, forwarded


class Payload:
    """Counts its serializations, so a test can see where it was (de)serialized."""

    dumps_calls = 0
    loads_calls = 0

    def __init__(self, data: np.ndarray):
        self.data = data


def _payload_dumps(obj: Payload, destination: str) -> tuple[dict[str, Any], list[Any]]:
    Payload.dumps_calls += 1
    return {"dtype": obj.data.dtype.str, "shape": obj.data.shape}, [obj.data]


def _payload_loads(header: dict[str, Any], frames: list[Any]) -> Payload:
    Payload.loads_calls += 1
    arr = np.frombuffer(frames[0], dtype=header["dtype"]).reshape(header["shape"])
    return Payload(arr)


register_serializer(Payload, _payload_dumps, _payload_loads, name="test-conformance-payload")


async def test_serialized_forwarded_through_a_middle_hop(address):
    Payload.dumps_calls = Payload.loads_calls = 0
    original = Payload(np.arange(50_000, dtype=np.float32).reshape(100, 500))
    seen_middle: list[Any] = []
    seen_final: list[Any] = []

    async def final(comm: Comm, x: Any) -> Any:
        seen_final.append(x)
        return x

    final_server = Server({"final": final}, name="final")
    await final_server.listen(address)

    async def forward(comm: Comm, x: Any) -> Any:
        seen_middle.append(x)
        async with rpc(final_server.address, deserialize=False) as r:
            return await r.final(x=x)

    middle = Server({"forward": forward}, deserialize=False, name="middle")
    await middle.listen(address)
    try:
        async with rpc(middle.address) as r:
            out = await r.forward(x=to_serialize(original))
    finally:
        await middle.close()
        await final_server.close()

    (at_middle,) = seen_middle
    (at_final,) = seen_final
    if is_inproc(address):
        assert type(at_middle) is Serialize and at_middle.data is original
        assert at_final is original and out is original
        assert Payload.dumps_calls == Payload.loads_calls == 0
    else:
        # client and final serialized; final and client deserialized; the middle never did
        assert Payload.dumps_calls == 2 and Payload.loads_calls == 2
        assert type(at_middle) is Serialized
        assert at_middle == serialize(original)  # the very bytes the client produced
        assert type(at_final) is Payload and np.array_equal(at_final.data, original.data)
        assert type(out) is Payload and np.array_equal(out.data, original.data)


# ------------------------------------------------------------------------ concurrency


async def test_many_concurrent_calls_through_a_bounded_pool(address, monkeypatch):
    limit = 10
    active = 0
    max_active = 0
    full = asyncio.Event()
    pool = ConnectionPool(limit=limit)
    opened_max = 0
    connects = 0
    real_connect = shoal.rpc.pool.connect

    async def counting_connect(*args: Any, **kwargs: Any) -> Comm:
        nonlocal connects, opened_max
        connects += 1
        opened_max = max(opened_max, pool.open)
        return await real_connect(*args, **kwargs)

    monkeypatch.setattr(shoal.rpc.pool, "connect", counting_connect)

    async def work(comm: Comm, i: int) -> int:
        nonlocal active, max_active, opened_max
        active += 1
        max_active = max(max_active, active)
        opened_max = max(opened_max, pool.open)
        if active == limit:
            full.set()
        await full.wait()  # the first calls wait until `limit` of them run at once
        await asyncio.sleep(0)
        active -= 1
        return i * 2

    server = Server({"work": work})
    await server.listen(address)
    try:
        results = await asyncio.gather(*(pool(server.address).work(i=i) for i in range(200)))
        assert results == [i * 2 for i in range(200)]
        assert max_active == limit
        assert opened_max <= limit and pool.open <= limit
        assert connects == limit  # then the connections were reused
        assert len(server.comms) <= limit
    finally:
        await pool.close()
        await server.close()


async def test_pool_waiters_wake_when_a_connection_attempt_fails():
    # nothing listens there: every attempt fails (after retrying for `timeout`); the
    # calls that waited for a free slot meanwhile must get their turn and their error
    pool = ConnectionPool(limit=1, timeout=0.05)
    try:
        calls = [pool("tcp://127.0.0.1:1").ping() for _ in range(5)]
        results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 10)
        assert all(isinstance(r, CommConnectError) for r in results)
        assert pool.open == 0
    finally:
        await pool.close()


# ------------------------------------------------------------------------ close vs break


def test_error_hierarchy():
    for cls in (CommClosedError, CommBrokenError, CommConnectError, HandshakeError):
        assert issubclass(cls, CommError) and issubclass(cls, ShoalError)
    assert not issubclass(CommClosedError, CommBrokenError)
    assert not issubclass(CommBrokenError, CommClosedError)


@pytest.mark.parametrize("how", ["close", "abort"])
async def test_after_our_close_read_and_write_raise_closed(address, how):
    async with comm_pair(address) as (client, server):
        await client.write("before")
        assert await server.read() == "before"
        if how == "close":
            await client.close()
        else:
            client.abort()
        assert client.closed()
        with pytest.raises(CommClosedError):
            await client.read()
        with pytest.raises(CommClosedError):
            await client.write("after")
        await client.close()  # closing twice never raises
        client.abort()


async def test_close_wakes_our_pending_read_with_closed(address):
    async with comm_pair(address) as (client, server):
        reader = asyncio.ensure_future(client.read())
        await asyncio.sleep(0)  # let the read start waiting
        await client.close()
        with pytest.raises(CommClosedError):
            await asyncio.wait_for(reader, 10)


@pytest.mark.parametrize("how", ["close", "abort"])
async def test_when_the_peer_closes_we_see_broken(address, how):
    async with comm_pair(address) as (client, server):
        pending = asyncio.ensure_future(client.read())
        await asyncio.sleep(0)
        if how == "close":
            await server.close()
        else:
            server.abort()
        with pytest.raises(CommBrokenError):
            await asyncio.wait_for(pending, 10)
        with pytest.raises(CommBrokenError):
            await client.read()
        with pytest.raises(CommBrokenError):
            await client.write("to nobody")
        assert client.closed()


async def test_messages_sent_before_a_graceful_close_are_delivered(address):
    async with comm_pair(address) as (client, server):
        for i in range(3):
            await client.write({"i": i, "data": np.full(1000, i)})
        await client.close()
        for i in range(3):
            msg = await server.read()
            assert msg["i"] == i and (msg["data"] == i).all()
        with pytest.raises(CommBrokenError):
            await server.read()


async def test_connect_to_nothing_is_a_connect_error(address):
    target = "inproc://no-such-listener" if is_inproc(address) else "tcp://127.0.0.1:1"
    with pytest.raises(CommConnectError):
        await connect(target, timeout=0.1)


# ------------------------------------------------------------------------ handshake (tcp)


@contextlib.asynccontextmanager
async def raw_tcp_server(reply: bytes) -> AsyncIterator[str]:
    """A tcp server that sends ``reply`` to each connection, then waits for EOF."""
    writers: list[asyncio.StreamWriter] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        writer.write(reply)
        await writer.drain()
        await reader.read()  # until the client goes away
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"tcp://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        for w in writers:
            w.close()
        server.close()
        await server.wait_closed()


def _handshake(version: Any) -> bytes:
    return message_bytes({"op": "handshake", "protocol": version, "pid": 1, "host": "h"})


async def test_connect_refuses_a_peer_of_another_protocol_version():
    async with raw_tcp_server(_handshake(PROTOCOL_VERSION + 1)) as address:
        with pytest.raises(HandshakeError, match=rf"protocol version {PROTOCOL_VERSION + 1}.*speaks version {PROTOCOL_VERSION}"):
            await connect(address, timeout=5)


async def test_connect_refuses_a_peer_that_is_not_shoal():
    async with raw_tcp_server(message_bytes({"op": "hello"})) as address:
        with pytest.raises(HandshakeError, match="did not start with a shoal handshake"):
            await connect(address, timeout=5)
    async with raw_tcp_server(b"HTTP/1.1 400 Bad Request\r\n\r\n") as address:
        with pytest.raises(HandshakeError):
            await connect(address, timeout=5)


async def test_listener_refuses_a_client_of_another_protocol_version(caplog):
    handled: list[Comm] = []

    async def handler(comm: Comm) -> None:
        handled.append(comm)

    listener = await listen("tcp://127.0.0.1:0", handler)
    writer = None
    try:
        with log_waiter() as logs:
            host, port = listener.contact_address.removeprefix("tcp://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(_handshake(PROTOCOL_VERSION + 7))
            await writer.drain()
            # the listener's handshake, then its refusal, which says why, then EOF
            messages = one_frame_messages(await asyncio.wait_for(reader.read(), 10))
            assert [m["op"] for m in messages] == ["handshake", "handshake-refused"]
            reason = messages[1]["reason"]
            assert f"version {PROTOCOL_VERSION + 7}" in reason and f"version {PROTOCOL_VERSION}" in reason
            logs.wait_for(lambda r: "refused" in r.getMessage())
        record = next(r for r in caplog.records if "refused" in r.getMessage())
        assert record.levelno >= logging.WARNING
        assert f"protocol version {PROTOCOL_VERSION + 7}" in record.getMessage()
        assert handled == []  # the handler never saw the incompatible peer
    finally:
        if writer is not None:
            writer.close()
        listener.stop()


# ------------------------------------------------------------------------ offloading


class Heavy:
    """A value whose family records the thread it runs in."""

    threads: list[tuple[str, str]] = []

    def __init__(self, nbytes: int):
        self.nbytes = nbytes


def _heavy_dumps(obj: Heavy, destination: str) -> tuple[dict[str, Any], list[Any]]:
    Heavy.threads.append(("dumps", threading.current_thread().name))
    return {"n": obj.nbytes}, [bytes(obj.nbytes)]


def _heavy_loads(header: dict[str, Any], frames: list[Any]) -> Heavy:
    Heavy.threads.append(("loads", threading.current_thread().name))
    return Heavy(header["n"])


register_serializer(Heavy, _heavy_dumps, _heavy_loads, name="test-conformance-heavy")


async def test_large_messages_are_serialized_off_the_event_loop(address):
    loop_thread = threading.current_thread().name
    Heavy.threads = []
    with config.set(offload_threshold=10_000):
        async with comm_pair(address) as (client, server):
            await client.write({"h": to_serialize(Heavy(50_000))})
            big = await server.read()
            await client.write({"h": to_serialize(Heavy(100))})
            small = await server.read()
    assert big["h"].nbytes == 50_000 and small["h"].nbytes == 100
    if is_inproc(address):
        assert Heavy.threads == []  # nothing is serialized in-process
    else:
        (d_big, l_big, d_small, l_small) = Heavy.threads
        assert d_big[0] == "dumps" and d_big[1].startswith("shoal-serialize")
        assert l_big[0] == "loads" and l_big[1].startswith("shoal-serialize")
        assert d_small == ("dumps", loop_thread) and l_small == ("loads", loop_thread)


# ------------------------------------------------------------------------ batched streams


class WrappedInproc(Backend):
    """A plug-in backend for ``wrapped://`` that delegates to inproc and counts calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def connect(self, location: str, deserialize: bool, timeout: float, security: Any = None,
                      **roles: Any) -> Comm:
        self.calls.append("connect")
        return await get_backend("inproc").connect(location, deserialize, timeout)

    def listener(self, location: str, handler: Any, deserialize: bool, security: Any = None) -> Any:
        self.calls.append("listener")
        return get_backend("inproc").listener(location, handler, deserialize)


async def _echo_via(scheme: str) -> Any:
    async def handler(comm: Comm) -> None:
        await comm.write(await comm.read())

    listener = await listen(f"{scheme}://", handler)
    try:
        location = listener.contact_address.split("://", 1)[1]
        comm = await connect(f"{scheme}://{location}")
        try:
            await comm.write({"hello": scheme})
            return await comm.read()
        finally:
            await comm.close()
    finally:
        listener.stop()


async def test_register_backend_for_a_custom_scheme(monkeypatch):
    backend = WrappedInproc()
    monkeypatch.setitem(shoal.comm.core._backends, "wrapped", backend)  # restored afterwards
    register_backend("wrapped", backend)
    assert get_backend("wrapped") is backend
    assert await _echo_via("wrapped") == {"hello": "wrapped"}
    assert backend.calls == ["listener", "connect"]


async def test_backend_found_through_an_entry_point(monkeypatch):
    monkeypatch.delitem(shoal.comm.core._backends, "plugged", raising=False)
    ep = EntryPoint(name="plugged", value=f"{__name__}:WrappedInproc", group="shoal.comm.backends")
    monkeypatch.setattr(shoal.comm.core, "entry_points", lambda group: [ep] if group == "shoal.comm.backends" else [])
    try:
        backend = get_backend("plugged")
        assert isinstance(backend, WrappedInproc)
        assert await _echo_via("plugged") == {"hello": "plugged"}
    finally:
        shoal.comm.core._backends.pop("plugged", None)


async def test_unknown_scheme():
    with pytest.raises(ValueError, match="unknown comm scheme 'nope'"):
        await connect("nope://somewhere", timeout=0.1)
    with pytest.raises(ValueError):
        await listen("nope://", lambda comm: asyncio.sleep(0))
