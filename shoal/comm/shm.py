"""The same-host data plane: values in POSIX shared memory (``/dev/shm``).

A *segment* holds one value: its pickle-5 stream and out-of-band buffers, each buffer
64-byte aligned. The owner writes it once through a shared mapping and never again;
readers (the owner's own tasks included) map it ``MAP_PRIVATE``, so an input array is
writeable and a write copies only the touched pages: no reader ever changes what
another sees, and reading needs no copy.

Names are ``shoal-<pid>-<n>``: whoever finds a dead process's segments (its
``LocalCluster``, its scheduler) removes them with :func:`sweep`. A reader that mapped a
segment keeps valid memory after the owner unlinks the name. The file rules (names,
headers, how a file a peer names is opened) are :mod:`.shm_files`'; which segments
this process holds, in which state, and its pool of retired segments are
:data:`registry`'s (:mod:`.shm_registry`), which the functions here drive.

Whether two processes share a shared-memory domain is tested, not guessed from host
names: one creates a probe segment and the other opens it (:func:`probe`,
:func:`check_probe`). ``SHOAL_SHM=0`` turns the data plane off.

Checksums (``shm-verify``, off by default): the owner then hashes a value's pickle
stream and buffers (xxh3_64) as it places it and puts the checksum in the segment info
(its sixth element); a reader that maps a segment whose info carries one hashes what
it mapped and raises :class:`~shoal.errors.CorruptedDataError` on a mismatch. Off by
default because hashing costs more than the mapping it checks: mapping a 64 MB value
takes microseconds and the whole same-host transfer ~2 ms, hashing it ~4 ms (8 with the
page faults of a fresh mapping); a segment's bytes are RAM like a process's own,
written once by their owner (mode 0600), read by everyone else through private
mappings, and a reused segment is told apart by the token in its header. Values that
leave a segment for a socket or a spill file are checksummed there.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import logging
import mmap
import os
import pickle
import secrets
import weakref
from collections.abc import Sequence
from typing import Any

import xxhash

from .. import config
from ..errors import CorruptedDataError, ShoalError
from .shm_files import (
    DATA_OFFSET,
    HEADER,
    PREFIX,
    SHM_DIR,
    align,
    free_bytes,
    new_name,
    open_segment,
    owner_mapping,
    process_gone,
    pwrite_all,
    segment_header,
    segment_path,
    segments_of,
    sweep,
    sweep_when_gone,
)
from .shm_registry import registry

__all__ = [
    "SHM_DIR",
    "PREFIX",
    "enabled",
    "ShmUnavailable",
    "Segment",
    "SegmentInfo",
    "registry",
    "place",
    "fill_segment",
    "attach",
    "verify",
    "unlink",
    "unlink_all",
    "owned",
    "sweep",
    "sweep_when_gone",
    "process_gone",
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


class ShmUnavailable(ShoalError):
    """Shared memory cannot be used for this value (full, missing, or turned off)."""


_HAS_SHM_DIR = os.path.isdir(SHM_DIR)


def enabled() -> bool:
    """Whether this process may use the shared-memory data plane."""
    return _HAS_SHM_DIR and os.environ.get("SHOAL_SHM", "1") != "0"


# A segment's info travels in messages:
#   [name, total size, pickle length, [[offset, length], ...], token]
SegmentInfo = list

#: values this process placed: published where they were born, or copied in
placements = {"born": 0, "copied": 0}


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
    registry.work_off()
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
    checksum = _checksum(data, raws) if config.get("shm-verify") else None
    born = _publish_born(data, raws)
    if born is not None:
        placements["born"] += 1
        if checksum is not None:
            born.info.append(checksum)
        return born, attach(born.info, verify=False)
    placements["copied"] += 1
    layout: list[list[int]] = []
    pos = max(DATA_OFFSET, align(HEADER + len(data)))
    for r in raws:
        layout.append([pos, r.nbytes])
        pos = align(pos + r.nbytes)
    pieces = [(HEADER, memoryview(data))] + [(off, r) for (off, _), r in zip(layout, raws)]
    name, size, token = fill_segment(pos, pieces)
    info: SegmentInfo = [name, size, len(data), layout, token]
    if checksum is not None:
        info.append(checksum)
    seg = Segment(name, size, info)
    return seg, _attach_placed(seg)


def _checksum(data: Any, buffers: Sequence[Any]) -> int:
    """The checksum of a value in a segment: xxh3_64 of its pickle stream and then its
    buffers, in order."""
    h = xxhash.xxh3_64()
    h.update(data)
    for b in buffers:
        h.update(b)
    return h.intdigest()


def _attach_placed(seg: Segment) -> Any:
    """The value just placed in ``seg``, mapped. Mapping it can fail for want of
    address space (``ENOMEM`` under ``RLIMIT_AS``): then the segment goes and
    :class:`ShmUnavailable` says why (the value stays in private memory)."""
    try:
        return attach(seg.info, verify=False)
    except (OSError, MemoryError) as exc:
        seg.unlink()
        raise ShmUnavailable(f"cannot map segment {seg.name} of {seg.size:,} bytes: {exc}; "
                             "the value stays in private memory") from exc


def _publish_born(data: bytes, raws: list[memoryview]) -> Segment | None:
    if not registry.has_born():  # no array was born in a segment: nothing to publish
        return None
    from .shm_born import publish

    return publish(data, raws)


def fill_segment(need: int, pieces: list[tuple[int, memoryview]], keep: bool = True) -> tuple[str, int, str]:
    """A segment (reused or new) of at least ``need`` bytes with a fresh header and
    each ``(offset, buffer)`` copied in; returns ``(name, size, token)``. A reused
    segment is filled through the owner's mapping (its pages are there: no faults); a
    new one with ``pwrite``, which fills fresh tmpfs pages far faster than faulting
    them in through a mapping (here 0.5 against 0.8 ms per MB). With ``keep`` the
    segment stays the owner's, published and mapped for its reuse; without, it is a
    transfer segment (its header says so), leased. Raises :class:`ShmUnavailable`;
    nothing is left behind on failure."""
    # a segment not kept is written once: one without a mapping is filled by pwrite
    # (cheaper than mapping its pages for one copy)
    name, fd, size, writer = _writable_segment(need, mapped=keep)
    token = secrets.token_hex(8)
    header = segment_header(token, transfer=not keep)
    try:
        if writer is None:
            pwrite_all(fd, header, 0)
            for offset, buf in pieces:
                pwrite_all(fd, buf, offset)
        else:
            view = memoryview(writer)
            try:
                view[:HEADER] = header
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
    if not keep:
        if writer is not None:
            writer.close()
        registry.lease(name)
        return name, size, token
    if writer is None:
        # map it now, while its pages are at hand, so that reusing it costs no faults
        try:
            writer = owner_mapping(name, size)
        except OSError:
            pass
    registry.publish(name, writer)
    return name, size, token


def _writable_segment(need: int, mapped: bool = True) -> tuple[str, int, int, mmap.mmap | None]:
    """``(name, fd, size, writer)`` of a segment of at least ``need`` bytes that nobody
    maps, opened for writing and locked exclusively: a reused one, with the owner's
    shared mapping of it (pages faulted in), or a new one (``writer`` is ``None``: the
    mapping is made when the segment is first reused)."""
    reused = registry.reuse(need, mapped)
    if reused is not None:
        return reused
    size = max(need, HEADER)
    name = new_name()
    try:
        fd = registry.create(name)
    except OSError as exc:
        raise ShmUnavailable(f"cannot create {segment_path(name)}: {exc}") from exc
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
                f"({free_bytes():,} bytes free); the value travels over tcp instead"
            ) from exc
        raise ShmUnavailable(f"cannot set up segment {name} of {size:,} bytes: {exc}; "
                             "the value travels over tcp instead") from exc
    return name, fd, size, None


def _copy_into(dst: memoryview, src: memoryview) -> None:
    try:
        import numpy as np
    except ImportError:
        dst[:] = src
        return
    # numpy copies without holding the GIL
    np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))


# ------------------------------------------------------- reuse of retired segments
#
# A segment whose key was released is *retired*: kept for reuse instead of unlinked, up
# to ``registry.pool_limit`` bytes (see :class:`.shm_registry.SegmentRegistry` for when
# a retired segment is reused). Finalizers (and numpy's frees of arrays born in
# segments, :mod:`.shm_born`) may run anywhere, even inside the garbage collector while
# this thread holds the registry's lock: they only queue what they need done, and
# later calls here do it.


def retire(name: str, size: int) -> None:
    """The owner no longer needs segment ``name``: its name goes at once (nobody can
    map the released value any more), and its memory is kept for reuse under a pool
    name, or freed when the pool is full. Raises
    :class:`~shoal.statelog.InvalidTransition` for a segment that cannot be retired
    (a transfer, or one already pooled)."""
    registry.work_off()  # an array born in it may have been freed meanwhile
    registry.retire(name, size)


def retire_later(name: str, size: int) -> None:
    """:func:`retire` from anywhere, even a finalizer run by the garbage collector
    while this thread holds the registry's lock: only queued (see :func:`later`)."""
    registry.later(registry.retire, name, size)


