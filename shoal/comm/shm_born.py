"""Arrays born in shared memory.

In a worker's task threads numpy may allocate large arrays straight from the pool of
retired segments (``shoal._shmalloc``, a numpy memory handler): the array's data starts
at offset 4096 of a segment whose pages are already there, so making it costs no page
faults, and if the task returns it, publishing it is writing the header and the pickle
stream in front of it (:func:`publish`, called by :func:`.shm.place`): no copy. While
its array is alive the segment is held exclusively (readers cannot map a value that is
still being written) and kept out of the pool. numpy frees it from any thread, even
inside the garbage collector: the release only queues the address (:func:`.shm.later`),
and the queue is worked off by later calls into the pool.
"""

from __future__ import annotations

import os
import secrets
from typing import Any

from . import shm
from .shm import (
    _DATA_OFFSET,
    _HEADER,
    Segment,
    SegmentInfo,
    _address,
    _close_writer,
    _header,
)

__all__ = ["enable_array_allocator", "use_array_allocator", "provide_array_memory", "release_array_memory",
           "publish"]


class _Born:
    __slots__ = ("name", "size", "fd", "anchor", "base", "published")

    def __init__(self, name: str, size: int, fd: int, anchor: Any, base: int):
        self.name, self.size, self.fd, self.anchor, self.base = name, size, fd, anchor, base
        self.published = False


_born: dict[int, _Born] = {}  # data address -> its segment
_allocator_on = False


def provide_array_memory(nbytes: int) -> int | None:
    """Called by numpy (through ``shoal._shmalloc``) for a large allocation in a task
    thread: the address of ``nbytes`` in a pooled segment, or ``None`` (numpy then
    allocates as usual) when no retired segment fits."""
    shm.work_off()
    with shm._lock:
        if not shm._pool:
            return None
    got = shm._reuse(_DATA_OFFSET + nbytes)
    if got is None:
        return None
    name, fd, size, writer = got
    assert writer is not None  # _reuse maps what it reuses unless told not to
    import ctypes

    anchor = ctypes.c_char.from_buffer(writer)  # the mapping cannot close while held
    base = ctypes.addressof(anchor)
    with shm._lock:
        shm._writers[name] = writer
        _born[base + _DATA_OFFSET] = _Born(name, size, fd, anchor, base)
        shm._born_names.add(name)
    return base + _DATA_OFFSET


def release_array_memory(address: int) -> None:
    """numpy freed an array born in a segment; it may be in the garbage collector:
    only queue it."""
    shm.later(_free, address)


def _free(address: int) -> None:
    with shm._lock:
        b = _born.pop(address, None)
        if b is None:
            return
        shm._born_names.discard(b.name)
        b.anchor = None
        published, alive = b.published, b.name in shm._owned
        writer = None if alive else shm._writers.pop(b.name, None)
    if not published:
        os.close(b.fd)
        shm._retire(b.name, b.size)  # never shown to anyone: straight back to the pool
    elif writer is not None:
        _close_writer(writer)  # its key was released while the array lived


def publish(data: bytes, raws: list[memoryview]) -> Segment | None:
    """If the value is one array born in a segment, publish that segment as the value
    (header and pickle stream written in front of the data) and return its record."""
    if len(raws) != 1 or not _born or _HEADER + len(data) > _DATA_OFFSET:
        return None
    start = _address(raws[0])
    if start is None:
        return None
    end = start + raws[0].nbytes
    with shm._lock:
        for b in _born.values():
            if b.base + _DATA_OFFSET <= start and end <= b.base + b.size and not b.published:
                writer = shm._writers.get(b.name)
                break
        else:
            return None
        if writer is None:
            return None
        b.published = True
    token = secrets.token_hex(8)
    writer[:_HEADER] = _header(token)
    writer[_HEADER : _HEADER + len(data)] = data
    os.close(b.fd)  # release the exclusive lock: readers may map it now
    info: SegmentInfo = [b.name, b.size, len(data), [[start - b.base, end - start]], token]
    return Segment(b.name, b.size, info)


def enable_array_allocator(threshold: int = 1 << 20) -> bool:
    """Let this process's task threads allocate numpy arrays of at least ``threshold``
    bytes in pooled segments (call :func:`use_array_allocator` in each). False when the
    C helper is not built or numpy is missing."""
    global _allocator_on
    try:
        from .. import _shmalloc

        _shmalloc.configure(provide_array_memory, release_array_memory, int(threshold))
    except Exception:  # ImportError, or a numpy whose handler we do not know
        return False
    _allocator_on = True
    return True


def use_array_allocator() -> None:
    """Large numpy arrays made in the calling thread come from pooled segments."""
    if _allocator_on:
        from .. import _shmalloc

        _shmalloc.install()


def _forget_parent_arrays() -> None:
    """A child made by ``fork`` has none of the parent's arrays (see
    :func:`.shm._forget_parent_segments`)."""
    _born.clear()


# the lock is shm's, read at each use (a forked child gets a new one)
os.register_at_fork(after_in_child=_forget_parent_arrays)
