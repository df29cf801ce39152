"""Child entry point: run ONE measurement in this fresh interpreter, print JSON.

    python bench/_child.py WORKLOAD SYSTEM '{"param": value, ...}'

The result goes to stdout as one line ``@@BENCH-RESULT@@ {json}`` (other output, e.g.
from dask or ray, may surround it); the parent reads that line. On failure the line
carries ``{"error": ...}`` and the exit status is 1.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

MARKER = "@@BENCH-RESULT@@"

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    # appended: a PYTHONPATH entry may supply another shoal to measure (e.g. a baseline)
    sys.path.append(_ROOT)


def main(argv: list[str]) -> int:
    from bench import registry

    workload_name, system, params_json = argv
    params = json.loads(params_json)
    load = os.getloadavg()[0]  # other work on the machine skews every figure: record it
    t0 = time.perf_counter()
    try:
        workload = registry.get(workload_name)
        fn = workload.systems[system]
        out = fn(**params)
    except BaseException as exc:  # report anything, including KeyboardInterrupt
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        _emit(result)
        return 1
    metrics = {k: float(v) for k, v in out.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    info = {k: v for k, v in out.items() if k not in metrics}
    info.setdefault("load1_before", round(load, 2))
    shoal = sys.modules.get("shoal")
    if shoal is not None:
        info.setdefault("shoal_from", os.path.dirname(os.path.dirname(shoal.__file__)))
    _emit({"metrics": metrics, "info": info, "wall_s": time.perf_counter() - t0})
    return 0


def _emit(result: dict) -> None:
    sys.stdout.flush()
    sys.stdout.write(f"\n{MARKER} {json.dumps(result, default=str)}\n")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
