"""Cluster workloads: shoal, dask.distributed and Ray side by side, each run as its users
would run it, on 2 worker processes x 1 thread (unless stated), loopback only.

- ``startup``: cluster creation to the first trivial result.
- ``tiny_tasks`` / ``tiny_tasks_inprocess``: 10,000 independent ``inc(i)``, map then gather.
- ``latency``: sequential submit -> result round trips of a no-op.
- ``tree_reduce``: binary-tree sum of 4,096 leaves (8,191 dependent tasks).
- ``transfer_64MB`` / ``transfer_512MB``: an array made on worker 0, consumed on worker 1.
- ``busy_owner``: worker 1 needs an array while its owner (worker 0) holds the GIL ~3 s.

How each system is set up (facts of this machine, see /work/shared/design.md):

- shoal: ``LocalCluster(n_workers=2, threads_per_worker=1, processes=..., host="127.0.0.1",
  dashboard_address=None)`` and ``Client(cluster)``; pinning with ``workers=[address]``.
- dask: ``distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=...,
  dashboard_address=None, host="127.0.0.1")`` and ``Client(cluster)`` with dask's default
  configuration (so root-task queuing, ``worker-saturation: 1.1``, is on); in-process
  (``processes=False``) without ``host``, which dask's inproc addresses reject; pinning with
  ``workers=[address]``. Where queuing matters an extra metric, suffixed
  ``_dask_saturation_inf``, repeats the measurement with ``worker-saturation: inf``.
- Ray: ``RAY_USAGE_STATS_ENABLED=0``, ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` and a
  temporary ``HOME`` set before ray is imported; ``ray.init(num_cpus=2,
  include_dashboard=False, _node_ip_address="127.0.0.1")``; the measurement fails unless
  ``ray.util.get_node_ip_address() == "127.0.0.1"``; ``ray.shutdown()`` always. Ray has
  no worker pinning on one node: "worker 0" and "worker 1" are two actors of
  ``num_cpus=1`` each (the producer actor returns the array, the consumer actor receives
  its ref). Ray's same-node reads are read-only zero-copy views of its object store.

Every task function lives at module level (imported by reference on the workers of all
three systems). Every cluster, process and actor is shut down before the child exits.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

from ..registry import Workload

SYSTEMS = ("shoal", "dask", "ray")
#: the same workloads on shoal over tls:// (what encryption costs)
TLS_SYSTEMS = (*SYSTEMS, "shoal-tls")
_perf = time.perf_counter


# ------------------------------------------------------------------------ task functions


def inc(x: int) -> int:
    return x + 1


def add(x: int, y: int) -> int:
    return x + y


def noop(x: Any = None) -> None:
    return None


def make_array(nbytes: int) -> Any:
    """A new float64 array of ``nbytes`` bytes, every page written (as a real result)."""
    import numpy as np

    return np.full(nbytes // 8, 1.0, dtype=np.float64)


def consume(arr: Any) -> tuple[float, bool, int]:
    """What the consumer task does: ``arr[0]``; also reports writeability and size."""
    return float(arr[0]), bool(arr.flags.writeable), int(arr.nbytes)


def hold_gil(n: int, path: str) -> tuple[float, float]:
    """Hold the GIL in one C call (``sum(range(n))``). Writes its start time (epoch
    seconds) to ``path`` first, so the measuring process knows it has started. Returns
    ``(start epoch seconds, duration seconds)``."""
    start = time.time()
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(repr(start))
    os.replace(tmp, path)
    t0 = _perf()
    sum(range(n))  # one C call: no bytecode runs, so the GIL is never released
    return start, _perf() - t0


class Peer:
    """A Ray actor body ("worker 0" / "worker 1" of the pinned workloads)."""

    def pid(self) -> int:
        return os.getpid()

    def produce(self, nbytes: int) -> Any:
        return make_array(nbytes)

    def consume(self, arr: Any) -> tuple[float, bool, int]:
        return consume(arr)

    def hold_gil(self, n: int, path: str) -> tuple[float, float]:
        return hold_gil(n, path)


# -------------------------------------------------------------------------- the systems


class Session:
    """One running cluster and a client of it, with the same small API on every system:
    ``submit(fn, *args, worker=None)`` -> handle, ``map(fn, *iterables)`` -> handles,
    ``result(handle)``, ``gather(handles)``, ``wait(handle)`` (done, value left where it
    is), ``release(handles)``."""

    system = ""
    workers: list[str]  # "worker 0", "worker 1" (addresses)

    def submit(self, fn: Any, *args: Any, worker: str | None = None, pure: bool = True) -> Any:
        raise NotImplementedError

    def map(self, fn: Any, *iterables: Any) -> Any:
        raise NotImplementedError

    def result(self, handle: Any) -> Any:
        raise NotImplementedError

    def gather(self, handles: Any) -> Any:
        raise NotImplementedError

    def wait(self, handle: Any) -> None:
        raise NotImplementedError

    def release(self, handles: Any) -> None:
        raise NotImplementedError

    def extra_info(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class FuturesSession(Session):
    """shoal and dask.distributed: a ``client`` with the same futures API (submit with
    ``workers=`` and ``pure=``, map, gather, futures with ``result()`` and ``release()``)
    and a module-level ``wait(futures)`` (``self.module``)."""

    client: Any
    module: Any

    def submit(self, fn: Any, *args: Any, worker: str | None = None, pure: bool = True) -> Any:
        return self.client.submit(fn, *args, workers=[worker] if worker else None, pure=pure)

    def map(self, fn: Any, *iterables: Any) -> Any:
        return self.client.map(fn, *iterables)

    def result(self, handle: Any) -> Any:
        return handle.result()

    def gather(self, handles: Any) -> Any:
        return self.client.gather(handles)

    def wait(self, handle: Any) -> None:
        self.module.wait([handle])
        if handle.status != "finished":
            handle.result()  # raise its error

    def release(self, handles: Any) -> None:
        for h in handles:
            h.release()


class ShoalSession(FuturesSession):
    system = "shoal"

    def __init__(self, processes: bool = True, tls: bool = False, memory_limit: Any = None,
                 dashboard_address: str | None = None):
        import shoal

        self.module = shoal
        if tls:
            self.system = "shoal-tls"
        # shoal-tls: the same cluster over tls:// (mutual TLS with a throw-away CA)
        security = shoal.Security.temporary() if tls else None
        # memory_limit None: LocalCluster's default ("auto", as dask's)
        limit = {} if memory_limit is None else {"memory_limit": memory_limit}
        # no dashboard unless asked (dask's and Ray's are off here too; `dashboard` measures it)
        self.cluster = shoal.LocalCluster(n_workers=2, threads_per_worker=1, processes=processes, host="127.0.0.1",
                                          security=security, dashboard_address=dashboard_address, **limit)
        self.client: Any = None
        self.workers = []
        try:
            self.client = shoal.Client(self.cluster)
            info = self.client.scheduler_info()["workers"]
            self.workers = [a for a, _ in sorted(info.items(), key=lambda kv: str(kv[1].get("name")))]
        except BaseException:
            self.close()
            raise

    def extra_info(self) -> dict[str, Any]:
        return shoal_bytes_served(self.client)

    def close(self) -> None:
        try:
            if self.client is not None:
                self.client.close()
        finally:
            self.cluster.close()


def shoal_bytes_served(client: Any) -> dict[str, str]:
    """The bytes a shoal client's workers moved, by way (info of a run)."""
    stats = client.transfer_stats()
    total = {k: sum(s.get(k, 0) for s in stats.values()) for k in ("inproc", "shm", "tcp")}
    return {"shoal_bytes_served": ", ".join(f"{k}={v / 1e6:.1f}MB" for k, v in total.items())}


