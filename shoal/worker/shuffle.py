"""shoal's own shuffle, on the workers: the functions of its tasks, and the
``get-slices`` request peers answer. The graph (one task per input partition, one
barrier, one per output partition) is made by :mod:`shoal.client.shuffle`; the theory
is in docs/shuffle.md.

- **split** (one task per input partition): the partition's rows sorted by their output
  partition (a stable sort: rows keep their order within each output), and the offset
  where each output's rows start. That is the task's value, kept where it was made like
  any other: in this worker's store (spilled under memory pressure, placed in shared
  memory when large, freed by the scheduler). Nothing is sent anywhere yet.
- **locate** (the barrier): a task the scheduler marks ``locate``. Its worker fetches
  none of its inputs; it gets their :class:`Location` instead (who holds each split,
  its size, its segment), and returns them. The scheduler keeps the splits while it is
  held, and makes it again when one of them is lost (a worker died), which sends the
  output tasks that needed that split back to wait for the new one.
- **assemble** (one task per output partition): its rows out of every split, taken by
  distance, then concatenated in input order: from this worker's store by reference;
  mapped from a same-host segment and sliced, with no peer involved; from the other
  holders with one ``get-slices`` request each, all at once, each holder sending only
  that output's rows. A holder that cannot be reached gives the task back
  (:class:`~shoal.errors.Reschedule`): the scheduler has lost that worker, or soon
  will, and runs the task again once the lost splits are made again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass
from typing import Any

from ..errors import CommError, Reschedule, ShuffleError

__all__ = ["Location", "output_numbers", "split", "locate", "assemble", "concat", "rows_of", "SPLIT_PREFIX",
           "LOCATE_PREFIX"]

#: the key prefixes of the shuffle's tasks (the client names them; the worker's
#: ``get-slices`` serves values of split tasks only)
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


def split(df: Any, on: Any, npartitions: int) -> tuple[Any, Any]:
    """``df``'s rows sorted (stably) by their output partition (see
    :func:`output_numbers`), and the offsets where each output's rows start
    (``npartitions + 1`` of them). Raises :class:`~shoal.errors.ShuffleError` for a
    number outside ``[0, npartitions)``."""
    import numpy as np

    parts = output_numbers(df, on, npartitions)
    if len(parts) and (parts.min() < 0 or parts.max() >= npartitions):
        raise ShuffleError(f"a row's output partition ({parts.min()}..{parts.max()}) is outside 0..{npartitions - 1}")
    order = np.argsort(parts, kind="stable")
    counts = np.bincount(parts, minlength=npartitions) if len(parts) else np.zeros(npartitions, dtype=np.int64)
    offsets = np.zeros(npartitions + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    if len(parts) and not (order[1:] > order[:-1]).all():
        df = df.take(order)
    return df, offsets


def rows_of(value: Any, index: int) -> Any:
    """The rows of output partition ``index`` in the value of a split task."""
    df, offsets = value
    if not 0 <= index < len(offsets) - 1:
        raise ShuffleError(f"output partition {index} of a shuffle into {len(offsets) - 1}")
    return df.iloc[int(offsets[index]) : int(offsets[index + 1])]


def locate(*inputs: Any) -> list[Any]:
    """The barrier: where each split is (a shoal worker passes their
    :class:`Location`). Under a scheduler that does not know ``locate`` tasks (dask's
    own, in a test's ``compute(scheduler="sync")``) it gets the splits themselves and
    passes them on: the shuffle is then an ordinary all-to-one exchange, still right."""
    kinds = {isinstance(x, Location) for x in inputs}
    if len(kinds) > 1:
        raise ShuffleError("the shuffle's barrier got both splits and the locations of splits")
    return list(inputs)


def assemble(inputs: list[Any], index: int, meta: Any, ignore_index: bool = False) -> Any:
    """Output partition ``index``: its rows of every split (``inputs``: where they are,
    or the splits themselves, see :func:`locate`), concatenated in input order as dask
    concatenates (``ignore_index``: a new index; ``meta``: the frame's empty form, for
    no inputs)."""
    if inputs and isinstance(inputs[0], Location):
        from .context import get_worker

        got = pieces(get_worker(), inputs, index)
    else:
        got = [rows_of(value, index) for value in inputs]
    return concat(got, meta, ignore_index)


def concat(frames: list[Any], meta: Any, ignore_index: bool) -> Any:
    """``frames`` as one, by dask's rules when dask is here (categories unioned, empty
    frames left out; none but empty ones: the first of them)."""
    if not frames:
        return meta
    full = [f for f in frames if len(f)]
    if not full:
        first = frames[0]
        return first.reset_index(drop=True) if ignore_index else first
    if len(full) == 1 and not ignore_index:
        return full[0]
    try:
        from dask.dataframe.methods import concat as dask_concat
    except ImportError:  # (a shuffle's graph comes from dask; its tests may run without)
        import pandas as pd

        return pd.concat(full, ignore_index=ignore_index)
    return dask_concat(full, uniform=True, ignore_index=ignore_index)


# -- on the worker (assemble's pulls, and the get-slices request)

def local_pieces(worker: Any, locations: list[Location], index: int) -> tuple[dict[int, Any], dict[str, list[int]]]:
    """The rows of ``index`` of the splits this worker holds or can map (by position
    in ``locations``), and the positions left to ask each holder for."""
    from ..comm import shm

    here: dict[int, Any] = {}
    ask: dict[str, list[int]] = {}
    address = worker.address
    for pos, loc in enumerate(locations):
        if address in loc.holders:
            continue  # read on the loop (the store is the loop's)
        if loc.shm is not None and worker.use_shm:
            try:
                here[pos] = rows_of(shm.attach(loc.shm), index)
                continue
            except Exception:  # noqa: BLE001 - gone, reused: ask a holder
                pass
        if not loc.holders:
            raise ShuffleError(f"no worker holds {loc.key!r} (input {pos} of the shuffle)")
        ask.setdefault(loc.holders[0], []).append(pos)
    return here, ask


def pieces(worker: Any, locations: list[Location], index: int) -> list[Any]:
    """The rows of ``index`` of every split, by distance (see the module); run in a
    task's thread. Raises :class:`~shoal.errors.Reschedule` when a holder cannot be
    reached, :class:`~shoal.errors.ShuffleError` when one answers without a split."""
    here, ask = local_pieces(worker, locations, index)
    mine = [pos for pos, loc in enumerate(locations) if worker.address in loc.holders]
    future = asyncio.run_coroutine_threadsafe(_gather(worker, locations, index, mine, ask), worker.loop)
    try:
        from .context import waiting

        with waiting():
            got = future.result()
    except concurrent.futures.CancelledError as exc:
        raise Reschedule("the worker is closing") from exc
    here.update(got)
    return [here[pos] for pos in range(len(locations))]


async def _gather(worker: Any, locations: list[Location], index: int, mine: list[int],
                  ask: dict[str, list[int]]) -> dict[int, Any]:
    out: dict[int, Any] = {}
    store = worker.store
    for pos in mine:
        key = locations[pos].key
        if key not in store:
            raise ShuffleError(f"this worker was to hold {key!r} (input {pos} of the shuffle) and does not")
        out[pos] = rows_of(store.peek(key), index)
    if ask:
        results = await asyncio.gather(*(_ask(worker, holder, [locations[p].key for p in positions], index)
                                         for holder, positions in ask.items()), return_exceptions=True)
        for (holder, positions), result in zip(ask.items(), results):
            if isinstance(result, BaseException):
                if isinstance(result, (CommError, OSError, asyncio.TimeoutError)):
                    # the scheduler loses that worker (or has): the task comes back once
                    # the splits it held are made again; a pause, not a spin, meanwhile
                    await asyncio.sleep(UNREACHABLE_PAUSE)
                    raise Reschedule(f"cannot reach {holder} for its part of the shuffle: {result}") from result
                raise result
            for pos in positions:
                key = locations[pos].key
                if key not in result:
                    raise ShuffleError(f"{holder} does not hold {key!r} (input {pos} of the shuffle) any more")
                out[pos] = result[key]
    return out


async def _ask(worker: Any, holder: str, keys: list[Any], index: int) -> dict[Any, Any]:
    comm = await worker.pool.connect(holder)
    try:
        await comm.write({"op": "get-slices", "reply": True, "keys": keys, "index": index})
        response = await comm.read()
    except BaseException:
        comm.abort()
        raise
    finally:
        worker.pool.reuse(holder, comm)
    if not isinstance(response, dict) or response.get("status") != "OK":
        text = response.get("message") if isinstance(response, dict) else repr(response)
        raise ShuffleError(f"{holder} could not send its part of the shuffle: {text}")
    return dict(response["result"]["data"])


def serve_slices(store: Any, keys: list[Any], index: int) -> dict[Any, Any]:
    """``get-slices``: the rows of output ``index`` of the split values among
    ``keys`` this worker holds (the others are left out)."""
    out: dict[Any, Any] = {}
    for key in keys:
        name = key[0] if isinstance(key, tuple) and key else key
        if not (isinstance(name, str) and name.startswith(SPLIT_PREFIX)):
            raise ShuffleError(f"get-slices serves the values of shuffle splits only, not {key!r:.100}")
        if key in store:
            out[key] = rows_of(store.peek(key), index)
    return out
