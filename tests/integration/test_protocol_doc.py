"""A "foreign" worker written from docs/protocol.md alone joins a real shoal cluster.

The first half of this file is the worker. It uses only ``socket``, ``struct``,
``msgpack``, ``pickle`` and ``cloudpickle`` (nothing from shoal): framing (§2), the
handshake with both steps, declining shared memory (§3), message encoding with the out-of-band table and the ``pickle``,
``bytes`` and ``shoal.runspec`` families (§4), requests (§5), batched streams (§6), the
scheduler <-> worker ops (§7) and ``get-data`` both ways (§8). It runs in threads of the
test process, with blocking sockets and a deadline on every socket operation, on
loopback only.

The second half starts a scheduler (and, for peer transfers, one ordinary shoal worker)
with the command line, and a normal ``shoal.Client`` submits tasks to the foreign
worker: successes, a failure, dependencies fetched in both directions between the
foreign and the Python worker (including an input the Python worker put in shared
memory, which the foreign worker fetches with ``get-data`` instead), results with
out-of-band buffers, tuple keys, and ``free-keys`` / ``unregister`` / ``close``.
"""

from __future__ import annotations

import io
import os
import pickle
import selectors
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Iterator
from typing import Any, ClassVar

import cloudpickle
import msgpack
import numpy as np
import pytest

# =====================================================================================
# The foreign worker (docs/protocol.md only; no shoal imports in this part)
# =====================================================================================

PROTOCOL_VERSION = 2  # §3
MAX_FRAMES = 1 << 20  # §2.2
MAX_FRAME_BYTES = 1 << 36  # §2.2
EXT_TUPLE = 1  # §4.1
EXT_OOB = 2  # §4.1
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
    """One message's frames (§2.1); raises EOF at a clean end of the connection and
    Stopped if ``stop.is_set()`` while no message has started."""
    (n,) = struct.unpack("<Q", _recv_exact(sock, 8, deadline, stop, at_boundary=True))
    deadline = min(deadline, time.monotonic() + OP_TIMEOUT)
    if not 1 <= n <= MAX_FRAMES:
        raise WireError(f"message announces {n} frames")
    lengths = struct.unpack(f"<{n}Q", _recv_exact(sock, 8 * n, deadline, None))
    if max(lengths) > MAX_FRAME_BYTES:
        raise WireError(f"frame of {max(lengths)} bytes")
    return [_recv_exact(sock, size, deadline, None) if size else b"" for size in lengths]


def send_frames(sock: socket.socket, frames: list[Any], deadline: float) -> None:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("no time left to send")
    sock.settimeout(remaining)
    lengths = [memoryview(f).nbytes for f in frames]
    try:
        # one message's bytes, contiguous on the stream (one writer per socket)
        sock.sendall(struct.pack(f"<Q{len(frames)}Q", len(frames), *lengths))
        for f in frames:
            if lengths and memoryview(f).nbytes:
                sock.sendall(f)
    except OSError as exc:
        raise WireError(f"connection broke while sending: {exc}") from exc


# -- §4 messages ---------------------------------------------------------------------


class OOB:
    """An out-of-band value: a table entry (family, header, frames, opaque) (§4.2)."""

    __slots__ = ("family", "frames", "header", "opaque")

    def __init__(self, family: str, header: dict[str, Any], frames: list[Any], opaque: bool = True):
        self.family = family
        self.header = header
        self.frames = list(frames)
        self.opaque = opaque

    def __repr__(self) -> str:
        return f"<OOB {self.family} {len(self.frames)} frames>"


def encode(msg: Any) -> list[Any]:
    """A message to frames: header, then (if any out-of-band values) table and frames."""
    table: list[list[Any]] = []
    oob_frames: list[Any] = []

    def conv(obj: Any) -> Any:
        if isinstance(obj, OOB):
            table.append([obj.family, obj.header, len(obj.frames), obj.opaque])
            oob_frames.extend(obj.frames)
            return msgpack.ExtType(EXT_OOB, (len(table) - 1).to_bytes(4, "little"))
        if type(obj) is tuple:
            return msgpack.ExtType(EXT_TUPLE, msgpack.packb([conv(x) for x in obj], use_bin_type=True))
        if type(obj) is list:
            return [conv(x) for x in obj]
        if type(obj) is dict:
            return {conv(k): conv(v) for k, v in obj.items()}
        return obj  # str, bytes, int, float, bool, None

    header = msgpack.packb(conv(msg), use_bin_type=True)
    if not table:
        return [header]
    return [header, msgpack.packb(table, use_bin_type=True), *oob_frames]


