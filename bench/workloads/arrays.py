"""dask.array workloads: the same dask graphs computed by shoal and by dask.distributed,
2 worker processes x 1 thread (one BLAS thread per worker thread on both), loopback only.

- ``matmul``: ``(x @ x.T).sum()`` for x random (4000, 4000) in (500, 500) chunks, the
  blocked product that makes workers wait on each other's blocks; also numpy in one
  process (its BLAS on every core) as the floor.
- ``dask_array_mix``: a ~1 GB random array persisted, then a handful of reductions and
  rechunks computed one after another, as a notebook would.

Both systems get the collection through ``client.compute`` / ``client.persist`` of their
own client (shoal's and distributed's have the same names), started as in
``bench/workloads/cluster.py``. Ray runs no dask graphs natively and is not measured.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

from ..registry import Workload

_perf = time.perf_counter
SYSTEMS = ("shoal", "dask")


def _session(system: str) -> Any:
    # one BLAS thread per worker thread (the workers inherit this environment)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = "1"
    from .cluster import open_session

    return open_session(system)


def _register(workload: Workload, fn: Any) -> None:
    for system in SYSTEMS:

        def run(system: str = system, **params: Any) -> dict[str, Any]:
            return fn(system, **params)

        run.__name__ = f"{fn.__name__}_{system}"
        workload.system(system)(run)


# -------------------------------------------------------------------------------- matmul

matmul = Workload(
    "matmul",
    "Seconds to compute (x @ x.T).sum() with x = dask.array random (n, n) in (chunk, "
    "chunk) chunks (4000 and 500: 64 blocks, 512 block products), from compute() to "
    "the number in hand, graph building included; median of `rounds` (3) after one "
    "untimed round; the result is checked against numpy's product of the same array. "
    "`numpy`: the same with numpy arrays in the measuring process, its BLAS on all "
    "cores (the floor; in the same child, before the cluster starts). "
    "`vs_numpy` = seconds / numpy seconds.",
    metrics={"seconds": "s", "numpy": "s", "vs_numpy": "x ref"},
    params={"n": 4000, "chunk": 500, "rounds": 3},
    quick={"n": 1000, "chunk": 250, "rounds": 1},
    timeout=900,
)


def _matmul(system: str, n: int, chunk: int, rounds: int) -> dict[str, Any]:
    import dask.array as da
    import numpy as np

    floor = []
    for _ in range(2):
        t0 = _perf()
        x_np = np.random.default_rng(0).random((n, n))
        float((x_np @ x_np.T).sum())
        floor.append(_perf() - t0)
    # the check: numpy's product of the very array the dask graph makes
    x_np = da.random.default_rng(0).random((n, n), chunks=(chunk, chunk)).compute(scheduler="sync")
    expected = float((x_np @ x_np.T).sum())
    del x_np
    out: dict[str, Any] = {"numpy": min(floor)}
    times = []
    with _session(system) as s:
        for i in range(rounds + 1):
            t0 = _perf()
            x = da.random.default_rng(0).random((n, n), chunks=(chunk, chunk))
            got = float(s.client.compute((x @ x.T).sum()).result())
            dt = _perf() - t0
            if abs(got - expected) > 1e-6 * abs(expected):
                raise AssertionError(f"{system} computed {got}, numpy {expected}")
            if i:
                times.append(dt)
        out.update(s.extra_info())
    out["seconds"] = statistics.median(times)
    out["vs_numpy"] = out["seconds"] / out["numpy"]
    out["rounds_s"] = [round(t, 3) for t in times]
    return out


_register(matmul, _matmul)

# ------------------------------------------------------------------------ dask_array_mix

dask_array_mix = Workload(
    "dask_array_mix",
    "Seconds for a notebook's worth of dask.array work on x = random (rows, cols) "
    "float64 in (1000, 1000) chunks (16000 x 8000: 1.0 GB, 128 chunks): persist x, "
    "then compute one after another x.mean(axis=0).sum(), x.std(), "
    "x.rechunk((rows, 250)).max(axis=0).sum() and x.rechunk((250, cols)).sum(axis=1).sum() "
    "(two rechunks that move every chunk), x[::3].var(axis=1).sum() and "
    "(x[:, :500].T @ x[:, :500]).trace(); from persist() to the last number in hand, "
    "then x is released. Median of `rounds` (3) after one untimed round; every result "
    "is checked against dask's synchronous scheduler in the same child.",
    metrics={"seconds": "s"},
    params={"rows": 16000, "cols": 8000, "rounds": 3},
    quick={"rows": 2000, "cols": 2000, "rounds": 1},
    timeout=900,
)


def _mix_exprs(x: Any, rows: int, cols: int) -> list[Any]:
    return [
        x.mean(axis=0).sum(),
        x.std(),
        x.rechunk((rows, 250)).max(axis=0).sum(),
        x.rechunk((250, cols)).sum(axis=1).sum(),
        x[::3].var(axis=1).sum(),
        (x[:, :500].T @ x[:, :500]).trace(),
    ]


def _dask_array_mix(system: str, rows: int, cols: int, rounds: int) -> dict[str, Any]:
    import dask
    import dask.array as da

    def make() -> Any:
        return da.random.default_rng(1).random((rows, cols), chunks=(1000, 1000))

    expected = [float(v) for v in dask.compute(*_mix_exprs(make(), rows, cols), scheduler="sync")]
    times = []
    with _session(system) as s:
        client = s.client
        for i in range(rounds + 1):
            t0 = _perf()
            x = client.persist(make())
            got = [float(client.compute(e).result()) for e in _mix_exprs(x, rows, cols)]
            dt = _perf() - t0
            del x
            for g, e in zip(got, expected):
                if abs(g - e) > 1e-6 * max(abs(e), 1.0):
                    raise AssertionError(f"{system} computed {got}, dask's sync scheduler {expected}")
            if i:
                times.append(dt)
        out: dict[str, Any] = s.extra_info()
    out["seconds"] = statistics.median(times)
    out["rounds_s"] = [round(t, 3) for t in times]
    return out


_register(dask_array_mix, _dask_array_mix)
