"""A "foreign" worker written from docs/protocol.md alone joins a real shoal cluster.

The first half of this file is the worker. It uses only the standard library
(``socket``, ``struct``, ``mmap``, ``fcntl``, ``pickle``, ...), ``msgpack`` and
``cloudpickle`` (nothing from shoal): framing (§2), the handshake with both steps,
offering a shared-memory probe and checking the peer's (§3), message encoding with the
out-of-band table, its optional lease ids, and the ``pickle``, ``bytes``,
``shoal.runspec`` and ``shoal.same-host`` families (§4), leases and
``shoal-lease-ack`` (§4.8), requests (§5), batched streams (§6), the scheduler <->
worker ops with their optional fields (§7), ``get-data`` both ways and ``update-data``
(§8), and the shared-memory data plane (§4.7): mapping the segments named in
``compute-task`` and in ``shoal.same-host`` refs (a shared ``flock`` held while
mapped, the header's token checked), placing its own large results in segments with
the 64-byte header, reported in ``task-finished``, renaming them away when their keys
are freed and reusing them only under an exclusive ``flock``. It runs in threads of
the test process, with blocking sockets and a deadline on every socket operation, on
loopback only. The shared-memory parts can be turned off (``shm=False``): the worker
then declines shared memory in the handshake, as a worker without the data plane does.

The second half starts a scheduler (and, for peer transfers, one ordinary shoal worker)
with the command line, and a normal ``shoal.Client`` submits tasks to the foreign
worker: successes, a failure, dependencies fetched in both directions between the
foreign and the Python worker (by ``get-data``, and by mapping segments in both
directions), values scattered to the foreign worker and fetched from the Python worker
as transfer segments with leases (acknowledged), results with out-of-band buffers,
tuple keys, and ``free-keys`` / ``unregister`` / ``close``. A test without a cluster
checks the segment rules of §4.7 against shoal's own reader and owner, both ways.
"""

from __future__ import annotations

import fcntl
import io
import itertools
import mmap
import os
import pickle
import secrets
import selectors
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
import uuid
import weakref
from collections import Counter
from collections.abc import Iterator
from typing import Any, ClassVar, Self

import cloudpickle
import msgpack
import numpy as np
import pytest

# =====================================================================================
# The foreign worker (docs/protocol.md only; no shoal imports in this part)
# =====================================================================================

PROTOCOL_VERSION = 3  # §3
MAX_FRAMES = 1 << 20  # §2.2
MAX_FRAME_BYTES = 1 << 36  # §2.2
EXT_TUPLE = 1  # §4.1
EXT_OOB = 2  # §4.1
LEASE_ACK = "shoal-lease-ack"  # §4.8
SHM_DIR = "/dev/shm"  # §3, §4.7
SHM_PREFIX = "shoal-"  # §4.7: the names readers open
SHM_THRESHOLD = 1 << 16  # our choice (Python's default): results with this many buffer bytes go to a segment
POLL = 0.05  # how often a blocked read looks at its stop flag (a socket timeout, not a sleep)
OP_TIMEOUT = 30.0  # the deadline of one exchange (a handshake, a request, a message)


class WireError(Exception):
    """The peer broke the protocol (or the connection broke)."""


class Stopped(Exception):
    """The worker is stopping."""


class EOF(Exception):
    """The peer closed the connection between two messages."""


#: what this module did, by kind (the test checks that every path was exercised)
stats: Counter[str] = Counter()
_stats_lock = threading.Lock()


def count(what: str, n: int = 1) -> None:
    with _stats_lock:
        stats[what] += n


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
    """An out-of-band value: a table entry (family, header, frames, opaque, and the
    sender's lease ids, §4.2)."""

    __slots__ = ("family", "frames", "header", "lease_ids", "opaque")

    def __init__(self, family: str, header: dict[str, Any], frames: list[Any], opaque: bool = True,
                 lease_ids: list[int] | None = None):
        self.family = family
        self.header = header
        self.frames = list(frames)
        self.opaque = opaque
        self.lease_ids = list(lease_ids or ())

    def __repr__(self) -> str:
        return f"<OOB {self.family} {len(self.frames)} frames leases={self.lease_ids}>"


