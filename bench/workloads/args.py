"""``task_args_64MB``: a large array passed from the client to a task as an argument.

The client lives in the process that runs the scheduler (shoal's and dask's
LocalCluster; Ray's driver), the workers are processes on this host. shoal copies a
large argument into shared memory once (into a segment it reuses when an earlier
task's argument is forgotten) and the worker maps it; dask pickles it into the task's
message over loopback tcp; Ray puts it into its object store and the worker reads a
read-only view.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from ..registry import Workload
from .cluster import SYSTEMS, RaySession, _register, _warm_up, consume, open_session

_perf = time.perf_counter


def _args_workload(mb: int, rounds: int) -> Workload:
    return Workload(
        f"task_args_{mb}MB",
        f"Seconds from submitting a task whose argument is a {mb} MB float64 array made "
        "in the client's process to its result (arr[0], the array's writeability and "
        "size) in hand; every round a new array (np.full with the round's number), the "
        "previous round's task released first. `seconds`: median of `rounds` "
        f"({rounds}); `first`: the first round alone (no memory of an earlier argument "
        "to reuse); `GBps` = size / seconds. Info `arg_writeable`: whether the task's "
        "input array was writeable. shoal and dask: the task pinned to worker 1 "
        "(workers=[address]); ray: a plain remote task (ray puts the argument in its "
        "object store).",
        metrics={"seconds": "s", "first": "s", "GBps": "GB/s"},
        params={"mb": mb, "rounds": rounds},
        quick={"mb": 4, "rounds": 2},
        timeout=600,
    )


task_args_64MB = _args_workload(64, 7)


def _task_args(system: str, mb: int, rounds: int) -> dict[str, Any]:
    import numpy as np

    nbytes = mb << 20
    times: list[float] = []
    writeable: list[bool] = []
    with open_session(system) as s:
        if not isinstance(s, RaySession):
            _warm_up(s)
        target = None if isinstance(s, RaySession) else s.workers[1]
        # untimed: the function reaches the worker once
        s.result(s.submit(consume, np.ones(8), worker=target, pure=False))
        for i in range(rounds):
            arr = np.full(nbytes // 8, float(i + 1))
            t0 = _perf()
            handle = s.submit(consume, arr, worker=target, pure=False)
            first, w, size = s.result(handle)
            times.append(_perf() - t0)
            if first != float(i + 1) or size != nbytes:
                raise AssertionError(f"the task saw arr[0]={first}, nbytes={size}")
            writeable.append(w)
            s.release([handle])
            del handle, arr
        out = s.extra_info()
    out["seconds"] = statistics.median(times)
    out["first"] = times[0]
    out["GBps"] = nbytes / out["seconds"] / 1e9
    out["arg_writeable"] = "yes" if all(writeable) else ("no" if not any(writeable) else f"mixed {writeable}")
    out["rounds_s"] = [round(t, 4) for t in times]
    return out


_register(task_args_64MB, SYSTEMS, _task_args)
