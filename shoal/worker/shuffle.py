"""shoal's own shuffle, on the workers: the values and functions of its tasks (where
an assembly finds its pieces, and the requests peers answer, are
:mod:`.shuffle_sources`). The graph (one task per input partition, one barrier, one
per output partition) is made by :mod:`shoal.client.shuffle`; the theory is in
docs/shuffle.md.

- **split** (one task per input partition): a :class:`Split`, the partition's arrays
  with their rows sorted (stably) by output partition, the outputs it has rows for
  and where each one's rows start. That is the task's value, kept where it was made like any other: in this
  worker's store (spilled under memory pressure, placed in shared memory when large,
  freed by the scheduler; spilled in parts, one per output: :class:`SplitHead`).
  Nothing is sent anywhere yet.
- **locate** (the barrier): a task the scheduler marks ``locate``. Its worker fetches
  none of its inputs; it gets their :class:`Location` instead (who holds each split,
  its size, its segment), and returns them (a :class:`Placement`). The scheduler
  keeps the splits while it is held, and makes it again when one of them is lost (a
  worker died), which sends the output tasks that needed that split back to wait.
- **assemble** (one per output partition): its rows out of every split that has any,
  taken by distance (:mod:`.shuffle_sources`), then joined in input order.

Rows travel column by column (:class:`Bundle`: the numpy or pandas extension arrays
of a holder's splits for one output, joined by the holder when they are small, and
which input each run of rows came from), and an output is joined a column at a time,
in input order: slicing a split costs microseconds however many outputs there are,
and only rows of inputs whose columns differ in type go through dask's ``concat``.
"""

from __future__ import annotations

import concurrent.futures
import pickle
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import ShuffleError

if TYPE_CHECKING:
    from .shuffle_sources import Sources

__all__ = ["Location", "Placement", "Split", "SplitHead", "Bundle", "output_numbers", "split", "locate", "assemble",
           "bundle", "join", "SPLIT_PREFIX", "LOCATE_PREFIX"]

