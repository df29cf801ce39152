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

Names come from peers, and ``/dev/shm`` is writable by every process of the host: a
name is turned into a path only if it looks like one of shoal's (:func:`_path`), and
an existing file is used only through :func:`_open_segment`, which neither follows a
symlink nor waits on a FIFO and takes nothing but a regular file of this user.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import errno
import fcntl
import itertools
import logging
import mmap
import os
import pickle
import secrets
import stat
import threading
import time
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
    "sweep_when_gone",
    "probe",
    "check_probe",
    "segments_of",
    "map_segment",
    "locate",
    "retire",
    "drain_pool",
    "trim_pool",
    "retire_later",
    "later",
    "work_off",
    "placements",
]

logger = logging.getLogger("shoal.comm.shm")

SHM_DIR = "/dev/shm"
PREFIX = "shoal-"
_ALIGN = 64
#: every segment starts with a header: magic and a random token naming this generation
#: of its contents (a segment may be reused, under a new name and a new token). A
#: *transfer* segment, made to be handed over to one receiver (flag-1 refs), has a magic
#: of its own: a receiver takes over (renames or removes) only a segment that says it is
#: a transfer, so a peer that learnt a value segment's name and token (any client of its
#: owner does) cannot make a receiver take that segment from its owner
_MAGIC = b"SHOALSEG"
_TRANSFER_MAGIC = b"SHOALTRN"
_HEADER = 64
#: where a value's buffers start in its segment (room for the header and the pickle
#: stream of an ordinary value before them), so that one segment size fits a value
#: copied in and an array born in the segment alike, and either can reuse the other's
_DATA_OFFSET = 4096
_counter = itertools.count()
_lock = threading.Lock()
_owned: set[str] = set()


class ShmUnavailable(ShoalError):
    """Shared memory cannot be used for this value (full, missing, or turned off)."""


_HAS_SHM_DIR = os.path.isdir(SHM_DIR)


def enabled() -> bool:
    """Whether this process may use the shared-memory data plane."""
    return _HAS_SHM_DIR and os.environ.get("SHOAL_SHM", "1") != "0"


#: the longest file name tmpfs takes (NAME_MAX)
_MAX_NAME = 255
#: opening a name someone else may have made: never follow a symlink out of /dev/shm,
#: never wait for a writer (a FIFO), never leak the descriptor into a child's exec
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
#: whose files this process takes for segments (read once: checking costs no syscall;
#: refreshed in a forked child)
_euid = os.geteuid()


def _path(name: str) -> str:
    """``/dev/shm/<name>`` for a name in shoal's form (``shoal-...``, at most 255
    characters, no ``/``, no ``..``, no NUL). Raises ``ValueError`` for any other name,
    e.g. one a peer made up to reach a file outside ``/dev/shm``."""
    if (
        type(name) is not str
        or not name.startswith(PREFIX)
        or len(name) <= len(PREFIX)
        or len(name) > _MAX_NAME
        or "/" in name
        or ".." in name
        or "\0" in name
    ):
        raise ValueError(f"not a shoal segment name: {name!r:.300}")
    return f"{SHM_DIR}/{name}"