def later(fn: Any, *args: Any) -> None:
    """Call ``fn(*args)`` at the next call into the pool (or :func:`work_off`), not now:
    for finalizers, which may run inside the garbage collector at any point, even while
    this thread holds the registry's lock."""
    registry.later(fn, *args)


def work_off() -> None:
    """Do what finalizers and numpy's frees queued (retire segments, free arrays)."""
    registry.work_off()


def drain_pool() -> None:
    """Unlink every retired segment (a worker closing)."""
    registry.drain_pool()


def trim_pool(max_idle: float) -> int:
    """Unlink the retired segments that no value reused for ``max_idle`` seconds, so
    that an idle worker gives their memory back; returns how many went."""
    return registry.trim_pool(max_idle)


# ------------------------------------------------------------------------ reading


def attach(info: Sequence[Any], verify: bool = True) -> Any:
    """Map a segment copy-on-write and rebuild its value (zero-copy, writeable).

    Raises ``FileNotFoundError`` if the segment is gone (unlinked, owner died, reused)
    or what bears its name is no segment of this user (see :func:`map_segment`),
    ``ValueError`` for a malformed description (a name not in shoal's form included),
    and :class:`~shoal.errors.CorruptedDataError` when the info carries a checksum
    (and ``verify``) that what is mapped does not match.
    """
    try:
        name, size, nbytes, layout, token, *more = info
        size, nbytes = int(size), int(nbytes)
        spans = [(int(o), int(n)) for o, n in layout]
        checksum = int(more[0]) if more and more[0] is not None else None
        if len(more) > 1:
            raise ValueError("more than six elements")
    except (TypeError, ValueError) as exc:
        raise ValueError(f"malformed segment description {info!r:.200}") from exc
    segment_path(name)  # the name's own error first: it says more than one about sizes
    # a slice beyond the mapping would be cut short silently, not fail
    if nbytes < 0 or HEADER + nbytes > size or any(o < 0 or n < 0 or o + n > size for o, n in spans):
        raise ValueError(f"segment description with spans outside the segment {info!r:.200}")
    view = map_segment(name, size, str(token))
    data, buffers = view[HEADER : HEADER + nbytes], [view[o : o + n] for o, n in spans]
    if verify and checksum is not None and _checksum(data, buffers) != checksum:
        raise CorruptedDataError(f"segment {name} ({size:,} bytes) does not match its checksum: its bytes "
                                 "changed after its owner wrote them")
    return pickle.loads(data, buffers=buffers)


