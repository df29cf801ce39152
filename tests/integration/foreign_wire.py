"""The wire side of the foreign worker (framing, handshake, encoding, shared-memory
segments, connections), written from docs/protocol.md alone: nothing from shoal."""



from __future__ import annotations

import fcntl
import hashlib
import hmac
import io
import itertools
import mmap
import os
import pickle
import secrets
import socket
import threading
import time
import weakref
from collections import Counter
from typing import Any, ClassVar, Self

import cloudpickle
import msgpack
from foreign_framing import (  # noqa: F401 - §2 (framing, tags), used here and by the tests
    EOF,
    MAX_FRAME_BYTES,
    MAX_FRAMES,
    OP_TIMEOUT,
    POLL,
    SESSIONS,
    Session,
    Stopped,
    WireError,
    recv_frames,
    send_frames,
)

# =====================================================================================
# The foreign worker (docs/protocol.md only; no shoal imports in this part)
# =====================================================================================

PROTOCOL_VERSION = 5  # §3
EXT_TUPLE = 1  # §4.1
EXT_OOB = 2  # §4.1
LEASE_ACK = "shoal-lease-ack"  # §4.8
SHM_DIR = "/dev/shm"  # §3, §4.7
SHM_PREFIX = "shoal-"  # §4.7: the names readers open
SHM_THRESHOLD = 1 << 16  # our choice (Python's default): results with this many buffer bytes go to a segment


#: what this module did, by kind (the test checks that every path was exercised)
stats: Counter[str] = Counter()
_stats_lock = threading.Lock()


def count(what: str, n: int = 1) -> None:
    with _stats_lock:
        stats[what] += n


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

SEG_MAGIC = b"SHOALSEG"  # §4.7: a value segment's header starts with it
TRANSFER_MAGIC = b"SHOALTRN"  # §4.7: a transfer segment's (flag-1 refs)
SEG_HEADER = 64  # §4.7: the header's size; the pickle starts here


class SegmentGone(FileNotFoundError):
    """§4.7: the segment's name is gone, its owner is rewriting it, or it holds another
    token now; the value must be had another way."""


def shm_path(name: Any) -> str:
    if not isinstance(name, str) or not name.startswith(SHM_PREFIX) or "/" in name:
        raise WireError(f"not a segment name: {name!r:.100}")
    return os.path.join(SHM_DIR, name)


def segment_header(token: Any, transfer: bool = False) -> bytes:
    """§4.7: b"SHOALSEG" (b"SHOALTRN" for a transfer), the token in ASCII, zero bytes
    up to 64."""
    if not isinstance(token, str):
        raise WireError(f"not a segment token: {token!r:.100}")
    header = (TRANSFER_MAGIC if transfer else SEG_MAGIC) + token.encode("ascii")
    if len(header) > SEG_HEADER:
        raise WireError(f"segment token too long: {token!r:.100}")
    return header.ljust(SEG_HEADER, b"\0")


def map_segment(name: str, size: int, token: str, take: bool = False) -> memoryview:
    """§4.7 "Reading a segment": a private, copy-on-write mapping of the first ``size``
    bytes of a segment that holds generation ``token`` (with ``take``, a transfer
    segment, which the caller then removes). The shared flock taken on the way is held
    for as long as the mapping lives (its descriptor is closed when the mapping is
    collected), so that the owner cannot reuse the memory meanwhile."""
    expected = {segment_header(token, transfer=True)} | (set() if take else {segment_header(token)})
    try:
        fd = os.open(shm_path(name), os.O_RDONLY)  # 1. open
    except FileNotFoundError:
        raise SegmentGone(f"segment {name} is gone") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # 2. the shared lock, no waiting
        except BlockingIOError:
            raise SegmentGone(f"segment {name} is being rewritten by its owner") from None
        if os.pread(fd, SEG_HEADER, 0) not in expected:  # 3. the header of this token
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
    name, size, pickle_len, spans, token = info[:5]  # (a sixth element, a checksum, may follow)
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
        # §4.5: large arguments may lie in shared memory (refs, as in shoal.same-host)
        buffers = _buffers(obj.header.get("refs"), frames[2:], "runspec-")
        args, kwargs = _ArgsUnpickler(io.BytesIO(frames[1]), buffers=buffers).load()
        return RunSpec(func, args, kwargs)
    if obj.family == "shoal.same-host":
        return pickle.loads(frames[0], buffers=_buffers(obj.header.get("refs"), frames[1:]))
    raise WireError(f"unknown family {obj.family!r}")