def _open_segment(name: str, flags: int) -> tuple[int, os.stat_result]:
    """Open the segment file ``name`` (``flags``: its access mode) and return the
    descriptor and its ``fstat``.

    Raises ``ValueError`` for a name not in shoal's form (:func:`_path`), and
    ``FileNotFoundError`` when there is no file by that name or what is there is no
    segment: a symlink, a FIFO, a device, a directory, another user's file (also one
    this process may not open). Any other ``OSError`` propagates.
    """
    try:
        fd = os.open(_path(name), flags | _OPEN_FLAGS)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.EACCES, errno.EPERM):
            # a symlink (O_NOFOLLOW), a FIFO without reader (O_NONBLOCK), a directory,
            # another user's file that a non-root process may not open
            raise FileNotFoundError(f"{SHM_DIR}/{name} is not a shoal segment ({exc.strerror})") from None
        raise
    try:
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(st.st_mode) or st.st_uid != _euid:
        os.close(fd)
        what = f"a file of uid {st.st_uid}" if stat.S_ISREG(st.st_mode) else "not a regular file"
        raise FileNotFoundError(f"{SHM_DIR}/{name} is not a shoal segment of this user ({what})")
    return fd, st


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
    _work_off_freed()
    buffers: list[pickle.PickleBuffer] = []
    try:
        data = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    except KeyboardInterrupt:
        raise
    except BaseException:  # noqa: BLE001 - a __reduce__ may raise anything: the value stays private
        return None
    raws = [b.raw() for b in buffers]
    big = sum(r.nbytes for r in raws)
    if big < min_buffer_bytes:
        return None
    born = _publish_born(data, raws)
    if born is not None:
        placements["born"] += 1
        return born, attach(born.info)
    placements["copied"] += 1
    layout: list[list[int]] = []
    pos = max(_DATA_OFFSET, _align(_HEADER + len(data)))
    for r in raws:
        layout.append([pos, r.nbytes])
        pos = _align(pos + r.nbytes)
    pieces = [(_HEADER, memoryview(data))] + [(off, r) for (off, _), r in zip(layout, raws)]
    name, size, token = _fill_segment(pos, pieces)
    info: SegmentInfo = [name, size, len(data), layout, token]
    seg = Segment(name, size, info)
    return seg, _attach_placed(seg)


def _attach_placed(seg: Segment) -> Any:
    """The value just placed in ``seg``, mapped. Mapping it can fail for want of
    address space (``ENOMEM`` under ``RLIMIT_AS``): then the segment goes and
    :class:`ShmUnavailable` says why (the value stays in private memory)."""
    try:
        return attach(seg.info)
    except (OSError, MemoryError) as exc:
        seg.unlink()
        raise ShmUnavailable(f"cannot map segment {seg.name} of {seg.size:,} bytes: {exc}; "
                             "the value stays in private memory") from exc


def _fill_segment(need: int, pieces: list[tuple[int, memoryview]], keep: bool = True) -> tuple[str, int, str]:
    """A segment (reused or new) of at least ``need`` bytes with a fresh header and
    each ``(offset, buffer)`` copied in; returns ``(name, size, token)``. A reused
    segment is filled through the owner's mapping (its pages are there: no faults); a
    new one with ``pwrite``, which fills fresh tmpfs pages far faster than faulting
    them in through a mapping (here 0.5 against 0.8 ms per MB). With ``keep`` the
    segment stays the owner's, mapped for its reuse; without, it is a transfer segment
    (its header says so). Raises :class:`ShmUnavailable`;
    nothing is left behind on failure."""
    # a segment not kept is written once: one without a mapping is filled by pwrite
    # (cheaper than mapping its pages for one copy)
    name, fd, size, writer = _writable_segment(need, mapped=keep)
    token = secrets.token_hex(8)
    header = _header(token, transfer=not keep)
    try:
        if writer is None:
            _pwrite_all(fd, header, 0)
            for offset, buf in pieces:
                _pwrite_all(fd, buf, offset)
        else:
            view = memoryview(writer)
            try:
                view[:_HEADER] = header
                for offset, buf in pieces:
                    _copy_into(view[offset : offset + buf.nbytes], buf)
            finally:
                view.release()
    except BaseException as exc:
        os.close(fd)
        if writer is not None:
            writer.close()
        unlink(name)
        if isinstance(exc, OSError):
            raise ShmUnavailable(f"cannot write segment {name} of {size:,} bytes: {exc}; "
                                 "the value travels over tcp instead") from exc
        raise
    os.close(fd)  # releases the exclusive lock: readers may map it now
    if writer is None and keep:
        # map it now, while its pages are at hand, so that reusing it costs no faults
        try:
            writer = _writer(name, size)
        except OSError:
            pass
    if writer is not None:
        if keep:
            with _lock:
                _writers[name] = writer
        else:
            writer.close()
    return name, size, token


