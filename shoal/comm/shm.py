"""The same-host data plane: values in POSIX shared memory (``/dev/shm``).

A *segment* holds one value: its pickle-5 stream and out-of-band buffers, each buffer
64-byte aligned. The owner writes it once through a shared mapping and never again;
readers (the owner's own tasks included) map it ``MAP_PRIVATE``, so an input array is
writeable and a write copies only the touched pages: no reader ever changes what
another sees, and reading needs no copy.

Names are ``shoal-<pid>-<n>``: whoever finds a dead process's segments (its
``LocalCluster``, its scheduler) removes them with :func:`sweep`. A reader that mapped a
segment keeps valid memory after the owner unlinks the name.

Whether two processes share a shared-memory domain is tested, not guessed from host
names: one creates a probe segment and the other opens it (:func:`probe`,
:func:`check_probe`). ``SHOAL_SHM=0`` turns the data plane off.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import itertools
import mmap
import os
import pickle
import secrets
import threading
import weakref
from collections.abc import Sequence
from typing import Any

from ..errors import ShoalError

__all__ = [
    "SHM_DIR",
    "enabled",
    "ShmUnavailable",
    "Segment",
    "SegmentInfo",
    "place",
    "attach",
    "unlink",
    "sweep",
    "probe",
    "check_probe",
    "segments_of",
    "map_segment",
    "locate",
    "retire",
    "drain_pool",
]

SHM_DIR = "/dev/shm"
PREFIX = "shoal-"
_ALIGN = 64
#: every segment starts with a header: magic and a random token naming this generation
#: of its contents (a segment may be reused, under a new name and a new token)
_MAGIC = b"SHOALSEG"
_HEADER = 64
_counter = itertools.count()
_lock = threading.Lock()
_owned: set[str] = set()


class ShmUnavailable(ShoalError):
    """Shared memory cannot be used for this value (full, missing, or turned off)."""


_HAS_SHM_DIR = os.path.isdir(SHM_DIR)


def enabled() -> bool:
    """Whether this process may use the shared-memory data plane."""
    return _HAS_SHM_DIR and os.environ.get("SHOAL_SHM", "1") != "0"


def _path(name: str) -> str:
    if "/" in name or not name.startswith(PREFIX):
        raise ValueError(f"not a shoal segment name: {name!r}")
    return os.path.join(SHM_DIR, name)


def _new_name(kind: str = "") -> str:
    return f"{PREFIX}{os.getpid()}-{kind}{next(_counter)}-{secrets.token_hex(4)}"


# A segment's info travels in messages:
#   [name, total size, pickle length, [[offset, length], ...], token]
SegmentInfo = list


class Segment:
    """A value placed in shared memory by this process (the owner's record)."""

    __slots__ = ("name", "size", "info", "__weakref__")

    def __init__(self, name: str, size: int, info: SegmentInfo):
        self.name = name
        self.size = size
        self.info = info

    def unlink(self) -> None:
        unlink(self.name)

    def retire(self) -> None:
        """The owner is done with it: keep it for reuse (or unlink it)."""
        retire(self.name, self.size)

    def __repr__(self) -> str:
        return f"<Segment {self.name} {self.size} bytes>"


def place(obj: Any, min_buffer_bytes: int = 1 << 16) -> tuple[Segment, Any] | None:
    """Put ``obj`` in a segment if its out-of-band buffers hold at least
    ``min_buffer_bytes``; return ``(segment, copy of obj backed by the segment)``, or
    ``None`` when ``obj`` is not worth it. A retired segment of a fitting size is reused
    when nobody maps it any more (its pages are already there: no page faults); else a
    new one is made. Raises :class:`ShmUnavailable` when shared memory cannot take it
    (e.g. ``/dev/shm`` is full); nothing is left behind then.
    """
    buffers: list[pickle.PickleBuffer] = []
    try:
        data = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    except Exception:
        return None
    raws = [b.raw() for b in buffers]
    big = sum(r.nbytes for r in raws)
    if big < min_buffer_bytes:
        return None
    layout: list[list[int]] = []
    pos = _align(_HEADER + len(data))
    for r in raws:
        layout.append([pos, r.nbytes])
        pos = _align(pos + r.nbytes)
    pieces = [(_HEADER, memoryview(data))] + [(off, r) for (off, _), r in zip(layout, raws)]
    name, size, token = _fill_segment(pos, pieces)
    info: SegmentInfo = [name, size, len(data), layout, token]
    seg = Segment(name, size, info)
    return seg, attach(info)


def _fill_segment(need: int, pieces: list[tuple[int, memoryview]]) -> tuple[str, int, str]:
    """A segment (reused or new) of at least ``need`` bytes with a fresh header and
    each ``(offset, buffer)`` copied in; returns ``(name, size, token)``. Raises
    :class:`ShmUnavailable`; nothing is left behind on failure."""
    name, fd, size = _writable_segment(need)
    token = secrets.token_hex(8)
    try:
        with mmap.mmap(fd, size, flags=mmap.MAP_SHARED) as m:
            view = memoryview(m)
            try:
                view[:_HEADER] = _header(token)
                for offset, buf in pieces:
                    _copy_into(view[offset : offset + buf.nbytes], buf)
            finally:
                view.release()
    except BaseException:
        os.close(fd)
        unlink(name)
        raise
    os.close(fd)  # releases the exclusive lock: readers may map it now
    return name, size, token


def _header(token: str) -> bytes:
    return (_MAGIC + token.encode()).ljust(_HEADER, b"\0")


def _writable_segment(need: int) -> tuple[str, int, int]:
    """``(name, fd, size)`` of a segment of at least ``need`` bytes that nobody maps,
    opened for writing and locked exclusively: a reused one, or a new one."""
    reused = _reuse(need)
    if reused is not None:
        return reused
    size = max(need, _HEADER)
    name = _new_name()
    path = _path(name)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError as exc:
        raise ShmUnavailable(f"cannot create {path}: {exc}") from exc
    with _lock:
        _owned.add(name)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # reserve the pages now: a full /dev/shm is an error here, not a SIGBUS later
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        os.close(fd)
        unlink(name)
        if exc.errno == errno.ENOSPC:
            raise ShmUnavailable(
                f"shared memory is full: {size:,} bytes do not fit in {SHM_DIR} "
                f"({_free_bytes():,} bytes free); the value travels over tcp instead"
            ) from exc
        raise ShmUnavailable(f"cannot set up segment {name} of {size:,} bytes: {exc}; "
                             "the value travels over tcp instead") from exc
    return name, fd, size


# ------------------------------------------------------- reuse of retired segments
#
# A segment whose key was released is *retired*: kept for reuse instead of unlinked, up
# to ``pool_limit`` bytes. Every process that maps a segment holds a shared flock on it
# for as long as the mapping lives; the owner reuses a retired segment only when it can
# lock it exclusively (nobody maps it), renames it (a reader holding the old name fails
# to open it) and writes a new token (a reader that opened it just before checks the
# token once it has its lock, and gives up on a mismatch).

_pool: list[tuple[int, str]] = []  # (size, name) of retired segments
#: bytes of retired segments kept for reuse (a worker's first large values pay for
#: fresh pages; later ones of similar sizes are copied into pages already there)
pool_limit = 1 << 30


def retire(name: str, size: int) -> None:
    """The owner no longer needs segment ``name``: its name goes at once (nobody can
    map the released value any more), and its memory is kept for reuse under a pool
    name, or freed when the pool is full."""
    with _lock:
        keep = sum(s for s, _ in _pool) + size <= pool_limit and name in _owned
    if keep:
        pooled = _new_name("pool")
        try:
            os.rename(_path(name), _path(pooled))
        except OSError:
            keep = False
        else:
            with _lock:
                _owned.discard(name)
                _owned.add(pooled)
                _pool.append((size, pooled))
            return
    unlink(name)


def _reuse(need: int) -> tuple[str, int, int] | None:
    with _lock:
        candidates = sorted(e for e in _pool if need <= e[0] <= max(2 * need, need + (1 << 20)))
        for entry in candidates:
            _pool.remove(entry)
    for i, (size, old) in enumerate(candidates):
        try:
            fd = os.open(_path(old), os.O_RDWR)
        except OSError:
            with _lock:
                _owned.discard(old)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)  # someone still maps it: try it again later
            with _lock:
                _pool.append((size, old))
            continue
        new = _new_name()
        try:
            os.rename(_path(old), _path(new))
        except OSError:
            os.close(fd)
            unlink(old)
            continue
        with _lock:
            _owned.discard(old)
            _owned.add(new)
            _pool.extend(candidates[i + 1 :])
        return new, fd, size
    return None


