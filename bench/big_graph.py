"""How long a big dask graph takes to reach the scheduler and to run.

    python bench/big_graph.py shoal 100000     # (da.ones(n, chunks=1) + 1).sum()
    python bench/big_graph.py dask 100000      # the same on dask.distributed

Both on 4 in-process workers of 1 thread. For shoal it prints the client's conversion
of the graph alone first (``graph_to_tasks``), then how long ``client.compute`` took to
return and the result to arrive.
"""

from __future__ import annotations

import sys
import time
from typing import Any


def graph(n: int) -> Any:
    import dask.array as da

    return (da.ones(n, chunks=1) + 1).sum()


def main(system: str, n: int) -> None:
    if system == "shoal":
        import shoal
        from shoal.client import graphs

        y = graph(n)
        t0 = time.perf_counter()
        tasks, _ = graphs.graph_to_tasks(y, graphs.flatten_keys(y.__dask_keys__(), []))
        print(f"shoal: the client's conversion of {len(tasks):,} tasks: {time.perf_counter() - t0:.2f}s")
        del tasks
        cluster: Any = shoal.LocalCluster(n_workers=4, processes=False, dashboard_address=None, memory_limit=None)
        make_client: Any = shoal.Client
    else:
        from distributed import Client, LocalCluster

        cluster = LocalCluster(n_workers=4, processes=False, dashboard_address=None, threads_per_worker=1)
        make_client = Client
    with cluster as c, make_client(c) as client:
        y = graph(n)
        t0 = time.perf_counter()
        future = client.compute(y)
        t1 = time.perf_counter()
        result = future.result()
        t2 = time.perf_counter()
    assert result == 2 * n, result
    print(f"{system}: {n:,} chunks: compute() returned after {t1 - t0:.2f}s, the result came after {t2 - t0:.2f}s")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