def decode(frames: list[bytes]) -> Any:
    """Frames to a message; out-of-band values stay :class:`OOB` (decode them with
    :func:`value_of`)."""
    entries: list[OOB] = []
    if len(frames) > 1:

        def table_ext(code: int, data: bytes) -> Any:
            if code == EXT_TUPLE:
                return tuple(msgpack.unpackb(data, raw=False, ext_hook=table_ext))
            raise WireError(f"ext type {code} in the table")

        table = msgpack.unpackb(frames[1], raw=False, ext_hook=table_ext)
        pos = 2
        for family, header, n, opaque in table:
            if pos + n > len(frames):
                raise WireError("the table names more frames than were sent")
            entries.append(OOB(family, header if isinstance(header, dict) else {}, frames[pos:pos + n], bool(opaque)))
            pos += n
        if pos != len(frames):
            raise WireError("frames not named by the table")

    def ext_hook(code: int, data: bytes) -> Any:
        if code == EXT_TUPLE:
            return tuple(msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=ext_hook))
        if code == EXT_OOB:
            return entries[int.from_bytes(data, "little")]
        raise WireError(f"unknown ext type {code}")

    return msgpack.unpackb(frames[0], raw=False, strict_map_key=False, ext_hook=ext_hook)


# -- §4.5 families -------------------------------------------------------------------


class Ref:
    """Stands in for ``shoal.taskspec.Ref(key)``."""

    def __init__(self, key: Any):
        self.key = key


class NestedTask:
    """Stands in for ``shoal.taskspec.Task(key, func, args, kwargs)``."""

    def __init__(self, key: Any, func: Any, args: Any = (), kwargs: Any = None):
        self.key, self.func, self.args, self.kwargs = key, func, tuple(args), dict(kwargs or {})


class Wrapped:
    """Stands in for ``shoal.protocol.serialize.Serialize`` (slots state {"data": obj})."""

    def __setstate__(self, state: Any) -> None:
        slots = state[1] if isinstance(state, tuple) else state
        self.data = (slots or {}).get("data")


class WrappedSerialized:
    """Stands in for ``shoal.protocol.serialize.Serialized`` (slots state {"family",
    "header", "frames"}): a value in its family's form."""

    def __setstate__(self, state: Any) -> None:
        slots = state[1] if isinstance(state, tuple) else state
        self.entry = OOB(slots["family"], slots["header"], slots["frames"])


class _ArgsUnpickler(pickle.Unpickler):
    _STANDINS: ClassVar[dict[tuple[str, str], type]] = {
        ("shoal.taskspec", "Ref"): Ref,
        ("shoal.taskspec", "Task"): NestedTask,
        ("shoal.protocol.serialize", "Serialize"): Wrapped,
        ("shoal.protocol.serialize", "Serialized"): WrappedSerialized,
    }

    def find_class(self, module: str, name: str) -> Any:
        standin = self._STANDINS.get((module, name))
        return standin if standin is not None else super().find_class(module, name)


class RunSpec:
    def __init__(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]):
        self.func, self.args, self.kwargs = func, args, kwargs


_function_cache: dict[bytes, Any] = {}
#: what value_of decoded (the test checks that every family was exercised)
decoded: dict[str, int] = {}


