"""dask.dataframe all-to-all workloads: the shuffles a dataframe user runs, on shoal and
on dask.distributed (its P2P shuffle and its task shuffle, in the same child), 2 worker
processes x 1 thread, loopback only.

``df_shuffle``: a frame of ``rows`` rows in ``partitions`` partitions made on the
workers (``dd.from_map``: an int key ``k`` with ``rows // 4`` distinct values, an int
group ``g``, a float ``v``), then each operation in ``ops``:

- ``shuffle``: ``df.shuffle("k")``;
- ``merge``: ``df.merge(other, on="k")``, ``other`` a frame a quarter the size;
- ``set_index``: ``df.set_index("k")``;
- ``groupby``: ``df.groupby("k").sum(split_out=8)``.

Each result is reduced on the workers to a line per output partition (rows, sum of
``v``, distinct keys, smallest and largest key) that is checked against pandas in the
child (the same frames made in one process): rows and sums agree, a key sits in one
output partition only, ``set_index``'s partitions are sorted and do not overlap. The
time is from ``compute()`` to the lines in hand (shoal: its own shuffle, and dask's task
shuffle on shoal; dask: its P2P and task shuffles); the peak is the largest sum of the
memory of the worker processes (the child's children: both systems run their scheduler
in the child), the sum of their PSS (shared pages counted once), sampled every 100 ms
during it; the sum of their RSS is reported beside it (``_peak_rss_mb``, an info). Median of ``rounds`` after one untimed round.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from typing import Any

from ..registry import Workload

_perf = time.perf_counter

OPS = ("shuffle", "merge", "set_index", "groupby")


def _metrics(methods: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for op in OPS:
        for method in methods:
            out[f"{op}_{method}"] = "s"
            out[f"{op}_{method}_peak_mb"] = "MB"
    return out


df_shuffle = Workload(
    "df_shuffle",
    "Seconds (and the worker processes' peak memory, MB of PSS) for dask.dataframe shuffle('k'), "
    "merge with a frame a quarter the size on 'k', set_index('k') and "
    "groupby('k').sum(split_out=8) of `rows` rows in `partitions` partitions made on "
    "2 worker processes x 1 thread; every result checked against pandas. shoal: its own "
    "shuffle (`shoal`, shuffle_method='shoal') and dask's task shuffle on shoal "
    "(`shoal_tasks`); dask: its P2P shuffle (`p2p`) and its task shuffle (`tasks`) on "
    "the same cluster. Median of `rounds` after one untimed round. `memory_limit` (each "
    "worker's; empty: the systems' default) and `methods` (a comma list of the methods "
    "above; empty: all) measure an exchange larger than the workers may hold.",
    metrics=_metrics(("shoal", "shoal_tasks", "p2p", "tasks")),
    params={"rows": 8_000_000, "partitions": 32, "ops": ",".join(OPS), "rounds": 1, "memory_limit": "",
            "methods": ""},
    quick={"rows": 200_000, "partitions": 8, "rounds": 1},
    timeout=1800,
)


# -- the data (made on the workers; the same in one process for the check)

def make_part(i: int, rows: int, keys: int, seed: int) -> Any:
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng([seed, i])
    return pd.DataFrame({
        "k": rng.integers(0, keys, rows, dtype=np.int64),
        "g": rng.integers(0, 100, rows, dtype=np.int64),
        "v": rng.random(rows),
    })


def summarize(part: Any, column: str | None = None) -> Any:
    """One line of an output partition: rows, sum of v, distinct keys, the smallest and
    largest key (of the index for ``column=None`` after set_index)."""
    import pandas as pd

    keys = part.index if column is None else part[column]
    return pd.DataFrame({
        "rows": [len(part)],
        "v": [float(part["v"].sum()) if "v" in part else 0.0],
        "distinct": [int(keys.nunique())],
        "lo": [keys.min() if len(part) else -1],
        "hi": [keys.max() if len(part) else -1],
    })


def _frames(dd: Any, rows: int, partitions: int) -> tuple[Any, Any]:
    per = rows // partitions
    keys = max(1, rows // 4)
    left = dd.from_map(make_part, range(partitions), rows=per, keys=keys, seed=1)
    right_parts = max(1, partitions // 4)
    right = dd.from_map(make_part, range(right_parts), rows=per, keys=keys, seed=2)
    right = right.rename(columns={"g": "g2", "v": "w"})
    return left, right


def _expected(rows: int, partitions: int, ops: str = ",".join(OPS)) -> dict[str, dict[str, float]]:
    """What each operation of ``ops`` must add up to, from pandas in this process."""
    import pandas as pd

    per = rows // partitions
    keys = max(1, rows // 4)
    wanted = set(ops.split(","))
    left = pd.concat([make_part(i, per, keys, 1) for i in range(partitions)], ignore_index=True)
    whole = {"rows": len(left), "v": float(left["v"].sum()), "distinct": left["k"].nunique()}
    out = {"shuffle": whole, "set_index": whole}
    if "merge" in wanted:
        right = pd.concat([make_part(i, per, keys, 2) for i in range(max(1, partitions // 4))], ignore_index=True)
        merged = left.merge(right.rename(columns={"g": "g2", "v": "w"}), on="k")
        out["merge"] = {"rows": len(merged), "v": float(merged["v"].sum()), "distinct": merged["k"].nunique()}
        del merged
    if "groupby" in wanted:
        grouped = left.groupby("k").sum()
        out["groupby"] = {"rows": len(grouped), "v": float(grouped["v"].sum()), "distinct": len(grouped)}
    return out


def _lines(op: str, left: Any, right: Any, method: str | None, summary: Any = summarize) -> Any:
    kw = {"shuffle_method": method} if method else {}
    if op == "shuffle":
        out, column = left.shuffle("k", **kw), "k"
    elif op == "merge":
        out, column = left.merge(right, on="k", **kw), "k"
    elif op == "set_index":
        out, column = left.set_index("k", **kw), None
    elif op == "groupby":
        out = left.groupby("k").sum(split_out=8, **kw).reset_index()
        column = "k"
    else:
        raise ValueError(f"unknown op {op!r}; known: {', '.join(OPS)}")
    meta = summary(left._meta.set_index("k") if column is None else left._meta, column)
    return out.map_partitions(summary, column, meta=meta)


def _check(op: str, lines: Any, want: dict[str, float]) -> None:
    got_rows, got_v = int(lines["rows"].sum()), float(lines["v"].sum())
    if got_rows != want["rows"] or abs(got_v - want["v"]) > 1e-6 * max(1.0, abs(want["v"])):
        raise AssertionError(f"{op}: {got_rows} rows, sum {got_v}; pandas: {want['rows']}, {want['v']}")
    # a key in one output partition only: the partitions' distinct keys add up
    if int(lines["distinct"].sum()) != want["distinct"]:
        raise AssertionError(f"{op}: keys spread over partitions ({int(lines['distinct'].sum())} "
                             f"against {want['distinct']} distinct)")
    if op == "set_index":
        full = lines[lines["rows"] > 0]
        if not (full["lo"].values[1:] > full["hi"].values[:-1]).all():
            raise AssertionError("set_index: partitions out of order or overlapping")


class _Peak:
    """The largest total memory of this process's children (the worker processes and
    what they started; the scheduler runs in this process on both systems and is not
    counted), sampled in a thread: the sum of their proportional set sizes (PSS: a
    page shared by two workers, such as a shared-memory segment one placed and the
    other mapped, counts half in each, so once in the sum; RSS would count it twice),
    and of their RSS."""

    def __init__(self) -> None:
        import psutil

        self._me = psutil.Process()
        self.peak = 0
        self.peak_rss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _total(self) -> tuple[int, int]:
        pss = rss = 0
        for p in self._me.children(recursive=True):
            try:
                info = p.memory_full_info()
            except Exception:  # noqa: BLE001 - gone meanwhile
                continue
            pss += getattr(info, "pss", info.rss)
            rss += info.rss
        return pss, rss

    def _sample(self) -> None:
        pss, rss = self._total()
        self.peak = max(self.peak, pss)
        self.peak_rss = max(self.peak_rss, rss)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(0.1)

    def __enter__(self) -> _Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def _run_ops(client: Any, methods: dict[str, str | None], rows: int, partitions: int, ops: str,
             rounds: int) -> dict[str, Any]:
    import dask.dataframe as dd

    want = _expected(rows, partitions, ops)
    left, right = _frames(dd, rows, partitions)
    out: dict[str, Any] = {}
    for op in ops.split(","):
        for name, method in methods.items():
            times, peaks, rss = [], [], []
            for i in range(rounds + 1):
                with _Peak() as peak:
                    t0 = _perf()
                    lines = client.compute(_lines(op, left, right, method)).result()
                    dt = _perf() - t0
                _check(op, lines, want[op])
                if i:
                    times.append(dt)
                    peaks.append(peak.peak / 1e6)
                    rss.append(peak.peak_rss / 1e6)
            out[f"{op}_{name}"] = statistics.median(times)
            out[f"{op}_{name}_peak_mb"] = statistics.median(peaks)
            out[f"{op}_{name}_peak_rss_mb"] = round(statistics.median(rss))
    return out


def _session(system: str, memory_limit: str = "") -> Any:
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = "1"
    from .cluster import open_session

    return open_session(system, memory_limit=memory_limit or None)


def _chosen(methods: dict[str, str], wanted: str) -> dict[str, str]:
    names = [m for m in wanted.split(",") if m]
    return {name: m for name, m in methods.items() if not names or name in names}


@df_shuffle.system("shoal")
def _shoal(rows: int, partitions: int, ops: str, rounds: int, memory_limit: str = "",
           methods: str = "") -> dict[str, Any]:
    chosen = _chosen({"shoal": "shoal", "shoal_tasks": "tasks"}, methods)
    with _session("shoal", memory_limit) as s:
        out = _run_ops(s.client, chosen, rows, partitions, ops, rounds) if chosen else {}
        out.update(s.extra_info())
    return out


@df_shuffle.system("dask")
def _dask(rows: int, partitions: int, ops: str, rounds: int, memory_limit: str = "",
          methods: str = "") -> dict[str, Any]:
    chosen = _chosen({"p2p": "p2p", "tasks": "tasks"}, methods)
    if not chosen:
        return {}
    with _session("dask", memory_limit) as s:
        out = _run_ops(s.client, chosen, rows, partitions, ops, rounds)
    return out
