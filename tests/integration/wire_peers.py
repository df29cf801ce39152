"""Peers of a live cluster by hand, for the wire tests (test_fuzz_wire.py,
test_wire_findings.py): a ``shoal scheduler`` and a ``shoal worker`` as processes, raw
sockets that do the handshake with the cluster's secret, and messages packed by hand
(out-of-band tables, ext types, any value as a map key)."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgpack

from shoal.comm import security
from shoal.errors import ProtocolError
from shoal.protocol import loads
from shoal_helpers import auth_files, complete_handshake, frame_bytes, raw_socket, recv_frames, stop_processes

#: how long a peer may take to answer (or close) once a connection's input is sent
DEADLINE = 15.0


# ---------------------------------------------------------------- the cluster


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Cluster:
    scheduler: subprocess.Popen
    worker: subprocess.Popen
    address: str
    worker_address: str
    secret: bytes
    logs: str

    def alive(self) -> bool:
        return self.scheduler.poll() is None and self.worker.poll() is None

    def log_tail(self) -> str:
        out = []
        for name in ("scheduler", "worker"):
            with open(os.path.join(self.logs, f"{name}.log"), errors="replace") as f:
                out.append(f"--- {name} (last 3000 chars)\n{f.read()[-3000:]}")
        return "\n".join(out)


@contextlib.contextmanager
def start_cluster(logs: str, worker_env: dict[str, str] | None = None) -> Iterator[Cluster]:
    """``shoal scheduler`` and one ``shoal worker`` (2 threads) as processes; their logs
    go to files in ``logs``."""
    procs: list[subprocess.Popen] = []
    files = []
    before = auth_files()

    def start(name: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        # a pipe nobody reads would fill up with the errors the fuzzing makes them log
        err = open(os.path.join(logs, f"{name}.log"), "w")
        files.append(err)
        p = subprocess.Popen([sys.executable, "-m", "shoal", *args], stdout=subprocess.PIPE, stderr=err, text=True,
                             env=None if env is None else {**os.environ, **env})
        procs.append(p)
        return p

    try:
        sched = start("scheduler", "scheduler", "--host", "127.0.0.1", "--port", str(_free_port()))
        address = sched.stdout.readline().split()[-1]
        assert address.startswith("tcp://127.0.0.1:"), address
        worker = start("worker", "worker", address, "--no-nanny", "--nthreads", "2", env=worker_env)
        line = worker.stdout.readline()
        assert line.startswith("shoal worker at tcp://127.0.0.1:"), line
        secret = security.read_secret(security.auth_file_for(address))
        yield Cluster(sched, worker, address, line.split()[-1], secret, logs)
    finally:
        stop_processes(procs, before)
        for f in files:
            f.close()


# ---------------------------------------------------------------- raw connections


def _hostport(address: str) -> tuple[str, int]:
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    return host, int(port)


@contextlib.contextmanager
def raw(address: str, secret: bytes | None = None) -> Iterator[socket.socket]:
    """A blocking socket to ``address``; handshaken with ``secret`` unless it is None."""
    sock = raw_socket(*_hostport(address), DEADLINE)
    try:
        if secret is not None:
            complete_handshake(sock, secret)
        yield sock
    finally:
        sock.close()


def read_until_closed(sock: socket.socket) -> None:
    """Read and drop whatever comes until the peer closes; fails after DEADLINE."""
    deadline = time.monotonic() + DEADLINE
    while True:
        sock.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            if not sock.recv(1 << 16):
                return
        except (ConnectionResetError, BrokenPipeError):
            return
        except socket.timeout:
            raise AssertionError(f"the peer neither answered nor closed within {DEADLINE}s") from None


def _next_frames(sock: socket.socket, deadline: float, what: str) -> list[bytes] | None:
    """The next message's frames, or None when the peer closed; fails at ``deadline``."""
    sock.settimeout(max(deadline - time.monotonic(), 0.01))
    try:
        return recv_frames(sock)
    except (EOFError, ConnectionResetError, BrokenPipeError):
        return None
    except socket.timeout:
        raise AssertionError(f"{what} within {DEADLINE}s") from None


def read_messages_until(sock: socket.socket, found: Any) -> bool:
    """Read messages (decoded as a non-deserializing reader does) until ``found(msg)``
    (True) or the peer closes (False); fails after DEADLINE."""
    deadline = time.monotonic() + DEADLINE
    while (frames := _next_frames(sock, deadline, "the peer neither answered nor closed")) is not None:
        msg = loads(frames, deserialize=False)
        for m in msg if isinstance(msg, list) else [msg]:
            if found(m):
                return True
    return False


