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
from .cluster import (
    SYSTEMS,
    FuturesSession,
    RaySession,
    _register,
    _warm_up,
    consume,
    open_session,
    shoal_bytes_served,
)

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


def _task_args(system: str, mb: int, rounds: int, session: Any = None) -> dict[str, Any]:
    import numpy as np

    nbytes = mb << 20
    times: list[float] = []
    writeable: list[bool] = []
    with session if session is not None else open_session(system) as s:
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


# ------------------------------------------- the scheduler in a process of its own

task_args_64MB_cli = Workload(
    "task_args_64MB_cli",
    "task_args_64MB with the scheduler and 2 workers (1 thread each) started from the "
    "command line as processes of their own (`shoal scheduler` / `shoal worker`; "
    "`dask scheduler` / `dask worker --nworkers 1`, dashboards off), all on 127.0.0.1, "
    "and the client in the measuring process: the argument travels client -> "
    "scheduler -> worker. shoal hands it to the scheduler in a transfer segment that "
    "the scheduler takes over and the worker maps; dask pickles it into both messages. "
    "The task is pinned to the second worker to join. (Ray's driver is always a "
    "process of its own: its task_args_64MB figures are this case.)",
    metrics={"seconds": "s", "first": "s", "GBps": "GB/s"},
    params={"mb": 64, "rounds": 7},
    quick={"mb": 4, "rounds": 2},
    timeout=600,
)


class CliSession(FuturesSession):
    """A scheduler and two workers started from the command line, and a client of them
    in this process."""

    def __init__(self, system: str):
        import socket
        import subprocess
        import sys

        self.system = system
        self.procs: list[subprocess.Popen[bytes]] = []
        self.client: Any = None
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        address = f"tcp://127.0.0.1:{port}"
        if system == "shoal":
            import shoal as module

            sched = [sys.executable, "-m", "shoal", "scheduler", "--host", "127.0.0.1", "--port", str(port)]
            worker = [sys.executable, "-m", "shoal", "worker", address, "--nthreads", "1"]
        else:
            import distributed as module

            sched = [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
                     "--port", str(port), "--no-dashboard"]
            worker = [sys.executable, "-m", "distributed.cli.dask_worker", address, "--nthreads", "1",
                      "--nworkers", "1", "--host", "127.0.0.1", "--no-dashboard"]
        self.module = module
        quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
        try:
            self.procs.append(subprocess.Popen(sched, **quiet))
            self.client = module.Client(address, timeout=30)
            self.workers = []
            for n in (1, 2):  # one at a time: "worker 1" is the second to join
                self.procs.append(subprocess.Popen(worker, **quiet))
                self._wait_workers(n)
                self.workers += sorted(set(self.client.scheduler_info()["workers"]) - set(self.workers))
        except BaseException:
            self.close()
            raise

    def _wait_workers(self, n: int) -> None:
        deadline = time.monotonic() + 60
        while len(self.client.scheduler_info()["workers"]) < n:
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"the {self.system} processes did not start {n} worker(s)")
            time.sleep(0.05)  # polling the scheduler, which offers no event for this

    def extra_info(self) -> dict[str, Any]:
        return shoal_bytes_served(self.client) if self.system == "shoal" else {}

    def close(self) -> None:
        import subprocess

        try:
            if self.client is not None:
                self.client.close()
        finally:
            for p in self.procs:
                p.terminate()
            for p in self.procs:
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def _task_args_cli(system: str, mb: int, rounds: int) -> dict[str, Any]:
    return _task_args(system, mb, rounds, session=CliSession(system))


_register(task_args_64MB_cli, ("shoal", "dask"), _task_args_cli)


# ------------------------------------------------------------------- scatter_64MB

scatter_64MB = Workload(
    "scatter_64MB",
    "A 64 MB float64 array made in the client's process is scattered to worker 0 "
    "(ray: ray.put), then a task pinned to worker 1 takes it and returns arr[0]. "
    "`scatter`: seconds of the scatter (its key's hash included for shoal and dask, "
    "which name scattered data by content); `use`: seconds from submitting the task "
    "to its result, the value living on another worker (ray: the object store). "
    "Median of `rounds` (5), every round a new array, the previous one released. Ray: "
    "the consumer is the actor of worker 1 (a read-only view).",
    metrics={"scatter": "s", "use": "s"},
    params={"mb": 64, "rounds": 5},
    quick={"mb": 4, "rounds": 1},
    timeout=600,
)


def _scatter(system: str, mb: int, rounds: int) -> dict[str, Any]:
    import numpy as np

    nbytes = mb << 20
    put, use = [], []
    with open_session(system) as s:
        if isinstance(s, RaySession):
            s.start_actors()
        else:
            _warm_up(s)
        w0, w1 = s.workers
        s.result(s.submit(consume, np.ones(8), worker=w1, pure=False))
        for i in range(rounds):
            arr = np.full(nbytes // 8, float(i + 1))
            t0 = _perf()
            if isinstance(s, RaySession):
                ref = s.ray.put(arr)
            else:
                [ref] = s.client.scatter([arr], workers=[w0])
            t1 = _perf()
            first, _, size = s.result(s.submit(consume, ref, worker=w1, pure=False))
            t2 = _perf()
            if first != float(i + 1) or size != nbytes:
                raise AssertionError(f"the task saw arr[0]={first}, nbytes={size}")
            put.append(t1 - t0)
            use.append(t2 - t1)
            del ref, arr
        out = s.extra_info()
    out["scatter"] = statistics.median(put)
    out["use"] = statistics.median(use)
    out["rounds_use_s"] = [round(t, 4) for t in use]
    return out


_register(scatter_64MB, SYSTEMS, _scatter)
