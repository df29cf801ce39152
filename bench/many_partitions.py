"""shoal's shuffle of many partitions: 200,000 rows in N partitions shuffled into N,
on 2 worker processes, checked against pandas.

    python bench/many_partitions.py 2000
    SHOAL_SHM=0 python bench/many_partitions.py 10000     # through tcp only

Prints the seconds from compute() to the result, then "right" once it matches pandas.
(The issue's target is 10,000 partitions; see bench/RESULTS.md "Many partitions".)
"""

from __future__ import annotations

import sys
import time

import dask.dataframe as dd
import numpy as np
import pandas as pd

import shoal


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    rng = np.random.default_rng(0)
    pdf = pd.DataFrame({"k": rng.integers(0, 10**6, 200_000), "v": rng.random(200_000)})
    with shoal.Client(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None):
        out = dd.from_pandas(pdf, npartitions=n, sort=False).shuffle("k", npartitions=n)
        start = time.perf_counter()
        got = out.compute()
        print(f"{n} partitions: {time.perf_counter() - start:.1f} s", flush=True)
    pd.testing.assert_frame_equal(got.sort_values(["k", "v"]).reset_index(drop=True),
                                  pdf.sort_values(["k", "v"]).reset_index(drop=True))
    print("right")
    return 0


if __name__ == "__main__":
    sys.exit(main())
