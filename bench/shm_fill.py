"""What it costs on this machine to put N MB into shared memory, by each way there is.

    python bench/shm_fill.py            # 64 MB
    python bench/shm_fill.py --mb 512

Best of 5, milliseconds, in one process (no cluster): the reference (a private numpy
array filled by copy), a new /dev/shm file filled through a mapping (a page fault per
4 KiB page), the same with its pages reserved and mapped in one call first
(posix_fallocate + MAP_POPULATE), a new file filled with pwrite (what shoal does for a
new segment), an existing file's pages refilled through a mapping kept from before
(what shoal does when it reuses a segment), and a reader's private mapping of an
existing file, summed (what a consumer does). Every file is removed.
"""

from __future__ import annotations

import argparse
import mmap
import os
import time
from collections.abc import Callable

import numpy as np


def best_ms(fn: Callable[[int], None], n: int = 5) -> float:
    best = float("inf")
    for i in range(n):
        t0 = time.perf_counter()
        fn(i)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=64)
    nbytes = parser.parse_args().mb << 20
    src = np.random.default_rng(0).random(nbytes // 8)
    raw = memoryview(src).cast("B")
    paths: list[str] = []

    def new_file(i: int) -> tuple[int, str]:
        path = f"/dev/shm/bench-fill-{os.getpid()}-{i}-{time.monotonic_ns()}"
        paths.append(path)
        return os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600), path

    def done(fd: int, path: str) -> None:
        os.close(fd)
        os.unlink(path)

    def private(_: int) -> None:
        np.copyto(np.empty_like(src), src)

    def faulted(i: int) -> None:
        fd, path = new_file(i)
        os.ftruncate(fd, nbytes)
        with mmap.mmap(fd, nbytes) as m:
            np.frombuffer(m, dtype=np.uint8)[:] = np.frombuffer(raw, dtype=np.uint8)
        done(fd, path)

    def populated(i: int) -> None:
        fd, path = new_file(i)
        os.posix_fallocate(fd, 0, nbytes)
        with mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE) as m:
            np.frombuffer(m, dtype=np.uint8)[:] = np.frombuffer(raw, dtype=np.uint8)
        done(fd, path)

    def pwritten(i: int) -> None:
        fd, path = new_file(i)
        written = 0
        while written < nbytes:
            written += os.pwrite(fd, raw[written:], written)
        done(fd, path)

    keep_fd, keep_path = new_file(99)
    os.posix_fallocate(keep_fd, 0, nbytes)
    kept = mmap.mmap(keep_fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)

    def reused(_: int) -> None:
        np.frombuffer(kept, dtype=np.uint8)[:] = np.frombuffer(raw, dtype=np.uint8)

    def read(_: int) -> None:
        fd = os.open(keep_path, os.O_RDONLY)
        with mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE) as m:
            a = np.frombuffer(m, dtype=np.float64)
            a.sum()
            del a
        os.close(fd)

    try:
        print(f"{nbytes >> 20} MB, best of 5 (ms):")
        for name, fn in [("private array, copied in", private),
                         ("new file, faulted in through a mapping", faulted),
                         ("new file, fallocate + MAP_POPULATE, then copied", populated),
                         ("new file, pwrite (shoal: a new segment)", pwritten),
                         ("existing pages, kept mapping (shoal: a reused segment)", reused),
                         ("reader: private mapping of existing pages, summed", read)]:
            print(f"  {name:58s} {best_ms(fn):8.1f}")
    finally:
        kept.close()
        os.close(keep_fd)
        for path in paths:
            if os.path.exists(path):
                os.unlink(path)


if __name__ == "__main__":
    main()