def encode(msg: Any) -> list[Any]:
    """A message to frames: header, then (if any out-of-band values) table and frames.
    We take no leases, so our entries have 4 elements."""
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
    :func:`value_of`, which also collects the lease ids to acknowledge)."""
    entries: list[OOB] = []
    if len(frames) > 1:

        def table_ext(code: int, data: bytes) -> Any:
            if code == EXT_TUPLE:
                return tuple(msgpack.unpackb(data, raw=False, ext_hook=table_ext))
            raise WireError(f"ext type {code} in the table")

        table = msgpack.unpackb(frames[1], raw=False, ext_hook=table_ext)
        if not isinstance(table, list):
            raise WireError("the table is not an array")
        pos = 2
        for entry in table:
            # [family, header, n_frames, opaque] or [..., lease_ids] (§4.2)
            if not isinstance(entry, list) or len(entry) not in (4, 5):
                raise WireError(f"malformed table entry {entry!r:.100}")
            family, header, n, opaque = entry[:4]
            lease_ids = entry[4] if len(entry) == 5 else []
            if not isinstance(family, str) or not isinstance(n, int) or n < 0 or not (
                isinstance(lease_ids, list) and all(type(i) is int for i in lease_ids)
            ):
                raise WireError(f"malformed table entry {entry!r:.100}")
            if pos + n > len(frames):
                raise WireError("the table names more frames than were sent")
            entries.append(OOB(family, header if isinstance(header, dict) else {}, frames[pos:pos + n],
                               bool(opaque), lease_ids))
            if lease_ids:
                count("lease-ids-received", len(lease_ids))
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


def is_lease_ack(msg: Any) -> bool:
    """§4.8: a control message, not a request, response or stream op."""
    return isinstance(msg, dict) and msg.get("op") == LEASE_ACK


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


# -- §4.7 shared memory ----------------------------------------------------------------

SEG_MAGIC = b"SHOALSEG"  # §4.7: a segment's header starts with it
SEG_HEADER = 64  # §4.7: the header's size; the pickle starts here


class SegmentGone(FileNotFoundError):
    """§4.7: the segment's name is gone, its owner is rewriting it, or it holds another
    token now; the value must be had another way."""


def shm_path(name: Any) -> str:
    if not isinstance(name, str) or not name.startswith(SHM_PREFIX) or "/" in name:
        raise WireError(f"not a segment name: {name!r:.100}")
    return os.path.join(SHM_DIR, name)


def segment_header(token: Any) -> bytes:
    """§4.7: b"SHOALSEG", the token in ASCII, zero bytes up to 64."""
    if not isinstance(token, str):
        raise WireError(f"not a segment token: {token!r:.100}")
    header = SEG_MAGIC + token.encode("ascii")
    if len(header) > SEG_HEADER:
        raise WireError(f"segment token too long: {token!r:.100}")
    return header.ljust(SEG_HEADER, b"\0")


def map_segment(name: str, size: int, token: str) -> memoryview:
    """§4.7 "Reading a segment": a private, copy-on-write mapping of the first ``size``
    bytes of a segment that holds generation ``token``. The shared flock taken on the
    way is held for as long as the mapping lives (its descriptor is closed when the
    mapping is collected), so that the owner cannot reuse the memory meanwhile."""
    expected = segment_header(token)
    try:
        fd = os.open(shm_path(name), os.O_RDONLY)  # 1. open
    except FileNotFoundError:
        raise SegmentGone(f"segment {name} is gone") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # 2. the shared lock, no waiting
        except BlockingIOError:
            raise SegmentGone(f"segment {name} is being rewritten by its owner") from None
        if os.pread(fd, SEG_HEADER, 0) != expected:  # 3. the header of this token
            raise SegmentGone(f"segment {name} no longer holds token {token}")
        if os.fstat(fd).st_size < size:  # 4. big enough, then map
            raise WireError(f"segment {name} is smaller than {size} bytes")
        m = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    weakref.finalize(m, os.close, fd)  # 5. the lock lives as long as the mapping
    return memoryview(m)


def attach(info: Any) -> Any:
    """The value a segment info (§4.7) describes."""
    name, size, pickle_len, spans, token = info
    view = map_segment(name, int(size), token)
    start = SEG_HEADER
    value = pickle.loads(view[start:start + int(pickle_len)],
                         buffers=[view[int(o):int(o) + int(n)] for o, n in spans])
    count("segments-mapped")
    return value


_names = itertools.count()


def _align(n: int) -> int:
    return (n + 63) // 64 * 64


def _segment_name(kind: str = "f") -> str:
    # shoal-<our pid>-...: what a scheduler on this host could sweep were we to die (§4.7)
    return f"{SHM_PREFIX}{os.getpid()}-{kind}{next(_names)}-{secrets.token_hex(4)}"


def _pwrite_all(fd: int, data: Any, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view.nbytes:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


class SegmentPool:
    """The segments one owner places (§4.7 "Owning a segment"): new ones, or released
    ones reused when nobody maps them any more."""

    def __init__(self, limit: int = 64 << 20):
        self.limit = limit
        #: (size, name) of released segments, renamed away and kept for reuse
        self.released: list[tuple[int, str]] = []
        self._lock = threading.Lock()

    def place(self, value: Any) -> list[Any] | None:
        """Put ``value`` in a segment if its pickle-5 buffers are large; returns the
        segment info (§4.7), or None."""
        buffers: list[pickle.PickleBuffer] = []
        try:
            data = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
        except Exception:  # noqa: BLE001 - not worth it: the value stays for get-data only
            return None
        raws = [b.raw() for b in buffers]
        if sum(r.nbytes for r in raws) < SHM_THRESHOLD:
            return None
        spans: list[list[int]] = []
        pos = _align(SEG_HEADER + len(data))  # the header, then the pickle, then the buffers
        for r in raws:
            spans.append([pos, r.nbytes])
            pos = _align(pos + r.nbytes)
        name, fd, size = self._writable(pos)
        token = secrets.token_hex(8)  # fresh for every value
        try:
            _pwrite_all(fd, segment_header(token) + data, 0)
            for (offset, _), r in zip(spans, raws):
                _pwrite_all(fd, r, offset)
        except BaseException:
            os.close(fd)
            remove_segment(name)
            raise
        os.close(fd)  # written: a reused segment's exclusive lock goes with it
        count("segments-placed")
        return [name, size, len(data), spans, token]

    def _writable(self, need: int) -> tuple[str, int, int]:
        """``(name, fd, size)``: a released segment of a fitting size that we could lock
        exclusively (nobody maps it), renamed to a new name; else a new file."""
        with self._lock:
            fitting = sorted(e for e in self.released if need <= e[0] <= 2 * need)
            for e in fitting:
                self.released.remove(e)
        found: tuple[str, int, int] | None = None
        for size, old in fitting:
            if found is not None:
                with self._lock:
                    self.released.append((size, old))
                continue
            try:
                fd = os.open(shm_path(old), os.O_RDWR)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)  # someone maps it: leave it alone, try again later
                count("segments-reuse-refused")
                with self._lock:
                    self.released.append((size, old))
                continue
            new = _segment_name()
            try:
                os.rename(shm_path(old), shm_path(new))  # under the exclusive lock
            except OSError:
                os.close(fd)
                remove_segment(old)
                continue
            count("segments-reused")
            found = (new, fd, size)
        if found is not None:
            return found
        name = _segment_name()
        fd = os.open(shm_path(name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, need)
        except BaseException:
            os.close(fd)
            remove_segment(name)
            raise
        return name, fd, need

    def release(self, info: list[Any]) -> None:
        """The key left our memory: its segment's name goes at once (§4.7); the memory
        is kept under a name no message carried, for reuse, or freed."""
        name, size = info[0], int(info[1])
        with self._lock:
            keep = sum(s for s, _ in self.released) + size <= self.limit
        if keep:
            pooled = _segment_name("fpool")
            try:
                os.rename(shm_path(name), shm_path(pooled))
            except FileNotFoundError:
                return
            with self._lock:
                self.released.append((size, pooled))
        else:
            remove_segment(name)

    def drain(self) -> None:
        """Unlink the released segments (shutdown)."""
        with self._lock:
            names = [n for _, n in self.released]
            self.released.clear()
        for name in names:
            remove_segment(name)


def remove_segment(name: str) -> None:
    try:
        os.unlink(shm_path(name))
    except FileNotFoundError:
        pass


def make_probe() -> tuple[str, str]:
    """§3: a file in /dev/shm holding a random token."""
    name = f"{SHM_PREFIX}{os.getpid()}-fprobe{next(_names)}-{secrets.token_hex(4)}"
    token = secrets.token_hex(16)
    fd = os.open(shm_path(name), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        os.write(fd, token.encode())
    finally:
        os.close(fd)
    return name, token


def check_probe(offered: Any) -> bool:
    """§3: whether we can open the peer's probe and read its token."""
    if not (isinstance(offered, list) and len(offered) == 2 and all(isinstance(x, str) for x in offered)):
        return False
    name, token = offered
    try:
        fd = os.open(shm_path(name), os.O_RDONLY)
    except (OSError, WireError):
        return False
    try:
        return os.read(fd, 64).decode(errors="replace") == token
    finally:
        os.close(fd)


