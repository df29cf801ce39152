"""Who holds which shared-memory segment in this process, and in which state.

One :class:`SegmentRegistry` per process (:data:`registry`) keeps the segments this
process owns, each in one :class:`SegmentState`, the pool of retired segments, the
owner's shared mappings of its segments (*writers*), the segments this process has
mapped to read them, and the arrays born in pooled segments (:mod:`.shm_born`). Each
step of a segment's life is one method, allowed only from the states the table
:data:`TRANSITIONS` lists for it: an illegal step raises
:class:`~shoal.statelog.InvalidTransition` and changes nothing. :meth:`validate`
checks the invariants (the tests call it after each test).

The registry does the renames and removals its steps stand for; writing into a
segment and mapping it are :mod:`.shm`'s. It takes its lock only around its own
records, never around a system call; finalizers (and numpy's frees of born arrays)
may run anywhere, even inside the garbage collector while this thread holds the lock,
so they only queue what they need done (:meth:`later`), and the next call into the
pool does it (:meth:`work_off`).

A child made by ``fork`` starts with an empty registry (:meth:`forget_parent`): the
parent's segments, pool and arrays are the parent's.
"""

from __future__ import annotations

import collections
import enum
import fcntl
import mmap
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from ..statelog import InvalidTransition
from .shm_files import (
    DATA_OFFSET,
    PREFIX,
    buffer_address,
    close_writer,
    is_own_file,
    new_name,
    open_segment,
    owner_mapping,
    segment_path,
)

__all__ = ["SegmentState", "TRANSITIONS", "BornArray", "SegmentRegistry", "registry"]


class SegmentState(enum.Enum):
    """The state of a segment this process holds (see :class:`SegmentRegistry`)."""

    #: made by this process (new, or a pooled one reused under a new name), locked
    #: exclusively: being written, or holding an array born in it
    CREATED = "created"
    #: a value segment (or a probe): same-host processes may map it by its name
    PUBLISHED = "published"
    #: a transfer segment written for one receiver, under a lease: the receiver removes
    #: or takes it over, or the lease's end removes it
    LEASED = "leased"
    #: another process's transfer segment, renamed to a name of this process
    ADOPTED = "adopted"
    #: retired: kept under a pool name for reuse, its pages at hand
    POOLED = "pooled"
    #: final: renamed for the process that made it, which takes it into its pool
    GIVEN_BACK = "given back"
    #: final: its name removed (readers' mappings stay valid)
    UNLINKED = "unlinked"


CREATED, PUBLISHED, LEASED, ADOPTED, POOLED, GIVEN_BACK, UNLINKED = SegmentState
_LIVE = (CREATED, PUBLISHED, LEASED, ADOPTED, POOLED)
#: the states whose file is there while the registry holds them (a leased segment's
#: receiver may have removed or renamed it)
_ON_DISK = (CREATED, PUBLISHED, ADOPTED, POOLED)

#: ``(state before, step) -> state after``; ``None`` before: a name this registry does
#: not hold. A segment keeps its state under its new name where a step renames it
#: (reuse, adopt, retire, reclaim, give back); a final state is not held any more.
TRANSITIONS: dict[tuple[SegmentState | None, str], SegmentState] = {
    (None, "create"): CREATED,
    (POOLED, "reuse"): CREATED,
    (CREATED, "publish"): PUBLISHED,
    (CREATED, "lease"): LEASED,
    (None, "adopt"): ADOPTED,
    (CREATED, "retire"): POOLED,  # a born array freed before it was published
    (PUBLISHED, "retire"): POOLED,
    (ADOPTED, "retire"): POOLED,
    (None, "reclaim"): POOLED,  # given back to this process by the one it was handed to
    (ADOPTED, "give_back"): GIVEN_BACK,
    **{(state, "unlink"): UNLINKED for state in _LIVE},
}


class BornArray:
    """A numpy array born in a pooled segment (:mod:`.shm_born`): the segment ``name``
    of ``size`` bytes, its descriptor ``fd`` holding the exclusive lock, ``anchor``
    keeping the owner's mapping open, the mapping's address ``base``, and whether the
    segment was published as a value."""

    __slots__ = ("name", "size", "fd", "anchor", "base", "published")

    def __init__(self, name: str, size: int, fd: int, anchor: Any, base: int):
        self.name, self.size, self.fd, self.anchor, self.base = name, size, fd, anchor, base
        self.published = False