def value_of(obj: Any) -> Any:
    """The value of an out-of-band entry (or an inline value, as it is)."""
    if not isinstance(obj, OOB):
        return obj
    frames = obj.frames
    decoded[obj.family] = decoded.get(obj.family, 0) + 1
    if obj.family == "shoal.runspec" and len(frames) > 2:
        decoded["runspec-buffers"] = decoded.get("runspec-buffers", 0) + 1
    if obj.family == "pickle":
        return pickle.loads(frames[0], buffers=frames[1:])
    if obj.family == "bytes":
        kind = obj.header["kind"]
        if kind == "bytes":
            return bytes(frames[0])
        if kind == "bytearray":
            return bytearray(frames[0])
        if kind == "memoryview":
            mv = memoryview(bytearray(frames[0])).cast("B")
            shape = obj.header["shape"]
            return mv.cast(obj.header["format"], shape) if len(shape) > 1 else mv.cast(obj.header["format"])
        if kind == "pickle":
            return pickle.loads(frames[0], buffers=frames[1:])
        raise WireError(f"unknown bytes kind {kind!r}")
    if obj.family == "shoal.runspec":
        key = bytes(frames[0])
        func = _function_cache.get(key)
        if func is None:
            func = _function_cache[key] = pickle.loads(key)
        args, kwargs = _ArgsUnpickler(io.BytesIO(frames[1]), buffers=frames[2:]).load()
        return RunSpec(func, args, kwargs)
    raise WireError(f"unknown family {obj.family!r}")


def pickled(value: Any) -> OOB:
    """``value`` as an opaque ``pickle`` family entry (protocol 5, buffers out of band)."""
    buffers: list[pickle.PickleBuffer] = []
    try:
        data = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    except Exception:  # noqa: BLE001 - what plain pickle cannot do, cloudpickle may
        buffers = []
        data = cloudpickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    return OOB("pickle", {}, [data, *(b.raw() for b in buffers)], True)


def substitute(obj: Any, values: dict[Any, Any]) -> Any:
    """§4.5 "Running a payload"."""
    typ = type(obj)
    if typ is Ref:
        return values[obj.key]
    if typ is NestedTask:
        return obj.func(*substitute(obj.args, values), **substitute(obj.kwargs, values))
    if typ is Wrapped:
        return obj.data
    if typ is WrappedSerialized:
        return value_of(obj.entry)
    if typ is list:
        return [substitute(v, values) for v in obj]
    if typ is tuple:
        return tuple(substitute(v, values) for v in obj)
    if typ is dict:
        return {k: substitute(v, values) for k, v in obj.items()}
    if typ in (set, frozenset):
        return typ(substitute(v, values) for v in obj)
    return obj


# -- connections: §3 handshake, §5 requests --------------------------------------------


def parse_address(address: str) -> tuple[str, int]:
    location = address.split("://", 1)[1] if "://" in address else address
    host, _, port = location.rpartition(":")
    return host.strip("[]"), int(port)


def handshake(sock: socket.socket, host_id: str, deadline: float, stop: Any = None) -> dict[str, Any]:
    """§3: both steps. We offer no shared-memory probe and cannot map the peer's, so
    every peer treats us as ``remote``."""
    send_frames(sock, encode({"op": "handshake", "protocol": PROTOCOL_VERSION, "pid": os.getpid(), "host": host_id}), deadline)
    info = decode(recv_frames(sock, deadline, stop))
    if not isinstance(info, dict) or info.get("op") != "handshake" or info.get("protocol") != PROTOCOL_VERSION:
        raise WireError(f"bad handshake {info!r:.100}")
    send_frames(sock, encode({"op": "handshake-shm", "can_map": False}), deadline)
    answer = decode(recv_frames(sock, deadline, stop))
    if not isinstance(answer, dict) or answer.get("op") != "handshake-shm":
        raise WireError(f"bad shared-memory answer {answer!r:.100}")
    return info


def connect(address: str, host_id: str, deadline: float) -> socket.socket:
    host, port = parse_address(address)
    assert host in ("127.0.0.1", "localhost", "::1"), f"loopback only, got {address}"
    sock = socket.create_connection((host, port), timeout=max(deadline - time.monotonic(), 0.001))
    try:
        handshake(sock, host_id, deadline)
    except BaseException:
        sock.close()
        raise
    return sock


def request(address: str, host_id: str, op: str, timeout: float = OP_TIMEOUT, **fields: Any) -> dict[str, Any]:
    """One request on a fresh connection; returns the response map (§5)."""
    deadline = time.monotonic() + timeout
    sock = connect(address, host_id, deadline)
    try:
        send_frames(sock, encode({"op": op, "reply": True, **fields}), deadline)
        response = decode(recv_frames(sock, deadline))
    finally:
        sock.close()
    if not isinstance(response, dict) or "status" not in response:
        raise WireError(f"malformed response {response!r:.100}")
    return response


