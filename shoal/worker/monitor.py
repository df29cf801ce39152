"""A worker's watch on its memory: spilling past the spill threshold, pausing past
pause, and the figures it reports to the scheduler.

Theory of operation
-------------------
The store (:class:`~shoal.worker.store.WorkerStore`) spills by the sizes of the
values it holds: past the *target* the least recently used go to disk as they come in.
Sizes are estimates, and a task's own allocations are nobody's value, so the monitor
also looks at the process: every ``memory-monitor-interval`` seconds it reads the
process's resident memory (psutil) and

- past *spill*, evicts values, least recently used first, until what the process
  holds would be below the *target* (or nothing more can go);
- when one more result of the size of the last would pass the *target*, the worker
  hands no task to its thread pool ahead of a free thread (a task started ahead makes
  its result while the last is still being spilled: one value more in memory), until
  it would fit again. This is decided where a result arrives too
  (:meth:`MemoryMonitor.result_arrives`), before the state machine hands out the next
  task: a look every interval comes too late for the first result that fills the
  target;
- past *pause*, or past the *target* while the disk refuses values (a spill found it
  full: tried again at most once a second), pauses the worker: the state
  machine starts no task and no fetch, the thread pool starts nothing it holds, and the
  scheduler hears it at once (it places work elsewhere); below *pause* (and the
  *target*, if the disk is full) again, the worker goes on. Each change is one line in
  the log.

What counts as the process's memory: its private resident memory (the resident set
less the pages of files and shared memory), plus the segments it owns (its values' and
those kept for reuse; a peer's segment that it maps is its owner's to count), and never
less than what the store holds. The segments kept for reuse go back first, before
anything is spilled; then a full pass of the cyclic collector (at most one a second)
frees values that only reference cycles still hold.
Workers that share their process with others (an in-process cluster) cannot tell
their part of it: they go by the store's figures alone.

The *terminate* rule is the nanny's (:mod:`shoal.worker.nanny`): a process past it
is beyond saving from inside.

Freed memory goes back to the system. glibc's allocator keeps what a program frees for
its next allocations, and after a large block is freed it serves blocks up to that size
from its heap instead of mapping them afresh (its "dynamic mmap threshold"), so a
worker that computed and spilled 16 MiB arrays keeps their pages: its resident memory
stays high with nothing in it, it is paused with nothing to spill, and its nanny kills
it. A worker process therefore fixes glibc's thresholds (:func:`keep_heap_small`,
setting ``malloc-threshold``, unless ``MALLOC_TRIM_THRESHOLD_`` or
``MALLOC_MMAP_THRESHOLD_`` is in its environment: the user's word wins): blocks of 4 MiB
and more (arrays, values read back) are mapped on their own and returned when freed,
and the heap gives back what is free at its top past 4 MiB. Not less: the blocks of
1 MiB that reading a compressed spill file goes through stay warm in the heap (with
glibc's default of 128 kiB each would be fresh pages, and reading back takes twice as
long). A look that finds the process past *spill* with nothing left to spill asks glibc
to give back what it still holds (``malloc_trim``) before it pauses. Workers in a user's
process leave its allocator alone.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import time
from typing import Any

from .. import config
from .memory import Thresholds, format_bytes

__all__ = ["MemoryMonitor", "memory_report", "keep_heap_small", "trim_heap"]

logger = logging.getLogger("shoal.worker")


_process: Any = None
_libc: Any = None


def _glibc() -> Any:
    """The C library if it is glibc (its ``mallopt``/``malloc_trim``), else None."""
    global _libc
    if _libc is None:
        _libc = False
        try:
            import ctypes

            libc = ctypes.CDLL(None)
            libc.mallopt, libc.malloc_trim  # noqa: B018 - glibc has both; musl, macOS do not
            _libc = libc
        except (OSError, AttributeError):
            pass
    return _libc or None


def keep_heap_small() -> bool:
    """In a worker's own process: have glibc return freed memory to the system (see
    the module). Returns whether it was set."""
    threshold = int(config.get("malloc-threshold"))
    libc = _glibc()
    if threshold <= 0 or libc is None or "MALLOC_TRIM_THRESHOLD_" in os.environ \
            or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    return bool(libc.mallopt(M_MMAP_THRESHOLD, threshold)) and bool(libc.mallopt(M_TRIM_THRESHOLD, threshold))


def trim_heap() -> None:
    """Give the memory glibc holds free back to the system (nothing elsewhere)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def _memory_info() -> Any:
    """psutil's memory figures of this process (``rss``, ``shared``: its pages of files
    and of shared memory)."""
    global _process
    import psutil

    if _process is None or _process.pid != os.getpid():
        _process = psutil.Process()
    return _process.memory_info()


