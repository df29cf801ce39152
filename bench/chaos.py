"""A long chaos run: mixed graphs checked against pandas/numpy/plain Python while worker
processes are killed (-9) at random points (shoal.chaos; the test suite runs a short one).

    python bench/chaos.py --minutes 10                # 2 worker processes, a kill every 1-3 s
    python bench/chaos.py --minutes 10 --kill-every 5,15 --workers 4 --memory-limit 300MB
    python bench/chaos.py --minutes 5 --shuffle-method tasks   # dataframes through dask's task shuffle

Prints each graph that came back wrong, hung or erred, then one line: graphs by kind,
kills, wrong, hung, erred. Exits 1 if any graph was wrong or hung.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys

import shoal
from shoal import config
from shoal.chaos import GRAPHS, kill_a_worker, run_chaos


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--memory-limit", default="300MB", help="per worker: small, so values spill")
    parser.add_argument("--kill-every", default="1,3", help="seconds between kills, drawn from this range")
    parser.add_argument("--kinds", default="", help=f"graph kinds (default all: {','.join(GRAPHS)})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deadline", type=float, default=120.0, help="seconds a graph may take")
    parser.add_argument("--shuffle-method", default="", help="dask's dataframe shuffle method (default: shoal's choice)")
    args = parser.parse_args()
    low, high = (float(x) for x in args.kill_every.split(","))
    kinds = [k for k in args.kinds.split(",") if k] or None
    method: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
    if args.shuffle_method:
        import dask

        method = dask.config.set({"dataframe.shuffle.method": args.shuffle_method})
    with config.set(nanny_max_restarts=1_000_000), method:
        with shoal.Client(n_workers=args.workers, processes=True, dashboard_address=None,
                          memory_limit=args.memory_limit) as client:
            report = run_chaos(client, kill_a_worker(client, random.Random(args.seed)), seconds=args.minutes * 60,
                               seed=args.seed, kill_every=(low, high), deadline=args.deadline, kinds=kinds,
                               say=lambda line: print(line, flush=True))
    print(report.summary(), flush=True)
    return 1 if report.wrong or report.hangs else 0


if __name__ == "__main__":
    sys.exit(main())