def drain_pool() -> None:
    """Unlink every retired segment (a worker closing)."""
    with _lock:
        names = [n for _, n in _pool]
        _pool.clear()
    for name in names:
        unlink(name)


def _copy_into(dst: memoryview, src: memoryview) -> None:
    try:
        import numpy as np
    except ImportError:
        dst[:] = src
        return
    # numpy copies without holding the GIL
    np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))


def attach(info: Sequence[Any]) -> Any:
    """Map a segment copy-on-write and rebuild its value (zero-copy, writeable).

    Raises ``FileNotFoundError`` if the segment is gone (unlinked, owner died, reused)
    and ``ValueError`` for a malformed description.
    """
    try:
        name, size, nbytes, layout, token = info
        size, nbytes = int(size), int(nbytes)
        spans = [(int(o), int(n)) for o, n in layout]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"malformed segment description {info!r:.200}") from exc
    view = map_segment(name, size, str(token))
    return pickle.loads(view[_HEADER : _HEADER + nbytes], buffers=[view[o : o + n] for o, n in spans])


# mapped segments of this process: name -> (weak mapping, token), and address ranges
_maps: dict[str, tuple[weakref.ref[mmap.mmap], str]] = {}
_ranges: dict[str, tuple[int, int, str]] = {}


def map_segment(name: str, size: int, token: str) -> memoryview:
    """A copy-on-write view of segment ``name`` holding generation ``token`` (one
    mapping per segment and process, alive while any value uses it). Raises
    ``FileNotFoundError`` if it is gone or now holds something else."""
    with _lock:
        entry = _maps.get(name)
        m = entry[0]() if entry is not None and entry[1] == token else None
    if m is not None and len(m) >= size:
        return memoryview(m)
    fd = os.open(_path(name), os.O_RDONLY)
    try:
        try:
            # held while the mapping lives: the owner cannot reuse the segment meanwhile
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            raise FileNotFoundError(f"segment {name} is being rewritten") from None
        if os.pread(fd, _HEADER, 0) != _header(token):
            raise FileNotFoundError(f"segment {name} no longer holds the value asked for")
        if os.fstat(fd).st_size < size:
            raise ValueError(f"segment {name} is smaller than described")
        m = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    view = memoryview(m)
    start = _address(view)
    with _lock:
        _maps[name] = (weakref.ref(m, lambda _r, name=name, fd=fd: _forget(name, fd)), token)
        if start is not None:
            _ranges[name] = (start, start + size, token)
    return view


