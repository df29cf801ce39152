"""shoal's own shuffle, on the workers: the functions of its tasks, and the
``split-outputs`` and ``get-slices`` requests peers answer. The graph (one task per
input partition, one barrier, one per output partition) is made by
:mod:`shoal.client.shuffle`; the theory is in docs/shuffle.md.

- **split** (one task per input partition): a :class:`Split`, the partition's arrays
  with their rows sorted (stably) by output partition, the outputs it has rows for
  and where each one's rows start. That is the task's value, kept where it was made like any other: in this
  worker's store (spilled under memory pressure, placed in shared memory when large,
  freed by the scheduler). Nothing is sent anywhere yet.
- **locate** (the barrier): a task the scheduler marks ``locate``. Its worker fetches
  none of its inputs; it gets their :class:`Location` instead (who holds each split,
  its size, its segment), and returns them (a :class:`Placement`). The scheduler
  keeps the splits while it is held, and makes it again when one of them is lost (a
  worker died), which sends the output tasks that needed that split back to wait.
- **assemble** (one per output partition): its rows out of every split that has any,
  taken by distance, then joined in input order. A worker learns once per shuffle
  which outputs each split has rows for (:class:`Sources`: the splits it holds, those
  of its host it maps from shared memory, and one ``split-outputs`` request to each
  other holder); an assembly then touches only the splits with rows for it: from this
  worker's store by reference, sliced from a mapped segment with no peer involved,
  from the other holders with one ``get-slices`` request each, all at once. A holder
  that cannot be reached gives the task back (:class:`~shoal.errors.Reschedule`).

Rows travel column by column (:class:`Bundle`: the numpy or pandas extension arrays
of a holder's splits for one output, joined by the holder when they are small, and
which input each run of rows came from), and an output is joined a column at a time,
in input order: slicing a split costs microseconds however many outputs there are,
and only rows of inputs whose columns differ in type go through dask's ``concat``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import logging
import pickle
import threading
from dataclasses import dataclass
from typing import Any

from ..comm.core import host_identity
from ..errors import CommError, Reschedule, ShuffleError

__all__ = ["Location", "Placement", "Split", "SplitHead", "Bundle", "Sources", "output_numbers", "split", "locate", "assemble",
           "bundle", "join", "serve_slices", "serve_outputs", "SPLIT_PREFIX", "LOCATE_PREFIX"]

#: the key prefixes of the shuffle's tasks (the client names them; the worker's
#: ``get-slices`` and ``split-outputs`` serve values of split tasks only)
SPLIT_PREFIX = "shoal-shuffle-split"
LOCATE_PREFIX = "shoal-shuffle-locate"
#: seconds an assembly waits before it gives itself back when a holder is unreachable
UNREACHABLE_PAUSE = 0.5
#: errors reading a spill file that may pass (the file is not at fault)
_MAY_PASS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})

logger = logging.getLogger("shoal.worker")


@dataclass(frozen=True)
class Location:
    """Where an input of a ``locate`` task is: its key, the workers that hold it,
    its size, and its shared-memory segment (opaque; None: in no segment)."""

    key: Any
    holders: tuple[str, ...]
    nbytes: int = 0
    shm: Any = None


class Placement(list):  # type: ignore[type-arg]
    """The barrier's value: where each split is (:class:`Location`, in input order),
    or, under a scheduler that does not know ``locate``, the splits themselves. Each
    worker that assembles from it keeps its :class:`Sources` here, for as long as it
    holds the value (never sent along: a copy elsewhere learns its own). A worker
    that fetched it keeps it until the scheduler frees it (``__shoal_replica__``)."""

    #: a fetched copy is kept as a replica (:mod:`shoal.worker.fetching`)
    __shoal_replica__ = True

    def __init__(self, items: Any = ()) -> None:
        super().__init__(items)
        self._sources: dict[str, concurrent.futures.Future[Sources]] = {}
        self._lock = threading.Lock()

    def __reduce__(self) -> Any:
        return (Placement, (list(self),))


class _Form:
    """What the rows of one split share: a series or a frame, its column labels (a
    series: its name), the type of each column, and its index (a MultiIndex or not,
    the levels' names and types). Forms that are equal (:attr:`key`) join column by
    column."""

    __slots__ = ("series", "labels", "dtypes", "index", "key")

    def __init__(self, series: bool, labels: Any, dtypes: tuple[Any, ...], index: tuple[Any, ...]) -> None:
        self.series, self.labels, self.dtypes, self.index = series, labels, dtypes, index
        named = (labels,) if series else (tuple(labels), str(labels.dtype), labels.nlevels)
        self.key = (series, named, dtypes, index)

    def __getstate__(self) -> Any:
        # (the labels in the pickle stream itself: an index of strings would otherwise
        # bring buffers of its own, and a split or bundle is best one buffer)
        labels = self.labels if self.series else pickle.dumps(self.labels, protocol=4)
        return (self.series, labels, self.dtypes, self.index)

    def __setstate__(self, state: Any) -> None:
        series, labels, dtypes, index = state
        self.__init__(series, labels if series else pickle.loads(labels), dtypes, index)  # type: ignore[misc]

    def same(self, other: _Form) -> bool:
        return other is self or other.key == self.key

    def build(self, arrays: list[Any], ignore_index: bool = False) -> Any:
        """A series or frame of ``arrays`` (its columns, then its index's levels, which
        ``ignore_index`` needs not), no copy. Each column keeps its type: pandas would
        read strings in an object array as its string type."""
        import pandas as pd

        n = len(self.dtypes)
        data, levels = arrays[:n], arrays[n:]
        multi, names, types = self.index
        if ignore_index:
            index = pd.RangeIndex(len(arrays[0]))
        elif multi:
            index = pd.MultiIndex.from_arrays([pd.Index(a, dtype=t, copy=False) for a, t in zip(levels, types)],
                                              names=list(names))
        else:
            index = pd.Index(levels[0], dtype=types[0], name=names[0], copy=False)
        if self.series:
            return pd.Series(data[0], index=index, name=self.labels, dtype=self.dtypes[0], copy=False)
        # (series on this very index: the frame takes them without aligning them)
        frame = pd.DataFrame({i: pd.Series(c, index=index, dtype=t, copy=False)
                              for i, (c, t) in enumerate(zip(data, self.dtypes))}, index=index, copy=False)
        frame.columns = self.labels
        return frame


def _array(values: Any) -> Any:
    """A series' or index's values, without copying: numpy for numpy types, pandas'
    extension arrays for the others."""
    import numpy as np

    return values.to_numpy() if isinstance(values.dtype, np.dtype) else values.array


def _arrays(frame: Any) -> tuple[_Form, list[Any]]:
    """``frame``'s form and its arrays: its columns, then its index's levels."""
    import pandas as pd

    index = frame.index
    multi = isinstance(index, pd.MultiIndex)
    levels = [index.get_level_values(i) for i in range(index.nlevels)] if multi else [index]
    index_form = (multi, tuple(index.names), tuple(level.dtype for level in levels))
    if frame.ndim == 1:
        form = _Form(True, frame.name, (frame.dtype,), index_form)
        columns = [_array(frame)]
    else:
        form = _Form(False, frame.columns, tuple(frame.dtypes), index_form)
        columns = [_array(frame.iloc[:, i]) for i in range(frame.shape[1])]
    return form, columns + [_array(level) for level in levels]


def _concat_arrays(arrays: list[Any], out: Any = None) -> Any:
    """One array of ``arrays`` (all of one type), always a new one (``out``, when
    given: a numpy array of their type and total length)."""
    import numpy as np

    first = arrays[0]
    if isinstance(first, np.ndarray):
        return np.concatenate(arrays, out=out)
    if len(arrays) == 1:
        return first.copy()
    return type(first)._concat_same_type(arrays)


def _take(array: Any, order: Any, out: Any = None) -> Any:
    import numpy as np

    return np.take(array, order, out=out) if isinstance(array, np.ndarray) else array.take(order)


def _result_arrays(types: list[Any], lengths: list[int]) -> list[Any]:
    """Empty numpy arrays of ``types`` and ``lengths`` (``None`` for a type numpy does
    not hold by value: objects, pandas' extension types), all in one buffer: a
    task's result that shoal places in shared memory is then published where it was
    written, one segment and no copy (:func:`shoal.comm.shm_born.for_result`)."""
    import numpy as np

    from ..comm.shm_born import for_result
    from ..comm.shm_files import align

    plain = [isinstance(t, np.dtype) and not t.hasobject for t in types]
    sizes = [align(t.itemsize * n) if p else 0 for t, n, p in zip(types, lengths, plain)]
    with for_result():
        whole = np.empty(max(sum(sizes), 1), dtype=np.uint8)
    out, pos = [], 0
    for t, n, p, size in zip(types, lengths, plain, sizes):
        out.append(whole[pos : pos + t.itemsize * n].view(t) if p else None)
        pos += size
    return out


#: chunks of a bundle smaller than this on average are joined by their holder (one
#: array to pickle, not one per split); larger ones travel as they are
_SMALL_CHUNKS = 16 * 1024


class Bundle:
    """The rows of one output partition from several splits of one form: for each
    array (the frame's columns, then its index's levels) its chunks, one per split in
    ``positions`` order (or, joined, one for all), and how many rows came from each
    (``lengths``)."""

    __slots__ = ("form", "positions", "lengths", "chunks")

    def __init__(self, form: _Form, positions: Any, lengths: Any, chunks: list[list[Any]]) -> None:
        self.form, self.positions, self.lengths, self.chunks = form, positions, lengths, chunks

    def __getstate__(self) -> Any:
        return (self.form, self.positions, self.lengths, self.chunks)

    def __setstate__(self, state: Any) -> None:
        self.form, self.positions, self.lengths, self.chunks = state

    @property
    def rows(self) -> int:
        return int(self.lengths.sum())

    def __sizeof__(self) -> int:
        return 64 + sum(int(getattr(c, "nbytes", 0)) for chunks in self.chunks for c in chunks)

    def arrays(self) -> list[Any]:
        """Each array, its chunks joined (new arrays)."""
        return [_concat_arrays(chunks) for chunks in self.chunks]

    def runs(self) -> list[tuple[int, Any]]:
        """``(position, rows)`` of each split, as pandas frames (or series)."""
        import numpy as np

        whole = self.form.build(self.arrays())
        bounds = np.concatenate([[0], np.cumsum(self.lengths)])
        return [(int(p), whole.iloc[int(a) : int(b)]) for p, a, b in zip(self.positions, bounds[:-1], bounds[1:])]


def bundle(splits: list[tuple[int, Split]], index: int) -> list[Bundle]:
    """The rows of output ``index`` of ``splits`` (``(position, split)``, positions
    ascending): one :class:`Bundle` per form among them (one, unless the inputs'
    columns differ in type)."""
    import numpy as np

    groups: list[tuple[_Form, list[int], list[int], list[list[Any]]]] = []
    for pos, value in splits:
        start, stop = value.bounds(index)
        form, arrays = value.form, value.arrays
        group = next((g for g in reversed(groups) if g[0].same(form)), None)
        if group is None:
            group = (form, list[int](), list[int](), [[] for _ in arrays])
            groups.append(group)
        group[1].append(pos)
        group[2].append(stop - start)
        for chunks, array in zip(group[3], arrays):
            chunks.append(array[start:stop])
    out = []
    for form, positions, lengths, chunks in groups:
        if len(positions) > 1 and sum(int(getattr(c, "nbytes", 0)) for c in chunks[0]) < _SMALL_CHUNKS * len(positions):
            chunks = [[_concat_arrays(c)] for c in chunks]
        out.append(Bundle(form, np.asarray(positions, dtype=np.int64), np.asarray(lengths, dtype=np.int64), chunks))
    return out


def join(bundles: list[Bundle], meta: Any, ignore_index: bool) -> Any:
    """``bundles`` as one frame, rows in input order: column by column when they are
    of one form, else by dask's rules (:func:`_concat`). No rows at all: the first
    bundle's empty frame (the data's types), or ``meta`` when there is none."""
    import numpy as np

    full = [b for b in bundles if b.rows]
    if not full:
        return bundles[0].form.build(bundles[0].arrays(), ignore_index) if bundles else meta
    form = full[0].form
    if all(form.same(b.form) for b in full[1:]) and form.dtypes:
        # (with ignore_index the index's levels are left out: a new one is made)
        width = len(form.dtypes) if ignore_index else len(full[0].chunks)
        # the result in one buffer (see _result_arrays)
        total = sum(b.rows for b in full)
        out = _result_arrays([c[0].dtype for c in full[0].chunks[:width]], [total] * width)
        if all(len(b.chunks[0]) == len(b.positions) for b in full):  # a chunk per split: put them in order
            order = sorted((p, i, j) for i, b in enumerate(full) for j, p in enumerate(b.positions.tolist()))
            arrays = [_concat_arrays([full[i].chunks[a][j] for _, i, j in order], out[a]) for a in range(width)]
        else:  # (small rows joined by their holders: interleaved row by row, if need be)
            keys = np.concatenate([np.repeat(b.positions, b.lengths) for b in full])
            rows = None
            if len(keys) > 1 and (keys[1:] < keys[:-1]).any():
                rows = np.argsort(keys, kind="stable")
            arrays = [_concat_arrays([c for b in full for c in b.chunks[a]], None if rows is not None else out[a])
                      for a in range(width)]
            if rows is not None:
                arrays = [_take(a, rows, target) for a, target in zip(arrays, out)]
        return form.build(arrays, ignore_index)
    runs = sorted((run for b in full for run in b.runs() if len(run[1])), key=lambda run: run[0])
    out = _concat([rows for _, rows in runs])
    return out.reset_index(drop=True) if ignore_index else out


class Split:
    """The value of a split task: an input partition's rows sorted (stably) by output
    partition, as its form and arrays (the frame's columns, then its index's levels:
    see :func:`_arrays`), the outputs it has rows for (``outputs``, ascending), where
    each of their rows start (``starts``, one more than ``outputs``) and how many
    outputs the shuffle has (``n``). Sparse: a split of a few rows into 10,000 outputs
    holds a few numbers, not 10,000."""

    __slots__ = ("form", "arrays", "outputs", "starts", "n", "__weakref__")

    def __init__(self, form: _Form, arrays: list[Any], outputs: Any, starts: Any, n: int) -> None:
        self.form, self.arrays, self.outputs, self.starts, self.n = form, arrays, outputs, starts, n

    def __reduce__(self) -> Any:
        return (Split, (self.form, self.arrays, self.outputs, self.starts, self.n))

    def __sizeof__(self) -> int:
        from ..protocol.sizes import managed_sizeof

        return managed_sizeof(self.arrays) + int(self.outputs.nbytes + self.starts.nbytes) + 64

    def bounds(self, index: int) -> tuple[int, int]:
        """Where output ``index``'s rows start and stop."""
        import numpy as np

        if not 0 <= index < self.n:
            raise ShuffleError(f"output partition {index} of a shuffle into {self.n}")
        i = int(np.searchsorted(self.outputs, index))
        start = int(self.starts[i])
        if i < len(self.outputs) and self.outputs[i] == index:
            return start, int(self.starts[i + 1])
        return start, start

    def rows(self, index: int) -> Any:
        """Output ``index``'s rows as a frame (or series)."""
        start, stop = self.bounds(index)
        return self.form.build([a[start:stop] for a in self.arrays])

    def __shoal_spill_parts__(self) -> tuple[SplitHead, list[list[Any]]]:
        """How a worker's store spills a split: its :class:`SplitHead` stays in
        memory, and each output's rows (its slice of every array) are a part of
        their own, read back alone when that output is assembled."""
        bounds = self.starts.tolist()
        parts = [[a[start:stop] for a in self.arrays] for start, stop in zip(bounds[:-1], bounds[1:])]
        head = SplitHead(self.form, [a[:0].copy() for a in self.arrays], self.outputs.copy(), self.starts.copy(),
                         self.n)
        return head, parts


class SplitHead:
    """What a worker keeps in memory of a split it spilled: all but its rows (the
    outputs it has rows for, where each one's rows start, the arrays' types as
    empty arrays). Part ``i`` of the spill file holds the rows of ``outputs[i]``."""

    __slots__ = ("form", "empty", "outputs", "starts", "n")

    def __init__(self, form: _Form, empty: list[Any], outputs: Any, starts: Any, n: int) -> None:
        self.form, self.empty, self.outputs, self.starts, self.n = form, empty, outputs, starts, n

    def part_of(self, index: int) -> int | None:
        """The part with output ``index``'s rows (``None``: the split has none)."""
        import numpy as np

        if not 0 <= index < self.n:
            raise ShuffleError(f"output partition {index} of a shuffle into {self.n}")
        i = int(np.searchsorted(self.outputs, index))
        return i if i < len(self.outputs) and self.outputs[i] == index else None

    def with_rows(self, index: int, arrays: list[Any] | None) -> Split:
        """A split of output ``index``'s rows alone (``arrays``, read from its part;
        ``None``: it has none)."""
        import numpy as np

        if arrays is None:
            return Split(self.form, self.empty, np.zeros(0, np.int64), np.zeros(1, np.int64), self.n)
        i = self.part_of(index)
        want = None if i is None else int(self.starts[i + 1] - self.starts[i])
        if len(arrays) != len(self.empty) or any(len(a) != want for a in arrays):
            raise ShuffleError(f"the part of output {index} read back from a spilled split is not the rows written")
        return Split(self.form, arrays, np.array([index], np.int64), np.array([0, want], np.int64), self.n)

    def __shoal_join_parts__(self, parts: list[list[Any]]) -> Split:
        """The whole split again, from all its parts (in order)."""
        if len(parts) != len(self.outputs):
            raise ShuffleError(f"a spilled split read back with {len(parts)} parts, not {len(self.outputs)}")
        if not parts:
            return Split(self.form, self.empty, self.outputs, self.starts, self.n)
        total = int(self.starts[-1])
        outputs, starts, *out = _result_arrays([self.outputs.dtype, self.starts.dtype] + [a.dtype for a in self.empty],
                                               [len(self.outputs), len(self.starts)] + [total] * len(self.empty))
        outputs[:], starts[:] = self.outputs, self.starts
        arrays = [_concat_arrays([part[a] for part in parts], out[a]) for a in range(len(self.empty))]
        return Split(self.form, arrays, outputs, starts, self.n)


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


def output_numbers(df: Any, on: Any, npartitions: int) -> Any:
    """The output partition of each row of ``df``, as dask numbers them: the column
    ``"_partitions"`` when ``on`` names it (dask's planner adds it), else the hash of
    the columns ``on`` (of the whole frame or series when ``on`` is empty) modulo
    ``npartitions``."""
    import numpy as np

    columns = [on] if isinstance(on, str) else list(on or [])
    if columns and columns[0] == "_partitions":
        numbers = df["_partitions"]
    else:
        from dask.dataframe.dispatch import hash_object_dispatch

        numbers = hash_object_dispatch(df[columns] if columns else df, index=False) % npartitions
    return np.asarray(numbers).astype(np.int64, copy=False)


def split(df: Any, on: Any, npartitions: int) -> Split:
    """``df``'s rows sorted (stably) by their output partition (see
    :func:`output_numbers`), and where each output's rows start. Raises
    :class:`~shoal.errors.ShuffleError` for a number outside ``[0, npartitions)``."""
    import numpy as np

    parts = output_numbers(df, on, npartitions)
    if len(parts) and (parts.min() < 0 or parts.max() >= npartitions):
        raise ShuffleError(f"a row's output partition ({parts.min()}..{parts.max()}) is outside 0..{npartitions - 1}")
    # (numbers of 8 or 16 bits sort by radix: 5x faster than as 64-bit numbers)
    narrow = np.uint8 if npartitions <= 1 << 8 else np.uint16 if npartitions <= 1 << 16 else np.uint32
    order = np.argsort(parts.astype(narrow), kind="stable")
    ordered = parts[order]
    # where the output number changes: each output's first row, and the end
    changes = np.flatnonzero(np.diff(ordered)) + 1 if len(ordered) else np.zeros(0, dtype=np.int64)
    nout = len(changes) + 1 if len(ordered) else 0
    form, arrays = _arrays(df)
    # the whole value in one buffer (see _result_arrays), its rows in the new order
    outputs, starts, *out = _result_arrays([np.dtype(np.int64)] * 2 + [a.dtype for a in arrays],
                                           [nout, nout + 1] + [len(parts)] * len(arrays))
    if nout:
        outputs[0], outputs[1:] = ordered[0], ordered[changes]
        starts[0], starts[1:-1], starts[-1] = 0, changes, len(ordered)
    else:
        starts[0] = 0
    taken = [_take(a, order, target) for a, target in zip(arrays, out)]
    return Split(form, taken, outputs, starts, npartitions)


def locate(*inputs: Any) -> Placement:
    """The barrier: where each split is (a shoal worker passes their
    :class:`Location`). Under a scheduler that does not know ``locate`` tasks (dask's
    own, in a test's ``compute(scheduler="sync")``) it gets the splits themselves and
    passes them on: the shuffle is then an ordinary all-to-one exchange, still right."""
    kinds = {isinstance(x, Location) for x in inputs}
    if len(kinds) > 1:
        raise ShuffleError("the shuffle's barrier got both splits and the locations of splits")
    return Placement(inputs)


def assemble(inputs: list[Any], index: int, meta: Any, ignore_index: bool = False) -> Any:
    """Output partition ``index``: its rows of every split (``inputs``: where they are,
    or the splits themselves, see :func:`locate`), joined in input order as dask
    concatenates (``ignore_index``: a new index; ``meta``: the frame's empty form, for
    no inputs)."""
    if inputs and isinstance(inputs[0], Location):
        from .context import get_worker

        if not isinstance(inputs, Placement):
            inputs = Placement(inputs)
        got = bundles(get_worker(), inputs, index)
    else:
        got = bundle(list(enumerate(inputs)), index)
    return join(got, meta, ignore_index)


def _concat(frames: list[Any]) -> Any:
    """``frames`` (not empty) as one, by dask's rules when dask is here (categories
    unioned)."""
    if len(frames) == 1:
        return frames[0]
    try:
        from dask.dataframe.methods import concat as dask_concat
    except ImportError:  # (a shuffle's graph comes from dask; its tests may run without)
        import pandas as pd

        return pd.concat(frames)
    return dask_concat(frames, uniform=True)


# -- on the worker (what an assembly reads where, and the requests peers answer)

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
                    part = head.part_of(index)
                    if part is None:
                        out.append((pos, head.with_rows(index, None)))
                    else:
                        offset, length = records[part]
                        out.append((pos, _PartRead(key, head, index, path, offset, length, expect)))
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
                                                  list[tuple[_PartRead, BaseException]]]:
    """Read the parts of spilled splits among ``pieces`` (in the calling thread):
    the splits (those in memory as they are, parts as splits of one output's rows),
    the parts whose files went meanwhile, and those whose files fail (with why)."""
    done: list[tuple[int, Split]] = []
    gone: list[tuple[int, _PartRead]] = []
    failed: list[tuple[_PartRead, BaseException]] = []
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
            if exc.errno in _MAY_PASS:
                raise
            failed.append((piece, exc))
        except Exception as exc:  # noqa: BLE001 - a corrupt file, or a part that does not unpickle
            failed.append((piece, exc))
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
        unread += [pos for pos, piece in gone if piece.expect is not None]
        unread += [pos for pos, piece in pieces if isinstance(piece, _PartRead) and piece.expect is not None
                   and any(p is piece for p, _ in failed)]
        gone = [(pos, piece) for pos, piece in gone if piece.expect is None]
        failed = [(piece, exc) for piece, exc in failed if piece.expect is None]
        if failed:
            _on_loop(worker, _lose(worker, failed))
            raise Reschedule(f"{len(failed)} split(s) of the shuffle were lost here (their spill files fail); "
                             "they are made again")
        if not gone:
            return done, unread
        pieces = done + _on_loop(worker, _look_again(worker, gone, index))
    raise ShuffleError(f"the spill files of {len(gone)} split(s) went {_TRIES} times while they were read")


async def _lose(worker: Any, failed: list[tuple[_PartRead, BaseException]]) -> list[Any]:
    """On the loop: the splits whose parts failed to read are lost; the scheduler
    is told. Returns their keys."""
    keys = []
    for piece, exc in failed:
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
    value = store.peek_head(key)
    if not isinstance(value, (Split, SplitHead)):
        raise ShuffleError(f"{key!r:.100} holds no split of shoal's shuffle")
    return value


def _piece(store: Any, key: Any, index: int) -> Split | _PartRead:
    """``key``'s split when it is in memory; when it is spilled, output ``index``'s
    rows of it to read (a split of no rows when it has none: nothing to read)."""
    value = _head(store, key)
    if isinstance(value, Split):
        return value
    part = value.part_of(index)
    if part is None:
        return value.with_rows(index, None)
    return _PartRead(key, value, index, *store.part_record(key, part))


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
            lost.extend(keys.index(piece.key) for piece, _ in failed)
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