# -- §4.5, §4.7 families ----------------------------------------------------------------


def value_of(obj: Any, acks: list[int] | None = None) -> Any:
    """The value of an out-of-band entry (or an inline value, as it is). The lease ids
    of the entries decoded here go to ``acks`` (§4.8)."""
    if not isinstance(obj, OOB):
        return obj
    frames = obj.frames
    count(f"family:{obj.family}")
    if obj.family == "shoal.runspec" and len(frames) > 2:
        count("runspec-buffers")
    value = _decode(obj, frames)
    if acks is not None:
        acks.extend(obj.lease_ids)
    return value


def _decode(obj: OOB, frames: list[Any]) -> Any:
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
    if obj.family == "shoal.same-host":
        refs = obj.header.get("refs")
        if not refs:
            return pickle.loads(frames[0], buffers=frames[1:])
        rest = iter(frames[1:])
        buffers: list[Any] = []
        for ref in refs:
            if ref is None:  # the next frame
                buffers.append(next(rest))
                continue
            if not isinstance(ref, list) or len(ref) != 6:
                raise WireError(f"malformed ref {ref!r:.100}")
            name, size, offset, length, flag, token = ref
            view = map_segment(name, int(size), token)  # the shared lock, the token (§4.7)
            buffers.append(view[int(offset):int(offset) + int(length)])
            if flag == 1:
                # a transfer segment: ours now that it is mapped; remove its name
                remove_segment(name)
                count("transfers-mapped")
            else:
                count("refs-mapped")
        return pickle.loads(frames[0], buffers=buffers)
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


# -- connections: §3 handshake, §5 requests, §4.8 acknowledgments ------------------------


def parse_address(address: str) -> tuple[str, int]:
    location = address.split("://", 1)[1] if "://" in address else address
    host, _, port = location.rpartition(":")
    return host.strip("[]"), int(port)


def handshake(sock: socket.socket, host_id: str, deadline: float, stop: Any = None,
              shm: bool = False) -> dict[str, Any]:
    """§3, both steps. With ``shm`` we offer a probe and answer whether we could open
    the peer's; without, we offer none and answer false, so every peer treats us as
    ``remote``. Returns the peer's step 1 and both answers."""
    probe = make_probe() if shm else None
    try:
        hello: dict[str, Any] = {"op": "handshake", "protocol": PROTOCOL_VERSION, "pid": os.getpid(), "host": host_id}
        if probe is not None:
            hello["shm_probe"] = list(probe)
        send_frames(sock, encode(hello), deadline)
        info = decode(recv_frames(sock, deadline, stop))
        if not isinstance(info, dict) or info.get("op") != "handshake" or info.get("protocol") != PROTOCOL_VERSION:
            raise WireError(f"bad handshake {info!r:.100}")
        can_map = shm and check_probe(info.get("shm_probe"))
        send_frames(sock, encode({"op": "handshake-shm", "can_map": can_map}), deadline)
        answer = decode(recv_frames(sock, deadline, stop))
        if not isinstance(answer, dict) or answer.get("op") != "handshake-shm":
            raise WireError(f"bad shared-memory answer {answer!r:.100}")
    finally:
        if probe is not None:
            remove_segment(probe[0])  # after step 2 (or a failure)
    return {"peer": info, "we_map_theirs": can_map, "peer_maps_ours": answer.get("can_map") is True}