class DaskSession(FuturesSession):
    system = "dask"

    def __init__(self, processes: bool = True, saturation: float | None = None, memory_limit: Any = None):
        import dask
        import distributed

        self.module = distributed
        self.cluster: Any = None
        self.client: Any = None
        self.workers = []
        self._config = contextlib.ExitStack()
        if saturation is not None:
            # read by the scheduler, which LocalCluster runs in this process
            self._config.enter_context(dask.config.set({"distributed.scheduler.worker-saturation": saturation}))
        try:
            # in-process, dask talks over inproc://, whose addresses are not host:port:
            # host="127.0.0.1" makes its scheduler fail to start ("not enough values to
            # unpack" in inproc.validate_address), so it is passed with processes only
            host: dict[str, Any] = {"host": "127.0.0.1"} if processes else {}
            if memory_limit is not None:
                host["memory_limit"] = memory_limit
            self.cluster = distributed.LocalCluster(
                n_workers=2, threads_per_worker=1, processes=processes, dashboard_address=None, **host
            )
            self.client = distributed.Client(self.cluster)
            info = self.client.scheduler_info()["workers"]
            self.workers = [a for a, _ in sorted(info.items(), key=lambda kv: str(kv[1].get("name")))]
        except BaseException:
            self.close()
            raise

    def extra_info(self) -> dict[str, Any]:
        sat = self.client.run_on_scheduler(
            lambda dask_scheduler: str(dask_scheduler.WORKER_SATURATION)
        )
        return {"dask_worker_saturation": sat}

    def close(self) -> None:
        try:
            if self.client is not None:
                self.client.close()
        finally:
            try:
                if self.cluster is not None:
                    self.cluster.close()
            finally:
                self._config.close()


