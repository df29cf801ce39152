"""Where an assembly of shoal's shuffle finds its pieces, and the requests peers
answer (``split-outputs``, ``get-slices``); the values and tasks are in
:mod:`.shuffle`, the theory in docs/shuffle.md.

A worker learns once per placement which outputs each split has rows for
(:class:`Sources`): from the splits it holds, from those of its host it maps from
shared memory (kept mapped up to a budget), from the files of those its host's other
workers spilled, and with one ``split-outputs`` request to each other holder. An
assembly then touches only the splits with rows for it: its own by reference (a
spilled one: its part read from disk in the task's thread), mapped ones sliced with
no peer involved, peers' spilled ones read from their files, the rest with one
``get-slices`` request to each holder, all at once. A holder that cannot be reached
gives the task back (:class:`~shoal.errors.Reschedule`), as does a spilled split of
this worker's whose part fails its checksum (the split is lost: the scheduler makes
it again).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from typing import Any

from ..comm.core import host_identity
from ..errors import CommError, Reschedule, ShuffleError
from .spill import MAY_PASS
from .shuffle import SPLIT_PREFIX, UNREACHABLE_PAUSE, Bundle, Location, Placement, Split, SplitHead, bundle

__all__ = ["Sources", "bundles", "serve_slices", "serve_outputs"]

logger = logging.getLogger("shoal.worker")


class _PartRead:
    """Output ``index``'s rows of a split spilled in parts, to read (in any thread)
    from ``path`` (the record at ``offset`` of ``length`` bytes): a file of this
    worker's store (``expect`` None), or of a peer of this host's, which must still be
    the file of identity ``expect`` (:func:`.spill.identity`)."""

    __slots__ = ("key", "head", "index", "path", "offset", "length", "expect")

    def __init__(self, key: Any, head: SplitHead, index: int, path: str, offset: int, length: int,
                 expect: tuple[int, ...] | None = None) -> None:
        self.key, self.head, self.index = key, head, index
        self.path, self.offset, self.length = path, offset, length
        self.expect = expect

    def read(self) -> Split:
        """The rows; raises ``FileNotFoundError`` when the file went meanwhile (the
        split was read back, or released: ask the store again; a peer's file changed:
        ask the peer), and what :func:`.spill.read_part` raises."""
        from . import spill

        return self.head.with_rows(self.index, spill.read_part(self.path, self.offset, self.length, self.expect))



class _ByOutput:
    """The positions (ascending) of the splits with rows for each output, from
    ``{position: the outputs its split has rows for}`` (each value ascending)."""

    def __init__(self, outputs_of: dict[int, Any]) -> None:
        import numpy as np

        items = sorted(outputs_of.items())
        outs = [np.asarray(o, dtype=np.int64) for _, o in items]
        if not outs or not sum(map(len, outs)):
            self.positions = np.zeros(0, dtype=np.int64)
            self.starts = np.zeros(1, dtype=np.int64)
            return
        flat = np.concatenate(outs)
        positions = np.repeat(np.fromiter((p for p, _ in items), np.int64, len(items)), [len(o) for o in outs])
        order = np.argsort(flat, kind="stable")  # (by output; within one, by position)
        self.positions = positions[order]
        self.starts = np.zeros(int(flat.max()) + 2, dtype=np.int64)
        np.cumsum(np.bincount(flat), out=self.starts[1:])

    def __call__(self, index: int) -> list[int]:
        if index + 1 >= len(self.starts):
            return []
        return self.positions[self.starts[index] : self.starts[index + 1]].tolist()


class Sources:
    """Where one worker finds the pieces of each output of one placement: the splits
    it holds (read from its store on its event loop), those of its host it maps
    from shared memory (sliced in the task's thread, their holders not involved), and
    the positions each other holder is asked for. Learned once per worker and
    placement (:meth:`learn`); kept on the placement while the worker holds it.

    Splits mapped from a peer's segments are kept mapped between assemblies up to
    ``budget`` bytes (least recently used go first; ``None``: no bound, the worker
    has no memory target) and mapped again when needed: a segment its owner spilled
    and unlinked lives on while it is mapped here, counted by neither worker. A split
    that cannot be mapped again (spilled, its owner gone) is asked of its holder."""

    def __init__(self, mine: dict[int, Any], mapped: dict[int, Any], remote: dict[str, dict[int, Any]],
                 budget: int | None = None, kept: dict[int, tuple[Split, int]] | None = None,
                 files: dict[int, tuple[Any, SplitHead, str, tuple[int, ...], list[Any]]] | None = None) -> None:
        # (the placement is not kept here: it holds this, and a cycle would keep the
        # mapped splits until the cyclic collector ran)
        self._mine = _ByOutput(mine)
        self._mapped = _ByOutput(mapped)
        self._remote = {holder: _ByOutput(outputs) for holder, outputs in remote.items()}
        #: what an output without rows reads: the first split (none of its rows), for
        #: the output's types
        holder = next((h for h, outputs in remote.items() if 0 in outputs), None)
        self._no_rows: tuple[list[int], list[int], dict[str, list[int]]] = (
            [0] if 0 in mine else [], [0] if 0 in mapped else [], {holder: [0]} if holder is not None else {})
        #: position -> (key, head, file, its identity, records) of a split that a peer
        #: of this host spilled in parts: its records are read here, the peer not asked
        self._files = dict(files or {})
        self._budget = budget
        #: position -> the split mapped, its size
        self._kept: dict[int, tuple[Split, int]] = {}
        self._kept_bytes = 0
        self._lock = threading.Lock()
        for pos, (value, nbytes) in (kept or {}).items():
            self._keep(pos, value, nbytes)

    @classmethod
    def learn(cls, worker: Any, placement: Placement) -> Sources:
        """What ``worker`` needs to know of ``placement`` (in a task's thread)."""
        address = worker.address
        target = getattr(worker.store, "target", None)
        budget = None if target is None else target // 4
        mine: list[int] = []
        mapped: dict[int, Any] = {}
        kept: dict[int, tuple[Split, int]] = {}
        room = budget
        ask: dict[str, list[int]] = {}
        for pos, loc in enumerate(placement):
            if address in loc.holders:
                mine.append(pos)
                continue
            if loc.shm is not None and worker.use_shm:
                value = _attach(loc)
                if value is not None:
                    mapped[pos] = value.outputs.copy()  # (not a view: it would keep the mapping)
                    if room is None or loc.nbytes <= room:
                        kept[pos] = (value, loc.nbytes)
                        room = None if room is None else room - loc.nbytes
                    continue
            if not loc.holders:
                raise ShuffleError(f"no worker holds {loc.key!r} (input {pos} of the shuffle)")
            ask.setdefault(loc.holders[0], []).append(pos)
        mine_outputs, remote, files = _on_loop(worker, _learn(worker, placement, mine, ask))
        return cls(mine_outputs, mapped, remote, budget, kept, files)

    def wanted(self, index: int) -> tuple[list[int], list[int], dict[str, list[int]]]:
        """The positions with rows for output ``index``: held here, mapped, and to
        ask each holder for. None anywhere: the first split (no rows), for the
        output's types."""
        mine, mapped = self._mine(index), self._mapped(index)
        ask = {h: got for h, table in self._remote.items() if (got := table(index))}
        if not (mine or mapped or ask):
            return self._no_rows
        return mine, mapped, ask

    def map(self, placement: Placement, positions: list[int], ask: dict[str, list[int]]) -> list[tuple[int, Split]]:
        """The splits at ``positions`` of ``placement`` (of this host's peers), kept or
        mapped again; those that cannot be mapped any more are added to ``ask``,
        under a holder."""
        out = []
        for pos in positions:
            with self._lock:
                entry = self._kept.pop(pos, None)
                if entry is not None:
                    self._kept[pos] = entry  # (most recently used now)
            if entry is not None:
                out.append((pos, entry[0]))
                continue
            loc = placement[pos]
            value = _attach(loc)
            if value is None:
                if not loc.holders:
                    raise ShuffleError(f"no worker holds {loc.key!r} (input {pos} of the shuffle)")
                ask.setdefault(loc.holders[0], []).append(pos)
                continue
            self._keep(pos, value, loc.nbytes)
            out.append((pos, value))
        return out

    def read_files(self, ask: dict[str, list[int]], index: int) -> list[tuple[int, Any]]:
        """Of the positions to ask each holder in ``ask``, those whose splits a peer of
        this host spilled: taken out of ``ask``, as parts to read from its files
        (splits of no rows where they have none for output ``index``)."""
        if not self._files:
            return []
        out: list[tuple[int, Any]] = []
        with self._lock:
            for holder in list(ask):
                left = []
                for pos in ask[holder]:
                    entry = self._files.get(pos)
                    if entry is None:
                        left.append(pos)
                        continue
                    key, head, path, expect, records = entry
                    out.append((pos, _part(key, head, index, path, records, expect)))
                if left:
                    ask[holder] = left
                else:
                    del ask[holder]
        return out

    def forget_file(self, pos: int) -> None:
        """The file of the split at ``pos`` failed to read here: its holder is asked."""
        with self._lock:
            self._files.pop(pos, None)

    def _keep(self, pos: int, value: Split, nbytes: int) -> None:
        with self._lock:
            if self._budget is not None and nbytes > self._budget:
                return
            old = self._kept.pop(pos, None)
            if old is not None:
                self._kept_bytes -= old[1]
            self._kept[pos] = (value, nbytes)
            self._kept_bytes += nbytes
            while self._budget is not None and self._kept_bytes > self._budget:
                self._kept_bytes -= self._kept.pop(next(iter(self._kept)))[1]


def _attach(loc: Location) -> Split | None:
    """The split ``loc`` says is in a segment, mapped; ``None`` if it cannot be (gone:
    spilled, reused, its owner dead; out of descriptors)."""
    from ..comm import shm

    try:
        value = shm.attach(loc.shm)
    except Exception:  # noqa: BLE001 - whatever it is, its holder is asked instead
        return None
    return value if isinstance(value, Split) else None


def _sources(worker: Any, placement: Placement) -> Sources:
    """``worker``'s :class:`Sources` of ``placement``: learned by the first of its
    assemblies, the others waiting for it out of the thread pool (a thread that held
    a lock while it waits could hold the slot the learner needs to come back to)."""
    with placement._lock:
        entry = placement._sources.get(worker.address)
        learner = entry is None
        if entry is None:
            entry = placement._sources[worker.address] = concurrent.futures.Future()
    if learner:
        try:
            entry.set_result(Sources.learn(worker, placement))
        except BaseException as exc:
            with placement._lock:
                placement._sources.pop(worker.address, None)  # the next assembly tries again
            entry.set_exception(exc)
            raise
    elif not entry.done():
        from .context import waiting

        with waiting():
            concurrent.futures.wait([entry])
    return entry.result()


def _on_loop(worker: Any, coroutine: Any) -> Any:
    """Run ``coroutine`` on the worker's event loop from a task's thread. The thread
    keeps its place in the pool while it waits: what an assembly fetches is its work,
    and one that left the pool would let the next assembly start and gather its
    pieces too (measured: two one-thread workers of 300 MB each, a shuffle of 1.7 GB,
    every assembly of a worker in flight at once when its pieces came over a socket:
    its nanny killed it)."""
    future = asyncio.run_coroutine_threadsafe(coroutine, worker.loop)
    try:
        return future.result()
    except concurrent.futures.CancelledError as exc:
        raise Reschedule("the worker is closing") from exc


def bundles(worker: Any, placement: Placement, index: int) -> list[Bundle]:
    """The rows of output ``index``, by distance (see the module); run in a task's
    thread. Raises :class:`~shoal.errors.Reschedule` when a holder cannot be reached,
    :class:`~shoal.errors.ShuffleError` when one answers without a split."""
    sources = _sources(worker, placement)
    mine, mapped, ask = sources.wanted(index)
    ask = {holder: list(positions) for holder, positions in ask.items()}
    pieces: list[tuple[int, Any]] = list(sources.map(placement, mapped, ask))
    pieces.extend(sources.read_files(ask, index))
    remote: list[Bundle] = []
    if mine or ask:
        local, remote = _on_loop(worker, _gather(worker, placement, index, mine, ask))
        pieces.extend(local)
    done, unread = _resolve(worker, pieces, index)
    if unread:  # peers' files that could not be read here: their holders are asked
        retry: dict[str, list[int]] = {}
        for pos in unread:
            sources.forget_file(pos)
            holders = placement[pos].holders
            if not holders:
                raise ShuffleError(f"no worker holds {placement[pos].key!r} (input {pos} of the shuffle)")
            retry.setdefault(holders[0], []).append(pos)
        remote = remote + _on_loop(worker, _gather(worker, placement, index, [], retry))[1]
    return bundle(sorted(done, key=lambda p: p[0]), index) + remote


#: times a part of a spilled split is looked up again when its file went meanwhile
#: (read back, or spilled again elsewhere) before its holder is taken not to hold it
_TRIES = 3


def _read(pieces: list[tuple[int, Any]]) -> tuple[list[tuple[int, Split]], list[tuple[int, _PartRead]],
                                                  list[tuple[int, _PartRead, BaseException]]]:
    """Read the parts of spilled splits among ``pieces`` (in the calling thread):
    the splits (those in memory as they are, parts as splits of one output's rows),
    the parts whose files went meanwhile, and those whose files fail (with why)."""
    done: list[tuple[int, Split]] = []
    gone: list[tuple[int, _PartRead]] = []
    failed: list[tuple[int, _PartRead, BaseException]] = []
    for pos, piece in pieces:
        if not isinstance(piece, _PartRead):
            done.append((pos, piece))
            continue
        try:
            done.append((pos, piece.read()))
        except FileNotFoundError:
            gone.append((pos, piece))
        except MemoryError:
            raise
        except OSError as exc:
            if exc.errno in MAY_PASS:
                raise
            failed.append((pos, piece, exc))
        except Exception as exc:  # noqa: BLE001 - a corrupt file, or a part that does not unpickle
            failed.append((pos, piece, exc))
    return done, gone, failed


def _resolve(worker: Any, pieces: list[tuple[int, Any]], index: int) -> tuple[list[tuple[int, Split]], list[int]]:
    """``pieces`` as splits, the parts of spilled splits read in this (the task's)
    thread, and the positions of those read from a peer's file that could not be (it
    went, changed or fails: its holder is to be asked, and finds out itself). A part
    of this worker's own file that fails loses its split (the scheduler hears it and
    makes it again) and gives the task back."""
    unread: list[int] = []
    for _ in range(_TRIES):
        done, gone, failed = _read(pieces)
        # (a peer's file: its holder is asked; this worker's own: looked up again, or lost)
        unread += [pos for pos, piece in gone if piece.expect is not None]
        unread += [pos for pos, piece, _ in failed if piece.expect is not None]
        gone = [(pos, piece) for pos, piece in gone if piece.expect is None]
        failed = [(pos, piece, exc) for pos, piece, exc in failed if piece.expect is None]
        if failed:
            _on_loop(worker, _lose(worker, failed))
            raise Reschedule(f"{len(failed)} split(s) of the shuffle were lost here (their spill files fail); "
                             "they are made again")
        if not gone:
            return done, unread
        pieces = done + _on_loop(worker, _look_again(worker, gone, index))
    raise ShuffleError(f"the spill files of {len(gone)} split(s) went {_TRIES} times while they were read")


async def _lose(worker: Any, failed: list[tuple[int, _PartRead, BaseException]]) -> list[Any]:
    """On the loop: the splits whose parts failed to read are lost; the scheduler
    is told. Returns their keys."""
    keys = []
    for _, piece, exc in failed:
        error = worker.store.lose(piece.key, piece.path, exc)
        logger.error("%s; it is made again", error)
        keys.append(piece.key)
    worker.values_lost(keys)
    return keys


async def _look_again(worker: Any, gone: list[tuple[int, _PartRead]], index: int) -> list[tuple[int, Any]]:
    """On the loop: the splits of ``gone`` as the store has them now."""
    out = []
    for pos, piece in gone:
        if piece.key not in worker.store:
            raise ShuffleError(f"this worker was to hold {piece.key!r} (input {pos} of the shuffle) and does not")
        out.append((pos, _piece(worker.store, piece.key, index)))
    return out


async def _ask_all(worker: Any, placement: Placement, ask: dict[str, list[int]], op: str,
                   **fields: Any) -> list[tuple[list[int], Any]]:
    """Ask each holder in ``ask`` (``op``: get-slices or split-outputs) about the
    splits at its positions, all at once; ``(positions, answer)`` of each."""
    if not ask:
        return []
    results = await asyncio.gather(*(_ask(worker, holder, op, [placement[p].key for p in positions], **fields)
                                     for holder, positions in ask.items()), return_exceptions=True)
    out = []
    for (holder, positions), result in zip(ask.items(), results):
        if isinstance(result, BaseException):
            if isinstance(result, (CommError, OSError, asyncio.TimeoutError)):
                # the scheduler loses that worker (or has): the task comes back once
                # the splits it held are made again; a pause, not a spin, meanwhile
                await asyncio.sleep(UNREACHABLE_PAUSE)
                raise Reschedule(f"cannot reach {holder} for its part of the shuffle: {result}") from result
            raise result
        if result.get("lost"):
            # the holder's spill files failed: it told the scheduler, which makes
            # those splits again and then the barrier; this task runs after it
            await asyncio.sleep(UNREACHABLE_PAUSE)
            raise Reschedule(f"{holder} lost {len(result['lost'])} split(s) of the shuffle (their spill files fail)")
        held = set(result["held"])
        for i, pos in enumerate(positions):
            if i not in held:
                key = placement[pos].key
                raise ShuffleError(f"{holder} does not hold {key!r} (input {pos} of the shuffle) any more")
        out.append((positions, result))
    return out


def _held(worker: Any, placement: Placement, positions: list[int]) -> list[tuple[int, Any]]:
    """The keys at ``positions`` of ``placement``, which this worker holds."""
    store = worker.store
    out = []
    for pos in positions:
        key = placement[pos].key
        if key not in store:
            raise ShuffleError(f"this worker was to hold {key!r} (input {pos} of the shuffle) and does not")
        out.append((pos, key))
    return out


def _head(store: Any, key: Any) -> Split | SplitHead:
    """``key``'s split as the store has it: in memory, or the head of one spilled."""
    where = store.parts_file(key)
    value = where[0] if where is not None else store.peek(key)
    if not isinstance(value, (Split, SplitHead)):
        raise ShuffleError(f"{key!r:.100} holds no split of shoal's shuffle")
    return value


def _piece(store: Any, key: Any, index: int) -> Split | _PartRead:
    """``key``'s split when it is in memory; when it is spilled, output ``index``'s
    rows of it to read (see :func:`_part`)."""
    value = _head(store, key)
    if isinstance(value, Split):
        return value
    _, path, records = store.parts_file(key)
    return _part(key, value, index, path, records)


def _part(key: Any, head: SplitHead, index: int, path: str, records: list[Any],
          expect: tuple[int, ...] | None = None) -> Split | _PartRead:
    """Output ``index``'s rows of the split ``key`` spilled in parts to ``path``: its
    record to read (:class:`_PartRead`), or a split of no rows when it has none."""
    part = head.part_of(index)
    if part is None:
        return head.with_rows(index, None)
    offset, length = records[part]
    return _PartRead(key, head, index, path, offset, length, expect)


async def _learn(worker: Any, placement: Placement, mine: list[int], ask: dict[str, list[int]]) -> Any:
    """On the loop: the outputs of this worker's splits at ``mine``; those of the
    splits each holder in ``ask`` has; and where the splits that holders of this host
    spilled in parts lie (read here, not asked for)."""
    import numpy as np

    store = worker.store
    outputs = {pos: _head(store, key).outputs for pos, key in _held(worker, placement, mine)}
    remote: dict[str, dict[int, Any]] = {}
    files: dict[int, tuple[Any, SplitHead, str, tuple[int, ...], list[Any]]] = {}
    for (holder, positions), (_, answer) in zip(ask.items(), await _ask_all(worker, placement, ask, "split-outputs")):
        remote[holder] = {pos: np.asarray(got, dtype=np.int64) for pos, got in zip(positions, answer["outputs"])}
        if answer.get("same_host") and answer.get("files"):
            for pos, entry in zip(positions, answer["files"]):
                if entry is not None and isinstance(entry[0], SplitHead):
                    head, path, expect, records = entry
                    files[pos] = (placement[pos].key, head, str(path), tuple(expect), list(records))
    return outputs, remote, files


async def _gather(worker: Any, placement: Placement, index: int, mine: list[int],
                  ask: dict[str, list[int]]) -> tuple[list[tuple[int, Any]], list[Bundle]]:
    """On the loop: this worker's splits at ``mine`` (or the parts to read of those
    spilled), and the bundles of output ``index`` the holders in ``ask`` send."""
    import numpy as np

    store = worker.store
    local = [(pos, _piece(store, key, index)) for pos, key in _held(worker, placement, mine)]
    out = []
    for positions, answer in await _ask_all(worker, placement, ask, "get-slices", index=index):
        where = np.asarray(positions, dtype=np.int64)
        for got in answer["rows"]:
            got.positions = where[got.positions]  # (their place in the request: in the placement)
            out.append(got)
    return local, out


async def _ask(worker: Any, holder: str, op: str, keys: list[Any], **fields: Any) -> dict[str, Any]:
    comm = await worker.pool.connect(holder)
    try:
        await comm.write({"op": op, "reply": True, "keys": keys, **fields})
        response = await comm.read()
    except BaseException:
        comm.abort()
        raise
    finally:
        worker.pool.reuse(holder, comm)
    if not isinstance(response, dict) or response.get("status") != "OK":
        text = response.get("message") if isinstance(response, dict) else repr(response)
        raise ShuffleError(f"{holder} could not send its part of the shuffle: {text}")
    result: dict[str, Any] = response["result"]
    # (a holder of this host: its spill files are this worker's to read too)
    result["same_host"] = comm.peer_info.get("host") == host_identity()
    return result


def _splits(store: Any, keys: list[Any], op: str) -> list[tuple[int, Any]]:
    """The split keys among ``keys`` this worker holds, with their place in ``keys``."""
    out = []
    for i, key in enumerate(keys):
        name = key[0] if isinstance(key, tuple) and key else key
        if not (isinstance(name, str) and name.startswith(SPLIT_PREFIX)):
            raise ShuffleError(f"{op} serves the values of shuffle splits only, not {key!r:.100}")
        if key in store:
            out.append((i, key))
    return out


async def serve_slices(worker: Any, keys: list[Any], index: int) -> tuple[list[int], list[Bundle], list[int]]:
    """``get-slices`` (on the worker's loop): which of ``keys`` this worker holds
    (their places in ``keys``), the rows of output ``index`` of those splits
    (bundles whose positions are places in ``keys``), and the places of those it
    lost answering (their spill files fail: the scheduler is told). The parts of
    spilled splits are read in a thread, off the loop."""
    store = worker.store
    pieces: list[tuple[int, Any]] = [(i, _piece(store, key, index)) for i, key in _splits(store, keys, "get-slices")]
    lost: list[int] = []
    for _ in range(_TRIES):
        if not any(isinstance(piece, _PartRead) for _, piece in pieces):
            break
        done, gone, failed = await asyncio.to_thread(_read, pieces)
        if failed:
            await _lose(worker, failed)
            lost.extend(i for i, _, _ in failed)
        # (one gone meanwhile and no longer here is left out: not held)
        pieces = done + [(i, _piece(store, piece.key, index)) for i, piece in gone if piece.key in store]
    else:
        pieces = [(i, piece) for i, piece in pieces if not isinstance(piece, _PartRead)]
    pieces.sort(key=lambda p: p[0])
    return [i for i, _ in pieces], bundle(pieces, index), lost


def serve_outputs(store: Any, keys: list[Any]) -> tuple[list[int], list[list[int]], list[Any]]:
    """``split-outputs``: which of ``keys`` this worker holds (their places in
    ``keys``), for each the output partitions its split has rows for, and for each
    spilled in parts ``(head, file, its identity, records)`` (else ``None``): a
    worker of this host reads the records itself."""
    import os

    from .spill import identity

    splits = _splits(store, keys, "split-outputs")
    files: list[Any] = []
    for _, key in splits:
        where = store.parts_file(key)
        if where is not None:
            head, path, records = where
            try:
                where = (head, path, identity(os.stat(path)), records)
            except OSError:
                where = None
        files.append(where)
    return [i for i, _ in splits], [_head(store, key).outputs.tolist() for _, key in splits], files