def _buffers(refs: Any, frames: list[Any], what: str = "") -> list[Any]:
    """The out-of-band buffers a family header's ``refs`` describe (§4.7)."""
    if not refs:
        return frames
    rest = iter(frames)
    buffers: list[Any] = []
    for ref in refs:
        if ref is None:  # the next frame
            buffers.append(next(rest))
            continue
        if not isinstance(ref, list) or len(ref) != 6:
            raise WireError(f"malformed ref {ref!r:.100}")
        name, size, offset, length, flag, token = ref
        view = map_segment(name, int(size), token, take=flag == 1)  # the shared lock, the token (§4.7)
        buffers.append(view[int(offset):int(offset) + int(length)])
        if flag == 1:
            # a transfer segment: ours now that it is mapped; remove its name
            remove_segment(name)
            count(f"{what}transfers-mapped")
        else:
            count(f"{what}refs-mapped")
    return buffers


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


def find_secret(scheduler_address: str) -> bytes | None:
    """§3.1: SHOAL_AUTH, the file SHOAL_AUTH_FILE names, or the scheduler's auth file
    for its port; None if there is none."""
    if os.environ.get("SHOAL_AUTH"):
        return os.environ["SHOAL_AUTH"].strip().encode()
    path = os.environ.get("SHOAL_AUTH_FILE")
    if not path:
        directory = os.environ.get("SHOAL_AUTH_DIR") or os.path.join(os.path.expanduser("~"), ".shoal", "auth")
        path = os.path.join(directory, f"port-{parse_address(scheduler_address)[1]}")
    try:
        with open(path, "rb") as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def auth_proof(secret: bytes, role: bytes, nonce_c: bytes, nonce_a: bytes) -> bytes:
    """§3 step 2."""
    return hmac.new(secret, b"|".join((b"shoal-auth-1", role, nonce_c, nonce_a)), hashlib.sha256).digest()


def _handshake_msg(sock: socket.socket, deadline: float, stop: Any, op: str,
                   raw: list[bytes] | None = None) -> dict[str, Any]:
    frames = recv_frames(sock, deadline, stop)
    if raw is not None:
        raw.append(frames[0])
    msg = decode(frames)
    if isinstance(msg, dict) and msg.get("op") == "handshake-refused":
        raise WireError(f"refused: {msg.get('reason')}")
    if not isinstance(msg, dict) or msg.get("op") != op:
        raise WireError(f"expected {op}, got {msg!r:.100}")
    return msg


def _send_step(sock: socket.socket, msg: dict[str, Any], deadline: float) -> bytes:
    """Send a handshake step; returns its bytes. A peer that refused us wrote
    ``handshake-refused`` and closed, so our send may break on its reset: the reason
    is then already waiting in our receive buffer, and it is the error to report."""
    frames = encode(msg)
    try:
        send_frames(sock, frames, deadline)
        return bytes(frames[0])
    except WireError as broke:
        try:
            said = decode(recv_frames(sock, min(deadline, time.monotonic() + 1.0)))
        except (OSError, WireError, EOF, TimeoutError):
            raise broke from None
        if isinstance(said, dict) and said.get("op") == "handshake-refused":
            raise WireError(f"refused: {said.get('reason')}") from None
        raise