class Connection:
    """A connection we open to a worker or the scheduler for requests (§5)."""

    def __init__(self, address: str, host_id: str, shm: bool = False, timeout: float = OP_TIMEOUT):
        host, port = parse_address(address)
        assert host in ("127.0.0.1", "localhost", "::1"), f"loopback only, got {address}"
        self.timeout = timeout
        deadline = time.monotonic() + timeout
        self.sock = socket.create_connection((host, port), timeout=max(deadline - time.monotonic(), 0.001))
        try:
            self.handshake = handshake(self.sock, host_id, deadline, shm=shm)
        except BaseException:
            self.sock.close()
            raise

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        """One request and its response (values in it stay :class:`OOB`)."""
        deadline = time.monotonic() + self.timeout
        send_frames(self.sock, encode({"op": op, "reply": True, **fields}), deadline)
        while True:
            response = decode(recv_frames(self.sock, deadline))
            if is_lease_ack(response):
                continue  # not a response (§5); we hold no leases, so nothing to end
            break
        if not isinstance(response, dict) or "status" not in response:
            raise WireError(f"malformed response {response!r:.100}")
        return response

    def ack(self, ids: list[int]) -> None:
        """§4.8: we have decoded the values that carried these leases."""
        if ids:
            send_frames(self.sock, encode({"op": LEASE_ACK, "ids": ids}), time.monotonic() + self.timeout)
            count("acks-sent")

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(address: str, host_id: str, deadline: float, shm: bool = False) -> tuple[socket.socket, dict[str, Any]]:
    host, port = parse_address(address)
    assert host in ("127.0.0.1", "localhost", "::1"), f"loopback only, got {address}"
    sock = socket.create_connection((host, port), timeout=max(deadline - time.monotonic(), 0.001))
    try:
        hs = handshake(sock, host_id, deadline, shm=shm)
    except BaseException:
        sock.close()
        raise
    return sock, hs


def request(address: str, host_id: str, op: str, timeout: float = OP_TIMEOUT, shm: bool = False,
            **fields: Any) -> dict[str, Any]:
    """One request on a fresh connection; returns the response map (§5). Values in it
    are not decoded (so there is nothing to acknowledge)."""
    with Connection(address, host_id, shm, timeout) as conn:
        return conn.call(op, **fields)


def get_data(address: str, host_id: str, keys: list[Any], shm: bool = False) -> dict[Any, Any]:
    """§8.1 as a requester: the values ``address`` holds among ``keys``, decoded, with
    their leases acknowledged before the connection closes."""
    with Connection(address, host_id, shm) as conn:
        response = conn.call("get-data", keys=keys)
        if response.get("status") != "OK":
            raise WireError(f"get-data failed: {response.get('message')!r}")
        acks: list[int] = []
        values = {k: value_of(v, acks) for k, v in response["result"]["data"].items()}
        conn.ack(acks)
        return values


# -- the worker ------------------------------------------------------------------------