#: the key prefixes of the shuffle's tasks (the client names them; the worker's
#: ``get-slices`` and ``split-outputs`` serve values of split tasks only)
SPLIT_PREFIX = "shoal-shuffle-split"
LOCATE_PREFIX = "shoal-shuffle-locate"
#: seconds an assembly waits before it gives itself back when a holder is unreachable
UNREACHABLE_PAUSE = 0.5



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
    column.

    ``numbered``: the position of the frame's column ``"_partitions"`` (the output
    partition of each row, which dask's planner adds and drops again after the
    shuffle) when the split routed its rows by it. Its values in output ``j`` are all
    ``j``, so that column is neither kept nor sent: each output makes it again
    (:meth:`build`'s ``number``), a fifth of the bytes of a frame of four columns."""

    __slots__ = ("series", "labels", "dtypes", "index", "numbered", "key")

    def __init__(self, series: bool, labels: Any, dtypes: tuple[Any, ...], index: tuple[Any, ...],
                 numbered: int | None = None) -> None:
        self.series, self.labels, self.dtypes, self.index = series, labels, dtypes, index
        self.numbered = numbered
        named = (labels,) if series else (tuple(labels), str(labels.dtype), labels.nlevels)
        self.key = (series, named, dtypes, index, numbered)

    def __getstate__(self) -> Any:
        # (the labels in the pickle stream itself: an index of strings would otherwise
        # bring buffers of its own, and a split or bundle is best one buffer)
        labels = self.labels if self.series else pickle.dumps(self.labels, protocol=4)
        return (self.series, labels, self.dtypes, self.index, self.numbered)

    def __setstate__(self, state: Any) -> None:
        series, labels, dtypes, index, numbered = state
        self.__init__(series, labels if series else pickle.loads(labels), dtypes, index,  # type: ignore[misc]
                      numbered)

    def same(self, other: _Form) -> bool:
        return other is self or other.key == self.key

    @property
    def stored(self) -> int:
        """How many of the columns a split holds arrays of (all but the numbered one)."""
        return len(self.dtypes) - (self.numbered is not None)

    def build(self, arrays: list[Any], ignore_index: bool = False, number: int | None = None,
              numbers: Any = None) -> Any:
        """A series or frame of ``arrays`` (its stored columns, then its index's
        levels, which ``ignore_index`` needs not), no copy. Each column keeps its type:
        pandas would read strings in an object array as its string type. A numbered
        form's column of output numbers is ``numbers`` (an array to fill with
        ``number``: see :func:`join`) or a new one of ``number``."""
        import numpy as np
        import pandas as pd

        n = self.stored
        data, levels = list(arrays[:n]), arrays[n:]
        rows = len(arrays[0]) if arrays else 0
        if self.numbered is not None:
            if number is None:
                raise ShuffleError("a split without its column of output numbers was joined with no output number")
            dtype = self.dtypes[self.numbered]
            if numbers is None:
                numbers = np.full(rows, number, dtype=dtype)
            else:
                numbers[:] = number
            data.insert(self.numbered, numbers)
        multi, names, types = self.index
        if ignore_index:
            index = pd.RangeIndex(rows)
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


def _arrays(frame: Any, numbered: bool = False) -> tuple[_Form, list[Any]]:
    """``frame``'s form and its arrays: its columns, then its index's levels;
    ``numbered``: without its column ``"_partitions"`` of output numbers when it has
    one of integers (see :class:`_Form`)."""
    import numpy as np
    import pandas as pd

    index = frame.index
    multi = isinstance(index, pd.MultiIndex)
    levels = [index.get_level_values(i) for i in range(index.nlevels)] if multi else [index]
    index_form = (multi, tuple(index.names), tuple(level.dtype for level in levels))
    if frame.ndim == 1:
        form = _Form(True, frame.name, (frame.dtype,), index_form)
        columns = [_array(frame)]
    else:
        labels = list(frame.columns)
        at = labels.index("_partitions") if numbered and labels.count("_partitions") == 1 else None
        if at is not None and not (isinstance(frame.dtypes.iloc[at], np.dtype) and frame.dtypes.iloc[at].kind in "iu"):
            at = None
        form = _Form(False, frame.columns, tuple(frame.dtypes), index_form, at)
        columns = [_array(frame.iloc[:, i]) for i in range(frame.shape[1]) if i != at]
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

    def runs(self, number: int | None = None) -> list[tuple[int, Any]]:
        """``(position, rows)`` of each split, as pandas frames (or series) of output
        ``number``."""
        import numpy as np

        whole = self.form.build(self.arrays(), number=number)
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


def join(bundles: list[Bundle], meta: Any, ignore_index: bool, number: int | None = None) -> Any:
    """``bundles`` as one frame (output ``number``), rows in input order: column by
    column when they are of one form, else by dask's rules (:func:`_concat`). No rows
    at all: the first bundle's empty frame (the data's types), or ``meta`` when there
    is none."""
    import numpy as np

    full = [b for b in bundles if b.rows]
    if not full:
        return bundles[0].form.build(bundles[0].arrays(), ignore_index, number) if bundles else meta
    form = full[0].form
    if all(form.same(b.form) for b in full[1:]) and form.dtypes:
        # (with ignore_index the index's levels are left out: a new one is made)
        width = form.stored if ignore_index and form.stored else len(full[0].chunks)
        # the result in one buffer (see _result_arrays), the column of output numbers too
        total = sum(b.rows for b in full)
        numbered = [form.dtypes[form.numbered]] if form.numbered is not None else []
        out = _result_arrays([c[0].dtype for c in full[0].chunks[:width]] + numbered, [total] * (width + len(numbered)))
        numbers = out.pop() if numbered else None
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
        return form.build(arrays, ignore_index, number, numbers)
    runs = sorted((run for b in full for run in b.runs(number) if len(run[1])), key=lambda run: run[0])
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
        return self.form.build([a[start:stop] for a in self.arrays], number=index)

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


def output_numbers(df: Any, on: Any, npartitions: int) -> Any:
    """The output partition of each row of ``df``, as dask numbers them: the column
    ``"_partitions"`` when ``on`` names it (dask's planner adds it), else the hash of
    the columns ``on`` (of the whole frame or series when ``on`` is empty) modulo
    ``npartitions``."""
    import numpy as np

    columns = _columns(on)
    if _by_numbers(columns):
        numbers = df["_partitions"]
    else:
        from dask.dataframe.dispatch import hash_object_dispatch

        numbers = hash_object_dispatch(df[columns] if columns else df, index=False) % npartitions
    return np.asarray(numbers).astype(np.int64, copy=False)


def _columns(on: Any) -> list[Any]:
    """The columns a shuffle ``on`` routes rows by (none: the whole frame or series)."""
    return [on] if isinstance(on, str) else list(on or [])


def _by_numbers(columns: list[Any]) -> bool:
    """Whether rows are routed by dask's column of output numbers ``"_partitions"``."""
    return columns[:1] == ["_partitions"]


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
    form, arrays = _arrays(df, numbered=_by_numbers(_columns(on)))
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
        from .shuffle_sources import bundles

        if not isinstance(inputs, Placement):
            inputs = Placement(inputs)
        got = bundles(get_worker(), inputs, index)
    else:
        got = bundle(list(enumerate(inputs)), index)
    return join(got, meta, ignore_index, index)


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