def _pwrite_all(fd: int, data: Any, offset: int) -> None:
    """Write all of ``data`` at ``offset`` (the GIL is released while the kernel copies)."""
    view = memoryview(data).cast("B")
    done = 0
    while done < view.nbytes:
        done += os.pwrite(fd, view[done:], offset + done)


def _header(token: str, transfer: bool = False) -> bytes:
    return ((_TRANSFER_MAGIC if transfer else _MAGIC) + token.encode()).ljust(_HEADER, b"\0")


def _writable_segment(need: int, mapped: bool = True) -> tuple[str, int, int, mmap.mmap | None]:
    """``(name, fd, size, writer)`` of a segment of at least ``need`` bytes that nobody
    maps, opened for writing and locked exclusively: a reused one, with the owner's
    shared mapping of it (pages faulted in), or a new one (``writer`` is ``None``: the
    mapping is made when the segment is first reused)."""
    reused = _reuse(need, mapped)
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
        # reserve the pages now: a full /dev/shm is a clear error before anything is copied
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
    return name, fd, size, None


def _writer(name: str, size: int) -> mmap.mmap:
    """The owner's shared mapping of a segment. Made through a descriptor of its own:
    mmap keeps a duplicate of the descriptor it is given, and a duplicate of the
    locked one would hold the exclusive lock for as long as the mapping lives. Raises
    ``OSError`` (``FileNotFoundError`` if the file is gone or no segment any more)."""
    fd, _ = _open_segment(name, os.O_RDWR)
    try:
        # MAP_POPULATE maps every page in one call: far cheaper here than a fault per page
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    finally:
        os.close(fd)


# ------------------------------------------------------- reuse of retired segments
#
# A segment whose key was released is *retired*: kept for reuse instead of unlinked, up
# to ``pool_limit`` bytes. Every process that maps a segment holds a shared flock on it
# for as long as the mapping lives; the owner reuses a retired segment only when it can
# lock it exclusively (nobody maps it), renames it (a reader holding the old name fails
# to open it) and writes a new token (a reader that opened it just before checks the
# token once it has its lock, and gives up on a mismatch).

_pool: list[tuple[int, str]] = []  # (size, name) of retired segments
_retired_at: dict[str, float] = {}  # pool name -> when it was retired (monotonic)
#: the owner's shared mappings of its segments (value and pooled), kept so that reusing
#: a segment costs no page faults; closed when the segment is unlinked
_writers: dict[str, mmap.mmap] = {}
#: bytes of retired segments kept for reuse (a worker's first large values pay for
#: fresh pages; later ones of similar sizes are copied into pages already there)
pool_limit = 1 << 30


def retire(name: str, size: int) -> None:
    """The owner no longer needs segment ``name``: its name goes at once (nobody can
    map the released value any more), and its memory is kept for reuse under a pool
    name, or freed when the pool is full."""
    _work_off_freed()  # an array born in it may have been freed meanwhile
    _retire(name, size)


def retire_later(name: str, size: int) -> None:
    """:func:`retire` from anywhere, even a finalizer run by the garbage collector
    while this thread holds the module's lock: only queued (see :func:`later`)."""
    _later.append((_retire, (name, size)))


def later(fn: Any, *args: Any) -> None:
    """Call ``fn(*args)`` at the next call into the pool (or :func:`work_off`), not now:
    for finalizers, which may run inside the garbage collector at any point, even while
    this thread holds the module's lock."""
    _later.append((fn, args))


def work_off() -> None:
    """Do what finalizers and numpy's frees queued (retire segments, free arrays)."""
    _work_off_freed()


def _retire(name: str, size: int) -> None:
    with _lock:
        keep = (sum(s for s, _ in _pool) + size <= pool_limit and name in _owned
                and name not in _born_names)  # an array still lives in it: not reusable yet
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
                _retired_at[pooled] = time.monotonic()
                if name in _writers:
                    _writers[pooled] = _writers.pop(name)
            return
    unlink(name)