class ForeignWorker:
    """One thread for the scheduler stream (tasks run there, one at a time:
    ``nthreads=1``), one accepting peers, one per peer connection.

    With ``shm`` (§4.7, §11 a-e) it answers ``"can_map": true`` to peers whose probe it
    can open, decodes ``shoal.same-host`` and acknowledges leases, maps the inputs
    ``compute-task`` names in ``shm``, and puts large results in segments of its own,
    released (renamed away, kept for reuse) when their keys are freed."""

    def __init__(self, scheduler_address: str, name: str = "foreign", deadline: float = 120.0,
                 shm: bool = False):
        self.scheduler_address = scheduler_address
        self.name = name
        self.shm = shm
        self.host_id = f"foreign-{uuid.uuid4().hex}"  # not a Python process's host identity (§3)
        self.deadline = time.monotonic() + deadline
        self.data: dict[Any, Any] = {}
        #: key -> the segment info of a result we placed (§4.7); released with the key
        self.segments: dict[Any, list[Any]] = {}
        self.pool = SegmentPool()
        self.errors: list[BaseException] = []
        self.ops_received: list[str] = []
        self.freed: set[Any] = set()
        #: keys served by get-data (values mapped from our segments are not among them)
        self.served: list[Any] = []
        #: handshake answers on connections peers opened to us
        self.peer_handshakes: list[dict[str, Any]] = []
        self.scheduler_handshake: dict[str, Any] = {}
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
        sock, self.scheduler_handshake = connect(self.scheduler_address, self.host_id, deadline, self.shm)
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
        with self._lock:
            segments, self.segments = list(self.segments.values()), {}
        for info in segments:  # the owner removes its segments at shutdown (§4.7)
            remove_segment(info[0])
        self.pool.drain()
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

    def _store(self, key: Any, value: Any) -> None:
        with self._lock:
            self.data[key] = value

    def _drop(self, key: Any) -> None:
        with self._lock:
            self.data.pop(key, None)
            info = self.segments.pop(key, None)
        if info is not None:
            self.pool.release(info)  # the key left our memory: its name goes at once (§4.7)

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
                if is_lease_ack(batch):
                    continue  # §4.8: we never send lease ids; nothing to end
                for msg in batch if isinstance(batch, list) else [batch]:
                    if not isinstance(msg, dict):
                        continue
                    op = msg.get("op")
                    self.ops_received.append(str(op))
                    if op == "compute-task":
                        if msg.get("shm"):
                            self.shm_hints += 1
                        pending.append(msg)
                    elif op == "free-keys":
                        keys = list(msg.get("keys") or ())
                        pending = [m for m in pending if m["key"] not in keys]
                        for k in keys:
                            self._drop(k)
                        with self.cond:
                            self.freed.update(keys)
                            self.cond.notify_all()
                    elif op == "close":
                        self.closed_by_scheduler.set()
                        return
                    # unknown ops are ignored (§6)
                pending.sort(key=lambda m: list(m.get("priority") or [0]))
                while pending:
                    acks: list[int] = []
                    out = self._compute(pending.pop(0), acks)
                    if acks:
                        # a message of its own, never inside a stream array (§4.8)
                        send_frames(sock, encode({"op": LEASE_ACK, "ids": acks}), time.monotonic() + OP_TIMEOUT)
                        count("acks-sent")
                    self._send(out)
        except EOF:
            pass
        finally:
            self.stream_ended.set()
            self._untrack(sock)

    def _stop_or_unregister(self) -> _AnyEvent:
        # a read between messages wakes up both to stop and to send unregister
        return _AnyEvent(self._stop, self._unregister)

    def _finished(self, key: Any, value: Any, duration: float | None = None) -> dict[str, Any]:
        msg: dict[str, Any] = {"op": "task-finished", "key": key, "nbytes": sys.getsizeof(value)}
        if duration is not None:
            msg["duration"] = duration  # optional (§7.3)
        info = self.segments.get(key)
        if info is not None:
            msg["shm"] = info  # optional: the value also lies in this segment (§7.3, §4.7)
        return msg

    def _fetch(self, dep: Any, holders: list[str], info: Any, out: list[dict[str, Any]]) -> tuple[bool, Any]:
        """A dependency's value: mapped from its segment, else fetched from a holder."""
        if info is not None and self.shm:
            try:
                return True, attach(info)  # §7.2 "shm": no holder involved
            except (OSError, ValueError, TypeError, WireError, pickle.UnpicklingError):
                pass  # fall back to get-data
        for holder in [h for h in holders if h != self.address]:
            try:
                got = get_data(holder, self.host_id, [dep], self.shm)
            except (WireError, EOF, OSError):  # OSError covers timeouts and refusals
                got = {}
            if dep in got:
                return True, got[dep]
            out.append({"op": "missing-data", "key": dep, "errant_worker": holder})
        return False, None

    def _compute(self, msg: dict[str, Any], acks: list[int]) -> list[dict[str, Any]]:
        key = msg["key"]
        if key in self.data:
            return [self._finished(key, self.data[key])]
        deps: dict[Any, Any] = {}
        out: list[dict[str, Any]] = []
        segment_infos = msg.get("shm") or {}
        for dep, holders in (msg.get("who_has") or {}).items():
            if dep in self.data:
                deps[dep] = self.data[dep]
                continue
            ok, value = self._fetch(dep, holders, segment_infos.get(dep), out)
            if ok:
                deps[dep] = value
                continue
            if self.address in holders:
                out.append({"op": "missing-data", "key": dep, "errant_worker": self.address})
            return [*out, {"op": "reschedule", "key": key}]
        start = time.perf_counter()
        try:
            spec = value_of(msg["payload"], acks)
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
        duration = time.perf_counter() - start
        info = self.pool.place(value) if self.shm else None
        with self._lock:
            self.data[key] = value
            if info is not None:
                self.segments[key] = info
        return [*out, self._finished(key, value, duration)]

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
            hs = handshake(conn, self.host_id, time.monotonic() + 10.0, self._stop, shm=self.shm)
            self.peer_handshakes.append(hs)
            while True:
                msg = decode(recv_frames(conn, self.deadline, self._stop))
                if is_lease_ack(msg):
                    continue  # §4.8: not a request, never answered
                if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
                    return  # not a request: close
                op = msg["op"]
                acks: list[int] = []
                if op == "get-data":
                    with self._lock:
                        held = {k: self.data[k] for k in msg.get("keys") or () if k in self.data}
                    self.served.extend(held)
                    data = {k: pickled(v) for k, v in held.items()}
                    response: dict[str, Any] = {"status": "OK", "result": {"data": data}}
                elif op == "update-data":
                    values = {k: value_of(v, acks) for k, v in (msg.get("data") or {}).items()}
                    for k, v in values.items():
                        self._store(k, v)
                    response = {"status": "OK", "result": {"nbytes": {k: sys.getsizeof(v) for k, v in values.items()}}}
                elif op == "identity":
                    response = {"status": "OK", "result": {"address": self.address, "nthreads": 1,
                                                           "name": self.name, "pid": os.getpid(),
                                                           "host": self.host_id}}
                else:
                    response = {"status": "error", "type": "builtins.ValueError",
                                "message": f"foreign worker has no handler for op {op!r}",
                                "traceback": "", "exception": None}
                if acks:
                    # before the response: the requester reads nothing after it (§4.8)
                    send_frames(conn, encode({"op": LEASE_ACK, "ids": acks}), time.monotonic() + OP_TIMEOUT)
                    count("acks-sent")
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