def _forget(name: str, fd: int) -> None:
    os.close(fd)  # the mapping is gone: release our shared lock
    with _lock:
        entry = _maps.get(name)
        if entry is not None and entry[0]() is None:
            del _maps[name]
            _ranges.pop(name, None)


def _address(view: memoryview) -> int | None:
    try:
        import numpy as np

        return int(np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0])
    except Exception:
        return None


def locate(buffer: memoryview) -> tuple[str, int, int, int, str] | None:
    """``(segment name, segment size, offset, length, token)`` if ``buffer`` lies
    inside a segment this process has mapped, else ``None``."""
    if not _ranges:
        return None
    start = _address(buffer)
    if start is None:
        return None
    n = buffer.nbytes
    with _lock:
        for name, (lo, hi, token) in _ranges.items():
            if lo <= start and start + n <= hi:
                return name, hi - lo, start - lo, n, token
    return None


def unlink(name: str) -> None:
    """Remove a segment's name (mappings stay valid); a missing name is fine."""
    with _lock:
        _owned.discard(name)
    try:
        os.unlink(_path(name))
    except FileNotFoundError:
        pass


@atexit.register
def _unlink_at_exit() -> None:
    unlink_all()


def owned() -> set[str]:
    """Names of the segments this process created and has not unlinked."""
    with _lock:
        return set(_owned)


def unlink_all() -> None:
    """Remove every segment this process created (clean shutdown)."""
    for name in owned():
        unlink(name)


def segments_of(pid: int) -> list[str]:
    """Names of existing segments created by process ``pid``."""
    prefix = f"{PREFIX}{pid}-"
    try:
        return [n for n in os.listdir(SHM_DIR) if n.startswith(prefix)]
    except OSError:
        return []


def sweep(pid: int) -> int:
    """Remove the segments of a process that is gone; returns how many."""
    names = segments_of(pid)
    for name in names:
        try:
            os.unlink(_path(name))
        except FileNotFoundError:
            pass
    return len(names)


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie counts as exited)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except Exception:  # includes NameError for open() during interpreter shutdown
        return False