def import_ray() -> tuple[Any, str]:
    """Import ray with its environment set first; returns ``(ray, temporary HOME)``."""
    if "ray" in sys.modules:
        raise RuntimeError("ray was imported before its environment was set")
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    home = tempfile.mkdtemp(prefix="bench-ray-home-")
    os.environ["HOME"] = home  # ray writes an auth token under ~/.ray
    import ray

    return ray, home


class RaySession(Session):
    """Ray: plain tasks for the unpinned workloads; two actors for the pinned ones."""

    system = "ray"

    def __init__(self, ray: Any = None, home: str = "") -> None:
        if ray is None:
            ray, home = import_ray()
        self.ray, self.home = ray, home
        self.actors: list[Any] = []
        self.workers = []
        self._remote: dict[Any, Any] = {}
        try:
            ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1")
            ip = ray.util.get_node_ip_address()
            if ip != "127.0.0.1":
                raise RuntimeError(f"ray runs on {ip!r}, not 127.0.0.1 (loopback only)")
        except BaseException:
            self.close()
            raise

    def remote(self, fn: Any) -> Any:
        r = self._remote.get(fn)
        if r is None:
            r = self._remote[fn] = self.ray.remote(fn)
        return r

    def start_actors(self) -> None:
        """Two actors of num_cpus=1: "worker 0" and "worker 1"."""
        cls = self.ray.remote(num_cpus=1)(Peer)
        self.actors = [cls.remote(), cls.remote()]
        pids = self.ray.get([a.pid.remote() for a in self.actors])
        if len(set(pids)) != 2:
            raise RuntimeError(f"the two actors share a process: {pids}")
        self.workers = ["actor-0", "actor-1"]

    def submit(self, fn: Any, *args: Any, worker: str | None = None, pure: bool = True) -> Any:
        if worker is None:
            return self.remote(fn).remote(*args)
        actor = self.actors[self.workers.index(worker)]
        method = {make_array: actor.produce, consume: actor.consume, hold_gil: actor.hold_gil}[fn]
        return method.remote(*args)

    def map(self, fn: Any, *iterables: Any) -> Any:
        r = self.remote(fn)
        return [r.remote(*args) for args in zip(*iterables)]

    def result(self, handle: Any) -> Any:
        return self.ray.get(handle)

    def gather(self, handles: Any) -> Any:
        return self.ray.get(handles)

    def wait(self, handle: Any) -> None:
        self.ray.wait([handle], fetch_local=False)

    def release(self, handles: Any) -> None:
        pass  # refs are released when dropped

    def close(self) -> None:
        try:
            for a in self.actors:
                with contextlib.suppress(Exception):  # already gone: ray.shutdown() follows
                    self.ray.kill(a)
            self.actors = []
        finally:
            try:
                self.ray.shutdown()
            finally:
                if self.home:
                    shutil.rmtree(self.home, ignore_errors=True)


