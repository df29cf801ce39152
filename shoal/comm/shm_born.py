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

import contextlib
import ctypes
import os
import secrets
import threading
import weakref
from collections.abc import Iterator
from typing import Any

from .shm import Segment, SegmentInfo, ShmUnavailable, _writable_segment, registry
from .shm_files import DATA_OFFSET, HEADER, align, buffer_address, close_writer, owner_mapping, segment_header
from .shm_registry import BornArray

__all__ = ["enable_array_allocator", "use_array_allocator", "provide_array_memory", "release_array_memory",
           "publish", "land", "for_result"]

_allocator_on = False
_thread = threading.local()


@contextlib.contextmanager
def for_result() -> Iterator[None]:
    """The large arrays the calling task thread makes in this block are (parts of) its
    result: one that no pooled segment fits is born in a new segment, not in private
    memory. Writing it faults its pages in as private memory would, and publishing
    the result then costs no copy. Threads that do not use the allocator
    (:func:`use_array_allocator`) allocate as usual."""
    before = getattr(_thread, "fresh", False)
    _thread.fresh = True
    try:
        yield
    finally:
        _thread.fresh = before


def provide_array_memory(nbytes: int) -> int | None:
    """Called by numpy (through ``shoal._shmalloc``) for a large allocation in a task
    thread: the address of ``nbytes`` in a pooled segment (in a new one inside
    :func:`for_result`), or ``None`` (numpy then allocates as usual) when none fits."""
    registry.work_off()
    got = registry.reuse(DATA_OFFSET + nbytes)
    if got is None and getattr(_thread, "fresh", False):
        got = _new_segment(DATA_OFFSET + nbytes)
    if got is None:
        return None
    name, fd, size, writer = got
    assert writer is not None  # reuse maps what it reuses unless told not to
    anchor = ctypes.c_char.from_buffer(writer)  # the mapping cannot close while held
    return registry.bear(BornArray(name, size, fd, anchor, ctypes.addressof(anchor)), writer)


def _new_segment(need: int) -> tuple[str, int, int, Any] | None:
    """A new segment of ``need`` bytes, locked and mapped as :meth:`reuse` gives one;
    ``None`` when shared memory cannot take it."""
    try:
        name, fd, size, _ = _writable_segment(need)
    except ShmUnavailable:
        return None
    try:
        return name, fd, size, owner_mapping(name, size)  # (its pages mapped in one call)
    except OSError:
        os.close(fd)
        registry.unlink(name)
        return None


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
    """If the value's largest buffer lies in an array born in a segment, and its other
    buffers do too (views of one buffer: see :func:`for_result`) or are small enough
    to be copied in front of that array's data with the pickle stream (a frame's
    column labels), publish that segment as the value and return its record."""
    if not raws or not registry.has_born() or HEADER + len(data) > DATA_OFFSET:
        return None
    spans = []
    for raw in raws:
        start = buffer_address(raw)
        if start is None:
            return None
        spans.append((start, raw.nbytes))
    first, largest = max(spans, key=lambda span: span[1])
    home = registry.born_holding(first, first + largest) if largest else None
    if home is None:
        return None
    base, low, high = home.base, home.base + DATA_OFFSET, home.base + home.size
    layout: list[list[int]] = []
    copies: list[tuple[int, memoryview]] = []
    pos = align(HEADER + len(data))
    for (start, n), raw in zip(spans, raws):
        if n and low <= start and start + n <= high:
            layout.append([start - base, n])
        else:
            layout.append([pos, n])
            copies.append((pos, raw))
            pos = align(pos + n)
    if pos > DATA_OFFSET:
        return None
    claimed = registry.claim_born(first, first + largest)
    if claimed is None:
        return None
    b, writer = claimed
    token = secrets.token_hex(8)
    writer[:HEADER] = segment_header(token)
    writer[HEADER : HEADER + len(data)] = data
    for offset, raw in copies:
        writer[offset : offset + raw.nbytes] = raw
    os.close(b.fd)  # release the exclusive lock: readers may map it now
    info: SegmentInfo = [b.name, b.size, len(data), layout, token]
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