# -- the worker ------------------------------------------------------------------------


class ForeignWorker:
    """One thread for the scheduler stream (tasks run there, one at a time:
    ``nthreads=1``), one accepting peers, one per peer connection."""

    def __init__(self, scheduler_address: str, name: str = "foreign", deadline: float = 120.0):
        self.scheduler_address = scheduler_address
        self.name = name
        self.host_id = f"foreign-{uuid.uuid4().hex}"  # not a Python process's host identity (§3)
        self.deadline = time.monotonic() + deadline
        self.data: dict[Any, Any] = {}
        self.errors: list[BaseException] = []
        self.ops_received: list[str] = []
        self.freed: set[Any] = set()
        self.shm_hints = 0
        self.cond = threading.Condition()
        self.closed_by_scheduler = threading.Event()
        self.stream_ended = threading.Event()
        self._stop = threading.Event()
        self._unregister = threading.Event()
        self._threads: list[threading.Thread] = []
        self._socks: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._stream: socket.socket | None = None
        self.address = ""

    # lifecycle (§10)

    def start(self) -> ForeignWorker:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._track(listener)
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        self._listener = listener
        self.address = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
        self._spawn(self._accept_loop, "foreign-accept")
        deadline = time.monotonic() + OP_TIMEOUT
        sock = connect(self.scheduler_address, self.host_id, deadline)
        self._track(sock)
        send_frames(sock, encode({
            "op": "register-worker", "address": self.address, "nthreads": 1,
            "host": self.host_id, "pid": os.getpid(), "name": self.name,
        }), deadline)
        reply = decode(recv_frames(sock, deadline))
        if not isinstance(reply, dict) or reply.get("status") != "OK":
            raise WireError(f"the scheduler refused: {reply!r:.200}")
        self._stream = sock
        self._send([{"op": "heartbeat"}])  # accepted and ignored (§7.3)
        self._spawn(self._stream_loop, "foreign-stream")
        return self

    def leave(self, timeout: float = 30.0) -> None:
        """Unregister (§7.3) and wait until the scheduler has closed the stream."""
        self._unregister.set()
        if not self.stream_ended.wait(timeout):
            raise TimeoutError("the scheduler did not close the stream after unregister")

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            socks = list(self._socks)
        for s in socks:
            try:
                s.close()
            except OSError:
                pass
        for t in self._threads:
            t.join(10)
        alive = [t.name for t in self._threads if t.is_alive()]
        assert not alive, f"threads still running: {alive}"

    def wait_freed(self, key: Any, timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: key in self.freed, timeout)

    # plumbing

    def _track(self, sock: socket.socket) -> None:
        with self._lock:
            self._socks.add(sock)

    def _untrack(self, sock: socket.socket) -> None:
        with self._lock:
            self._socks.discard(sock)
        sock.close()

    def _spawn(self, fn: Any, name: str, *args: Any) -> None:
        def run() -> None:
            try:
                fn(*args)
            except (Stopped, EOF):
                pass
            except BaseException as exc:  # noqa: BLE001 - recorded; the test asserts there are none
                if not self._stop.is_set():
                    self.errors.append(exc)

        t = threading.Thread(target=run, name=name, daemon=True)
        self._threads.append(t)
        t.start()

    def _send(self, msgs: list[dict[str, Any]]) -> None:
        assert self._stream is not None
        send_frames(self._stream, encode(msgs), time.monotonic() + OP_TIMEOUT)

    # the scheduler stream (§6, §7.2, §7.3)

    def _stream_loop(self) -> None:
        sock = self._stream
        assert sock is not None
        pending: list[dict[str, Any]] = []
        try:
            while True:
                if self._unregister.is_set():
                    self._send([{"op": "unregister"}])
                    self._unregister.clear()
                try:
                    batch = decode(recv_frames(sock, self.deadline, self._stop_or_unregister()))
                except Stopped:
                    if self._stop.is_set():
                        raise
                    continue  # unregister was asked for: send it at the top of the loop
                for msg in batch if isinstance(batch, list) else [batch]:
                    if not isinstance(msg, dict):
                        continue
                    op = msg.get("op")
                    self.ops_received.append(str(op))
                    if op == "compute-task":
                        if msg.get("shm"):
                            self.shm_hints += 1  # ignored: dependencies come by get-data
                        pending.append(msg)
                    elif op == "free-keys":
                        keys = list(msg.get("keys") or ())
                        pending = [m for m in pending if m["key"] not in keys]
                        with self._lock:
                            for k in keys:
                                self.data.pop(k, None)
                        with self.cond:
                            self.freed.update(keys)
                            self.cond.notify_all()
                    elif op == "close":
                        self.closed_by_scheduler.set()
                        return
                    # unknown ops are ignored (§6)
                pending.sort(key=lambda m: list(m.get("priority") or [0]))
                while pending:
                    self._send(self._compute(pending.pop(0)))
        except EOF:
            pass
        finally:
            self.stream_ended.set()
            self._untrack(sock)

    def _stop_or_unregister(self) -> _AnyEvent:
        # a read between messages wakes up both to stop and to send unregister
        return _AnyEvent(self._stop, self._unregister)

    def _compute(self, msg: dict[str, Any]) -> list[dict[str, Any]]:
        key = msg["key"]
        if key in self.data:
            return [{"op": "task-finished", "key": key, "nbytes": sys.getsizeof(self.data[key])}]
        deps: dict[Any, Any] = {}
        out: list[dict[str, Any]] = []
        for dep, holders in (msg.get("who_has") or {}).items():
            if dep in self.data:
                deps[dep] = self.data[dep]
                continue
            for holder in [h for h in holders if h != self.address]:
                try:
                    response = request(holder, self.host_id, "get-data", keys=[dep])
                except (WireError, EOF, OSError):  # OSError covers timeouts and refusals
                    response = {}
                if response.get("status") == "OK" and dep in response["result"]["data"]:
                    deps[dep] = value_of(response["result"]["data"][dep])
                    break
                out.append({"op": "missing-data", "key": dep, "errant_worker": holder})
            else:
                if self.address in holders:
                    out.append({"op": "missing-data", "key": dep, "errant_worker": self.address})
                return [*out, {"op": "reschedule", "key": key}]
        start = time.perf_counter()
        try:
            spec = value_of(msg["payload"])
            value = spec.func(*substitute(spec.args, deps), **substitute(spec.kwargs, deps))
        except Exception as exc:  # noqa: BLE001 - the task's error, whatever it is
            try:
                exception: Any = pickled(exc)
            except Exception:  # noqa: BLE001 - unpicklable: nil, the text still tells
                exception = None
            return [*out, {
                "op": "task-erred", "key": key, "exception": exception,
                "traceback": "".join(traceback.format_exception(exc)),
                "text": f"{type(exc).__name__}: {exc}",
            }]
        with self._lock:
            self.data[key] = value
        return [*out, {"op": "task-finished", "key": key, "nbytes": sys.getsizeof(value),
                       "duration": time.perf_counter() - start}]

    # peers and clients (§8)

    def _accept_loop(self) -> None:
        listener = self._listener
        assert listener is not None
        listener.settimeout(POLL)
        while not self._stop.is_set():
            try:
                conn, peer = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                raise
            assert peer[0] == "127.0.0.1"
            self._track(conn)
            self._spawn(self._serve, "foreign-peer", conn)

    def _serve(self, conn: socket.socket) -> None:
        try:
            handshake(conn, self.host_id, time.monotonic() + 10.0, self._stop)
            while True:
                msg = decode(recv_frames(conn, self.deadline, self._stop))
                if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
                    return  # not a request: close
                op = msg["op"]
                if op == "get-data":
                    with self._lock:
                        held = {k: self.data[k] for k in msg.get("keys") or () if k in self.data}
                    data = {k: pickled(v) for k, v in held.items()}
                    response: dict[str, Any] = {"status": "OK", "result": {"data": data}}
                elif op == "identity":
                    response = {"status": "OK", "result": {"address": self.address, "nthreads": 1,
                                                           "name": self.name, "pid": os.getpid(),
                                                           "host": self.host_id}}
                else:
                    response = {"status": "error", "type": "builtins.ValueError",
                                "message": f"foreign worker has no handler for op {op!r}",
                                "traceback": "", "exception": None}
                if msg.get("reply", True):
                    send_frames(conn, encode(response), time.monotonic() + OP_TIMEOUT)
        finally:
            self._untrack(conn)


