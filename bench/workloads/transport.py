"""Transport-layer workloads (shoal only: dask and ray have no equivalent layer).

- ``rpc_latency``: one small request/response (``echo(x=1)``) round trip.
- ``tcp_bandwidth``: one large numpy array from one process to another over shoal tcp,
  against plain sockets moving the same bytes in the same run.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from typing import Any

from ..common import LoopThread, async_wait_for_stop, loop_name, median, pin, placement, run, start_helper
from ..registry import Workload

_U64 = struct.Struct("<Q")

# --------------------------------------------------------------------------- rpc_latency

rpc_latency = Workload(
    "rpc_latency",
    "Median round trip of a small RPC (echo(x=1)) after warm-up, in microseconds. "
    "`*_rpc`: through the rpc() proxy and its connection pool; `*_comm`: send_recv on a "
    "held comm. inproc_same_loop: client and server on one event loop; inproc_thread: "
    "server on another thread's loop; tcp_process: server in another process on "
    "127.0.0.1. References, served by the same helper process and interleaved with the "
    "tcp_process calls (so they see the same CPU placement and noise): ref_tcp_streams, "
    "a length-prefixed msgpack echo over asyncio streams on the same kind of loop; "
    "ref_tcp_raw, a 1-byte echo over blocking sockets (a thread of that process). "
    "*_vs_streams: tcp_process time / ref_tcp_streams time in the same child (robust "
    "to the machine's regime changes).",
    metrics={
        "inproc_same_loop_rpc": "us",
        "inproc_same_loop_comm": "us",
        "inproc_thread_rpc": "us",
        "inproc_thread_comm": "us",
        "tcp_process_rpc": "us",
        "tcp_process_comm": "us",
        "ref_tcp_streams": "us",
        "ref_tcp_raw": "us",
        "tcp_process_rpc_vs_streams": "x ref",
        "tcp_process_comm_vs_streams": "x ref",
    },
    params={"n": 5000, "warmup": 500, "batches": 5, "loop": "auto", "cpus": ""},
    quick={"n": 200, "warmup": 20, "batches": 2},
    timeout=300,
)


def _echo(comm: Any, x: Any = None) -> Any:
    return x


async def _ref_streams_handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    import msgpack

    writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        try:
            (n,) = _U64.unpack(await reader.readexactly(8))
            msg = msgpack.unpackb(await reader.readexactly(n))
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            return
        out = msgpack.packb({"status": "OK", "result": msg["x"]})
        writer.write(_U64.pack(len(out)) + out)


def _raw_echo(listener: socket.socket) -> None:
    while True:
        try:
            sock, _ = listener.accept()
        except OSError:
            return
        with sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while data := sock.recv(1):
                sock.sendall(data)


async def _echo_servers(conn: Any) -> None:
    from shoal.rpc import Server

    server = Server({"echo": _echo})
    await server.listen("tcp://127.0.0.1:0")
    streams = await asyncio.start_server(_ref_streams_handle, "127.0.0.1", 0)
    raw = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_raw_echo, args=(raw,), daemon=True).start()
    conn.send({"shoal": server.address, "streams": streams.sockets[0].getsockname(), "raw": raw.getsockname()})
    try:
        await async_wait_for_stop(conn)
    finally:
        raw.close()
        streams.close()
        await server.close()


def _echo_server_process(conn: Any, loop: str) -> None:
    """Helper process: a shoal echo Server on tcp, plus the reference echo servers."""
    try:
        run(_echo_servers(conn), loop)
    except BaseException as exc:
        conn.send(exc)
        raise


async def _interleaved_us(calls: dict[str, Any], n: int, warmup: int, batches: int) -> dict[str, float]:
    """Median microseconds per call of each ``calls[name]`` (returns an awaitable, or
    is marked with :func:`_sync`), over ``n`` calls each, in ``batches`` interleaved
    rounds (so every variant sees the same stretches of machine noise)."""
    clock = time.perf_counter_ns
    samples: dict[str, list[int]] = {name: [] for name in calls}
    per_batch = max(n // batches, 1)
    for name, call in calls.items():
        for _ in range(warmup):
            r = call()
            if r is not None:
                await r
    for _ in range(batches):
        for name, call in calls.items():
            out = samples[name]
            if getattr(call, "sync", False):
                for _ in range(per_batch):
                    t0 = clock()
                    call()
                    out.append(clock() - t0)
            else:
                for _ in range(per_batch):
                    t0 = clock()
                    await call()
                    out.append(clock() - t0)
    return {name: median(v) / 1000 for name, v in samples.items()}


def _sync(fn: Any) -> Any:
    fn.sync = True
    return fn


async def _shoal_calls(address: str, prefix: str, stack: Any) -> dict[str, Any]:
    """``{prefix_rpc: call, prefix_comm: call}`` for an echo server at ``address``."""
    from shoal.comm import connect
    from shoal.rpc import rpc, send_recv

    r = rpc(address)
    stack.push_async_callback(r.close)
    comm = await connect(address)
    stack.push_async_callback(comm.close)
    assert await r.echo(x=1) == 1
    assert await send_recv(comm, "echo", x=1) == 1
    return {f"{prefix}_rpc": lambda: r.echo(x=1), f"{prefix}_comm": lambda: send_recv(comm, "echo", x=1)}


async def _ref_calls(value: dict[str, Any], stack: Any) -> dict[str, Any]:
    import msgpack

    reader, writer = await asyncio.open_connection(*value["streams"])
    writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    stack.callback(writer.close)

    async def streams() -> None:
        out = msgpack.packb({"op": "echo", "reply": True, "x": 1})
        writer.write(_U64.pack(len(out)) + out)
        (size,) = _U64.unpack(await reader.readexactly(8))
        msgpack.unpackb(await reader.readexactly(size))

    sock = socket.create_connection(tuple(value["raw"]))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    stack.callback(sock.close)

    @_sync
    def raw() -> None:
        sock.sendall(b"x")
        sock.recv(1)

    return {"ref_tcp_streams": streams, "ref_tcp_raw": raw}


@rpc_latency.system("shoal")
def _(n: int, warmup: int, batches: int, loop: str, cpus: str) -> dict[str, Any]:
    from contextlib import AsyncExitStack

    from shoal.rpc import Server

    mine, helpers = placement(cpus)
    pin(mine)
    out: dict[str, Any] = {"loop": loop_name(loop), "cpus": cpus or "unpinned"}

    async def same_loop() -> None:
        server = Server({"echo": _echo})
        await server.listen("inproc://")
        try:
            async with AsyncExitStack() as stack:
                calls = await _shoal_calls(server.address, "inproc_same_loop", stack)
                out.update(await _interleaved_us(calls, n, warmup, batches))
        finally:
            await server.close()

    async def other_thread() -> None:
        thread = LoopThread(loop, name="bench-server-loop")
        server = Server({"echo": _echo})
        try:
            await thread.acall(server.listen("inproc://"))
            async with AsyncExitStack() as stack:
                calls = await _shoal_calls(server.address, "inproc_thread", stack)
                out.update(await _interleaved_us(calls, n, warmup, batches))
        finally:
            await thread.acall(server.close())
            thread.stop()

    async def tcp_process(value: dict[str, Any]) -> None:
        async with AsyncExitStack() as stack:
            calls = await _shoal_calls(value["shoal"], "tcp_process", stack)
            calls.update(await _ref_calls(value, stack))
            out.update(await _interleaved_us(calls, n, warmup, batches))

    run(same_loop(), loop)
    run(other_thread(), loop)
    with start_helper(_echo_server_process, loop, cpus=helpers) as helper:
        run(tcp_process(helper.value), loop)
    out["tcp_process_rpc_vs_streams"] = out["tcp_process_rpc"] / out["ref_tcp_streams"]
    out["tcp_process_comm_vs_streams"] = out["tcp_process_comm"] / out["ref_tcp_streams"]
    return out


# ------------------------------------------------------------------------- tcp_bandwidth

tcp_bandwidth = Workload(
    "tcp_bandwidth",
    "A float64 numpy array of `mb` MB from a sender process to this one on 127.0.0.1, "
    "GB/s at the receiver from request sent to array in hand. shoal: the sender writes "
    '{"x": to_serialize(arr)} on a shoal tcp comm whose bytes cross the socket (the '
    "shared-memory data plane is refused at the handshake, SHOAL_SHM=0 in the receiver); "
    "shoal_same_host: the same on a comm with shoal's default same-host path (values "
    "through /dev/shm when the handshake finds a shared domain; the destination used is "
    "reported). plain_fresh: socket.sendall / recv_into a new np.empty buffer. "
    "plain_warm: recv_into a preallocated, touched, reused buffer (upper bound). Each "
    "child runs `iters` interleaved rounds (order rotated) and reports medians; ratios "
    "are taken per round. The receiver first touches and frees `prefault_mb` MB (a VM's "
    "first touch of memory is slow on the host side). shoal carries the session's tags "
    "(the cluster's secret: every message is authenticated, a large frame hashed in pieces "
    "off the loop); shoal_untagged is the same to a listener without a secret, and "
    "without checksums: what the tags cost is shoal_tags_cost. shoal_checksums is that "
    "listener with xxh3 checksums (what --no-auth tcp carries): their cost is "
    "shoal_checksums_cost.",
    metrics={
        "shoal": "GB/s",
        "plain_fresh": "GB/s",
        "plain_warm": "GB/s",
        "shoal_vs_plain_fresh": "x",
        "shoal_vs_plain_warm": "x",
        "shoal_same_host": "GB/s",
        "shoal_untagged": "GB/s",
        "shoal_tags_cost": "x",
        "shoal_checksums": "GB/s",
        "shoal_checksums_cost": "x",
    },
    params={"mb": 512, "iters": 3, "loop": "auto", "prefault_mb": 1536, "cpus": "", "same_host": True},
    quick={"mb": 8, "iters": 1, "prefault_mb": 0},
    timeout=600,
)


def _sender_array(nbytes: int) -> Any:
    import numpy as np

    return np.arange(nbytes // 8, dtype=np.float64)  # touched, and checkable


def _plain_sender(listener: socket.socket, arr: Any) -> None:
    view = memoryview(arr).cast("B")
    while True:
        try:
            sock, _ = listener.accept()
        except OSError:
            return
        with sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while sock.recv(1):  # one byte per request; b"" when the receiver closes
                sock.sendall(view)


async def _shoal_sender(conn: Any, arr: Any, plain_address: Any) -> None:
    from shoal.comm import listen
    from shoal.protocol import to_serialize

    async def handler(comm: Any) -> None:
        while True:
            try:
                request = await comm.read()
            except Exception:
                return
            # "warm-up": a 2 MB slice, to start both ends' serialization threads
            value = arr[: 1 << 18] if request.get("op") == "warm-up" else arr
            await comm.write({"x": to_serialize(value)})

    from shoal.comm.security import Security

    listener = await listen("tcp://127.0.0.1:0", handler)
    # no secret: no session tags (and the receiver offers no checksums)
    untagged = await listen("tcp://127.0.0.1:0", handler, security=Security.disabled())
    conn.send({"shoal": listener.contact_address, "untagged": untagged.contact_address, "plain": plain_address})
    try:
        await async_wait_for_stop(conn)
    finally:
        listener.stop()
        untagged.stop()


def _bandwidth_sender_process(conn: Any, nbytes: int, loop: str) -> None:
    """Helper process: serves the array over shoal tcp and over a plain socket."""
    try:
        arr = _sender_array(nbytes)
        plain = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=_plain_sender, args=(plain, arr), daemon=True).start()
        run(_shoal_sender(conn, arr, plain.getsockname()), loop)
        plain.close()
    except BaseException as exc:
        conn.send(exc)
        raise


def _recv_exactly(sock: socket.socket, buf: Any) -> None:
    view = memoryview(buf).cast("B")
    pos, n = 0, view.nbytes
    while pos < n:
        got = sock.recv_into(view[pos:])
        if not got:
            raise ConnectionError("sender closed early")
        pos += got


def _check(arr: Any, nbytes: int) -> None:
    import numpy as np

    n = nbytes // 8
    if not isinstance(arr, np.ndarray) or arr.dtype != np.float64 or arr.shape != (n,):
        raise AssertionError(f"received {type(arr).__name__} {getattr(arr, 'shape', '')}, expected float64 ({n},)")
    idx = np.linspace(0, n - 1, 4097).astype(np.int64)
    if not np.array_equal(arr[idx], idx.astype(np.float64)):
        raise AssertionError("received array differs from the one sent")


@tcp_bandwidth.system("shoal")
def _(mb: int, iters: int, loop: str, prefault_mb: int, cpus: str, same_host: bool) -> dict[str, Any]:
    import os

    import numpy as np

    mine, helpers = placement(cpus)
    pin(mine)

    from shoal.comm import connect

    nbytes = mb << 20
    gb = nbytes / 1e9
    out: dict[str, Any] = {}
    variants = ["shoal", "shoal_untagged", "shoal_checksums", "plain_fresh", "plain_warm"]
    variants += ["shoal_same_host"] if same_host else []
    results: dict[str, list[float]] = {name: [] for name in variants}
    if prefault_mb:
        # In a VM the first touch of guest memory also faults on the host, several
        # times slower than the guest's own page faults; touch (and free) some memory
        # first so that "fresh" buffers measure the guest's cost, as on bare metal.
        np.ones((prefault_mb << 20) // 8, dtype=np.float64)
    warm = np.ones(nbytes // 8, dtype=np.float64)  # touched once, reused

    with start_helper(_bandwidth_sender_process, nbytes, loop, cpus=helpers) as helper:
        plain = socket.create_connection(tuple(helper.value["plain"]))
        plain.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        async def shoal_rounds(comm: Any) -> float:
            t0 = time.perf_counter()
            await comm.write({"op": "send"})
            msg = await comm.read()
            arr = msg["x"]
            dt = time.perf_counter() - t0
            _check(arr, nbytes)
            return dt

        def plain_round(buf: Any) -> float:
            t0 = time.perf_counter()
            if buf is None:
                plain.sendall(b"!")
                buf = np.empty(nbytes // 8, dtype=np.float64)
            else:
                plain.sendall(b"!")
            _recv_exactly(plain, buf)
            dt = time.perf_counter() - t0
            _check(buf, nbytes)
            return dt

        async def connect_tcp_only(address: str, **kwargs: Any) -> Any:
            # refuse the shared-memory data plane at the handshake: bytes cross the socket
            old = os.environ.get("SHOAL_SHM")
            os.environ["SHOAL_SHM"] = "0"
            try:
                return await connect(address, **kwargs)
            finally:
                if old is None:
                    del os.environ["SHOAL_SHM"]
                else:
                    os.environ["SHOAL_SHM"] = old

        async def connect_untagged(checksums: int = 0) -> Any:
            from shoal import config
            from shoal.comm.security import Security

            with config.set(wire_checksums=checksums):
                return await connect_tcp_only(helper.value["untagged"], security=Security.disabled())

        async def main() -> None:
            comms = {"shoal": await connect_tcp_only(helper.value["shoal"]), "shoal_untagged": await connect_untagged(),
                     "shoal_checksums": await connect_untagged(checksums=1)}
            if same_host:
                comms["shoal_same_host"] = await connect(helper.value["shoal"])
                out["same_host_destination"] = comms["shoal_same_host"].destination
            out["shoal_destination"] = comms["shoal"].destination
            try:
                for comm in comms.values():
                    for _ in range(2):  # untimed: thread pools, first-use imports
                        await comm.write({"op": "warm-up"})
                        await comm.read()
                for i in range(iters):
                    k = i % len(variants)
                    for name in variants[k:] + variants[:k]:  # rotate: no variant always first
                        if name in comms:
                            dt = await shoal_rounds(comms[name])
                        else:
                            dt = plain_round(warm if name == "plain_warm" else None)
                        results[name].append(gb / dt)
            finally:
                for comm in comms.values():
                    await comm.close()

        try:
            run(main(), loop)
        finally:
            plain.close()

    out.update({k: median(v) for k, v in results.items()})
    out["shoal_vs_plain_fresh"] = median([s / p for s, p in zip(results["shoal"], results["plain_fresh"])])
    out["shoal_vs_plain_warm"] = median([s / p for s, p in zip(results["shoal"], results["plain_warm"])])
    out["shoal_tags_cost"] = median([u / s for s, u in zip(results["shoal"], results["shoal_untagged"])])
    out["shoal_checksums_cost"] = median([u / c for c, u in zip(results["shoal_checksums"], results["shoal_untagged"])])
    out["loop"] = loop_name(loop)
    out["cpus"] = cpus or "unpinned"
    out["rounds"] = {k: [round(x, 3) for x in v] for k, v in results.items()}
    return out
