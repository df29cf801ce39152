"""Arrays born in shared memory.

In a worker's task threads numpy may allocate large arrays straight from the pool of
retired segments (``shoal._shmalloc``, a numpy memory handler): the array's data starts
at offset 4096 of a segment whose pages are already there, so making it costs no page
faults, and if the task returns it, publishing it is writing the header and the pickle
stream in front of it (:func:`publish`, called by :func:`.shm.place`): no copy. While
its array is alive the segment is held exclusively (readers cannot map a value that is
still being written) and kept out of the pool. numpy frees it from any thread, even
inside the garbage collector: the release only queues the address (:func:`.shm.later`),
and the queue is worked off by later calls into the pool. The records of the arrays
are the registry's (:class:`.shm_registry.BornArray`), which a forked child starts
without.

A large frame that a worker receives from another host is born the same way
(:func:`land`): the socket writes it straight into a pooled segment, so keeping the
value for the workers of this host (:func:`.shm.place`) is publishing that segment,
with no copy and no page faults; a value that is not kept gives the segment back to
the pool when it dies.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import weakref
from typing import Any

from .shm import Segment, SegmentInfo, registry
from .shm_files import DATA_OFFSET, HEADER, buffer_address, close_writer, segment_header
from .shm_registry import BornArray

__all__ = ["enable_array_allocator", "use_array_allocator", "provide_array_memory", "release_array_memory",
           "publish", "land"]

_allocator_on = False


def provide_array_memory(nbytes: int) -> int | None:
    """Called by numpy (through ``shoal._shmalloc``) for a large allocation in a task
    thread: the address of ``nbytes`` in a pooled segment, or ``None`` (numpy then
    allocates as usual) when no retired segment fits."""
    registry.work_off()
    got = registry.reuse(DATA_OFFSET + nbytes)
    if got is None:
        return None
    name, fd, size, writer = got
    assert writer is not None  # reuse maps what it reuses unless told not to
    anchor = ctypes.c_char.from_buffer(writer)  # the mapping cannot close while held
    return registry.bear(BornArray(name, size, fd, anchor, ctypes.addressof(anchor)), writer)


def land(nbytes: int) -> Any:
    """A writable buffer (a numpy ``uint8`` array) of ``nbytes`` at offset 4096 of a
    pooled segment, recorded as an array born there, for a frame about to be received;
    ``None`` when numpy is missing or no retired segment fits (the receiver then uses
    private memory)."""
    try:
        import numpy as np
    except ImportError:
        return None
    registry.work_off()
    got = registry.reuse(DATA_OFFSET + nbytes)
    if got is None:
        return None
    name, fd, size, writer = got
    assert writer is not None
    anchor = ctypes.c_char.from_buffer(writer)
    address = registry.bear(BornArray(name, size, fd, anchor, ctypes.addressof(anchor)), writer)
    buf = np.frombuffer(writer, dtype=np.uint8, count=nbytes, offset=DATA_OFFSET)
    # whatever the frame becomes holds this array: when it dies, so does the birth
    weakref.finalize(buf, release_array_memory, address).atexit = False
    return buf


def release_array_memory(address: int) -> None:
    """numpy freed an array born in a segment; it may be in the garbage collector:
    only queue it."""
    registry.later(_free, address)


def _free(address: int) -> None:
    released = registry.release_born(address)
    if released is None:
        return
    b, writer = released
    if not b.published:
        os.close(b.fd)
        registry.retire(b.name, b.size)  # never shown to anyone: straight back to the pool
    if writer is not None:
        close_writer(writer)  # its key was released while the array lived


def publish(data: bytes, raws: list[memoryview]) -> Segment | None:
    """If the value is one array born in a segment, publish that segment as the value
    (header and pickle stream written in front of the data) and return its record."""
    if len(raws) != 1 or not registry.has_born() or HEADER + len(data) > DATA_OFFSET:
        return None
    start = buffer_address(raws[0])
    if start is None:
        return None
    end = start + raws[0].nbytes
    claimed = registry.claim_born(start, end)
    if claimed is None:
        return None
    b, writer = claimed
    token = secrets.token_hex(8)
    writer[:HEADER] = segment_header(token)
    writer[HEADER : HEADER + len(data)] = data
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