class _AnyEvent:
    """``is_set()`` when any of the events is set."""

    def __init__(self, *events: threading.Event):
        self.events = events

    def is_set(self) -> bool:
        return any(e.is_set() for e in self.events)


# =====================================================================================
# The test: a real scheduler, a Python worker, a shoal.Client
# =====================================================================================

import shoal  # (only here: the worker above must not use it)


class _Procs:
    def __init__(self, tmp_path: Any):
        self.tmp_path = tmp_path
        self.procs: list[tuple[subprocess.Popen[bytes], Any]] = []

    def start(self, *args: str, banner: str, timeout: float = 60.0) -> tuple[subprocess.Popen[bytes], str]:
        """``python -m shoal ARGS``; returns the process and the address it prints."""
        log = open(self.tmp_path / f"{args[0]}-{len(self.procs)}.log", "wb")  # noqa: SIM115 - closed in close()
        proc = subprocess.Popen([sys.executable, "-m", "shoal", *args], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=log)
        self.procs.append((proc, log))
        line = _read_line(proc, time.monotonic() + timeout)
        assert line.startswith(banner), f"{args[0]} printed {line!r}; log: {self.log_of(proc)}"
        return proc, line.split()[-1]

    def log_of(self, proc: subprocess.Popen[bytes]) -> str:
        for p, log in self.procs:
            if p is proc:
                log.flush()
                with open(log.name, errors="replace") as f:
                    return f.read()[-4000:]
        return ""

    def close(self) -> None:
        for proc, _ in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc, log in self.procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
            log.close()