def _reuse(need: int, mapped: bool = True) -> tuple[str, int, int, mmap.mmap | None] | None:
    with _lock:
        candidates = sorted(e for e in _pool if need <= e[0] <= max(2 * need, need + (1 << 20)))
        for entry in candidates:
            _pool.remove(entry)
    for i, (size, old) in enumerate(candidates):
        try:
            fd, _ = _open_segment(old, os.O_RDWR)
        except OSError:  # gone, or replaced by something that is no segment of ours
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
            _retired_at.pop(old, None)
            writer = _writers.pop(old, None)
        if writer is not None and writer.closed:
            writer = None
        if writer is None and mapped:
            try:
                writer = _writer(new, size)
            except OSError:
                os.close(fd)
                unlink(new)
                continue
        return new, fd, size, writer
    return None


def drain_pool() -> None:
    """Unlink every retired segment (a worker closing)."""
    with _lock:
        names = [n for _, n in _pool]
        _pool.clear()
    for name in names:
        unlink(name)


def trim_pool(max_idle: float) -> int:
    """Unlink the retired segments that no value reused for ``max_idle`` seconds, so
    that an idle worker gives their memory back; returns how many went."""
    now = time.monotonic()
    with _lock:
        stale = [e for e in _pool if now - _retired_at.get(e[1], now) >= max_idle]
        for e in stale:
            _pool.remove(e)
    for _, name in stale:
        unlink(name)
    return len(stale)


# ------------------------------------------------------------ deferred actions
#
# Finalizers (and numpy's frees of arrays born in segments, :mod:`.shm_born`) may run
# anywhere, even inside the garbage collector while this thread holds the module's
# lock: they only queue what they need done, and later calls here do it.

#: values this process placed: published where they were born, or copied in
placements = {"born": 0, "copied": 0}
#: segments that hold an array born in them (:mod:`.shm_born`): not reusable yet
_born_names: set[str] = set()
#: what finalizers asked for (see :func:`later`)
_later: collections.deque[tuple[Any, tuple[Any, ...]]] = collections.deque()


def _work_off_freed() -> None:
    while _later:
        try:
            fn, args = _later.popleft()
        except IndexError:
            return
        fn(*args)