def _rss() -> int:
    """The resident memory of this process, in bytes."""
    return int(_memory_info().rss)


def private_memory(info: Any) -> int:
    """The resident memory that is a process's alone (its heap, its arrays): the
    resident set less the pages of files and of shared memory (Linux's ``RssAnon``)."""
    return max(int(info.rss) - int(getattr(info, "shared", 0)), 0)


def memory_report(store: Any, limit: int | None, own_process: bool) -> dict[str, int]:
    """The figures a worker reports (bytes): ``limit`` (0: none), ``managed`` (its
    values in private memory), ``shm`` (its values in segments it owns), ``spilled``
    (on disk), ``process`` (the resident memory of its process) and ``unmanaged``
    (``process`` less what its values and the peers' segments it maps account for);
    ``process`` is 0 when it cannot be read now (no descriptor left to read /proc)."""
    try:
        process = _rss()
    except Exception:  # noqa: BLE001 - psutil's errors, EMFILE: no figure this time
        process = 0
    managed = int(store.managed)
    shm = int(store.shm_owned)
    mapped = int(store.mapped) if own_process else 0
    return {
        "limit": limit or 0,
        "managed": managed,
        "shm": shm,
        "spilled": int(store.spilled),
        "unmanaged": max(process - managed - shm - mapped, 0) if own_process else 0,
        "process": process,
    }


