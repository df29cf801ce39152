"""Helpers shared by the test suites (not fixtures: plain functions and classes).

- :func:`assert_same`: deep equality that also checks exact types (a list is not a
  tuple, bytes are not a bytearray), dict key order, float signs and NaNs, numpy dtypes.
- :class:`LoopThread`: an asyncio event loop running in its own thread.
- :class:`LogWaiter`: wait (with a deadline) until a matching log record was emitted,
  from any thread.
- raw wire helpers speaking shoal's tcp framing over a blocking socket.
- ``shoal`` command-line processes: :func:`start_shoal`, :func:`start_scheduler`,
  :func:`start_worker`, :func:`stop_processes`.
- task functions the task-stream and dashboard tests submit: :func:`inc`, :func:`add`,
  :func:`total`, :func:`boom`, :func:`make`, :func:`array_sum`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import selectors
import socket
import struct
import subprocess
import sys
import time
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import msgpack

from shoal.comm import security, session
from shoal.protocol import PROTOCOL_VERSION

try:
    import numpy as np
except ImportError:  # pragma: no cover - numpy is a test dependency
    np = None


def assert_same(a: Any, b: Any, path: str = "msg") -> None:
    """Assert ``a`` and ``b`` are equal with exactly the same types, recursively."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if type(a) is dict:
        assert len(a) == len(b), f"{path}: {len(a)} keys != {len(b)} keys"
        for i, ((ka, va), (kb, vb)) in enumerate(zip(a.items(), b.items())):
            assert_same(ka, kb, f"{path}<key {i}>")
            assert_same(va, vb, f"{path}[{ka!r}]")
    elif type(a) in (list, tuple):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif type(a) is float:
        if math.isnan(a):
            assert math.isnan(b), f"{path}: nan != {b!r}"
        else:
            assert a == b and math.copysign(1, a) == math.copysign(1, b), f"{path}: {a!r} != {b!r}"
    elif type(a) is memoryview:
        assert (a.format, a.shape, a.itemsize) == (b.format, b.shape, b.itemsize), (
            f"{path}: memoryview {a.format} {a.shape} != {b.format} {b.shape}"
        )
        assert a.tobytes() == b.tobytes(), f"{path}: memoryview contents differ"
    elif np is not None and isinstance(a, np.ndarray):
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{path}: shape {a.shape} != {b.shape}"
        if a.dtype.kind == "O":
            assert_same(a.tolist(), b.tolist(), path)
        elif a.dtype.fields is None and a.dtype.kind in "fc":
            assert np.array_equal(a, b, equal_nan=True), f"{path}: arrays differ"
        else:
            assert a.tobytes() == b.tobytes(), f"{path}: arrays differ"
    else:
        assert a == b, f"{path}: {a!r:.200} != {b!r:.200}"