def verify(info: Sequence[Any]) -> None:
    """Check the value a segment info describes against the checksum in it (nothing
    when it has none). Raises :class:`~shoal.errors.CorruptedDataError` on a mismatch,
    and what :func:`attach` raises for a segment that cannot be mapped."""
    if len(info) > 5 and info[5] is not None:
        attach(info)


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
    this user (see :func:`.shm_files.open_segment`), ``ValueError`` for a name not in
    shoal's form, a size the file does not have, or a value segment to be taken over."""
    if not (own or adopt or take):  # a segment to take over has its header checked
        m = registry.mapping(name, token)
        if m is not None and len(m) >= size:
            return memoryview(m)
    if size < HEADER:
        raise ValueError(f"segment {name!r:.300} described with {size} bytes, less than its header")
    fd, st = open_segment(name, os.O_RDWR if adopt else os.O_RDONLY)
    try:
        try:
            # held while the mapping lives: the owner cannot reuse the segment meanwhile
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            raise FileNotFoundError(f"segment {name} is being rewritten") from None
        header = os.pread(fd, HEADER, 0)
        if header != segment_header(token, transfer=True) and (adopt or take or header != segment_header(token)):
            if header == segment_header(token):
                raise ValueError(f"segment {name} is a value's, not a transfer: it cannot be handed over")
            raise FileNotFoundError(f"segment {name} no longer holds the value asked for")
        if st.st_size < size:
            raise ValueError(f"segment {name} is smaller than described")
        m = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        if adopt:
            try:
                name = registry.adopt(name)
            except FileNotFoundError:
                raise FileNotFoundError(f"segment {name} went away while it was mapped") from None
            # ours now, and a value's: nobody can hand it over again
            pwrite_all(fd, segment_header(token), 0)
    except BaseException:
        os.close(fd)
        raise
    view = memoryview(m)
    if own:
        weakref.finalize(m, os.close, fd).atexit = False  # the lock goes with the mapping
        return view
    retire_size = size if adopt else -1

    def gone(_ref: weakref.ref[mmap.mmap]) -> None:
        os.close(fd)  # the mapping is gone: release our shared lock
        registry.forget_mapping(name)
        if retire_size >= 0:
            retire_later(name, retire_size)  # an adopted segment: nobody here uses it now

    registry.remember_mapping(name, m, token, size, gone)
    return view


