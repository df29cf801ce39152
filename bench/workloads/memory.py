"""Workloads of memory limits: spilling to disk, and what a limit costs tiny tasks.

- ``spill``: 2 worker processes x 1 thread, each with ``limit_mb`` of memory limit
  (the same for shoal and dask.distributed, both with their default thresholds: target
  0.6, spill 0.7, pause 0.8, terminate 0.95). ``factor`` x the cluster's limit of
  ``array_mb`` arrays are made by tasks and held by futures, then each is reduced to
  its sum and the sums are added up (every array is read back). Seconds of each phase,
  and the peak resident memory of the largest worker process, sampled every 20 ms
  (nannies are not counted).
- ``tiny_tasks_limit``: tiny_tasks (10,000 inc tasks, map + gather) on the same
  cluster with the default limit ("auto", as dask's LocalCluster) and without one
  (``memory_limit=0``), one after the other in one child process.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ..registry import Workload
from .cluster import _tiny_once, open_session

__all__ = ["spill", "tiny_tasks_limit"]


def make_chunk(i: int, nbytes: int) -> Any:
    import numpy as np

    out = np.empty(nbytes // 8, dtype="f8")
    out.fill(float(i))
    return out


def chunk_sum(arr: Any) -> float:
    return float(arr.sum())


def total(*sums: float) -> float:
    return float(sum(sums))


class PeakRss:
    """Samples the resident memory of this process's descendants whose command line
    holds ``keep`` (their largest) in a thread, every ``interval`` seconds."""

    def __init__(self, keep: str, interval: float = 0.02):
        import psutil

        self._psutil = psutil
        self.interval = interval
        self.keep = keep
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-rss", daemon=True)

    def _workers(self) -> list[Any]:
        out = []
        for p in self._psutil.Process().children(recursive=True):
            try:
                cmd = " ".join(p.cmdline())
            except self._psutil.Error:
                continue
            if self.keep in cmd:
                out.append(p)
        return out

    def _run(self) -> None:
        procs = self._workers()
        n = 0
        while not self._stop.wait(self.interval):
            n += 1
            if n % 25 == 0:
                procs = self._workers()  # restarted ones
            for p in procs:
                try:
                    self.peak = max(self.peak, p.memory_info().rss)
                except self._psutil.Error:
                    pass

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


spill = Workload(
    "spill",
    "2 worker processes x 1 thread with memory_limit=limit_mb each (same for shoal and "
    "dask, default thresholds); factor x the cluster's limit of array_mb float64 arrays "
    "made by tasks and held by futures (`produce`), then reduced: each to its sum, the "
    "sums added (`reduce`: every array read back). Peak RSS: the largest worker process "
    "(nannies not counted), sampled every 20 ms, over both phases and over produce alone.",
    metrics={"produce": "s", "reduce": "s", "total": "s", "peak_rss": "MB", "peak_rss_produce": "MB",
             "spilled": "MB"},
    params={"limit_mb": 1024, "factor": 3, "array_mb": 64},
    quick={"limit_mb": 256, "factor": 2, "array_mb": 16},
    timeout=900,
)


def _spill(system: str, limit_mb: int, factor: int, array_mb: int) -> dict[str, Any]:
    nbytes = array_mb << 20
    n = (factor * 2 * limit_mb) // array_mb
    limit = f"{limit_mb}MiB"
    # worker processes, not their nannies: shoal's run `shoal worker --no-nanny` under
    # a `shoal worker`; dask's are multiprocessing children of nannies in this process
    keep = "--no-nanny" if system == "shoal" else "spawn_main"
    with open_session(system, memory_limit=limit) as s:
        s.gather(s.map(chunk_sum, [make_chunk(0, 8)]))  # warm-up, untimed
        with PeakRss(keep) as peak:
            t0 = time.perf_counter()
            arrays = s.client.map(make_chunk, range(n), [nbytes] * n)
            s.module.wait(arrays)
            t1 = time.perf_counter()
            produce_peak = peak.peak
            spilled = _spilled(system, s.client)
            sums = s.client.map(chunk_sum, arrays)
            result = s.client.submit(total, *sums).result()
            t2 = time.perf_counter()
        expected = float(sum(range(n))) * (nbytes // 8)
        if result != expected:
            raise AssertionError(f"wrong sum: {result} != {expected}")
        return {"produce": t1 - t0, "reduce": t2 - t1, "total": t2 - t0, "peak_rss": peak.peak / 1e6,
                "peak_rss_produce": produce_peak / 1e6, "spilled": spilled / 1e6, "arrays": f"{n} x {array_mb} MB, limit {limit} per worker"}


def _spilled(system: str, client: Any) -> int:
    """Bytes on disk right after the produce phase, as the system reports them."""
    if system == "shoal":
        info = client.scheduler_info()["workers"]
        return sum(w.get("memory", {}).get("spilled", 0) for w in info.values())

    return sum(client.run(_dask_spilled).values())


def _dask_spilled(dask_worker: Any) -> int:
    """The sizes (in memory, as shoal reports them) of the values a dask worker holds on disk."""
    return int(dask_worker.data.spilled_total.memory)


for _system in ("shoal", "dask"):
    spill.system(_system)(lambda _s=_system, **kw: _spill(_s, **kw))


tiny_tasks_limit = Workload(
    "tiny_tasks_limit",
    "tiny_tasks (n inc tasks, map + gather, 2 worker processes x 1 thread) with the "
    "default memory limit ('auto', as dask's LocalCluster) and with none "
    "(memory_limit=0), one cluster after the other in the same child.",
    metrics={"throughput_limit": "tasks/s", "throughput_no_limit": "tasks/s"},
    params={"n": 10_000},
    quick={"n": 200},
    timeout=600,
)


def _tiny_limit(system: str, n: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with open_session(system, memory_limit="auto") as s:
        out["throughput_limit"] = _tiny_once(s, n)
    with open_session(system, memory_limit=0) as s:
        out["throughput_no_limit"] = _tiny_once(s, n)
    return out


for _system in ("shoal", "dask"):
    tiny_tasks_limit.system(_system)(lambda _s=_system, **kw: _tiny_limit(_s, **kw))
