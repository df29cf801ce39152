"""A chaos run: mixed graphs, each checked against pandas, numpy or plain Python, while
workers die at random points.

    report = run_chaos(client, kill=kill_a_worker(client), seconds=20, seed=1)
    assert not report.wrong and not report.hangs

One graph at a time runs to its result (or its error, or its deadline) and is compared
with the same computation done locally; meanwhile a thread calls ``kill()`` at random
moments (``kill_every`` seconds apart, drawn uniformly), so deaths fall anywhere: while
inputs are scattered, while a shuffle's pieces are in flight, while a value is spilled
or read back. What each graph is:

- ``groupby``: a dataframe's group sums (a tree reduction; dask may pick a shuffle when
  the frame has many partitions), ``groupby_split``: the same over a shuffle
  (``split_out=4``); ``shuffle``: ``df.shuffle("k")``, then each key must sit in one
  partition with all its rows; ``merge``: a join on a key with a second frame;
  ``set_index``: sorted by a column, divisions in order;
- ``array``: a reduction of an array along an axis, ``rechunk``: a rechunk of rows into
  columns, then a reduction;
- ``chain``: ``client.map`` chains of ``inc``; ``scatter``: scattered arrays and tasks
  on them; ``persisted``: arrays held by the cluster (spilled, on workers with a small
  memory limit) read back by a later graph.

A graph is *wrong* when its value differs from the local one: the one outcome that must
never happen. It *hangs* when it has no result by its deadline. It may *err* when the
cluster gave up on it for a reason the kills explain (``KilledWorker``: a task was on
``allowed_failures`` workers that died; ``LostDataError``: a scattered value's one
holder died); any other error is *unexplained*.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ChaosReport", "run_chaos", "kill_a_worker", "GRAPHS"]


@dataclass
class ChaosReport:
    """What a chaos run saw: graphs run (by kind), kills made, and the graphs that came
    back wrong, hung or erred (one line each: the kind, the seed and what happened)."""

    graphs: Counter[str] = field(default_factory=Counter)
    kills: int = 0
    wrong: list[str] = field(default_factory=list)
    hangs: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    #: of ``errors``, those the kills do not explain (see :func:`_explained`)
    unexplained: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def total(self) -> int:
        return sum(self.graphs.values())

    def check(self) -> None:
        """Raise ``AssertionError`` naming the graphs that came back wrong or hung, or
        erred where the kills do not explain it (a task on ``allowed_failures`` dead
        workers, a scattered value whose holder died, do)."""
        for name, lines in (("wrong", self.wrong), ("hung", self.hangs), ("erred unexplained", self.unexplained)):
            if lines:
                raise AssertionError(f"{len(lines)} graph(s) {name}: {self.summary()}\n" + "\n".join(lines))

    def summary(self) -> str:
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(self.graphs.items()))
        return (f"{self.total} graphs ({kinds}) in {self.seconds:.0f} s, {self.kills} kills: "
                f"{len(self.wrong)} wrong, {len(self.hangs)} hung, {len(self.errors)} erred "
                f"({len(self.unexplained)} not explained by the kills)")


def kill_a_worker(client: Any, rng: random.Random | None = None,
                  sig: int = signal.SIGKILL) -> Callable[[], bool]:
    """A ``kill`` for :func:`run_chaos`: send ``sig`` (kill -9) to one of the client's
    worker processes, picked at random (workers of this machine's pid namespace: worker
    processes, and workers of test hosts). Returns whether one was killed."""
    rng = rng or random.Random()

    def kill() -> bool:
        try:
            workers = client.scheduler_info()["workers"]
        except Exception:  # noqa: BLE001 - the scheduler busy or a worker leaving: no kill this time
            return False
        pids = sorted(w.get("pid") for w in workers.values() if w.get("pid") and w.get("pid") != os.getpid())
        if not pids:
            return False
        try:
            os.kill(rng.choice(pids), sig)
        except ProcessLookupError:
            return False
        return True

    return kill


# ------------------------------------------------------------------------- the graphs


def _frame(rng: Any, rows: int, keys: int) -> Any:
    import numpy as np
    import pandas as pd

    return pd.DataFrame({
        "k": rng.integers(0, keys, rows),
        "v": rng.integers(0, 1000, rows),
        "f": rng.random(rows),
    }, index=pd.RangeIndex(rows) + 10 * rows)  # not 0..n: an index dask must carry along


def _dd(pdf: Any, rng: Any) -> Any:
    import dask.dataframe as dd

    return dd.from_pandas(pdf, npartitions=int(rng.integers(4, 24)), sort=False)


def _series_equal(got: Any, want: Any) -> bool:
    return bool(got.sort_index().equals(want.sort_index()))


def _groupby(client: Any, rng: Any) -> tuple[Any, Any, Callable[[Any, Any], bool]]:
    pdf = _frame(rng, int(rng.integers(20_000, 120_000)), int(rng.integers(3, 500)))
    return _dd(pdf, rng).groupby("k").v.sum(), pdf.groupby("k").v.sum(), _series_equal


def _groupby_split(client: Any, rng: Any) -> tuple[Any, Any, Callable[[Any, Any], bool]]:
    pdf = _frame(rng, int(rng.integers(20_000, 120_000)), int(rng.integers(50, 5_000)))
    return _dd(pdf, rng).groupby("k").v.sum(split_out=4), pdf.groupby("k").v.sum(), _series_equal


def _per_partition_sums(part: Any) -> Any:
    return part.groupby("k").v.sum()


def _shuffle(client: Any, rng: Any) -> tuple[Any, Any, Callable[[Any, Any], bool]]:
    pdf = _frame(rng, int(rng.integers(20_000, 120_000)), int(rng.integers(10, 2_000)))
    shuffled = _dd(pdf, rng).shuffle("k").map_partitions(_per_partition_sums)

    def same(got: Any, want: Any) -> bool:
        # a key in two output partitions would show up twice: each sits in exactly one
        return bool(got.index.is_unique) and _series_equal(got, want)

    return shuffled, pdf.groupby("k").v.sum(), same


def _merge(client: Any, rng: Any) -> tuple[Any, Any, Callable[[Any, Any], bool]]:
    import dask.dataframe as dd

    keys = int(rng.integers(100, 3_000))
    left = _frame(rng, int(rng.integers(10_000, 60_000)), keys)
    right = _frame(rng, int(rng.integers(1_000, 10_000)), keys).rename(columns={"v": "w", "f": "g"})
    joined = _dd(left, rng).merge(dd.from_pandas(right, npartitions=int(rng.integers(2, 8))), on="k")
    got = joined.assign(p=joined.v * joined.w).groupby("k").p.sum()
    local = left.merge(right, on="k")

    def same(got: Any, want: Any) -> bool:
        # dask (2026.11, any scheduler) may leave a key in several partitions of a group
        # sum after a broadcast join: add them up before comparing
        return _series_equal(got.groupby(level=0).sum(), want)

    return got, local.assign(p=local.v * local.w).groupby("k").p.sum(), same


def _set_index(client: Any, rng: Any) -> tuple[Any, Any, Callable[[Any, Any], bool]]:
    import pandas as pd

    pdf = _frame(rng, int(rng.integers(20_000, 100_000)), int(rng.integers(100, 10_000)))
    indexed = _dd(pdf, rng).set_index("k")
    collection = indexed.v.map_partitions(lambda s: pd.Series([s.sum(), len(s), s.index.min() if len(s) else -1,
                                                               s.index.max() if len(s) else -1,
                                                               bool(s.index.is_monotonic_increasing)]))
    want = (int(pdf.v.sum()), len(pdf))

    def same(got: Any, expected: Any) -> bool:
        parts = [got.iloc[i:i + 5].tolist() for i in range(0, len(got), 5)]
        total, rows = sum(p[0] for p in parts), sum(p[1] for p in parts)
        spans = [(p[2], p[3]) for p in parts if p[1]]
        ordered = all(p[4] for p in parts) and all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
        return (total, rows) == expected and ordered

    return collection, want, same


def _array(client: Any, rng: Any) -> tuple[Any, Any, Callable[[Any, Any], bool]]:
    import dask.array as da
    import numpy as np

    x = rng.random((int(rng.integers(200, 1_200)), int(rng.integers(50, 400))))
    dx = da.from_array(x, chunks=(int(rng.integers(20, 200)), int(rng.integers(20, 200))))
    axis = int(rng.integers(0, 2))
    return dx.sum(axis=axis), x.sum(axis=axis), lambda got, want: bool(np.allclose(got, want))


def _rechunk(client: Any, rng: Any) -> tuple[Any, Any, Callable[[Any, Any], bool]]:
    import dask.array as da
    import numpy as np

    n = int(rng.integers(200, 800))
    x = rng.random((n, 64))
    dx = da.from_array(x, chunks=(int(rng.integers(10, 100)), 64)).rechunk((n, int(rng.integers(4, 32))))
    return (dx ** 2).sum(axis=0), (x ** 2).sum(axis=0), lambda got, want: bool(np.allclose(got, want))


def _inc(x: int) -> int:
    return x + 1


def _chain(client: Any, rng: Any) -> tuple[Any, Any, Callable[[Any, Any], bool]]:
    n, depth = int(rng.integers(20, 200)), int(rng.integers(2, 8))
    futures = list(range(n))
    for _ in range(depth):
        futures = client.map(_inc, futures, pure=False)
    return client.submit(sum, futures), sum(range(n)) + n * depth, lambda got, want: got == want


def _scatter(client: Any, rng: Any) -> tuple[Any, Any, Callable[[Any, Any], bool]]:
    import numpy as np

    arrays = [rng.random(int(rng.integers(1_000, 200_000))) for _ in range(int(rng.integers(2, 10)))]
    data = client.scatter(arrays)
    sums = client.map(np.sum, data)
    return client.submit(sum, sums), sum(float(np.sum(a)) for a in arrays), \
        lambda got, want: bool(np.isclose(got, want))


def _persisted(client: Any, rng: Any) -> tuple[Any, Any, Callable[[Any, Any], bool]]:
    import dask.array as da
    import numpy as np

    # values the cluster holds between two graphs (spilled on workers with a small
    # memory limit), read back by the second
    x = rng.random((int(rng.integers(2_000, 6_000)), 500))
    held = client.persist(da.from_array(x, chunks=(500, 500)) * 2)
    return (held + 1).sum(axis=0), (x * 2 + 1).sum(axis=0), lambda got, want: bool(np.allclose(got, want))


#: the kinds of graph a chaos run draws from, with what makes each
GRAPHS: dict[str, Callable[[Any, Any], tuple[Any, Any, Callable[[Any, Any], bool]]]] = {
    "groupby": _groupby,
    "groupby_split": _groupby_split,
    "shuffle": _shuffle,
    "merge": _merge,
    "set_index": _set_index,
    "array": _array,
    "rechunk": _rechunk,
    "chain": _chain,
    "scatter": _scatter,
    "persisted": _persisted,
}


# ------------------------------------------------------------------------- the run


def run_chaos(client: Any, kill: Callable[[], bool] | None, *, seconds: float | None = None,
              graphs: int | None = None, seed: int = 0, kill_every: tuple[float, float] = (0.5, 2.0),
              deadline: float = 60.0, kinds: list[str] | None = None,
              say: Callable[[str], None] | None = None, min_kills: int = 0) -> ChaosReport:
    """Run graphs drawn from ``kinds`` (default: all of :data:`GRAPHS`) one after another
    for ``seconds`` or ``graphs`` of them (whichever comes first), each checked against
    its local result, while ``kill()`` is called every ``kill_every`` seconds (drawn
    uniformly; ``kill=None``: no kills). ``min_kills``: with ``graphs``, more graphs are
    drawn until ``kill()`` killed that many times (graphs may all be done before the
    first kill), for at most ``deadline`` seconds more. A graph without a result after
    ``deadline`` seconds counts as hung and is cancelled. Returns a :class:`ChaosReport`."""
    if seconds is None and graphs is None:
        raise ValueError("run_chaos needs seconds= or graphs=")
    names = list(kinds or GRAPHS)
    unknown = [k for k in names if k not in GRAPHS]
    if unknown:
        raise ValueError(f"unknown graph kinds {unknown}; known: {sorted(GRAPHS)}")
    report = ChaosReport()
    pick = random.Random(seed)
    stop = threading.Event()

    def killer() -> None:
        times = random.Random(seed + 1)
        while not stop.wait(times.uniform(*kill_every)):
            try:
                if kill is not None and kill():
                    report.kills += 1
            except Exception as exc:  # noqa: BLE001 - a kill that failed is no kill
                if say:
                    say(f"kill failed: {exc!r}")

    thread = threading.Thread(target=killer, name="shoal-chaos-killer", daemon=True)
    started = time.monotonic()
    if kill is not None:
        thread.start()
    try:
        i = 0
        more_until: float | None = None  # (drawing more graphs for min_kills, until then)

        def another() -> bool:
            nonlocal more_until
            if seconds is not None and time.monotonic() - started >= seconds:
                return False
            if graphs is None or i < graphs:
                return True
            if kill is None or report.kills >= min_kills:
                return False
            if more_until is None:
                more_until = time.monotonic() + deadline
            return time.monotonic() < more_until

        while another():
            kind = pick.choice(names)
            graph_seed = seed * 1_000_003 + i
            i += 1
            line = _one(client, kind, graph_seed, deadline, report)
            report.graphs[kind] += 1
            if say and line:
                say(line)
    finally:
        stop.set()
        if thread.is_alive():
            thread.join()
        report.seconds = time.monotonic() - started
    return report


def _one(client: Any, kind: str, graph_seed: int, deadline: float, report: ChaosReport) -> str:
    """Run one graph of ``kind``; file it in ``report``; a line saying what went amiss."""
    import numpy as np

    rng = np.random.default_rng(graph_seed)
    future = None
    try:
        # (making a graph may run part of it already: scatter, persist)
        collection, want, same = GRAPHS[kind](client, rng)
        future = collection if _is_future(collection) else client.compute(collection)
        got = future.result(timeout=deadline)
    except TimeoutError:
        report.hangs.append(f"{kind} seed={graph_seed}: no result in {deadline} s")
        if future is not None:
            client.cancel(future)
        return report.hangs[-1]
    except Exception as exc:  # noqa: BLE001 - reported as it is
        line = f"{kind} seed={graph_seed}: {type(exc).__name__}: {exc}"
        report.errors.append(line)
        if not _explained(kind, exc):
            report.unexplained.append(line)
        return line
    if not same(got, want):
        report.wrong.append(f"{kind} seed={graph_seed}: got {_short(got)}, want {_short(want)}")
        return report.wrong[-1]
    return ""


def _explained(kind: str, exc: BaseException) -> bool:
    """Whether killing workers explains ``exc``: a task that was on ``allowed_failures``
    workers that died (``KilledWorker``), or a scattered value whose one holder died
    (``LostDataError``: nothing can make it again), or no worker alive to scatter to, or
    one that died while the scatter sent to it."""
    from .errors import CommError, KilledWorker, LostDataError

    if isinstance(exc, KilledWorker):
        return True
    if kind == "scatter":
        # (a scatter whose worker died while it sent raises the broken connection)
        return (isinstance(exc, (LostDataError, CommError)) or "no workers to scatter to" in str(exc))
    return False


def _is_future(obj: Any) -> bool:
    return bool(getattr(type(obj), "__shoal_future__", False))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 300 else text[:300] + "..."