#: whether this run can use shared memory (the Python processes decide the same way)
SHM = os.path.isdir(SHM_DIR) and os.environ.get("SHOAL_SHM", "1") != "0"


@pytest.fixture
def lease_ends(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, str]]:
    """``(lease id, reason)`` of every lease this process (the client) ends."""
    from shoal.protocol.leases import Lease

    ended: list[tuple[int, str]] = []
    original = Lease.end

    def end(self: Lease, reason: str) -> bool:
        done = original(self, reason)
        if done:
            ended.append((self.id, reason))
        return done

    monkeypatch.setattr(Lease, "end", end)
    return ended


def _foreign_files() -> set[str]:
    """Files in /dev/shm the foreign worker (this process) created: segments, probes."""
    prefix = f"{SHM_PREFIX}{os.getpid()}-f"
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith(prefix)}
    except OSError:
        return set()


@pytest.mark.timeout(180)
def test_foreign_worker_runs_tasks_and_serves_data(procs: _Procs, workers: list[ForeignWorker],
                                                   lease_ends: list[tuple[int, str]]) -> None:
    _, address = _scheduler(procs)
    py_proc, py_address = procs.start("worker", address, "--name", "python", "--host", "127.0.0.1",
                                      banner="shoal worker at ")
    fw = ForeignWorker(address, name="foreign", shm=SHM)
    workers.append(fw)  # stopped by the fixture even if start() fails
    fw.start()
    here = [fw.address]
    there = [py_address]
    # §3: on one host each end can open the other's probe (unless shared memory is off)
    assert fw.scheduler_handshake["we_map_theirs"] is SHM
    assert fw.scheduler_handshake["peer_maps_ours"] is SHM
    before = stats.copy()

    with shoal.Client(address, timeout=30) as c:
        info = c.scheduler_info()
        assert info["workers"][fw.address]["name"] == "foreign"
        assert info["workers"][fw.address]["nthreads"] == 1
        assert py_address in info["workers"]

        # a task, its value fetched by the client from the foreign worker (get-data)
        f1 = c.submit(lambda x: x + 1, 41, workers=here)
        assert f1.result(timeout=30) == 42
        assert c.who_has([f1]) == {f1.key: [fw.address]}
        assert f1.key in fw.served

        # a tuple key, keyword arguments and an argument whose pickle has an out-of-band
        # buffer (a numpy array: frames[2:] of the runspec entry)
        arr = np.arange(50_000, dtype="int64")
        f2 = c.submit(lambda x, *, scale: (int(x.sum()), scale), arr, scale=3,
                      key=("foreign", 2), workers=here)
        assert f2.result(timeout=30) == (int(arr.sum()), 3)

        # an argument wrapped with to_serialize travels pickled inside the payload
        assert c.submit(lambda x: x * 2, shoal.to_serialize(21), workers=here).result(timeout=30) == 42

        # a value with out-of-band pickle buffers on the way back; with shared memory the
        # foreign worker put it in a segment of its own and said so in task-finished: the
        # client maps it (key-in-memory "shm") instead of asking for it
        f3 = c.submit(lambda n: np.full(n, 7, dtype="float64"), 300_000, workers=here)
        out = f3.result(timeout=30)
        assert out.dtype == np.float64 and out.shape == (300_000,) and (out == 7).all()
        if SHM:
            assert f3.key in fw.segments and f3.key not in fw.served
            # and a Python worker maps it too (compute-task "shm"), without asking either
            assert c.submit(lambda x: float(x.sum()), f3, workers=there).result(timeout=30) == 2_100_000.0
            assert f3.key not in fw.served

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

        # dependencies across workers: Python -> foreign (bytes and pickle or same-host
        # families), foreign -> foreign (local), foreign -> Python (the Python worker's
        # get-data)
        a = c.submit(lambda: b"abc" * 1000, workers=there)
        d = c.submit(lambda: {"k": [1, 2]}, workers=there)
        b = c.submit(lambda v: len(v), a, workers=here)
        e = c.submit(lambda n, m, nested: (n, m["k"], nested), b, d, [b, {"again": d}], workers=here)
        g = c.submit(lambda t: t[0] * 2, e, workers=there)
        assert g.result(timeout=30) == 6000
        assert e.result(timeout=30) == (3000, [1, 2], [3000, {"again": {"k": [1, 2]}}])

        # a large input that the Python worker placed in shared memory: compute-task says
        # where ("shm"); the foreign worker maps it (or, without shared memory, there is
        # no "shm" and it fetches the value with get-data)
        big = c.submit(lambda: np.arange(200_000, dtype="int64"), workers=there)
        total = c.submit(lambda x: int(x.sum()), big, workers=here)
        assert total.result(timeout=30) == int(np.arange(200_000, dtype="int64").sum())
        if SHM:
            assert fw.shm_hints >= 1
            assert stats["segments-mapped"] > before["segments-mapped"]

        # scatter to the foreign worker: a large private buffer crosses as a transfer
        # segment with a lease (§4.7, §4.8); the foreign worker maps it, removes its
        # name and acknowledges before answering, so the client's lease has ended,
        # acknowledged, by the time scatter returns
        arr2 = np.arange(300_000, dtype="int64")  # 2.4 MB: over the 1 MiB of a transfer
        n_ended = len(lease_ends)
        [s_here] = c.scatter([arr2], workers=here)
        if SHM:
            assert [reason for _, reason in lease_ends[n_ended:]] == ["acknowledged"]
        assert c.submit(lambda x: int(x.sum()), s_here, workers=here).result(timeout=30) == int(arr2.sum())

        # scatter to the Python worker, then a foreign task that needs it: the Python
        # worker's copy lies in a transfer segment whose name is gone, so get-data sends
        # it as a new transfer with a lease, which the foreign worker acknowledges
        arr3 = np.arange(400_000, dtype="int64") * 3
        [s_there] = c.scatter([arr3], workers=there)
        mid = stats.copy()
        assert c.submit(lambda x: int(x[::2].sum()), s_there, workers=here).result(timeout=30) == int(arr3[::2].sum())
        if SHM:
            assert stats["transfers-mapped"] > mid["transfers-mapped"]
            assert stats["acks-sent"] > mid["acks-sent"]
            assert stats["lease-ids-received"] > mid["lease-ids-received"]

        # requests of our own to the Python worker, on one connection
        with Connection(py_address, "doc-test", shm=SHM) as conn:
            assert conn.handshake["we_map_theirs"] is SHM and conn.handshake["peer_maps_ours"] is SHM
            # a value in its result segment: a flag-0 ref, no lease; the segment stays
            entry = conn.call("get-data", keys=[big.key])["result"]["data"][big.key]
            acks: list[int] = []
            assert (value_of(entry, acks) == np.arange(200_000, dtype="int64")).all()
            assert acks == []
            if SHM:
                assert entry.family == "shoal.same-host" and not entry.lease_ids
                [ref] = entry.header["refs"]
                assert len(ref) == 6 and ref[4] == 0
                # the segment is still there, with the header of the ref's token (§4.7)
                with open(os.path.join(SHM_DIR, ref[0]), "rb") as f:
                    assert f.read(SEG_HEADER) == segment_header(ref[5])
            # a transfer with a lease: mapped, its name removed, acknowledged
            entry = conn.call("get-data", keys=[s_there.key])["result"]["data"][s_there.key]
            acks = []
            assert (value_of(entry, acks) == arr3).all()
            if SHM:
                assert entry.family == "shoal.same-host" and entry.lease_ids and acks == entry.lease_ids
                [ref] = entry.header["refs"]
                assert len(ref) == 6 and ref[4] == 1 and ref[2] >= SEG_HEADER
                assert not os.path.exists(os.path.join(SHM_DIR, ref[0]))
            conn.ack(acks)
            # the acknowledgment is not a request: no response, and the connection serves on
            ident = conn.call("identity")
            assert ident["status"] == "OK" and ident["result"]["address"] == py_address
        # declining shared memory: the same values as plain pickles, no leases
        mid = stats.copy()
        plain = get_data(py_address, "doc-test", [d.key, s_there.key], shm=False)
        assert plain[d.key] == {"k": [1, 2]} and (plain[s_there.key] == arr3).all()
        assert stats["family:pickle"] >= mid["family:pickle"] + 2
        assert stats["lease-ids-received"] == mid["lease-ids-received"]

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

    # the client closed: everything it held is freed on the foreign worker, and the
    # names of the segments it placed went with their keys (§4.7); their memory is kept
    # for reuse under names no message carried
    assert fw.wait_freed(f2.key, timeout=30)
    assert fw.wait_freed(e.key, timeout=30)
    assert fw.wait_freed(f3.key, timeout=30)
    assert fw.wait_freed(s_here.key, timeout=30)
    assert not fw.segments
    assert {n for n in _foreign_files() if "-fpool" not in n} == set()
    assert bool(fw.pool.released) is SHM

    # every family of §4.5 and §4.7 was decoded, and a payload carried out-of-band buffers
    expected = {"family:pickle", "family:bytes", "family:shoal.runspec", "runspec-buffers"}
    if SHM:
        expected |= {"family:shoal.same-host", "refs-mapped", "transfers-mapped", "segments-mapped",
                     "segments-placed", "lease-ids-received", "acks-sent"}
    assert expected <= {k for k, v in (stats - before).items() if v > 0}, stats - before
    # everyone on this host could open our probe, and we theirs
    assert fw.peer_handshakes
    for hs in fw.peer_handshakes:
        assert hs["we_map_theirs"] is SHM and hs["peer_maps_ours"] is SHM, hs

    # a clean leave: unregister, the scheduler closes the stream and forgets the worker
    fw.leave()
    ident = request(address, "test", "identity")
    assert ident["status"] == "OK"
    assert fw.address not in ident["result"]["workers"]
    assert py_address in ident["result"]["workers"]
    assert {"compute-task", "free-keys"} <= set(fw.ops_received)
    assert not fw.errors, fw.errors
    assert py_proc.poll() is None
    fw.stop()  # and the released segments go when the worker stops
    assert _foreign_files() == set()