class MemoryMonitor:
    """Applies the spill and pause rules of ``thresholds`` to ``store`` (see the
    module). ``pause(bool)`` is called when the worker must pause or may go on."""

    def __init__(self, store: Any, thresholds: Thresholds, own_process: bool, pause: Any,
                 give_back: Any = None, pooled: Any = None, tight: Any = None):
        self.store = store
        #: gives back memory held for reuse (the pool of retired segments) before
        #: anything is spilled: that is the cheapest memory to free
        self._give_back = give_back
        #: bytes of shared memory held for reuse (None: none)
        self._pooled = pooled
        self.thresholds = thresholds
        self.own_process = own_process
        self._pause = pause
        self.paused = False
        #: ``tight(bool)``: called when the process passes its target or falls below
        self._tight = tight
        self.tight = False
        #: the size of the last result: what the next one is expected to add
        self.expected = 0
        self._warned_spill = False
        #: what the process held besides the store's values at the last look
        self.unmanaged = 0
        #: full collections run before spilling (_collect_garbage): when the last one
        #: ended and how long it took, and how many there were
        self._gc_at = -math.inf
        self._gc_took = 0.0
        self.collections = 0

    def _collect_garbage(self) -> bool:
        """A full pass of the cyclic collector before anything is spilled: values held
        only by reference cycles (an exception's traceback, say) go first, and they go
        later than by Python's default while shoal serves (:mod:`shoal.gcpolicy`). At
        most one pass a second, and no more than 5% of the time (a pass over a big heap
        takes long); returns whether it ran."""
        now = time.monotonic()
        if now - self._gc_at < max(1.0, 20 * self._gc_took):
            return False
        gc.collect()
        self._gc_at = time.monotonic()
        self._gc_took = self._gc_at - now
        self.collections += 1
        return True

    def fits(self, nbytes: int) -> bool:
        """Whether a new value of ``nbytes`` would leave the process below the target,
        counting what the store holds now and what it did not hold at the last look
        (read from a task's thread: a hint). A value that would not is soon spilled:
        the worker does not give it a shared-memory segment first."""
        target = self.thresholds.target
        store = self.store
        return target is None or int(store.managed) + int(store.shm_owned) + self.unmanaged + nbytes <= target

    def result_arrives(self, nbytes: int) -> None:
        """A task's result of ``nbytes`` is about to be stored (on the worker's loop,
        before the state machine hears of it): memory turns tight here if the store,
        with this result and one more of its size, would pass the target. Only
        turns tight: falling below again is the periodic look's to tell."""
        self.expected = nbytes
        target = self.thresholds.target
        if target is None or self.tight or self._tight is None:
            return
        store = self.store
        if int(store.managed) + int(store.shm_owned) + self.unmanaged + 2 * nbytes > target:
            self.tight = True
            self._tight(True)

    def used(self) -> int:
        """What this worker's process holds, by the rule of the module."""
        store = self.store
        held = int(store.managed) + int(store.shm_owned)
        if not self.own_process:
            return held
        pooled = int(self._pooled()) if self._pooled is not None else 0
        return max(private_memory(_memory_info()) + int(store.shm_owned) + pooled, held)

    def _disk_refused(self, used: int, goal: int | None) -> bool:
        """Whether memory is past ``goal`` while the disk refuses what should go there."""
        return goal is not None and used > goal and bool(getattr(self.store, "disk_full", False))

    def check(self) -> None:
        """One look: spill, then pause or go on. Raises ``OSError`` when the process's
        memory cannot be read now (out of descriptors: /proc is a file)."""
        t = self.thresholds
        used = self.used()
        goal = t.target if t.target is not None else t.spill
        # past spill, or past the target while the disk refused values (a full disk: tried
        # again here, at most once per the store's disk_retry, until it takes them)
        spilling = (t.spill is not None and used > t.spill) or self._disk_refused(used, goal)
        if spilling and self._give_back is not None:
            self._give_back()
            used = self.used()
            spilling = (t.spill is not None and used > t.spill) or self._disk_refused(used, goal)
        if spilling and self._collect_garbage():
            used = self.used()
            spilling = (t.spill is not None and used > t.spill) or self._disk_refused(used, goal)
        if spilling and goal is not None and used > goal:
            freed = 0
            while used - freed > goal:
                n = self.store.evict()
                if n <= 0:
                    break
                freed += n
            if freed and not self._warned_spill:
                self._warned_spill = True
                logger.info("process memory %s is past the spill threshold (%s of a %s limit): "
                            "values moved to disk", format_bytes(used), format_bytes(t.spill if t.spill is not None else goal),
                            format_bytes(t.limit))
            if freed:
                used = self.used()
            if used > goal and self.own_process:
                trim_heap()  # nothing (more) to spill: what the allocator holds free
                used = self.used()
        self.unmanaged = max(0, used - int(self.store.managed) - int(self.store.shm_owned))
        tight = t.target is not None and used + self.expected > t.target
        if tight != self.tight and self._tight is not None:
            self.tight = tight
            self._tight(tight)
        over = t.pause is not None and used > t.pause
        # a full disk pauses the worker only while memory is past the target: below it
        # nothing needs the disk, and a worker paused with room to spare would stay so
        # (nothing it runs would free the disk or its memory)
        disk_full = self._disk_refused(used, goal)
        if (over or disk_full) and not self.paused:
            self.paused = True
            why = "its disk is full" if disk_full and not over else (
                f"memory {format_bytes(used)} is past the pause threshold {format_bytes(t.pause or 0)}")
            logger.warning("worker paused: %s (limit %s); no task or fetch starts until it falls",
                           why, format_bytes(t.limit))
            self._pause(True)
        elif self.paused and not over and not disk_full:
            self.paused = False
            logger.warning("worker goes on: memory %s is below the pause threshold", format_bytes(used))
            self._pause(False)
