"""A worker in another language (issue 15): the JavaScript worker of ``workers/js``
next to Python workers, in one shoal cluster.

- ``foreign``: one cluster of 2 Python worker processes x 1 thread and 1 JavaScript
  worker (``node workers/js/bin/shoal-worker.js``, 1 thread), loopback tcp.
  ``tiny_js``/``tiny_py``: ``n`` independent ``inc(i)`` tasks on the JS worker, then
  the same on the Python workers (map then gather, as tiny_tasks).
  ``roundtrip_js``/``roundtrip_py``: an ``array_mb`` float64 array made on Python
  worker 0, scaled by 2 on the JS worker (or on Python worker 1), the result read on
  Python worker 0 (its first element, checked): seconds per round trip, the median of
  ``rounds``. Both moves cross tcp (the JS worker maps no shared memory; for the
  Python path shared memory is off too, so that the two paths move the same bytes the
  same way), and both transforms make one new array in one pass.

shoal only: dask.distributed and Ray have no workers in another language.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import time
from typing import Any

from ..registry import Workload

__all__ = ["foreign"]

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(os.path.dirname(_HERE))
WORKER = os.path.join(_REPO, "workers", "js", "bin", "shoal-worker.js")
MODULES = os.path.join(_REPO, "bench", "js")


def inc(x: int) -> int:
    return x + 1


def make(nbytes: int) -> Any:
    import numpy as np

    return np.full(nbytes // 8, 1.5, dtype=np.float64)


def scale(a: Any, k: float) -> Any:
    return a * k


def first(a: Any) -> float:
    return float(a[0])


foreign = Workload(
    "foreign",
    "A JavaScript worker beside Python workers: tiny tasks/s and a 64 MB array round trip "
    "Python -> JS -> Python, against the same on Python workers",
    metrics={"tiny_js": "tasks/s", "tiny_py": "tasks/s", "roundtrip_js": "s", "roundtrip_py": "s"},
    params={"n": 5_000, "array_mb": 64, "rounds": 5},
    quick={"n": 200, "array_mb": 8, "rounds": 2},
)


@foreign.system("shoal")
def _(n: int, array_mb: int, rounds: int) -> dict[str, Any]:
    os.environ["SHOAL_SHM"] = "0"  # (before shoal starts anything: the workers inherit it)
    import shoal

    with shoal.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                            dashboard_address=None) as cluster, shoal.Client(cluster) as client:
        env = {**os.environ, **cluster.security.to_env()}
        js = subprocess.Popen(["node", WORKER, cluster.scheduler_address, "--nthreads", "1", "--path", MODULES],
                              env=env, stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60
            while len(client.scheduler_info()["workers"]) < 3:
                if js.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the JS worker did not join (exit code {js.poll()})")
                time.sleep(0.05)
            info = client.scheduler_info()["workers"]
            py = sorted(a for a, w in info.items() if "python" in w.get("languages", ["python"]))
            js_inc = shoal.foreign("js", "bench_tasks", "inc")
            js_scale = shoal.foreign("js", "bench_tasks", "scale")

            def tiny(fn: Any) -> float:
                client.gather(client.map(fn, range(10), pure=False))  # warm
                began = time.perf_counter()
                out = client.gather(client.map(fn, range(n), pure=False))
                elapsed = time.perf_counter() - began
                assert out == [i + 1 for i in range(n)]
                return n / elapsed

            def roundtrip(transform: Any, where: list[str] | None) -> float:
                times = []
                for _ in range(rounds + 1):  # the first warms up
                    x = client.submit(make, array_mb << 20, workers=[py[0]], pure=False)
                    x.result()
                    began = time.perf_counter()
                    y = client.submit(transform, x, 2.0, workers=where, pure=False)
                    z = client.submit(first, y, workers=[py[0]], pure=False)
                    assert z.result() == 3.0
                    times.append(time.perf_counter() - began)
                    del x, y, z
                return statistics.median(times[1:])

            return {
                "tiny_js": tiny(js_inc),
                "tiny_py": tiny(inc),
                "roundtrip_js": roundtrip(js_scale, None),
                "roundtrip_py": roundtrip(scale, [py[1]]),
                "workers": f"2 Python + 1 JS (node {subprocess.run(['node', '--version'], capture_output=True, text=True).stdout.strip()})",
            }
        finally:
            js.terminate()
            try:
                js.wait(10)
            except subprocess.TimeoutExpired:
                js.kill()
                js.wait()