def locate(buffer: memoryview) -> tuple[str, int, int, int, str] | None:
    """``(segment name, segment size, offset, length, token)`` if ``buffer`` lies
    inside a segment this process has mapped, else ``None``."""
    return registry.locate(buffer)


# ---------------------------------------------------------------------- removal


def unlink(name: str) -> None:
    """Remove a segment's name (mappings stay valid); a missing name is fine. Raises
    ``ValueError`` for a name not in shoal's form."""
    registry.unlink(name)


def owned() -> set[str]:
    """Names of the segments this process created and has not unlinked."""
    return registry.owned()


@atexit.register
def unlink_all() -> None:
    """Remove every segment this process created (clean shutdown), and any file still
    named after it (segments given back to it and not taken in yet)."""
    registry.unlink_all()
    sweep(os.getpid())


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
    name = new_name("probe")
    token = secrets.token_hex(16)
    try:
        fd = registry.create(name)
    except OSError as exc:
        _probe_failed(exc)
        return None
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
    registry.publish(name)
    return name, token


#: whether this process said that it cannot make a probe (it says it once)
probe_warned = False


def _probe_failed(exc: OSError) -> None:
    global probe_warned
    if probe_warned:
        logger.debug("no shared-memory probe for a connection: %s", exc)
        return
    probe_warned = True
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
        fd, _ = open_segment(name, os.O_RDONLY)
    except (OSError, ValueError):
        return False
    try:
        return os.read(fd, 64).decode(errors="replace") == token
    except OSError:
        return False
    finally:
        os.close(fd)