@pytest.mark.timeout(120)
def test_foreign_worker_is_closed_by_scheduler_shutdown(procs: _Procs, workers: list[ForeignWorker]) -> None:
    # a worker without the shared-memory data plane: no probe, "can_map": false (§3, §11)
    sched, address = _scheduler(procs)
    fw = ForeignWorker(address, name="foreign-2", shm=False)
    workers.append(fw)
    fw.start()
    assert fw.scheduler_handshake["we_map_theirs"] is False
    assert fw.scheduler_handshake["peer_maps_ours"] is False
    before = stats.copy()
    with shoal.Client(address, timeout=30) as c:
        big = c.submit(lambda n: np.ones(n), 100_000, workers=[fw.address])
        assert c.submit(lambda: "hi", workers=[fw.address]).result(timeout=30) == "hi"
        assert float(big.result(timeout=30).sum()) == 100_000.0
    # nothing placed in, or received through, shared memory; nothing to acknowledge
    assert not fw.segments and big.key in fw.served
    assert stats["lease-ids-received"] == before["lease-ids-received"]
    assert stats["family:shoal.same-host"] == before["family:shoal.same-host"]
    for hs in fw.peer_handshakes:
        assert hs["we_map_theirs"] is False and hs["peer_maps_ours"] is False, hs
    sched.terminate()  # the scheduler shuts down: it sends close to every worker
    assert fw.closed_by_scheduler.wait(30), fw.ops_received
    assert fw.stream_ended.wait(30)
    assert sched.wait(30) == 0
    assert not fw.errors, fw.errors


