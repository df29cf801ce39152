"""``shoal demo``: a blocked matrix product, a map-reduce and a large task argument on
a local cluster.

Run it as ``shoal demo``. The same code in a script of your own needs no
``if __name__ == "__main__":`` guard on shoal's account: worker processes are started
as ``python -m shoal worker``, not by forking or spawning your script.
"""

from __future__ import annotations

import sys
import time
import warnings
from typing import Any

__all__ = ["main"]


def random_block(seed: int, n: int) -> Any:
    import numpy as np

    return np.random.default_rng(seed).random((n, n))


def matmul(a: Any, b: Any) -> Any:
    return a @ b


def add_all(*blocks: Any) -> Any:
    out = blocks[0].copy()
    for b in blocks[1:]:
        out += b
    return out


def normal_chunk(seed: int, n: int) -> Any:
    import numpy as np

    return np.random.default_rng(seed).standard_normal(n)


def histogram(x: Any) -> Any:
    import numpy as np

    counts, _ = np.histogram(x, bins=40, range=(-4.0, 4.0))
    return counts


def add(a: Any, b: Any) -> Any:
    return a + b


def _show_progress(futures: Any) -> None:
    """Bars per task prefix until ``futures`` are done (``shoal.progress``)."""
    from . import progress

    progress(futures)


def blocked_matmul(client: Any, n: int, block: int, show_progress: bool = False) -> tuple[float, float, Any]:
    """C = A @ B with n x n matrices in block x block tiles; returns (seconds, checksum,
    (A, B)); with ``show_progress``, bars show how far its tasks are meanwhile."""
    nb = n // block
    a = {(i, k): client.submit(random_block, 1000 * i + k, block) for i in range(nb) for k in range(nb)}
    b = {(k, j): client.submit(random_block, 5000 + 1000 * k + j, block) for k in range(nb) for j in range(nb)}
    t0 = time.perf_counter()
    c = {}
    for i in range(nb):
        for j in range(nb):
            products = [client.submit(matmul, a[i, k], b[k, j]) for k in range(nb)]
            c[i, j] = client.submit(add_all, *products)
    total = client.submit(lambda *blocks: float(sum(x.sum() for x in blocks)), *c.values())
    if show_progress:
        _show_progress(total)
    checksum = total.result()
    return time.perf_counter() - t0, checksum, (a, b)


def map_reduce(client: Any, chunks: int, size: int, show_progress: bool = False) -> tuple[float, Any]:
    t0 = time.perf_counter()
    hists = client.map(histogram, client.map(normal_chunk, range(chunks), [size] * chunks))
    while len(hists) > 1:  # a tree reduction
        pairs = [client.submit(add, hists[i], hists[i + 1]) for i in range(0, len(hists) - 1, 2)]
        hists = pairs + ([hists[-1]] if len(hists) % 2 else [])
    if show_progress:
        _show_progress(hists[0])
    counts = hists[0].result()
    return time.perf_counter() - t0, counts


def column_sums(x: Any) -> Any:
    return x.sum(axis=0)


def large_argument(client: Any, mb: int) -> tuple[float, bool]:
    """Pass a ``mb`` MB array made here to a task as its argument (no scatter); returns
    (seconds, whether the task's result matches numpy's here)."""
    import numpy as np

    x = np.random.default_rng(7).random(((mb << 20) // 8 // 1000, 1000))
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        # the client's advice to scatter large arguments is for arrays that several
        # tasks use; this one goes to a single task
        warnings.simplefilter("ignore", UserWarning)
        future = client.submit(column_sums, x, pure=False)
    sums = future.result()
    return time.perf_counter() - t0, bool(np.allclose(sums, x.sum(axis=0)))


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    return str(n)


def main(n: int = 2000, block: int = 500, chunks: int = 16, chunk_size: int = 1_000_000, arg_mb: int = 64,
         progress: bool | None = None) -> int:
    """Run the demo on both kinds of local cluster; returns the exit status. Progress
    bars show while the matrix product and the map-reduce run when ``progress`` is
    True, or when it is None and stdout is a terminal."""
    import numpy as np

    show = sys.stdout.isatty() if progress is None else progress

    from . import Client, LocalCluster

    for processes in (True, False):
        kind = "2 worker processes" if processes else "2 workers as threads of this process"
        t0 = time.perf_counter()
        with LocalCluster(n_workers=2, threads_per_worker=1, processes=processes) as cluster, Client(cluster) as client:
            startup = time.perf_counter() - t0
            print(f"== local cluster with {kind} (started in {startup * 1e3:.0f} ms)")
            if cluster.dashboard_link:
                print(f"dashboard at {cluster.dashboard_link} (while this cluster runs)")
            secs, checksum, (a, b) = blocked_matmul(client, n, block, show)
            nb = n // block
            full_a = np.block([[client.gather(a[i, k]) for k in range(nb)] for i in range(nb)])
            full_b = np.block([[client.gather(b[k, j]) for j in range(nb)] for k in range(nb)])
            expected = float((full_a @ full_b).sum())
            ok = "matches numpy" if abs(checksum - expected) <= 1e-9 * abs(expected) else f"MISMATCH (numpy: {expected})"
            print(f"blocked matmul {n}x{n} in {block}x{block} tiles: sum(A @ B) = {checksum:.6e} "
                  f"({ok}) in {secs:.2f} s")
            secs, counts = map_reduce(client, chunks, chunk_size, show)
            total = int(counts.sum())
            centers = np.linspace(-4, 4, 41)[:-1] + 0.1
            mean = float((counts * centers).sum() / total)
            print(f"map-reduce: histogram of {chunks} x {chunk_size:,} normal samples: {total:,} of "
                  f"{chunks * chunk_size:,} within +-4, mean ~ {mean:+.3f}, in {secs:.2f} s")
            secs, sums_agree = large_argument(client, arg_mb)
            print(f"a {arg_mb} MB array passed to a task as its argument: column sums "
                  f"{'agree with numpy' if sums_agree else 'DIFFER from numpy'}, in {secs * 1e3:.0f} ms")
            stats = client.transfer_stats()
            moved = {k: sum(s[k] for s in stats.values()) for k in ("inproc", "shm", "tcp")}
            print("values moved: " + ", ".join(f"{_fmt_bytes(v)} {name}" for name, v in
                                              (("by reference", moved["inproc"]), ("through shared memory", moved["shm"]),
                                               ("over tcp", moved["tcp"]))))
            print()
    return 0
