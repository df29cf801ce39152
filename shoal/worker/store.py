"""A worker's values: in its memory, in shared-memory segments, or spilled to disk.

``WorkerStore`` is the mapping the worker state machine reads and writes. Each value is
of one of three kinds, counted in running totals (O(1) to read):

- ``managed``: private memory of this process;
- ``shm_owned``: a segment this worker owns (placed by it, :meth:`WorkerStore.expect`,
  or a transfer segment it adopted): counted once, here, by its owner;
- ``mapped``: a mapping of a *peer's* segment: its owner counts it, so it weighs
  nothing here and is never spilled (writing it to disk would free nothing).

With a ``target`` (bytes), values beyond it by their sizes (:mod:`shoal.protocol.sizes`)
move to files in ``directory``, least recently used first (:mod:`.spill` writes and
reads them), and come back transparently on ``store[key]``, private then (reading
one back spills nothing: the reader may be collecting several and holds them; the
next store or :meth:`~WorkerStore.evict` makes room). Of the least recently used, a
value that nothing else holds goes first: writing out a running task's input frees
nothing while the task runs. An owned segment's value that spills takes its segment
with it (unlinked: readers that mapped it keep their mapping). Actors never spill (an
actor's instance does not travel with its pickled ref). :meth:`WorkerStore.evict`
spills one value on demand (the memory monitor, which watches the process, calls it).
Without a target nothing spills and the hot path is a dict plus one size per value.

A value that is read a part at a time (a shuffle's split: each output partition wants
its own rows of it) spills in parts: its class's ``__shoal_spill_parts__()`` gives a
*head*, small and kept in memory, and the parts, written one record each
(:func:`.spill.write_parts`). :meth:`~WorkerStore.parts_file` then gives the head and where each part lies, and
any thread reads one part
alone (:func:`.spill.read_part`): a value on disk is served a part at a time, never
read back whole for one part. Read back whole, it is the head's
``__shoal_join_parts__(parts)``.

Why not zict: its ``Buffer``/``LRU`` (with a lock on every call in zict 3) has no notion
of values that must not spill (mapped ones, unpicklable ones tried once) nor of values
whose spilling must also drop a segment; the LRU here is a plain insertion-ordered
dict of the spillable keys, so picking what to spill is O(1).

A spill file that does not give back what was written (a flipped bit fails its
checksum, it was cut short or removed: :mod:`.spill`) loses its value: reading it
raises :class:`.spill.CorruptSpillFile` naming the key and the file, and the key is
no longer here; the worker tells the scheduler, which computes it again. With
``shm-verify``, so does a value whose segment no longer matches the checksum its
placing wrote (checked as it is read: :class:`~shoal.errors.CorruptedDataError`).

A value neither pickle nor cloudpickle can write (a lock, an open file) stays in
memory and is not tried again until it is stored anew. A failed write (disk full, any
``OSError``) leaves the value in memory, removes the partial file, warns once and sets
:attr:`WorkerStore.disk_full` (the worker pauses on it); it clears after a later spill
succeeds, when a spill file goes (room on the disk), or when the values in memory fall
back to the target. While it is set, :meth:`~WorkerStore.evict` tries the disk again at
most once per :attr:`~WorkerStore.disk_retry` seconds.

All calls happen on the worker's event loop thread.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, MutableMapping
from typing import Any

from .. import config
from ..comm import shm
from ..comm.shm_files import segment_path
from ..comm.shm_registry import SegmentState
from ..errors import CorruptedDataError, describe, short_repr
from ..protocol.messages import Key
from ..protocol.sizes import managed_sizeof
from . import spill
from .actor import ActorRef

__all__ = ["WorkerStore"]

#: a value spilled in parts: its head and each part's record (offset, length)
Parts = tuple[Any, list[tuple[int, int]]]

logger = logging.getLogger("shoal.worker")

MANAGED, SHM_OWNED, MAPPED = 0, 1, 2
#: values never spilled: an actor's instance lives in its ref and pickles without it
_KEEP = (ActorRef,)
#: least recently used values looked at for one that nothing else holds
SCAN = 32


class WorkerStore(MutableMapping[Key, Any]):
    """The worker's values (see the module). ``target``: bytes of values in memory
    (private and in owned segments) beyond which the least recently used spill;
    ``None``: no spilling as values come in. ``directory``: where spill files go
    (made when first needed; a temporary one of the store's own when ``None``).
    ``compress``: lz4 for spill files when lz4 is installed."""

    def __init__(self, target: int | None = None, directory: str | None = None, compress: bool = True) -> None:
        self._data: dict[Key, Any] = {}
        #: key -> (kind, bytes) of each value in memory
        self._meta: dict[Key, tuple[int, int]] = {}
        #: key -> the segment this worker placed the value in
        self.segments: dict[Key, shm.Segment] = {}
        self._expected: dict[Key, shm.Segment] = {}
        self.target = target
        self.directory = directory
        self.compress = compress
        #: whether values may spill at all (a target, or a directory for evict())
        self._spills = target is not None or directory is not None
        #: spillable keys in memory, least recently used first
        self._lru: dict[Key, None] = {}
        #: keys whose values cannot be pickled: never tried again while stored
        self.unspillable: set[Key] = set()
        #: key -> (spill file, bytes written, the value's size in memory, and for a
        #: value written in parts its head and where each part's record is)
        self._slow: dict[Key, tuple[str, int, int, Parts | None]] = {}
        self._names = itertools.count()
        self._own_dir: str | None = None  # a temporary directory made by this store
        self._dir_ready = False
        #: bytes of values in private memory, in owned segments, in peers' segments
        self.managed = 0
        self.shm_owned = 0
        self.mapped = 0
        #: the sizes (in memory) of the values on disk, the bytes of their files
        #: (less, compressed), and how many values are spilled
        self.spilled = 0
        self.spilled_disk = 0
        self.spilled_count = 0
        #: the last spill failed to write (disk full, or another OSError)
        self.disk_full = False
        #: seconds between tries of the disk while it is full
        self.disk_retry = 1.0
        self._retry_at = 0.0
        self._warned_disk = False
        #: values smaller than this are never looked for in shared memory
        self._shm_min = min(int(config.get("shm-threshold")), 1 << 16)
        #: the segments of values placed with a checksum are checked when read
        self._verify = bool(config.get("shm-verify"))

    # ------------------------------------------------------------------ mapping

    def __getitem__(self, key: Key) -> Any:
        try:
            value = self._data[key]
        except KeyError:
            return self._unspill(key)
        if self._verify and key in self.segments:
            self._check_segment(key)
        lru = self._lru
        if key in lru:  # most recently used now
            del lru[key]
            lru[key] = None
        return value

    def __setitem__(self, key: Key, value: Any) -> None:
        self.put(key, value)

    def put(self, key: Key, value: Any, nbytes: int | None = None) -> None:
        """``store[key] = value``; ``nbytes``: the value's managed size
        (:func:`~shoal.protocol.sizes.managed_sizeof`) when the caller measured it
        already (a task's thread, a fetch as the value arrived), so that a value is
        measured once: a dict of 23 small frames (a shuffle's split) takes 5 ms."""
        if key in self._data or key in self._slow:
            self.discard(key)
        data = self._data
        data[key] = value
        seg = self._expected.pop(key, None) if self._expected else None
        if seg is not None:
            self.segments[key] = seg
            kind, n = SHM_OWNED, seg.size
        else:
            n = managed_sizeof(value) if nbytes is None else max(nbytes, 0)
            kind = self._kind(value, n)
        self._meta[key] = (kind, n)
        if kind == MANAGED:
            self.managed += n
        elif kind == SHM_OWNED:
            self.shm_owned += n
        else:
            self.mapped += n
            return
        if self._spills and type(value) not in _KEEP:
            self._lru[key] = None
            target = self.target
            if target is not None and self.managed + self.shm_owned > target:
                # heavier than the target alone: straight to disk, the others stay
                if not (n > target and self._spill(key) is not None):
                    self._shrink(target)

    def fits(self, nbytes: int) -> bool:
        """Whether a value of ``nbytes`` would stay in memory, below the target, if it
        came now (read from a task's thread: a hint, not a promise)."""
        target = self.target
        return target is None or not self._spills or self.managed + self.shm_owned + nbytes <= target

    def __delitem__(self, key: Key) -> None:
        try:
            del self._data[key]
        except KeyError:
            self._remove_file(*self._slow.pop(key))  # KeyError if it is not spilled either
            return
        self._forget(key)

    def nbytes(self, key: Key) -> int:
        """The managed size of ``key``'s value as it was stored (spilled or not);
        raises ``KeyError`` if absent."""
        meta = self._meta.get(key)
        return meta[1] if meta is not None else self._slow[key][2]

    def parts_file(self, key: Key) -> tuple[Any, str, list[tuple[int, int]]] | None:
        """``(head, file, records)`` of ``key``'s value when it is spilled in parts,
        else ``None``: the head (what its ``__shoal_spill_parts__`` kept in memory),
        and each part's ``(offset, length)`` in the file, which any thread, or another
        process of this host, reads alone (:func:`.spill.read_part`; a file gone
        meanwhile means the value was read back or released: ask again)."""
        entry = self._slow.get(key) if key not in self._data else None
        if entry is None or entry[3] is None:
            return None
        return entry[3][0], entry[0], entry[3][1]

    def lose(self, key: Key, path: str, cause: BaseException) -> spill.CorruptSpillFile:
        """The value of ``key`` is lost: reading its spill file ``path`` failed with
        ``cause`` (here, or a part read in another thread). Its file and key go if they
        are still that file's; returns the error to raise or report (the caller tells
        the scheduler, which computes the value again)."""
        entry = self._slow.get(key)
        if entry is not None and entry[0] == path:
            del self._slow[key]
            self._remove_file(*entry)
        return spill.CorruptSpillFile(f"the value of {short_repr(key)} is lost: its spill file {path} cannot be "
                                      f"read back ({describe(cause)})", key=key, path=path)

    def peek(self, key: Key) -> Any:
        """``key``'s value without moving it: one in memory as ``store[key]`` gives it,
        a spilled one read from its file and left there (a peer's or a client's fetch
        takes it away; it would push others out here for nothing). Raises ``KeyError``
        if absent, and what :meth:`__getitem__` raises for a file it cannot read."""
        if key in self._data:
            return self[key]
        return self._read_back(key)

    def discard(self, key: Key) -> None:
        """Remove ``key`` if it is here, without reading a spilled value back
        (``MutableMapping.pop`` would)."""
        if key in self._data:
            del self._data[key]
            self._forget(key)
        elif key in self._slow:
            self._remove_file(*self._slow.pop(key))

    def _forget(self, key: Key) -> None:
        """The records of a value just removed from memory."""
        kind, n = self._meta.pop(key)
        if kind == MANAGED:
            self.managed -= n
        elif kind == SHM_OWNED:
            self.shm_owned -= n
        else:
            self.mapped -= n
        if self._lru:
            self._lru.pop(key, None)
        if self.unspillable:
            self.unspillable.discard(key)
        if self.segments:
            self._drop_segment(key)
        if self.disk_full and (self.target is None or self.managed + self.shm_owned <= self.target):
            self.disk_full = False  # memory fell: worth trying the disk again

    def expect(self, key: Key, segment: shm.Segment) -> None:
        """The next value stored under ``key`` lives in ``segment``: own it from then."""
        self._expected[key] = segment

    def unexpect(self, key: Key) -> None:
        """The value announced by :meth:`expect` was not stored: remove its segment."""
        seg = self._expected.pop(key, None)
        if seg is not None:
            seg.unlink()

    def _drop_segment(self, key: Key) -> None:
        seg = self.segments.pop(key, None)
        if seg is not None:
            seg.retire()  # reused for a later value once nobody maps it

    def __iter__(self) -> Iterator[Key]:
        return itertools.chain(self._data, self._slow)

    def __len__(self) -> int:
        return len(self._data) + len(self._slow)

    def __contains__(self, key: object) -> bool:
        return key in self._data or key in self._slow

    def segment_info(self, key: Key) -> list[Any] | None:
        """The segment info of ``key``'s value if it is in a segment this worker
        placed it in (``None``: private, or spilled)."""
        seg = self.segments.get(key)
        return None if seg is None else seg.info

    # ---------------------------------------------------------------- spilling

    def is_spilled(self, key: Key) -> bool:
        """Whether ``key``'s value is on disk now."""
        return key in self._slow

    def kind(self, key: Key) -> str | None:
        """``"managed"``, ``"shm"``, ``"mapped"`` or ``"spilled"``; ``None`` if absent."""
        if key in self._slow:
            return "spilled"
        meta = self._meta.get(key)
        return None if meta is None else ("managed", "shm", "mapped")[meta[0]]

    def evict(self) -> int:
        """Spill the least recently used value that can spill, now; returns the bytes
        of memory it freed, 0 when nothing could be spilled (none left, or the disk is
        full: see the module). Values that turn out unpicklable are passed over (and
        not tried again)."""
        while (key := self._victim()) is not None:
            freed = self._spill(key)
            if freed is not None:
                return freed
        return 0

    def _shrink(self, target: int) -> None:
        """Spill least recently used values until those in memory fit ``target`` or
        nothing more can go."""
        while self.managed + self.shm_owned > target and (key := self._victim()) is not None:
            if self._spill(key) == 0:
                return  # the disk refuses: the rest stays

    def _victim(self) -> Key | None:
        """The key to spill next: of the :data:`SCAN` least recently used, the first
        whose value nothing else holds (a running task's input, a value being sent:
        writing it out would free nothing now), else the least recently used."""
        data = self._data
        first = None
        for key in itertools.islice(self._lru, SCAN):
            if first is None:
                first = key
            if sys.getrefcount(data[key]) <= 2:  # the store's reference and the call's
                return key
        return first

    def _spill(self, key: Key) -> int | None:
        """Write ``key``'s value to disk and drop it from memory; returns the bytes
        freed (at least 1), 0 when the disk refused it (it stays in memory), ``None``
        when it cannot be pickled (it stays, and leaves the LRU)."""
        if self.disk_full:
            now = time.monotonic()
            if now < self._retry_at:
                return 0
            self._retry_at = now + self.disk_retry
        value = self._data[key]
        parts: Parts | None = None
        try:
            path = self._new_path()
            cut = getattr(type(value), "__shoal_spill_parts__", None)
            if cut is not None:
                head, pieces = cut(value)
                written, records = spill.write_parts(path, pieces, self.compress)
                del pieces
                parts = (head, records)
            else:
                written = spill.write_value(path, value, self.compress)
        except spill.Unspillable as exc:
            del self._lru[key]
            self.unspillable.add(key)
            logger.debug("%r stays in memory: %s", key, exc)
            return None
        except OSError as exc:
            self._disk_failed(exc)
            return 0
        except MemoryError:  # no room to compress it: it stays, a later try may do
            logger.debug("%r stays in memory: out of memory while writing it", key)
            return 0
        kind, n = self._meta.pop(key)
        seg = self.segments.pop(key, None)
        # its segment goes too, its memory freed once no reader maps it (not kept in
        # the pool: spilling is for giving memory back)
        if seg is not None:
            seg.unlink()
        elif kind == SHM_OWNED:  # a transfer segment this worker took over for it
            for name in _segments_of(value):
                if shm.registry.state(name) is SegmentState.ADOPTED:
                    shm.unlink(name)
        del value
        del self._data[key]
        del self._lru[key]
        if kind == MANAGED:
            self.managed -= n
        else:
            self.shm_owned -= n
        self._slow[key] = (path, written, n, parts)
        self.spilled += n
        self.spilled_disk += written
        self.spilled_count += 1
        self.disk_full = False
        return max(n, 1)

    def _unspill(self, key: Key) -> Any:
        """Read ``key``'s value back from disk into private memory; raises ``KeyError``
        if it is not spilled, and what :meth:`_read_back` raises."""
        value = self._read_back(key)
        self._remove_file(*self._slow.pop(key))
        n = managed_sizeof(value)
        self._data[key] = value
        self._meta[key] = (MANAGED, n)
        self.managed += n
        if type(value) not in _KEEP:
            self._lru[key] = None
        # not spilling others now: the caller (a task's inputs, a peer's request) may be
        # reading several, and holds those it read; the next store or evict() does it
        return value

    def _read_back(self, key: Key) -> Any:
        """The value in ``key``'s spill file (left there). A file that does not give
        back what was written (its checksums fail, it is cut short, gone or unreadable,
        the value in it does not unpickle) loses the value: the file and the key go, and
        :class:`.spill.CorruptSpillFile` names both (the caller tells the scheduler,
        which computes it again). A want of memory or of descriptors, which may pass,
        raises as it is (``MemoryError``, ``OSError``), and the key stays spilled."""
        path, written, was, parts = self._slow[key]
        try:
            if parts is not None:
                head, records = parts
                return head.__shoal_join_parts__(spill.read_parts(path, records))
            return spill.read_value(path)
        except MemoryError:
            raise
        except OSError as exc:
            if exc.errno in spill.MAY_PASS:
                raise
            cause: Exception = exc
        except Exception as exc:  # noqa: BLE001 - a corrupt file, or a value whose unpickling raises
            cause = exc
        raise self.lose(key, path, cause) from cause

    def _check_segment(self, key: Key) -> None:
        """Check the segment of ``key``'s value against the checksum its placing wrote
        (``shm-verify``). One that fails loses the value (as a spill file that fails),
        raising :class:`~shoal.errors.CorruptedDataError` naming key and segment."""
        info = self.segments[key].info
        try:
            shm.verify(info)
        except CorruptedDataError as exc:
            self.discard(key)
            raise CorruptedDataError(f"the value of {short_repr(key)} is lost: {exc}") from exc

    def _new_path(self) -> str:
        directory = self.directory
        if directory is None:
            if self._own_dir is None:
                self._own_dir = tempfile.mkdtemp(prefix="shoal-spill-")
            directory = self._own_dir
        elif not self._dir_ready:
            os.makedirs(directory, exist_ok=True)
            self._dir_ready = True
        while True:
            path = os.path.join(directory, f"{next(self._names)}.spill")
            if not os.path.lexists(path):  # a file left by an earlier store: not ours
                return path

    def _remove_file(self, path: str, written: int, size: int, parts: Parts | None = None) -> None:
        self.spilled -= size
        self.spilled_disk -= written
        self.spilled_count -= 1
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        self.disk_full = False  # room on the disk again

    def _disk_failed(self, exc: OSError) -> None:
        self.disk_full = True
        self._retry_at = time.monotonic() + self.disk_retry
        if self._warned_disk:
            logger.debug("spilling failed again: %s", describe(exc))
            return
        self._warned_disk = True
        logger.warning("cannot spill to %s (%s): values stay in memory until the disk takes them "
                       "(this is said once)", self.directory or self._own_dir, describe(exc))

    # ------------------------------------------------------------ what is where

    def _kind(self, value: Any, n: int) -> int:
        """Whether ``value`` lives in a peer's segment (``MAPPED``), in one of this
        process's (``SHM_OWNED``) or in private memory (``MANAGED``)."""
        if n < self._shm_min or not _maps_segments():
            return MANAGED
        names = _segments_of(value)
        if not names:
            return MANAGED
        # a segment this process does not hold is a peer's while its name is there; a
        # transfer taken over (its name removed) is this process's memory alone
        if any(shm.registry.state(name) is None and os.path.lexists(segment_path(name)) for name in names):
            return MAPPED
        return SHM_OWNED

    # ------------------------------------------------------------------ closing

    def clear(self) -> None:
        """Drop every value, unlink the segments this store owns and remove every
        spill file (and the store's own temporary directory)."""
        self._data.clear()
        self._meta.clear()
        self._lru.clear()
        self.unspillable.clear()
        for seg in [*self.segments.values(), *self._expected.values()]:
            seg.unlink()
        self.segments.clear()
        self._expected.clear()
        for path, *_ in self._slow.values():
            try:
                os.unlink(path)
            except OSError:
                pass
        self._slow.clear()
        self.managed = self.shm_owned = self.mapped = self.spilled = self.spilled_disk = self.spilled_count = 0
        self.disk_full = False
        if self._own_dir is not None:
            shutil.rmtree(self._own_dir, ignore_errors=True)
            self._own_dir = None
        shm.drain_pool()

    def close(self) -> None:
        """:meth:`clear`: nothing of the store is left in memory or on disk (a
        ``directory`` given to it stays, emptied of its files)."""
        self.clear()


def _maps_segments() -> bool:
    """Whether this process maps any segment (no value can be in one otherwise)."""
    return bool(getattr(shm.registry, "_ranges", True))


def _segments_of(value: Any) -> set[str]:
    """Names of the segments ``value``'s buffers lie in (an array is looked up
    directly; anything else by the buffers pickle finds in it)."""
    names: set[str] = set()
    if getattr(type(value), "__module__", "") == "numpy" and hasattr(value, "__array_interface__"):
        # an array (or a view of one): the memory behind it is its root array's
        root = value
        while type(getattr(root, "base", None)) is type(value):
            root = root.base
        if not root.flags.c_contiguous:
            return names  # made by numpy itself, not mapped from a buffer
        try:
            where = shm.locate(memoryview(root).cast("B"))
        except (TypeError, ValueError, BufferError):  # object or structured dtypes: no buffer
            return names
        return {where[0]} if where is not None else names
    import pickle

    buffers: list[pickle.PickleBuffer] = []
    try:
        pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    except KeyboardInterrupt:
        raise
    except BaseException:  # noqa: BLE001 - a __reduce__ may raise anything: private then
        return names
    for b in buffers:
        try:
            raw = b.raw()
        except BufferError:
            continue
        where = shm.locate(raw)
        if where is not None:
            names.add(where[0])
    return names