def _pool_files(pid: int, kind: str) -> set[str]:
    prefix = f"{SHM_PREFIX}{pid}-{kind}"
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith(prefix)}
    except OSError:
        return set()


@pytest.mark.skipif(not SHM, reason="needs /dev/shm and SHOAL_SHM not 0")
@pytest.mark.timeout(60)
def test_segment_rules_hold_against_shoals_own_reader_and_owner() -> None:
    """§4.7 both ways, without a cluster: the foreign reader (shared flock, token) on
    segments shoal places and reuses, and shoal's reader on segments the foreign owner
    places, releases and reuses."""
    import gc

    from shoal.comm import shm as py_shm

    py_shm.drain_pool()
    gc.collect()
    pid = os.getpid()
    arr = np.arange(1 << 17, dtype="float64")  # 1 MiB of buffer: worth a segment

    # -- shoal owns, the foreign reader maps ------------------------------------------
    def py_place(value: Any) -> tuple[Any, Any]:
        placed = py_shm.place(value)
        assert placed is not None
        return placed

    seg, own = py_place(arr)
    try:
        info = seg.info
        assert len(info) == 5 and info[1] >= SEG_HEADER
        with open(shm_path(info[0]), "rb") as f:
            assert f.read(SEG_HEADER) == segment_header(info[4])
        mine = attach(info)
        assert np.array_equal(mine, arr)
        with pytest.raises(SegmentGone, match="no longer holds"):
            attach([*info[:4], "0" * 16])  # another token: not the value we were given
        # released while we map it: its name goes at once, its memory is not reused
        del own
        gc.collect()
        seg.retire()
        assert not os.path.exists(shm_path(info[0]))
        assert len(_pool_files(pid, "pool")) == 1
        seg2, v2 = py_place(arr * 2)
        assert len(_pool_files(pid, "pool")) == 1  # our shared lock kept it out of reuse
        assert np.array_equal(mine, arr) and np.array_equal(v2, arr * 2)
        # we let go: the next value of that size reuses the memory, under a new name and token
        del mine
        gc.collect()
        seg3, v3 = py_place(arr * 3)
        assert _pool_files(pid, "pool") == set()
        assert seg3.name != info[0] and seg3.info[4] != info[4]
        with pytest.raises(SegmentGone, match="is gone"):
            attach(info)  # the old name
        with pytest.raises(SegmentGone, match="no longer holds"):
            attach([seg3.name, *seg3.info[1:4], info[4]])  # the reused file, the old token
        assert np.array_equal(attach(seg3.info), arr * 3)
        # an owner rewriting a segment holds an exclusive lock: no reader may map it then
        del v3
        gc.collect()
        fd = os.open(shm_path(seg3.name), os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with pytest.raises(SegmentGone, match="being rewritten"):
                attach(seg3.info)
        finally:
            os.close(fd)
        seg2.unlink()
        seg3.unlink()
    finally:
        seg.unlink()
        py_shm.drain_pool()

    # -- the foreign owner places, shoal's reader maps ---------------------------------
    before = _foreign_files()
    pool = SegmentPool()
    try:
        info = pool.place(arr)
        assert info is not None and len(info) == 5
        theirs = py_shm.attach(info)
        assert np.array_equal(theirs, arr)
        pool.release(info)  # the key is freed: the name goes at once
        assert not os.path.exists(shm_path(info[0])) and len(pool.released) == 1
        n_refused = stats["segments-reuse-refused"]
        info2 = pool.place(arr * 2)  # shoal's reader still maps the released one
        assert info2 is not None and len(pool.released) == 1
        assert stats["segments-reuse-refused"] == n_refused + 1
        assert np.array_equal(theirs, arr)
        del theirs
        gc.collect()
        n_reused = stats["segments-reused"]
        info3 = pool.place(arr * 3)  # nobody maps it now: reused, new name, new token
        assert info3 is not None and not pool.released
        assert stats["segments-reused"] == n_reused + 1
        assert info3[0] not in (info[0], info2[0]) and info3[4] != info[4]
        with pytest.raises(FileNotFoundError):
            py_shm.attach(info)  # the old name
        with pytest.raises(FileNotFoundError, match="no longer holds"):
            py_shm.attach([info3[0], *info3[1:4], info[4]])  # the reused file, the old token
        assert np.array_equal(py_shm.attach(info3), arr * 3)
        assert np.array_equal(py_shm.attach(info2), arr * 2)
        pool.release(info2)
        pool.release(info3)
    finally:
        pool.drain()
        gc.collect()
    assert _foreign_files() - before == set()
