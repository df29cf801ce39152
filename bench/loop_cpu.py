"""The event loop's CPU per task, end to end: N tiny tasks on W in-process workers.

    python bench/loop_cpu.py 20000 50

Client, scheduler and workers share one loop thread in this process; its CPU is read
with ``time.thread_time()`` on that loop before and after the tasks run.
"""

from __future__ import annotations

import sys
import time

import shoal


def inc(x: int) -> int:
    return x + 1


async def _thread_time() -> float:
    return time.thread_time()


def main(n: int, workers: int) -> None:
    with shoal.LocalCluster(n_workers=workers, processes=False, dashboard_address=None, memory_limit=None) as c, \
            shoal.Client(c) as client:
        client.gather(client.map(inc, range(500)))  # warm
        loop0, proc0, t0 = c._loop_thread.run(_thread_time()), time.process_time(), time.perf_counter()
        futures = client.map(inc, range(n))
        client.gather(futures)
        elapsed = time.perf_counter() - t0
        loop1, proc1 = c._loop_thread.run(_thread_time()), time.process_time()
        del futures
    print(f"{n} tasks on {workers} workers: {n / elapsed:,.0f} tasks/s; CPU per task: "
          f"loop thread {1e6 * (loop1 - loop0) / n:.0f} µs, process {1e6 * (proc1 - proc0) / n:.0f} µs")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20000, int(sys.argv[2]) if len(sys.argv) > 2 else 50)