def _read_line(proc: subprocess.Popen[bytes], deadline: float) -> str:
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    buf = b""
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while b"\n" not in buf:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no line from {proc.args} (got {buf!r})")
            if not sel.select(remaining):
                continue
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"{proc.args} exited with {proc.wait()} before printing its address")
            buf += chunk
    return buf.split(b"\n", 1)[0].decode()


@pytest.fixture
def procs(tmp_path: Any) -> Iterator[_Procs]:
    p = _Procs(tmp_path)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def workers() -> Iterator[list[ForeignWorker]]:
    started: list[ForeignWorker] = []
    try:
        yield started
    finally:
        for w in started:
            w.stop()


def _scheduler(procs: _Procs) -> tuple[subprocess.Popen[bytes], str]:
    proc, address = procs.start("scheduler", "--host", "127.0.0.1", "--port", "0", banner="shoal scheduler at ")
    assert address.startswith("tcp://127.0.0.1:")
    return proc, address


@pytest.mark.timeout(180)
def test_foreign_worker_runs_tasks_and_serves_data(procs: _Procs, workers: list[ForeignWorker]) -> None:
    _, address = _scheduler(procs)
    py_proc, py_address = procs.start("worker", address, "--name", "python", "--host", "127.0.0.1",
                                      banner="shoal worker at ")
    fw = ForeignWorker(address, name="foreign")
    workers.append(fw)  # stopped by the fixture even if start() fails
    fw.start()
    here = [fw.address]
    there = [py_address]

    with shoal.Client(address, timeout=30) as c:
        info = c.scheduler_info()
        assert info["workers"][fw.address]["name"] == "foreign"
        assert info["workers"][fw.address]["nthreads"] == 1
        assert py_address in info["workers"]

        # a task, its value fetched by the client from the foreign worker (get-data)
        f1 = c.submit(lambda x: x + 1, 41, workers=here)
        assert f1.result(timeout=30) == 42
        assert c.who_has([f1]) == {f1.key: [fw.address]}

        # a tuple key, keyword arguments and an argument whose pickle has an out-of-band
        # buffer (a numpy array: frames[2:] of the runspec entry)
        arr = np.arange(50_000, dtype="int64")
        f2 = c.submit(lambda x, *, scale: (int(x.sum()), scale), arr, scale=3,
                      key=("foreign", 2), workers=here)
        assert f2.result(timeout=30) == (int(arr.sum()), 3)

        # an argument wrapped with to_serialize travels pickled inside the payload
        assert c.submit(lambda x: x * 2, shoal.to_serialize(21), workers=here).result(timeout=30) == 42

        # a value with out-of-band pickle buffers on the way back
        f3 = c.submit(lambda n: np.full(n, 7, dtype="float64"), 300_000, workers=here)
        out = f3.result(timeout=30)
        assert out.dtype == np.float64 and out.shape == (300_000,) and (out == 7).all()

        # a failing task: the same exception type, with the worker's traceback
        def fail(x: int) -> None:
            raise ValueError(f"boom {x} from the foreign worker")

        bad = c.submit(fail, 7, workers=here)
        with pytest.raises(ValueError, match="boom 7 from the foreign worker") as excinfo:
            bad.result(timeout=30)
        notes = "".join(getattr(excinfo.value, "__notes__", []))
        assert "traceback on the worker" in notes and "fail" in notes
        # a dependent of a failed task fails with the same error
        with pytest.raises(ValueError, match="boom 7"):
            c.submit(lambda v: v, bad, workers=here).result(timeout=30)

        # dependencies across workers: Python -> foreign (bytes and pickle families),
        # foreign -> foreign (local), foreign -> Python (the Python worker's get-data)
        a = c.submit(lambda: b"abc" * 1000, workers=there)
        d = c.submit(lambda: {"k": [1, 2]}, workers=there)
        b = c.submit(lambda v: len(v), a, workers=here)
        e = c.submit(lambda n, m, nested: (n, m["k"], nested), b, d, [b, {"again": d}], workers=here)
        g = c.submit(lambda t: t[0] * 2, e, workers=there)
        assert g.result(timeout=30) == 6000
        assert e.result(timeout=30) == (3000, [1, 2], [3000, {"again": {"k": [1, 2]}}])

        # a large input that the Python worker placed in shared memory: compute-task says
        # where ("shm"); the foreign worker ignores that and fetches it with get-data
        big = c.submit(lambda: np.arange(200_000, dtype="int64"), workers=there)
        total = c.submit(lambda x: int(x.sum()), big, workers=here)
        assert total.result(timeout=30) == int(np.arange(200_000, dtype="int64").sum())
        if os.path.isdir("/dev/shm") and os.environ.get("SHOAL_SHM", "1") != "0":
            assert fw.shm_hints >= 1

        # many tasks at once (more than nthreads: the worker queues them)
        squares = c.map(lambda i: i * i, range(30), workers=here)
        assert c.gather(squares) == [i * i for i in range(30)]

        # an op the foreign worker does not serve: an error response, not a hang
        with pytest.raises(shoal.RemoteError, match="no handler for op 'run'"):
            c.run(os.getpid, workers=here)

        # free-keys once the client lets go
        key = f1.key
        f1.release()
        assert fw.wait_freed(key, timeout=30), fw.ops_received[-20:]
        assert key not in fw.data

    # the client closed: everything it held is freed on the foreign worker
    assert fw.wait_freed(f2.key, timeout=30)
    assert fw.wait_freed(e.key, timeout=30)

    # every family of §4.5 was decoded, and a payload carried out-of-band buffers
    assert {"pickle", "bytes", "shoal.runspec", "runspec-buffers"} <= decoded.keys(), decoded

    # a clean leave: unregister, the scheduler closes the stream and forgets the worker
    fw.leave()
    ident = request(address, "test", "identity")
    assert ident["status"] == "OK"
    assert fw.address not in ident["result"]["workers"]
    assert py_address in ident["result"]["workers"]
    assert {"compute-task", "free-keys"} <= set(fw.ops_received)
    assert not fw.errors, fw.errors
    assert py_proc.poll() is None


@pytest.mark.timeout(120)
def test_foreign_worker_is_closed_by_scheduler_shutdown(procs: _Procs, workers: list[ForeignWorker]) -> None:
    sched, address = _scheduler(procs)
    fw = ForeignWorker(address, name="foreign-2")
    workers.append(fw)
    fw.start()
    with shoal.Client(address, timeout=30) as c:
        assert c.submit(lambda: "hi", workers=[fw.address]).result(timeout=30) == "hi"
    sched.terminate()  # the scheduler shuts down: it sends close to every worker
    assert fw.closed_by_scheduler.wait(30), fw.ops_received
    assert fw.stream_ended.wait(30)
    assert sched.wait(30) == 0
    assert not fw.errors, fw.errors