def _publish_born(data: bytes, raws: list[memoryview]) -> Segment | None:
    if not _born_names:  # no array was born in a segment: nothing to publish
        return None
    from .shm_born import publish

    return publish(data, raws)


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
    or what bears its name is no segment of this user (see :func:`map_segment`), and
    ``ValueError`` for a malformed description (a name not in shoal's form included).
    """
    try:
        name, size, nbytes, layout, token = info
        size, nbytes = int(size), int(nbytes)
        spans = [(int(o), int(n)) for o, n in layout]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"malformed segment description {info!r:.200}") from exc
    _path(name)  # the name's own error first: it says more than one about sizes
    # a slice beyond the mapping would be cut short silently, not fail
    if nbytes < 0 or _HEADER + nbytes > size or any(o < 0 or n < 0 or o + n > size for o, n in spans):
        raise ValueError(f"segment description with spans outside the segment {info!r:.200}")
    view = map_segment(name, size, str(token))
    return pickle.loads(view[_HEADER : _HEADER + nbytes], buffers=[view[o : o + n] for o, n in spans])


# mapped segments of this process: name -> (weak mapping, token), and address ranges
_maps: dict[str, tuple[weakref.ref[mmap.mmap], str]] = {}
_ranges: dict[str, tuple[int, int, str]] = {}


#: a worker process keeps the transfer segments it receives (renamed to names of its
#: own, see :func:`map_segment`), so that its peers map them too
adopt_transfers = False


def map_segment(name: str, size: int, token: str, own: bool = False, adopt: bool = False,
                take: bool = False) -> memoryview:
    """A copy-on-write view of segment ``name`` holding generation ``token`` (one
    mapping per segment and process, alive while any value uses it; with ``own``, a
    mapping of its own, whose writes no other user of the segment in this process
    sees: a task's arguments). With ``adopt`` (a transfer segment sent to this
    process) the file is renamed to a name of this process, which it keeps while the
    mapping lives and then retires to its pool, its header now a value segment's;
    :func:`locate` gives the new name. With ``adopt`` or ``take`` (the caller removes
    the name once mapped) the segment must be a transfer segment. Raises
    ``FileNotFoundError`` if it is gone, now holds something else or is no segment of
    this user (see :func:`_open_segment`), ``ValueError`` for a name not in shoal's
    form, a size the file does not have, or a value segment to be taken over."""
    if not (own or adopt or take):  # a segment to take over has its header checked
        with _lock:
            entry = _maps.get(name)
            m = entry[0]() if entry is not None and entry[1] == token else None
        if m is not None and len(m) >= size:
            return memoryview(m)
    if size < _HEADER:
        raise ValueError(f"segment {name!r:.300} described with {size} bytes, less than its header")
    fd, st = _open_segment(name, os.O_RDWR if adopt else os.O_RDONLY)
    try:
        try:
            # held while the mapping lives: the owner cannot reuse the segment meanwhile
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            raise FileNotFoundError(f"segment {name} is being rewritten") from None
        header = os.pread(fd, _HEADER, 0)
        if header != _header(token, transfer=True) and (adopt or take or header != _header(token)):
            if header == _header(token):
                raise ValueError(f"segment {name} is a value's, not a transfer: it cannot be handed over")
            raise FileNotFoundError(f"segment {name} no longer holds the value asked for")
        if st.st_size < size:
            raise ValueError(f"segment {name} is smaller than described")
        m = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        if adopt:
            new = _new_name()
            try:
                os.rename(_path(name), _path(new))
            except FileNotFoundError:
                raise FileNotFoundError(f"segment {name} went away while it was mapped") from None
            # ours now, and a value's: nobody can hand it over again
            _pwrite_all(fd, _header(token), 0)
            with _lock:
                _owned.add(new)
            name = new
    except BaseException:
        os.close(fd)
        raise
    view = memoryview(m)
    if own:
        weakref.finalize(m, os.close, fd).atexit = False  # the lock goes with the mapping
        return view
    start = _address(view)
    retire_size = size if adopt else -1

    def gone(_ref: weakref.ref[mmap.mmap]) -> None:
        _forget(name, fd, retire_size)

    with _lock:
        _maps[name] = (weakref.ref(m, gone), token)
        if start is not None:
            _ranges[name] = (start, start + size, token)
    return view


def _forget(name: str, fd: int, retire_size: int = -1) -> None:
    os.close(fd)  # the mapping is gone: release our shared lock
    with _lock:
        entry = _maps.get(name)
        if entry is not None and entry[0]() is None:
            del _maps[name]
            _ranges.pop(name, None)
    if retire_size >= 0:
        retire_later(name, retire_size)  # an adopted segment: nobody here uses it now


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
        _retired_at.pop(name, None)
        writer = None if name in _born_names else _writers.pop(name, None)
    if writer is not None:
        _close_writer(writer)
    try:
        os.unlink(_path(name))
    except FileNotFoundError:
        pass


def _close_writer(writer: mmap.mmap) -> None:
    try:
        writer.close()
    except BufferError:
        pass  # a view of it is still alive somewhere: it goes with that view


@atexit.register
def _unlink_at_exit() -> None:
    unlink_all()


def _forget_parent_segments() -> None:
    """In a child made by ``fork`` (a task using multiprocessing, say): the parent's
    segments, pool and arrays are the parent's. The child must not reuse, unlink or
    publish them (its exit would otherwise remove the parent's values)."""
    global _lock
    _lock = threading.Lock()  # it may have been held by another thread at the fork
    _owned.clear()
    _pool.clear()
    _retired_at.clear()
    _writers.clear()
    _born_names.clear()
    _later.clear()
    global adopt_transfers, _euid
    adopt_transfers = False
    _euid = os.geteuid()


os.register_at_fork(after_in_child=_forget_parent_segments)


def owned() -> set[str]:
    """Names of the segments this process created and has not unlinked."""
    with _lock:
        return set(_owned)


def unlink_all() -> None:
    """Remove every segment this process created (clean shutdown), and any file still
    named after it (segments given back to it and not taken in yet)."""
    for name in owned():
        unlink(name)
    sweep(os.getpid())


def segments_of(pid: int) -> list[str]:
    """Names of existing segments created by process ``pid``."""
    prefix = f"{PREFIX}{pid}-"
    try:
        return [n for n in os.listdir(SHM_DIR) if n.startswith(prefix)]
    except OSError:
        return []


def sweep(pid: int) -> int:
    """Remove the segments of a process that is gone; returns how many. Only this
    user's regular files go: the pid may come from a peer, and a file another user
    made under that name is not ours to remove."""
    removed = 0
    for name in segments_of(pid):
        try:
            path = _path(name)
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_uid == _euid:
                os.unlink(path)
                removed += 1
        except (OSError, ValueError):
            pass
    return removed


async def sweep_when_gone(pid: int, wait: float = 1.0) -> int:
    """Remove the segments of process ``pid`` once it has exited; a connection to it
    may close a moment before the process is gone, so look for up to ``wait`` seconds.
    Returns how many went (0 when it lives on: it removes its own when it exits)."""
    deadline = time.monotonic() + wait
    while not process_gone(pid):
        if time.monotonic() >= deadline:
            return 0
        await asyncio.sleep(0.05)  # polling: nothing signals another process's exit
    return sweep(pid)


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
    """Create a probe segment holding a random token; returns ``(name, token)``, or
    ``None`` when the data plane is off or the probe cannot be made (``/dev/shm`` full,
    out of descriptors, any ``OSError``): the connection then offers no shared memory
    and its values travel over tcp. The first such failure of a process is logged as a
    warning; a probe that could not be completed is removed at once.

    The caller unlinks it (:func:`unlink`) once the peer has answered.
    """
    if not enabled():
        return None
    name = _new_name("probe")
    token = secrets.token_hex(16)
    path = _path(name)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        _probe_failed(exc)
        return None
    with _lock:
        _owned.add(name)
    try:
        try:
            data = token.encode()
            if os.write(fd, data) != len(data):
                raise OSError(errno.ENOSPC, "short write of the probe token")
        finally:
            os.close(fd)
    except BaseException as exc:
        try:
            unlink(name)  # an empty probe in a full /dev/shm: never left behind
        except OSError:
            pass
        if not isinstance(exc, OSError):
            raise
        _probe_failed(exc)
        return None
    return name, token


_probe_warned = False


def _probe_failed(exc: OSError) -> None:
    global _probe_warned
    if _probe_warned:
        logger.debug("no shared-memory probe for a connection: %s", exc)
        return
    _probe_warned = True
    logger.warning("cannot create a shared-memory probe in %s (%s): connections of this process "
                   "offer no shared memory until one can be made; their values travel over tcp "
                   "(this is said once)", SHM_DIR, exc)


def check_probe(name: Any, token: Any) -> bool:
    """Whether this process can open the peer's probe (same shared-memory domain):
    False at once for anything but a regular file of this user, in shoal's naming,
    holding ``token`` (a FIFO, say, which a blocking open would wait on forever)."""
    if not enabled() or not isinstance(name, str) or not isinstance(token, str):
        return False
    try:
        fd, _ = _open_segment(name, os.O_RDONLY)
    except (OSError, ValueError):
        return False
    try:
        return os.read(fd, 64).decode(errors="replace") == token
    except OSError:
        return False
    finally:
        os.close(fd)