def handshake(sock: socket.socket, host_id: str, deadline: float, stop: Any = None,
              shm: bool = False, secret: bytes | None = None, connector: bool = True,
              reads: str | None = None, expect: str | None = None, role: str = "worker") -> dict[str, Any]:
    """§3, all three steps, as the end that opened the connection (``connector``) or
    accepted it; with a secret, the connection's session (§2.5) then tags every
    message. With ``shm`` we offer a probe and answer whether we could open the
    peer's; without, we offer none and answer false, so every peer treats us as
    ``remote``. ``role``: what we say we are; ``expect``: the role the peer must say
    it is. Returns the peer's step 2 and both answers."""
    nonce = os.urandom(32)
    mine, theirs_raw = [], []
    mine.append(_send_step(sock, {"op": "handshake", "protocol": PROTOCOL_VERSION, "nonce": nonce,
                                  "auth": secret is not None}, deadline))
    hello = _handshake_msg(sock, deadline, stop, "handshake", theirs_raw)
    theirs = hello.get("nonce")
    if hello.get("protocol") != PROTOCOL_VERSION or not isinstance(theirs, bytes) or len(theirs) != 32:
        raise WireError(f"bad handshake {hello!r:.100}")
    if (hello.get("auth") is True) != (secret is not None):
        raise WireError("one end authenticates and the other does not")
    nonce_c, nonce_a = (nonce, theirs) if connector else (theirs, nonce)
    side, peer_side = (b"connector", b"acceptor") if connector else (b"acceptor", b"connector")
    probe = make_probe() if shm else None
    try:
        step2: dict[str, Any] = {
            "op": "handshake-auth", "pid": os.getpid(), "host": host_id, "role": role,
            "proof": None if secret is None else auth_proof(secret, side, nonce_c, nonce_a),
        }
        if probe is not None:
            step2["shm_probe"] = list(probe)
        if reads is not None:
            step2["reads"] = reads  # e.g. "neutral": we decode no pickle
        mine.append(_send_step(sock, step2, deadline))
        info = _handshake_msg(sock, deadline, stop, "handshake-auth", theirs_raw)
        if secret is not None and not hmac.compare_digest(
            auth_proof(secret, peer_side, nonce_c, nonce_a), info.get("proof") or b""
        ):
            raise WireError("the peer's proof is wrong")
        if secret is not None:  # §2.5: step 3 on carries tags
            first = (mine[0], theirs_raw[0], mine[1], theirs_raw[1]) if connector else \
                (theirs_raw[0], mine[0], theirs_raw[1], mine[1])
            SESSIONS[sock] = Session(secret, b"".join(len(m).to_bytes(8, "little") + m for m in first), connector)
        if expect is not None and info.get("role") != expect:
            raise WireError(f"the peer is {info.get('role')!r}, not the {expect} we dialed")
        can_map = shm and check_probe(info.get("shm_probe"))
        _send_step(sock, {"op": "handshake-shm", "can_map": can_map}, deadline)
        answer = _handshake_msg(sock, deadline, stop, "handshake-shm")
    finally:
        if probe is not None:
            remove_segment(probe[0])  # after step 3 (or a failure)
    return {"peer": info, "we_map_theirs": can_map, "peer_maps_ours": answer.get("can_map") is True}


class Connection:
    """A connection we open to a worker or the scheduler for requests (§5)."""

    def __init__(self, address: str, host_id: str, shm: bool = False, timeout: float = OP_TIMEOUT,
                 secret: bytes | None = None, reads: str | None = None):
        host, port = parse_address(address)
        assert host in ("127.0.0.1", "localhost", "::1"), f"loopback only, got {address}"
        self.timeout = timeout
        deadline = time.monotonic() + timeout
        self.sock = socket.create_connection((host, port), timeout=max(deadline - time.monotonic(), 0.001))
        try:
            self.handshake = handshake(self.sock, host_id, deadline, shm=shm, secret=secret, reads=reads)
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


def connect(address: str, host_id: str, deadline: float, shm: bool = False,
            secret: bytes | None = None, expect: str | None = None) -> tuple[socket.socket, dict[str, Any]]:
    host, port = parse_address(address)
    assert host in ("127.0.0.1", "localhost", "::1"), f"loopback only, got {address}"
    sock = socket.create_connection((host, port), timeout=max(deadline - time.monotonic(), 0.001))
    try:
        hs = handshake(sock, host_id, deadline, shm=shm, secret=secret, expect=expect)
    except BaseException:
        sock.close()
        raise
    return sock, hs


def request(address: str, host_id: str, op: str, timeout: float = OP_TIMEOUT, shm: bool = False,
            secret: bytes | None = None, **fields: Any) -> dict[str, Any]:
    """One request on a fresh connection; returns the response map (§5). Values in it
    are not decoded (so there is nothing to acknowledge)."""
    with Connection(address, host_id, shm, timeout, secret=secret) as conn:
        return conn.call(op, **fields)


def get_data(address: str, host_id: str, keys: list[Any], shm: bool = False,
             secret: bytes | None = None) -> dict[Any, Any]:
    """§8.1 as a requester: the values ``address`` holds among ``keys``, decoded, with
    their leases acknowledged before the connection closes."""
    with Connection(address, host_id, shm, secret=secret) as conn:
        response = conn.call("get-data", keys=keys)
        if response.get("status") != "OK":
            raise WireError(f"get-data failed: {response.get('message')!r}")
        acks: list[int] = []
        values = {k: value_of(v, acks) for k, v in response["result"]["data"].items()}
        conn.ack(acks)
        return values


# -- the worker ------------------------------------------------------------------------
