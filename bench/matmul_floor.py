"""The floor of the `matmul` workload's graph on this machine, whatever runs it.

Runs the same dask graph as `matmul` ((x @ x.T).sum(), x random (4000, 4000) in
(500, 500) chunks) with dask's own schedulers in this one process, one BLAS thread per
thread: synchronously (the graph's total work) and threaded with 2 threads (no
serialization, no transfers: what any 2-worker run can at best approach), and times one
500 x 500 block product. Usage: ``python bench/matmul_floor.py [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import os

# one BLAS thread per thread, as the workers have; set before numpy is imported
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import statistics  # noqa: E402
import time  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--n", type=int, default=4000)
    parser.add_argument("--chunk", type=int, default=500)
    args = parser.parse_args()

    import dask.array as da
    import numpy as np

    rng = np.random.default_rng(0)
    a, b = rng.random((args.chunk, args.chunk)), rng.random((args.chunk, args.chunk))
    block = []
    for _ in range(20):
        t0 = time.perf_counter()
        a @ b.T
        block.append(time.perf_counter() - t0)
    print(f"one {args.chunk}x{args.chunk} block product, 1 BLAS thread: {statistics.median(block) * 1e3:.2f} ms")
    for scheduler, kwargs in (("sync", {}), ("threads", {"num_workers": 2})):
        times = []
        for _ in range(args.rounds):
            x = da.random.default_rng(0).random((args.n, args.n), chunks=(args.chunk, args.chunk))
            t0 = time.perf_counter()
            (x @ x.T).sum().compute(scheduler=scheduler, **kwargs)
            times.append(time.perf_counter() - t0)
        label = "dask sync scheduler (1 thread)" if scheduler == "sync" else "dask threaded scheduler, 2 threads"
        print(f"{label}: median {statistics.median(times):.3f} s ({', '.join(f'{t:.3f}' for t in times)})")


if __name__ == "__main__":
    main()
