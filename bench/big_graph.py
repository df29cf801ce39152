"""How long a big dask graph takes to reach the scheduler and to run.

    python bench/big_graph.py shoal 100000     # (da.ones(n, chunks=1) + 1).sum()
    python bench/big_graph.py dask 100000      # the same on dask.distributed
    python bench/big_graph.py shoal 333333 --start   # until the first task is done
    python bench/big_graph.py shoal 100000 --processes   # workers in processes of their own

Both on 4 in-process workers of 1 thread (with ``--processes``, 4 worker processes).
For shoal it prints the client's conversion of the graph alone first
(``graph_to_tasks``), then how long ``client.compute`` took to return, the first task
to finish (read from the scheduler's counts by a thread) and the result to arrive;
with ``--start``, it stops at the first task.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any


def graph(n: int) -> Any:
    import dask.array as da

    return (da.ones(n, chunks=1) + 1).sum()


def _first_done(system: str, cluster: Any, t0: list[float], out: list[float], stop: threading.Event) -> None:
    """Poll the in-process scheduler until a task of the graph is in memory."""
    while not stop.is_set():
        if system == "shoal":
            done = cluster.scheduler.state.done_total > 0
        else:
            done = any(tg.states.get("memory") for tg in list(cluster.scheduler.task_groups.values()))
        if done and t0:
            out.append(time.perf_counter() - t0[0])
            return
        time.sleep(0.005)


def main(system: str, n: int, start_only: bool = False, processes: bool = False) -> None:
    if system == "shoal":
        import shoal
        from shoal.client import graphs

        y = graph(n)
        t0 = time.perf_counter()
        tasks, _ = graphs.graph_to_tasks(y, graphs.flatten_keys(y.__dask_keys__(), []))
        print(f"shoal: the client's conversion of {len(tasks):,} tasks: {time.perf_counter() - t0:.2f}s")
        del tasks
        cluster: Any = shoal.LocalCluster(n_workers=4, processes=processes, threads_per_worker=1,
                                          dashboard_address=None, memory_limit=None)
        make_client: Any = shoal.Client
    else:
        from distributed import Client, LocalCluster

        cluster = LocalCluster(n_workers=4, processes=processes, dashboard_address=None, threads_per_worker=1)
        make_client = Client
    with cluster as c, make_client(c) as client:
        y = graph(n)
        began: list[float] = []
        first: list[float] = []
        stop = threading.Event()
        poll = threading.Thread(target=_first_done, args=(system, c, began, first, stop), daemon=True)
        poll.start()
        began.append(time.perf_counter())
        t0 = began[0]
        future = client.compute(y)
        t1 = time.perf_counter()
        poll.join(timeout=3600)
        done = f"{first[0]:.2f}s" if first else "(not within an hour)"
        print(f"{system}: {n:,} chunks: compute() returned after {t1 - t0:.2f}s, the first task was done after "
              f"{done}", flush=True)
        if start_only:
            future.cancel()
            return
        result = future.result()
        t2 = time.perf_counter()
        stop.set()
    assert result == 2 * n, result
    print(f"{system}: {n:,} chunks: the result came after {t2 - t0:.2f}s")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), "--start" in sys.argv[3:], "--processes" in sys.argv[3:])