#: what :meth:`SegmentRegistry.reuse` gives: ``(name, fd, size, writer)``
Reused = tuple[str, int, int, mmap.mmap | None]


class SegmentRegistry:
    """The segments of this process and the life of each::

                   create              publish                retire
        (none) ──────────▶ CREATED ──────────▶ PUBLISHED ──────────────▶ POOLED
                           │ │ ▲                                         │ ▲ ▲
                           │ │ └───────────────── reuse ─────────────────┘ │ │
                           │ └──── retire (a born array, unpublished) ─────┘ │
                           └── lease ──▶ LEASED                              │
        (none) ── adopt ──▶ ADOPTED ──────────────── retire ─────────────────┘
                            └── give_back ──▶ GIVEN_BACK
        (none) ── reclaim ──▶ POOLED
        CREATED, PUBLISHED, LEASED, ADOPTED, POOLED ── unlink ──▶ UNLINKED

    *create* makes a new file (or a probe); *reuse* takes a pooled one that nobody
    maps, under a new name, for a new value; *publish* makes a written value segment
    mappable (a probe once written); *lease* hands a written transfer segment to one
    receiver; *adopt* takes another process's transfer segment over under a name of
    ours; *retire* renames a segment no longer needed to a pool name (so nobody maps
    the released value by its name any more) or, the pool full, unlinks it; *reclaim*
    takes a segment given back to this process into its pool; *give_back* renames an
    adopted segment for the process that made it; *unlink* removes a name. Retiring a
    name this process does not hold unlinks it (it was unlinked already).

    Every process that maps a segment holds a shared flock on it for as long as the
    mapping lives: the owner reuses a pooled segment only when it can lock it
    exclusively (nobody maps it), renames it (a reader holding the old name fails to
    open it) and writes a new token (a reader that opened it just before checks the
    token once it has its lock, and gives up on a mismatch).
    """

    def __init__(self) -> None:
        #: bytes of retired segments kept for reuse (a worker's first large values pay
        #: for fresh pages; later ones of similar sizes are copied into pages there)
        self.pool_limit = 1 << 30
        #: a worker process keeps the transfer segments it receives (renamed to names
        #: of its own, see :func:`.shm.map_segment`), so that its peers map them too
        self.adopt_transfers = False
        #: the clock of the pool's ages (a test may set its own)
        self.clock: Callable[[], float] = time.monotonic
        #: segments this process mapped: name -> (weak mapping, token), and their ranges
        self._maps: dict[str, tuple[weakref.ref[mmap.mmap], str]] = {}
        self._ranges: dict[str, tuple[int, int, str]] = {}
        self.forget_parent()

    def forget_parent(self) -> None:
        """Start afresh, holding nothing (in a child made by ``fork``: the parent's
        segments, pool and arrays are the parent's; the child must not reuse, unlink or
        publish them). The mappings stay: the child has them too."""
        self._lock = threading.Lock()  # it may have been held by another thread at the fork
        self._states: dict[str, SegmentState] = {}
        #: pooled name -> (size, when it was retired)
        self._pool: dict[str, tuple[int, float]] = {}
        #: bytes in the pool, counting the segments being tried for reuse or renamed in
        self._pool_bytes = 0
        #: the owner's shared mappings of its segments, kept so that reusing a segment
        #: costs no page faults; closed when the segment is unlinked
        self._writers: dict[str, mmap.mmap] = {}
        self._born: dict[int, BornArray] = {}  # data address -> its array's segment
        self._born_names: set[str] = set()  # segments an array lives in: not reusable yet
        self._later: collections.deque[tuple[Any, tuple[Any, ...]]] = collections.deque()
        self.adopt_transfers = False

    # ------------------------------------------------------------------ the steps

    def _after(self, name: str, step: str) -> SegmentState:
        """The state ``step`` takes ``name`` to; raises :class:`InvalidTransition` when
        the table does not allow it. The caller holds the lock."""
        before = self._states.get(name)
        after = TRANSITIONS.get((before, step))
        if after is None:
            held = "one this process does not hold" if before is None else f"a {before.value} one"
            raise InvalidTransition(f"cannot {step.replace('_', ' ')} segment {name}: it is {held}")
        return after

    def create(self, name: str) -> int:
        """Make the file of a new segment ``name`` (:func:`.shm_files.new_name`); returns
        its descriptor, open for reading and writing. Raises ``OSError``."""
        fd = os.open(segment_path(name), os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
        with self._lock:
            try:
                self._states[name] = self._after(name, "create")
            except InvalidTransition:
                os.close(fd)
                raise
        return fd

    def publish(self, name: str, writer: mmap.mmap | None = None) -> None:
        """A created segment is written: same-host processes may map it now. ``writer``:
        the owner's shared mapping of it, kept for its reuse."""
        with self._lock:
            self._states[name] = self._after(name, "publish")
            if writer is not None:
                self._writers[name] = writer

    def lease(self, name: str) -> None:
        """A created segment is written as a transfer for one receiver."""
        with self._lock:
            self._states[name] = self._after(name, "lease")

    def adopt(self, name: str) -> str:
        """Rename another process's transfer segment ``name`` to a name of this process
        and hold it; returns the new name. Raises ``OSError`` (``FileNotFoundError``:
        the file is gone). The caller checked the file, and marks it a value's."""
        new = new_name()
        os.rename(segment_path(name), segment_path(new))
        with self._lock:
            self._states[new] = self._after(new, "adopt")
        return new

    def give_back(self, name: str, maker: int) -> bool:
        """Rename an adopted segment for process ``maker`` to take into its pool
        (``shoal-<maker>-ret...``, see :meth:`reclaim`); False when this process does
        not hold ``name`` or the rename fails (the caller unlinks it then)."""
        with self._lock:
            if name not in self._states:
                return False
            self._after(name, "give_back")
        try:
            os.rename(segment_path(name), segment_path(new_name("ret", pid=maker)))
        except OSError:
            return False
        with self._lock:
            self._states.pop(name, None)
            writer = self._writers.pop(name, None)
        if writer is not None:
            close_writer(writer)
        return True

    def retire(self, name: str, size: int) -> None:
        """This process no longer needs segment ``name`` (of ``size`` bytes): its name
        goes at once, and its memory is kept for reuse under a pool name, or freed when
        the pool is full or an array born in it still lives."""
        with self._lock:
            held = name in self._states
            if held:
                self._after(name, "retire")
            # an array still living in it: not reusable yet
            keep = held and name not in self._born_names and self._reserve(size)
        pooled = self._rename_into_pool(name, size) if keep else None
        if pooled is None:
            self.unlink(name)
            return
        with self._lock:
            del self._states[name]
            self._pool_up(pooled, size, POOLED)
            if name in self._writers:
                self._writers[pooled] = self._writers.pop(name)

    def reclaim(self, name: str, size: int) -> bool:
        """Take the file ``name`` (of ``size`` bytes) that another process gave back to
        this one into the pool, or remove it when the pool is full; False when it cannot
        be renamed (it stays as it is). The caller checked that it is a regular file of
        this user."""
        with self._lock:
            keep = self._reserve(size)
        if not keep:
            self.unlink(name)
            return True
        pooled = self._rename_into_pool(name, size)
        if pooled is None:
            return False
        with self._lock:
            self._pool_up(pooled, size, self._after(pooled, "reclaim"))
        return True

    def _reserve(self, size: int) -> bool:
        """Take room for ``size`` bytes in the pool if it has it (the caller holds the
        lock): counted from before the rename into the pool, so that no two threads
        take the same room."""
        if self._pool_bytes + size > self.pool_limit:
            return False
        self._pool_bytes += size
        return True

    def _rename_into_pool(self, name: str, size: int) -> str | None:
        """Rename ``name`` to a new pool name, its room reserved; that name, or ``None``
        when the rename fails (the room is given back)."""
        pooled = new_name("pool")
        try:
            os.rename(segment_path(name), segment_path(pooled))
        except OSError:
            with self._lock:
                self._pool_bytes -= size
            return None
        return pooled

    def _pool_up(self, pooled: str, size: int, state: SegmentState) -> None:
        """Record ``pooled`` in the pool, retired now (the caller holds the lock)."""
        self._states[pooled] = state
        self._pool[pooled] = (size, self.clock())

    def reuse(self, need: int, mapped: bool = True) -> Reused | None:
        """A pooled segment of at least ``need`` bytes (and not much more) that nobody
        maps, renamed to a new name, created again: ``(name, fd, size, writer)``, its
        descriptor open for writing and locked exclusively, ``writer`` the owner's
        mapping of it (``None`` only when not ``mapped``: then it may have none).
        ``None`` when no pooled segment fits or every fitting one is mapped: the caller
        then takes ``need`` bytes elsewhere, and as many pooled bytes go first."""
        if not self._pool:  # nothing pooled (no lock: a hint, as most calls find it)
            return None
        with self._lock:
            fitting = sorted((s, n) for n, (s, _) in self._pool.items()
                             if need <= s <= max(2 * need, need + (1 << 20)))
            # out of the pool while they are tried (still counted in its bytes): no
            # other thread takes them meanwhile
            tried = {n: self._pool.pop(n) for _, n in fitting}
        got: Reused | None = None
        for _, old in fitting:
            got = self._take(old, tried.pop(old), mapped)
            if got is not None:
                break
        if tried:
            with self._lock:
                self._pool.update(tried)
        if got is None:
            # the caller makes ``need`` bytes elsewhere (a new segment, private memory)
            self._make_room(need)
        return got

    def _take(self, old: str, entry: tuple[int, float], mapped: bool) -> Reused | None:
        """:meth:`reuse` of the pooled segment ``old`` (``entry``: its size and age),
        out of the pool: ``None`` when someone maps it (it goes back into the pool) or
        it is gone or no segment of ours any more (it is not held any more)."""
        size = entry[0]
        try:
            fd, _ = open_segment(old, os.O_RDWR)
        except OSError:  # gone, or replaced by something that is no segment of ours
            self._drop_pooled(old, size)
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)  # someone still maps it: try it again later
            with self._lock:
                self._pool[old] = entry
            return None
        new = new_name()
        try:
            os.rename(segment_path(old), segment_path(new))
        except OSError:
            os.close(fd)
            self._drop_pooled(old, size)
            self.unlink(old)
            return None
        with self._lock:
            self._pool_bytes -= size
            self._states[new] = self._after(old, "reuse")
            del self._states[old]
            writer = self._writers.pop(old, None)
        if writer is not None and writer.closed:
            writer = None
        if writer is None and mapped:
            try:
                writer = owner_mapping(new, size)
            except OSError:
                os.close(fd)
                self.unlink(new)
                return None
        return new, fd, size, writer

    def _drop_pooled(self, name: str, size: int) -> None:
        """Forget a pooled segment taken out of the pool that cannot be reused."""
        with self._lock:
            self._pool_bytes -= size
            self._states.pop(name, None)
            writer = self._writers.pop(name, None)
        if writer is not None:
            close_writer(writer)

    def unlink(self, name: str) -> None:
        """Remove a segment's name (mappings stay valid); a name this process does not
        hold is removed too, and a missing one is fine. Raises ``ValueError`` for a
        name not in shoal's form."""
        path = segment_path(name)
        with self._lock:
            self._states.pop(name, None)
            pooled = self._pool.pop(name, None)
            if pooled is not None:
                self._pool_bytes -= pooled[0]
            writer = None if name in self._born_names else self._writers.pop(name, None)
        if writer is not None:
            close_writer(writer)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def unlink_all(self) -> None:
        """Remove every segment this process holds (clean shutdown)."""
        for name in self.owned():
            self.unlink(name)

    def drain_pool(self) -> None:
        """Unlink every pooled segment."""
        self._unlink_pooled(list)

    def trim_pool(self, max_idle: float) -> int:
        """Unlink the pooled segments that no value reused for ``max_idle`` seconds;
        returns how many went."""
        now = self.clock()
        return len(self._unlink_pooled(lambda pool: [n for n, (_, at) in pool.items() if now - at >= max_idle]))

    def _make_room(self, size: int) -> None:
        """``size`` bytes are about to be taken elsewhere because no pooled segment
        fits: unlink pooled segments, the longest retired first, until ``size`` bytes of
        them went (or the pool is empty), so that the pool never makes the process
        larger than the most it held."""
        def oldest(pool: dict[str, tuple[int, float]]) -> list[str]:
            names, freed = [], 0
            for name, (nbytes, _) in sorted(pool.items(), key=lambda item: item[1][1]):
                if freed >= size:
                    break
                names.append(name)
                freed += nbytes
            return names

        self._unlink_pooled(oldest)

    def _unlink_pooled(self, which: Callable[[dict[str, tuple[int, float]]], list[str]]) -> list[str]:
        """Unlink the pooled segments ``which`` picks from the pool (name -> size, when
        retired; called under the lock); returns their names."""
        with self._lock:
            names = which(self._pool)
            for name in names:
                self._pool_bytes -= self._pool.pop(name)[0]
        for name in names:
            self.unlink(name)
        return names

    # --------------------------------------------------------------- born arrays

    def bear(self, born: BornArray, writer: mmap.mmap) -> int:
        """Record an array born in the created (reused) segment ``born.name``, whose
        owner's mapping is ``writer``; returns the address of the array's data."""
        address = born.base + DATA_OFFSET
        with self._lock:
            self._writers[born.name] = writer
            self._born[address] = born
            self._born_names.add(born.name)
        return address

    def has_born(self) -> bool:
        """Whether an array lives in a segment of this process (no lock: a hint)."""
        return bool(self._born_names)

    def born_arrays(self) -> list[BornArray]:
        """The arrays born in segments that are alive."""
        with self._lock:
            return list(self._born.values())

    def born_holding(self, start: int, end: int) -> BornArray | None:
        """The unpublished born array whose data holds the bytes ``start`` to ``end``."""
        with self._lock:
            return self._holding(start, end)

    def _holding(self, start: int, end: int) -> BornArray | None:
        for b in self._born.values():
            if b.base + DATA_OFFSET <= start and end <= b.base + b.size and not b.published:
                return b
        return None

    def claim_born(self, start: int, end: int) -> tuple[BornArray, mmap.mmap] | None:
        """Publish the created segment of the born array whose data holds the bytes
        ``start`` to ``end``: the array and the owner's mapping of its segment, for the
        caller to write the value's header and pickle stream into; ``None`` when no
        unpublished born array holds them."""
        with self._lock:
            b = self._holding(start, end)
            if b is None:
                return None
            writer = self._writers.get(b.name)
            if writer is None or self._states.get(b.name) is not CREATED:
                return None
            self._states[b.name] = self._after(b.name, "publish")
            b.published = True
        return b, writer

    def release_born(self, address: int) -> tuple[BornArray, mmap.mmap | None] | None:
        """numpy freed the born array at ``address``: its record, and the owner's
        mapping of its segment if that segment is gone (unlinked while the array
        lived) for the caller to close; ``None`` for an address of no born array."""
        with self._lock:
            b = self._born.pop(address, None)
            if b is None:
                return None
            self._born_names.discard(b.name)
            b.anchor = None
            writer = None if b.name in self._states else self._writers.pop(b.name, None)
        return b, writer

    # ------------------------------------------------------- this process's mappings

    def mapping(self, name: str, token: str) -> mmap.mmap | None:
        """This process's live mapping of segment ``name`` holding ``token``, if any."""
        with self._lock:
            entry = self._maps.get(name)
            return entry[0]() if entry is not None and entry[1] == token else None

    def remember_mapping(self, name: str, m: mmap.mmap, token: str, size: int,
                         gone: Callable[[weakref.ref[mmap.mmap]], Any]) -> None:
        """Record this process's mapping ``m`` of ``size`` bytes of segment ``name``;
        ``gone`` is called when it dies (and should call :meth:`forget_mapping`)."""
        start = buffer_address(memoryview(m))
        with self._lock:
            self._maps[name] = (weakref.ref(m, gone), token)
            if start is not None:
                self._ranges[name] = (start, start + size, token)

    def forget_mapping(self, name: str) -> None:
        """Drop the record of a dead mapping of ``name`` (a live one stays)."""
        with self._lock:
            entry = self._maps.get(name)
            if entry is not None and entry[0]() is None:
                del self._maps[name]
                self._ranges.pop(name, None)

    def locate(self, buffer: memoryview) -> tuple[str, int, int, int, str] | None:
        """``(segment name, segment size, offset, length, token)`` if ``buffer`` lies
        inside a segment this process has mapped, else ``None``."""
        if not self._ranges:
            return None
        start = buffer_address(buffer)
        if start is None:
            return None
        n = buffer.nbytes
        with self._lock:
            for name, (lo, hi, token) in self._ranges.items():
                if lo <= start and start + n <= hi:
                    return name, hi - lo, start - lo, n, token
        return None

    # ------------------------------------------------------------ deferred steps

    def later(self, fn: Callable[..., Any], *args: Any) -> None:
        """Call ``fn(*args)`` at the next :meth:`work_off`, not now (for finalizers)."""
        self._later.append((fn, args))

    def work_off(self) -> None:
        """Do what finalizers and numpy's frees queued."""
        while self._later:
            try:
                fn, args = self._later.popleft()
            except IndexError:
                return
            fn(*args)

    # ------------------------------------------------------------------ reading

    def owned(self) -> set[str]:
        """Names of the segments this process holds (any state but a final one)."""
        with self._lock:
            return set(self._states)

    def state(self, name: str) -> SegmentState | None:
        """The state of segment ``name``, ``None`` if this process does not hold it."""
        return self._states.get(name)

    def pooled(self) -> list[tuple[int, str]]:
        """``(size, name)`` of the pooled segments, oldest first."""
        with self._lock:
            return [(size, name) for name, (size, _) in self._pool.items()]

    def owner_view(self, buffer: memoryview) -> memoryview | None:
        """The same bytes as ``buffer`` (a view of a segment this process mapped) in
        the owner's mapping of that segment, if this process keeps one, else None. The
        owner's mapping has its pages mapped: a value's own (copy-on-write) mapping is
        new, and a first read of it faults every 64 KiB."""
        found = self.locate(buffer)
        if found is None:
            return None
        name, _, offset, length, _ = found
        with self._lock:
            writer = self._writers.get(name)
            if writer is None or writer.closed or len(writer) < offset + length:
                return None
            return memoryview(writer)[offset : offset + length]

    def has_writer(self, name: str) -> bool:
        """Whether this process keeps an owner's mapping of segment ``name``."""
        return name in self._writers

    def validate(self) -> None:
        """Raise ``AssertionError`` naming every broken invariant. Call it when no other
        thread uses the registry (a segment being tried for reuse is out of the pool)."""
        with self._lock:
            states, pool, born = dict(self._states), dict(self._pool), list(self._born.values())
            writers, born_names, pool_bytes = set(self._writers), set(self._born_names), self._pool_bytes
            maps, ranges = set(self._maps), set(self._ranges)
        problems: list[str] = []
        ours = f"{PREFIX}{os.getpid()}-"
        for name, state in states.items():
            if state not in _LIVE:
                problems.append(f"{name} is held in the final state {state.value}")
            if not name.startswith(ours):
                problems.append(f"{name} ({state.value}) is not named after this process")
            if (state is POOLED) != (name in pool):
                problems.append(f"{name} is {state.value} but {'not ' if name not in pool else ''}in the pool")
            if state in _ON_DISK and not _exists(name):
                problems.append(f"{name} is {state.value} but its file is gone or no segment of ours")
        for name in pool:
            if name not in states:
                problems.append(f"{name} is in the pool but not held")
            if name in maps:
                problems.append(f"{name} is pooled but mapped by this process")
            if name in born_names:
                problems.append(f"{name} is pooled but an array lives in it")
        total = sum(size for size, _ in pool.values())
        if total != pool_bytes:
            problems.append(f"the pool holds {total} bytes but counts {pool_bytes}")
        if pool_bytes > self.pool_limit:
            problems.append(f"the pool holds {pool_bytes} bytes, beyond its limit of {self.pool_limit}")
        for name in writers - born_names:
            if name not in states:
                problems.append(f"an owner's mapping of {name}, which is not held")
        if {b.name for b in born} != born_names:
            problems.append(f"born arrays {sorted(b.name for b in born)} but born segments {sorted(born_names)}")
        for b in born:
            allowed = (PUBLISHED, None) if b.published else (CREATED, None)
            if states.get(b.name) not in allowed:
                problems.append(f"{b.name}: an array lives in it, but it is {states[b.name].value}")
            if b.name not in writers:
                problems.append(f"{b.name}: an array lives in it without the owner's mapping")
        if not ranges <= maps:
            problems.append(f"address ranges of segments not mapped: {sorted(ranges - maps)}")
        if problems:
            raise AssertionError("shared-memory registry: " + "; ".join(problems))


def _exists(name: str) -> bool:
    try:
        return is_own_file(os.lstat(segment_path(name)))
    except OSError:
        return False


#: the registry of this process
registry = SegmentRegistry()
os.register_at_fork(after_in_child=registry.forget_parent)