def read_response(sock: socket.socket) -> Any:
    """The next response on a request connection (out-of-band values not decoded: a
    response may carry pickles for requesters that deserialize), or None if closed."""
    deadline = time.monotonic() + DEADLINE
    while (frames := _next_frames(sock, deadline, "no response and no close")) is not None:
        try:
            msg = loads(frames, deserialize=False)
        except ProtocolError:
            return {"status": "?", "undecoded": True}  # e.g. a key that travels as a pickle
        if isinstance(msg, dict) and msg.get("op") == "shoal-lease-ack":
            continue
        return msg
    return None


def send(sock: socket.socket, data: bytes) -> bool:
    """Send; False when the peer has closed already (it may close on what came first)."""
    try:
        sock.sendall(data)
        return True
    except (BrokenPipeError, ConnectionResetError):
        return False


def register(sock: socket.socket, msg: Any) -> bool:
    """Send a registration; True when the stream was accepted."""
    if not send(sock, frame_bytes(encode(msg))):
        return False
    response = read_response(sock)
    return isinstance(response, dict) and response.get("status") == "OK"


# ---------------------------------------------------------------- messages by hand
#
# A message is built from plain values plus these, then packed by :func:`encode` into
# frames: dicts keep str keys; Map holds pairs, so that any value may be a key.


class Oob(NamedTuple):
    """An out-of-band value: one table entry and its frames."""

    family: Any
    header: Any
    frames: list[bytes]
    opaque: Any = True
    leases: list[Any] | None = None


class Ext(NamedTuple):
    """A msgpack extension value of any type code (-128 ... 127)."""

    code: int
    data: bytes


class Map(NamedTuple):
    items: list[tuple[Any, Any]]


class Dangling(NamedTuple):
    """An ext 2 reference to a table index that may not exist, of any data length."""

    index: int
    width: int


_PACKER = msgpack.Packer(use_bin_type=True)


def _ext(code: int, data: bytes) -> bytes:
    n = len(data)
    c = struct.pack("b", code)
    fixed = {1: b"\xd4", 2: b"\xd5", 4: b"\xd6", 8: b"\xd7", 16: b"\xd8"}
    if n in fixed:
        return fixed[n] + c + data
    if n < 1 << 8:
        return b"\xc7" + struct.pack("B", n) + c + data
    if n < 1 << 16:
        return b"\xc8" + struct.pack(">H", n) + c + data
    return b"\xc9" + struct.pack(">I", n) + c + data


def _pack(obj: Any, table: list[Oob]) -> bytes:
    typ = type(obj)
    if typ is dict:
        return _PACKER.pack_map_header(len(obj)) + b"".join(_pack(k, table) + _pack(v, table) for k, v in obj.items())
    if typ is Map:
        return _PACKER.pack_map_header(len(obj.items)) + b"".join(
            _pack(k, table) + _pack(v, table) for k, v in obj.items)
    if typ is list:
        return _PACKER.pack_array_header(len(obj)) + b"".join(_pack(v, table) for v in obj)
    if typ is tuple:
        return _ext(1, _PACKER.pack_array_header(len(obj)) + b"".join(_pack(v, table) for v in obj))
    if typ is Oob:
        table.append(obj)
        return _ext(2, (len(table) - 1).to_bytes(4, "little"))
    if typ is Dangling:
        return _ext(2, (obj.index % (1 << 8 * obj.width)).to_bytes(obj.width, "little"))
    if typ is Ext:
        return _ext(obj.code, obj.data)
    if typ is int and not -(1 << 63) <= obj < 1 << 64:
        return _pack(big_int(obj), table)  # out of band, as shoal's own senders do
    return msgpack.packb(obj, use_bin_type=True)


def big_int(n: int) -> Oob:
    """An int beyond msgpack's range, out of band as shoal's own senders put it."""
    return Oob("int", {"int": str(n)}, [], False)


def encode(msg: Any, unreferenced: tuple[Oob, ...] = ()) -> list[bytes]:
    """The frames of ``msg``: header, table (if any value is out of band), their frames.
    ``unreferenced`` entries go in the table without a reference in the header."""
    table: list[Oob] = []
    header = _pack(msg, table)
    table.extend(unreferenced)
    if not table:
        return [header]
    entries = [[e.family, e.header, len(e.frames), e.opaque] + ([e.leases] if e.leases is not None else [])
               for e in table]
    return [header, _pack(entries, []), *(f for e in table for f in e.frames)]