def _free_bytes() -> int:
    try:
        st = os.statvfs(SHM_DIR)
        return st.f_bavail * st.f_frsize
    except OSError:
        return 0


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


# --------------------------------------------------------------- same-domain probing


def probe() -> tuple[str, str] | None:
    """Create a probe segment holding a random token; returns ``(name, token)``.

    The caller unlinks it (:func:`unlink`) once the peer has answered.
    """
    if not enabled():
        return None
    name = _new_name("probe")
    token = secrets.token_hex(16)
    try:
        fd = os.open(_path(name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError:
        return None
    with _lock:
        _owned.add(name)
    try:
        os.write(fd, token.encode())
    finally:
        os.close(fd)
    return name, token


def check_probe(name: Any, token: Any) -> bool:
    """Whether this process can open the peer's probe (same shared-memory domain)."""
    if not enabled() or not isinstance(name, str) or not isinstance(token, str):
        return False
    try:
        fd = os.open(_path(name), os.O_RDONLY)
    except (OSError, ValueError):
        return False
    try:
        return os.read(fd, 64).decode(errors="replace") == token
    finally:
        os.close(fd)


# ------------------------------------------- the same-host family: buffers by reference


#: private buffers at least this large cross to a same-host peer through a new segment
TRANSFER_MIN_BYTES = 1 << 20


def _same_host_dumps(obj: Any, destination: str) -> tuple[dict[str, Any], list[Any]]:
    """Pickle 5. A buffer that already lives in a segment travels as (name, size,
    offset, length). A large private buffer is copied into a segment of its own that the
    receiver maps and then unlinks (flag 1); a lease removes it should the receiver never
    get it. Small buffers travel as frames."""
    from ..protocol import leases
    from ..protocol.serialize import pickle_dumps

    buffers: list[pickle.PickleBuffer] = []
    data = pickle_dumps(obj, buffer_callback=buffers.append)
    refs: list[Any] = []
    frames: list[Any] = [data]
    use = enabled()
    for b in buffers:
        raw = b.raw()
        where = locate(raw) if use else None
        if where is not None and not os.path.exists(_path(where[0])):
            where = None  # its name was removed: a receiver could not map it
        if where is not None:
            name, size, offset, length, token = where
            refs.append([name, size, offset, length, 0, token])
        elif use and raw.nbytes >= TRANSFER_MIN_BYTES and leases.active():
            try:
                name, size, token = _segment_for_buffer(raw)
            except ShmUnavailable:
                refs.append(None)
                frames.append(raw)
                continue
            leases.lease(lambda name=name: unlink(name))
            refs.append([name, size, _HEADER, raw.nbytes, 1, token])
        else:
            refs.append(None)
            frames.append(raw)
    return ({"refs": refs} if any(r is not None for r in refs) else {}), frames


def _segment_for_buffer(raw: memoryview) -> tuple[str, int, str]:
    """A new segment holding a copy of ``raw``; returns (name, size, token)."""
    return _fill_segment(_align(_HEADER + raw.nbytes), [(_HEADER, raw)])


def _same_host_loads(header: dict[str, Any], frames: Sequence[Any]) -> Any:
    refs = header.get("refs")
    if not refs:
        return pickle.loads(frames[0], buffers=frames[1:])
    buffers: list[Any] = []
    it = iter(frames[1:])
    for ref in refs:
        if ref is None:
            buffers.append(next(it))
        else:
            name, size, offset, length, flag, token = ref
            view = map_segment(name, int(size), str(token))
            buffers.append(view[int(offset) : int(offset) + int(length)])
            if flag == 1:
                # a transfer: the mapping is ours now; the name is not needed any more
                try:
                    os.unlink(_path(name))
                except FileNotFoundError:
                    pass
    return pickle.loads(frames[0], buffers=buffers)


def shm_bytes(obj: Any) -> int:
    """Bytes of ``obj``'s buffers that live in segments (what a same-host peer maps)."""
    buffers: list[pickle.PickleBuffer] = []
    try:
        pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    except Exception:
        return 0
    total = 0
    for b in buffers:
        raw = b.raw()
        if locate(raw) is not None:
            total += raw.nbytes
    return total


def _register_family() -> None:
    from ..protocol import SAME_HOST, register_serializer

    register_serializer(object, _same_host_dumps, _same_host_loads, destinations=[SAME_HOST],
                        name="shoal.same-host")


_register_family()