class LoopThread:
    """An event loop in a background thread; ``run(coro)`` runs a coroutine there.

    ``stop()`` (or leaving the ``with`` block) ends the loop the way ``asyncio.run``
    does: remaining tasks are cancelled, async generators and executors shut down.
    """

    def __init__(self, name: str = "test-loop") -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self._started = threading.Event()
        self._stop: asyncio.Future[None] | None = None
        self.thread = threading.Thread(target=asyncio.run, args=(self._main(),), name=name, daemon=True)

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._stop = self.loop.create_future()
        self._started.set()
        await self._stop

    def start(self) -> LoopThread:
        self.thread.start()
        if not self._started.wait(10):
            raise RuntimeError("loop thread did not start")
        return self

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 20.0) -> Any:
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def arun(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Await ``coro`` running on this thread's loop from another loop."""
        assert self.loop is not None
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def stop(self) -> None:
        if self.loop is not None and self.thread.is_alive():
            self.loop.call_soon_threadsafe(lambda: self._stop.done() or self._stop.set_result(None))  # type: ignore[union-attr]
        self.thread.join(10)
        assert not self.thread.is_alive(), "loop thread did not stop"

    def __enter__(self) -> LoopThread:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class LogWaiter(logging.Handler):
    """Collects records of the ``shoal`` loggers and lets a test wait for one."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self._cond = threading.Condition()

    def emit(self, record: logging.LogRecord) -> None:
        with self._cond:
            self.records.append(record)
            self._cond.notify_all()

    def wait_for(
        self, predicate: Callable[[logging.LogRecord], bool], timeout: float = 10.0
    ) -> logging.LogRecord:
        """The first record matching ``predicate``; fails after ``timeout`` seconds."""
        found: list[logging.LogRecord] = []

        def check() -> bool:
            found[:] = [r for r in self.records if predicate(r)]
            return bool(found)

        with self._cond:
            ok = self._cond.wait_for(check, timeout)
        assert ok, f"no matching log record within {timeout}s; got {[r.getMessage() for r in self.records]}"
        return found[0]


@contextlib.contextmanager
def log_waiter(name: str = "shoal") -> Iterator[LogWaiter]:
    """Attach a :class:`LogWaiter` to logger ``name`` (after pytest's caplog handler,
    so that a record seen here is already in ``caplog.records``)."""
    waiter = LogWaiter()
    logger = logging.getLogger(name)
    root = logging.getLogger()
    # on the root logger, after caplog's handler: when we are notified caplog has it
    target = root if name == "shoal" else logger
    target.addHandler(waiter)
    old_level = logger.level
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    try:
        yield waiter
    finally:
        target.removeHandler(waiter)
        logger.setLevel(old_level)


# ---------------------------------------------------------------- raw tcp wire helpers


def frame_bytes(frames: list[bytes]) -> bytes:
    """Frames in shoal's tcp framing: n, the n lengths, the frames (u64 little-endian)."""
    return struct.pack(f"<Q{len(frames)}Q", len(frames), *map(len, frames)) + b"".join(frames)


def message_bytes(msg: Any) -> bytes:
    """A plain msgpack message (no out-of-band values) in shoal's tcp framing."""
    return frame_bytes([msgpack.packb(msg, use_bin_type=True)])


def handshake_bytes(protocol: int = PROTOCOL_VERSION, nonce: bytes = b"n" * 32, auth: bool = True, **extra: Any) -> bytes:
    """Step 1 of the handshake (docs/protocol.md §3)."""
    return message_bytes({"op": "handshake", "protocol": protocol, "nonce": nonce, "auth": auth, **extra})


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise EOFError("peer closed")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def recv_frames(sock: socket.socket) -> list[bytes]:
    """The next message's frames; from a :class:`RawPeer` with a session, once its
    tag is checked."""
    head = recv_exactly(sock, 8)
    (n,) = struct.unpack("<Q", head)
    lengths = recv_exactly(sock, 8 * n)
    frames = [recv_exactly(sock, length) for length in struct.unpack(f"<{n}Q", lengths)]
    keys = getattr(sock, "session", None)
    if keys is not None:
        tag = recv_exactly(sock, session.TAG_BYTES)
        assert tag == _tag_of(keys.receive, head + lengths, frames), "a message whose session tag does not match"
    return frames


def _tag_of(mac: session.MessageMac, header: bytes, frames: list[bytes]) -> bytes:
    large = {i + 1: session.digest_now(f) for i, f in enumerate(frames) if len(f) >= session.LARGE}
    return mac.tag_buffers([header, *frames], large)


class RawPeer(socket.socket):
    """A blocking socket for speaking shoal's wire by hand. After
    :func:`complete_handshake` with a secret (``session`` set), what :meth:`sendall`
    sends gets the session's tag after each whole message it holds, whatever pieces
    the message is sent in; bytes that are no message (a count of 0, or absurd) go
    out as they are, and nothing after them is tagged."""

    session: session.SessionKeys | None = None
    _pending = b""
    _untagged = False

    def sendall(self, data: Any, flags: int = 0) -> None:  # type: ignore[override]
        keys = self.session
        if keys is None or self._untagged:
            return super().sendall(data, flags)
        out = bytearray(data)
        pending = self._pending + bytes(data)
        while True:
            end = _message_end(pending)
            if end is None:
                break
            if end < 0:
                self._untagged, pending = True, b""
                break
            n = struct.unpack_from("<Q", pending)[0]
            lengths = struct.unpack_from(f"<{n}Q", pending, 8)
            frames, pos = [], 8 + 8 * n
            for size in lengths:
                frames.append(pending[pos : pos + size])
                pos += size
            tag = _tag_of(keys.send, pending[: 8 + 8 * n], frames)
            pending = pending[end:]
            at = len(out) - len(pending)
            out[at:at] = tag
        self._pending = pending
        super().sendall(bytes(out), flags)


def _message_end(data: bytes) -> int | None:
    """Where the message at the start of ``data`` ends; None: not all there yet; -1:
    no message (a count of 0 or over 10,000)."""
    if len(data) < 8:
        return None
    (n,) = struct.unpack_from("<Q", data)
    if not 0 < n <= 10_000:
        return -1
    if len(data) < 8 + 8 * n:
        return None
    end = 8 + 8 * n + sum(struct.unpack_from(f"<{n}Q", data, 8))
    return end if len(data) >= end else None


def raw_socket(host: str, port: int, timeout: float = 10.0) -> RawPeer:
    """A :class:`RawPeer` connected to ``host:port``."""
    sock = RawPeer(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def one_frame_messages(data: bytes) -> list[Any]:
    """The plain msgpack messages of one frame each that ``data`` holds, back to back."""
    out = []
    while data:
        n, size = struct.unpack_from("<QQ", data)
        assert n == 1, f"a message of {n} frames"
        out.append(msgpack.unpackb(data[16 : 16 + size]))
        data = data[16 + size :]
    return out


def recv_until_closed(sock: socket.socket) -> bytes:
    """Read until the peer closes (EOF or reset); returns what was read."""
    data = []
    try:
        while True:
            chunk = sock.recv(1 << 16)
            if not chunk:
                break
            data.append(chunk)
    except ConnectionResetError:
        pass
    return b"".join(data)


def complete_handshake(sock: RawPeer, secret: bytes | None, **step2: Any) -> dict:
    """The handshake of a connecting end, by hand: step 1, the proof of ``secret``
    (None: no authentication), and the shared-memory answers (we offer no probe and say
    we cannot map the peer's); ``step2``: more fields of step 2 (``checksums=``).
    With a secret, the socket's session is set: later messages carry tags. Returns
    the peer's step-2 message."""
    assert isinstance(sock, RawPeer), "complete_handshake needs a RawPeer (raw_socket()): it keeps the session"
    nonce = os.urandom(32)
    mine = [handshake_bytes(nonce=nonce, auth=secret is not None)]
    sock.sendall(mine[0])
    (hello,) = recv_frames(sock)
    peer = msgpack.unpackb(hello)
    assert peer["op"] == "handshake", peer
    proof = None if secret is None else security.proof(secret, b"connector", nonce, peer["nonce"])
    mine.append(message_bytes({"op": "handshake-auth", "proof": proof, "pid": 1, "host": "elsewhere", **step2}))
    sock.sendall(mine[1])
    (info,) = recv_frames(sock)
    if secret is not None:
        start_session(sock, secret, [mine[0], mine[1]], [hello, info])
    info = msgpack.unpackb(info)
    assert info["op"] == "handshake-auth", info
    sock.sendall(message_bytes({"op": "handshake-shm", "can_map": False}))
    (answer,) = recv_frames(sock)
    assert msgpack.unpackb(answer)["op"] == "handshake-shm"
    return info


def start_session(sock: RawPeer, secret: bytes, sent: list[bytes], got: list[bytes]) -> None:
    """Give ``sock`` (the connecting end) the session of a handshake whose steps 1 and 2
    it ``sent`` (as messages in the framing, or their frame 0) and ``got`` (frame 0)."""
    sent = [m[16:] if m[:16] == struct.pack("<QQ", 1, len(m) - 16) else m for m in sent]
    first = (sent[0], got[0], sent[1], got[1])
    sock.session = session.session_keys(secret, b"".join(len(m).to_bytes(8, "little") + m for m in first), True)


def secret_of(address: str) -> bytes | None:
    """The secret this process would prove to ``address`` (its listener's own)."""
    found = security.for_address(address)
    return None if found is None else found.secret


def raw_connect(address: str, handshake: bool = True, timeout: float = 10.0) -> socket.socket:
    """A blocking socket to a ``tcp://host:port`` shoal endpoint, after (by default) a
    valid handshake in both directions."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    sock = raw_socket(host, int(port), timeout)
    try:
        if handshake:
            complete_handshake(sock, secret_of(address))
    except BaseException:
        sock.close()
        raise
    return sock


def free_port() -> int:
    """A tcp port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_shoal(procs: list[Any], *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``python -m shoal *args`` with its stdout and stderr piped (text), appended to
    ``procs`` (for :func:`stop_processes`); ``env`` is added to this environment."""
    p = subprocess.Popen([sys.executable, "-m", "shoal", *args], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=None if env is None else {**os.environ, **env})
    procs.append(p)
    return p


def start_scheduler(procs: list[Any], *args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """A ``shoal scheduler`` on a free port of 127.0.0.1 and its address, once it
    listens; ``env`` is added to this environment."""
    p = start_shoal(procs, "scheduler", "--host", "127.0.0.1", "--port", str(free_port()), *args, env=env)
    line = p.stdout.readline()
    assert line.startswith("shoal scheduler at tcp://"), (line, p.poll())
    return p, line.split()[-1]


def start_worker(procs: list[Any], address: str, *args: str,
                 env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """A ``shoal worker`` joining the scheduler at ``address`` and its own address, once
    it has registered."""
    p = start_shoal(procs, "worker", address, *args, env=env)
    line = p.stdout.readline()
    assert line.startswith("shoal worker at tcp://"), (line, p.poll())
    return p, line.split()[-1]


def stop_processes(procs: list[Any], auth_before: set[str] | None = None) -> None:
    """Terminate ``procs`` (subprocess.Popen), waiting up to 10 s each before killing,
    and close their pipes. With ``auth_before`` (the auth directory's names before they
    started): if one was killed with SIGKILL, remove the auth files they left, which a
    killed scheduler cannot do itself (a later one on the same port replaces it)."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        for stream in (p.stdin, p.stdout, p.stderr):
            if stream is not None:
                try:
                    stream.close()
                except BrokenPipeError:  # stdin: what was buffered for it cannot go any more
                    pass
    auth_dir = security.auth_dir()
    if auth_before is not None and any(p.returncode == -9 for p in procs) and os.path.isdir(auth_dir):
        for name in set(os.listdir(auth_dir)) - auth_before:
            os.unlink(os.path.join(auth_dir, name))


def auth_files() -> set[str]:
    """The names in this user's auth directory now."""
    auth_dir = security.auth_dir()
    return set(os.listdir(auth_dir)) if os.path.isdir(auth_dir) else set()


@contextlib.contextmanager
def small_tmpfs(size: str = "1m") -> Iterator[str]:
    """A tmpfs of ``size`` (``mount -o size=``) mounted on a new temporary directory,
    for tests of full disks and full shared memory; unmounted (lazily, so a process
    that still holds a file there cannot keep it) and removed afterwards. Needs root:
    skips the test otherwise."""
    import shutil
    import tempfile

    import pytest

    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a tmpfs")
    path = tempfile.mkdtemp(prefix="shoal-test-tmpfs-")
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], capture_output=True,
                              timeout=30)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs: {done.stderr.decode(errors='replace').strip()}")
        try:
            yield path
        finally:
            subprocess.run(["umount", "-l", path], capture_output=True, timeout=30)
    finally:
        os.rmdir(path)


# -- task functions of the task-stream and dashboard tests: a key's prefix is its
# function's name, which those tests look for. Defined here, not in a test module, so
# that worker processes (of LocalCluster(processes=True), whose path is this process's)
# import them by reference.


def inc(x: int) -> int:
    return x + 1


def add(x: int, y: int) -> int:
    return x + y


def total(*xs: int) -> int:
    return sum(xs)


def boom(x: Any) -> Any:
    raise ValueError(f"boom {x}: no such luck")


def make(n_bytes: int) -> Any:
    """An array of ``n_bytes`` (of ones)."""
    return np.ones(n_bytes // 8)


def array_sum(a: Any) -> float:
    return float(a.sum())


def read_line(proc: subprocess.Popen[bytes], deadline: float) -> str:
    """The first line child process ``proc`` prints on its stdout (a pipe), waiting no
    longer than ``deadline`` (``time.monotonic()``): its banner, e.g. its address."""
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