def open_session(system: str, processes: bool = True, **kwargs: Any) -> Session:
    if system in ("shoal", "shoal-tls"):
        return ShoalSession(processes=processes, tls=system == "shoal-tls", **kwargs)
    if system == "dask":
        return DaskSession(processes=processes, **kwargs)
    if system == "ray":
        if not processes:
            raise ValueError("ray has no in-process mode")
        return RaySession()
    raise ValueError(system)


def _register(workload: Workload, systems: tuple[str, ...], fn: Any) -> None:
    for system in systems:
        workload.system(system)(_bind(fn, system))


def _bind(fn: Any, system: str) -> Any:
    def run(**params: Any) -> dict[str, Any]:
        return fn(system, **params)

    run.__name__ = f"{fn.__name__}_{system}"
    return run


def _warm_up(s: Session) -> None:
    """Untimed: a few tasks so both workers have imported this module and the functions."""
    if s.result(s.submit(inc, -1)) != 0:
        raise AssertionError("inc(-1) != 0")
    s.gather(s.map(inc, range(-20, 0)))


# ------------------------------------------------------------------------------- startup

startup = Workload(
    "startup",
    "Seconds from creating the cluster (2 worker processes x 1 thread; ray: ray.init with "
    "num_cpus=2) and its client to the result of one trivial task (inc(1)) in hand. "
    "`import`: importing what a user imports beforehand (shoal/distributed: Client and "
    "LocalCluster; ray: ray), not included; `shutdown`: closing "
    "client and cluster (ray.shutdown) afterwards.",
    metrics={"startup": "s", "import": "s", "shutdown": "s"},
    params={},
    timeout=300,
)


def _startup(system: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    ray, home = None, ""
    t = _perf()
    # the names a user imports (shoal loads its client and cluster layers on first use)
    if system in ("shoal", "shoal-tls"):
        import shoal

        shoal.Client, shoal.LocalCluster  # noqa: B018
    elif system == "dask":
        import distributed

        distributed.Client, distributed.LocalCluster  # noqa: B018
    else:
        ray, home = import_ray()
    out["import"] = _perf() - t
    t0 = _perf()
    if system == "ray":
        s: Session = RaySession(ray, home)
    else:
        s = open_session(system)
    try:
        if s.result(s.submit(inc, 1)) != 2:
            raise AssertionError("inc(1) != 2")
        out["startup"] = _perf() - t0
    finally:
        t1 = _perf()
        s.close()
        out["shutdown"] = _perf() - t1
    return out


_register(startup, TLS_SYSTEMS, _startup)

# ---------------------------------------------------------------------------- tiny_tasks

_QUEUING_NOTE = (
    "dask runs with its default configuration: root-task queuing "
    "(distributed.scheduler.worker-saturation: 1.1) caps its tiny-task rate at ~450/s on "
    "this machine; `throughput_dask_saturation_inf` repeats the dask measurement in the "
    "same child on a new cluster with worker-saturation: inf (an extra, not the default)."
)

tiny_tasks = Workload(
    "tiny_tasks",
    "n (10,000) independent inc(i) tasks: map, then gather; tasks/s from the map call to "
    "all results in hand (after an untimed warm-up of 21 tasks). 2 worker processes x 1 "
    "thread. shoal and dask: client.map + client.gather; ray: [inc.remote(i) ...] + "
    "ray.get. " + _QUEUING_NOTE,
    metrics={"throughput": "tasks/s", "throughput_dask_saturation_inf": "tasks/s"},
    params={"n": 10_000, "dask_saturation_inf": True},
    quick={"n": 200},
    timeout=600,
)

tiny_tasks_inprocess = Workload(
    "tiny_tasks_inprocess",
    "tiny_tasks on in-process clusters: shoal LocalCluster(processes=False), dask "
    "LocalCluster(processes=False) (without host=, which dask's inproc:// addresses "
    "reject); 2 workers x 1 thread, all threads of the measuring "
    "process (ray has no in-process mode). " + _QUEUING_NOTE,
    metrics={"throughput": "tasks/s", "throughput_dask_saturation_inf": "tasks/s"},
    params={"n": 10_000, "dask_saturation_inf": True},
    quick={"n": 200},
    timeout=600,
)


def _tiny_once(s: Session, n: int) -> float:
    _warm_up(s)
    t0 = _perf()
    futures = s.map(inc, range(n))
    values = s.gather(futures)
    dt = _perf() - t0
    if len(values) != n or values[0] != 1 or values[-1] != n:
        raise AssertionError("wrong results")
    s.release(futures)
    return n / dt


def _tiny(system: str, n: int, dask_saturation_inf: bool, processes: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with open_session(system, processes=processes) as s:
        out["throughput"] = _tiny_once(s, n)
        if system == "dask":
            out.update(s.extra_info())
    if system == "dask" and dask_saturation_inf:
        with open_session(system, processes=processes, saturation=float("inf")) as s:
            out["throughput_dask_saturation_inf"] = _tiny_once(s, n)
    return out


def _tiny_inprocess(system: str, n: int, dask_saturation_inf: bool) -> dict[str, Any]:
    return _tiny(system, n, dask_saturation_inf, processes=False)


_register(tiny_tasks, TLS_SYSTEMS, _tiny)
_register(tiny_tasks_inprocess, ("shoal", "dask"), _tiny_inprocess)

# ------------------------------------------------------------------------------- latency

latency = Workload(
    "latency",
    "Median microseconds of n (500) sequential round trips: submit a no-op (a new key "
    "each time), wait for its result in hand, after `warmup` untimed round trips. "
    "p90 also reported. 2 worker processes x 1 thread; ray: noop.remote(i) + ray.get.",
    metrics={"latency": "us", "latency_p90": "us"},
    params={"n": 500, "warmup": 20},
    quick={"n": 20, "warmup": 2},
    timeout=300,
)


def _latency(system: str, n: int, warmup: int) -> dict[str, Any]:
    with open_session(system) as s:
        _warm_up(s)
        for i in range(warmup):
            s.result(s.submit(noop, -1 - i))
        samples = []
        for i in range(n):
            t0 = _perf()
            s.result(s.submit(noop, i))
            samples.append(_perf() - t0)
    samples.sort()
    return {"latency": statistics.median(samples) * 1e6, "latency_p90": samples[int(0.9 * (len(samples) - 1))] * 1e6}


_register(latency, TLS_SYSTEMS, _latency)

# --------------------------------------------------------------------------- tree_reduce

tree_reduce = Workload(
    "tree_reduce",
    "Binary-tree sum: `leaves` (4,096) inc(i) leaf tasks, then add(a, b) level by level "
    "down to one root (8,191 dependent tasks), all submitted up front; tasks/s from the "
    "first submission to the root's result in hand. shoal and dask: client.map(inc, ...) "
    "then client.map(add, level[0::2], level[1::2]) per level (futures as arguments); "
    "ray: inc.remote / add.remote(ref, ref). " + _QUEUING_NOTE,
    metrics={"throughput": "tasks/s", "throughput_dask_saturation_inf": "tasks/s"},
    params={"leaves": 4096, "dask_saturation_inf": True},
    quick={"leaves": 64},
    timeout=600,
)


def _tree_once(s: Session, leaves: int) -> float:
    _warm_up(s)
    t0 = _perf()
    level = s.map(inc, range(leaves))
    tasks = len(level)
    held = [level]
    while len(level) > 1:
        level = s.map(add, level[0::2], level[1::2])
        tasks += len(level)
        held.append(level)
    total = s.result(level[0])
    dt = _perf() - t0
    if total != leaves * (leaves + 1) // 2:
        raise AssertionError(f"tree sum {total} != {leaves * (leaves + 1) // 2}")
    for lv in held:
        s.release(lv)
    return tasks / dt


def _tree(system: str, leaves: int, dask_saturation_inf: bool) -> dict[str, Any]:
    if leaves & (leaves - 1):
        raise ValueError("leaves must be a power of two")
    out: dict[str, Any] = {"tasks": str(2 * leaves - 1)}
    with open_session(system) as s:
        out["throughput"] = _tree_once(s, leaves)
    if system == "dask" and dask_saturation_inf:
        with open_session(system, saturation=float("inf")) as s:
            out["throughput_dask_saturation_inf"] = _tree_once(s, leaves)
    return out


_register(tree_reduce, TLS_SYSTEMS, _tree)

# ------------------------------------------------------------------------------ transfer


def memcpy_gbps(nbytes: int, reps: int = 3) -> float:
    """Plain memcpy bandwidth: np.copyto into an already-touched buffer (median)."""
    import numpy as np

    src = np.full(nbytes // 8, 1.0)
    dst = np.full(nbytes // 8, 0.0)
    np.copyto(dst, src)
    times = []
    for _ in range(reps):
        t0 = _perf()
        np.copyto(dst, src)
        times.append(_perf() - t0)
    del src, dst
    return nbytes / statistics.median(times) / 1e9


def alloc_fill_s(nbytes: int, reps: int = 3) -> float:
    """Seconds to create a new filled array of ``nbytes`` here (fresh pages): the floor
    of any producer step."""
    times = []
    for _ in range(reps):
        t0 = _perf()
        a = make_array(nbytes)
        times.append(_perf() - t0)
        del a
    return statistics.median(times)


def _transfer_workload(mb: int, iters: int) -> Workload:
    return Workload(
        f"transfer_{mb}MB",
        f"A task pinned to worker 0 creates a {mb} MB float64 array (np.full); a task "
        "pinned to worker 1 takes it and returns arr[0]. `consumer`: GB/s of that second "
        "step (array size / seconds from its submission to arr[0] in hand). `producer`: "
        "seconds of the first step (submission to done, the value left on its worker; "
        "any cost of putting it into shared memory or an object store shows here), against "
        "`ref_alloc_fill`: seconds to create the same array in the measuring process. "
        "`memcpy`: np.copyto of the same size into an already-touched buffer, in the same "
        "child (the limit of any copy). `consumer_vs_memcpy` = consumer / memcpy. Info "
        "`consumer_writeable`: whether the consumer's input array was writeable. Median "
        f"of `iters` ({iters}) rounds per child, each with a new array. Pinning: "
        "workers=[address] (shoal, dask); ray: two actors (num_cpus=1), the producer "
        "actor returns the array, the consumer actor receives the ref (a read-only "
        "zero-copy view of the object store).",
        metrics={"consumer": "GB/s", "producer": "s", "ref_alloc_fill": "s", "memcpy": "GB/s",
                 "consumer_vs_memcpy": "x"},
        params={"mb": mb, "iters": iters},
        quick={"mb": 4, "iters": 1},
        timeout=600,
    )


transfer_64MB = _transfer_workload(64, 5)
transfer_512MB = _transfer_workload(512, 3)


def _transfer(system: str, mb: int, iters: int) -> dict[str, Any]:
    nbytes = mb << 20
    out: dict[str, Any] = {"memcpy": memcpy_gbps(nbytes), "ref_alloc_fill": alloc_fill_s(nbytes)}
    consumer, producer, writeable = [], [], []
    with open_session(system) as s:
        if isinstance(s, RaySession):
            s.start_actors()
        else:
            _warm_up(s)
        w0, w1 = s.workers
        # untimed: a small round so both sides have the functions (and any pools) ready
        s.result(s.submit(consume, s.submit(make_array, 1 << 16, worker=w0, pure=False), worker=w1, pure=False))
        for _ in range(iters):
            t0 = _perf()
            arr = s.submit(make_array, nbytes, worker=w0, pure=False)
            s.wait(arr)
            t1 = _perf()
            first, w, size = s.result(s.submit(consume, arr, worker=w1, pure=False))
            t2 = _perf()
            if first != 1.0 or size != nbytes:
                raise AssertionError(f"consumer saw arr[0]={first}, nbytes={size}")
            producer.append(t1 - t0)
            consumer.append(nbytes / (t2 - t1) / 1e9)
            writeable.append(w)
            del arr  # release the value before the next round
        out.update(s.extra_info())
    out["producer"] = statistics.median(producer)
    out["consumer"] = statistics.median(consumer)
    out["consumer_vs_memcpy"] = out["consumer"] / out["memcpy"]
    out["consumer_writeable"] = "yes" if all(writeable) else ("no" if not any(writeable) else f"mixed {writeable}")
    out["rounds_consumer_GBps"] = [round(x, 3) for x in consumer]
    out["rounds_producer_s"] = [round(x, 4) for x in producer]
    return out


_register(transfer_64MB, TLS_SYSTEMS, _transfer)
_register(transfer_512MB, TLS_SYSTEMS, _transfer)

# ---------------------------------------------------------------------------- busy_owner

busy_owner = Workload(
    "busy_owner",
    "Worker 0 holds a 16 MB array (made there by a pinned task), then runs a task that "
    "holds the GIL for ~`busy_s` (3) s in one C call (sum(range(N)), N calibrated in the "
    "measuring process); `delay` (0.2) s after that task has started (it signals its "
    "start through a file), a task pinned to worker 1 takes the array and returns arr[0]. "
    "`busy_owner`: seconds from that submission to its result in hand. `idle_owner`: the "
    "same with another 16 MB array of worker 0 while worker 0 is idle (reference). "
    "`busy_task`: how long the GIL-holding call actually ran on worker 0; `busy_left`: "
    "how much of it remained when the consumer was submitted. ray: actors as in transfer.",
    metrics={"busy_owner": "s", "idle_owner": "s", "busy_task": "s", "busy_left": "s"},
    params={"mb": 16, "busy_s": 3.0, "delay": 0.2},
    quick={"mb": 1, "busy_s": 0.3, "delay": 0.05},
    timeout=300,
)


def calibrate_gil_n(seconds: float) -> int:
    """N such that sum(range(N)) takes about ``seconds`` here (one C call)."""
    n = 1 << 20
    while True:
        t0 = _perf()
        sum(range(n))
        dt = _perf() - t0
        if dt > 0.05:
            break
        n *= 2
    dt = min(dt, *(_timed_sum(n) for _ in range(2)))
    return max(int(n * seconds / dt), 1)


def _timed_sum(n: int) -> float:
    t0 = _perf()
    sum(range(n))
    return _perf() - t0


def _busy_owner(system: str, mb: int, busy_s: float, delay: float) -> dict[str, Any]:
    nbytes = mb << 20
    n = calibrate_gil_n(busy_s)
    out: dict[str, Any] = {"gil_N": str(n)}
    tmp = tempfile.mkdtemp(prefix="bench-busy-")
    try:
        with open_session(system) as s:
            if isinstance(s, RaySession):
                s.start_actors()
            else:
                _warm_up(s)
            w0, w1 = s.workers
            s.result(s.submit(consume, s.submit(make_array, 1 << 16, worker=w0, pure=False), worker=w1, pure=False))
            held = s.submit(make_array, nbytes, worker=w0, pure=False)
            other = s.submit(make_array, nbytes, worker=w0, pure=False)
            s.wait(held)
            s.wait(other)
            t0 = _perf()
            s.result(s.submit(consume, other, worker=w1, pure=False))
            out["idle_owner"] = _perf() - t0

            path = os.path.join(tmp, "started")
            busy = s.submit(hold_gil, n, path, worker=w0, pure=False)
            deadline = _perf() + 60
            while not os.path.exists(path):
                if _perf() > deadline:
                    raise TimeoutError("the GIL-holding task did not start within 60 s")
                time.sleep(0.001)
            with open(path) as f:
                started = float(f.read())
            time.sleep(max(0.0, started + delay - time.time()))
            submitted = time.time()
            t0 = _perf()
            first, _, _ = s.result(s.submit(consume, held, worker=w1, pure=False))
            out["busy_owner"] = _perf() - t0
            if first != 1.0:
                raise AssertionError(f"consumer saw arr[0]={first}")
            start, duration = s.result(busy)
            out["busy_task"] = duration
            out["busy_left"] = start + duration - submitted
            out.update(s.extra_info())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


_register(busy_owner, TLS_SYSTEMS, _busy_owner)
