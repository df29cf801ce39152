"""The scheduler without IO: its state machine driven by virtual workers.

    python bench/sim.py                                  # the issue's grid, shoal and dask
    python bench/sim.py --graphs tree,chain --workers 10,1000 --tasks 100000
    python bench/sim.py --quick                          # small sizes (what the tests run)
    python bench/sim.py --memory                         # also bytes per task after submit
    python bench/sim.py --gc python                      # Python's collector thresholds for both

Both systems' scheduler states are driven the same way: one graph is submitted to a
cluster of virtual workers (1 thread each), then every task the scheduler sends to a
worker "finishes" at once, in the order it was sent, as one event handled on its own.
Nothing runs, nothing is sent: what is measured is the CPU time spent inside the state
machine (``time.process_time`` around each call into it), per task. Each finished task
reports ``nbytes`` bytes; the locality share is the fraction of the input bytes of the
tasks that ran on a worker which did not hold them when the task was sent there.

The dask side (``bench/sim_dask.py``) drives ``distributed.scheduler.SchedulerState`` the
way its scheduler does; its default root-task queuing is on.

Each run is a process of its own, with the cyclic collector's thresholds its system's
scheduler process sets (``--gc server``, the default: shoal's :mod:`shoal.gcpolicy`,
the tripled thresholds of ``dask scheduler``), or Python's own (``--gc python``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import tracemalloc
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.append(_ROOT)

__all__ = ["Graph", "Result", "GRAPHS", "make_graph", "run_shoal", "SYSTEMS", "main"]


# ------------------------------------------------------------------------- the graphs


@dataclass
class Graph:
    """Tasks in an order where dependencies come first: ``keys[i]`` depends on the
    tasks ``deps[i]`` (indices). The last ``wanted`` tasks are what the client holds."""

    name: str
    keys: list[str]
    deps: list[list[int]]
    wanted: list[int]
    #: what each task asks of its worker: "" nothing, "pinned" ``workers=`` one worker
    #: (task i the worker i modulo their number), "gpu" a resource every worker offers
    constraint: str = ""

    @property
    def edges(self) -> int:
        return sum(len(d) for d in self.deps)


def independent(n: int) -> Graph:
    return Graph("independent", [f"inc-{i}" for i in range(n)], [[] for _ in range(n)], list(range(n)))


def chain(n: int) -> Graph:
    return Graph("chain", [f"link-{i}" for i in range(n)], [[]] + [[i - 1] for i in range(1, n)], [n - 1])


def tree(n: int) -> Graph:
    """A binary reduction with about ``n`` tasks: n/2 leaves, then sums of pairs, in
    the depth-first order a reduction is run in (each sum right after its inputs, as
    ``dask.order`` ranks it, and as shoal's client submits it)."""
    leaves = max(2, (n + 1) // 2)
    keys: list[str] = []
    deps: list[list[int]] = []

    def build(lo: int, hi: int) -> int:  # the depth is log2(leaves)
        if hi - lo == 1:
            keys.append(f"leaf-{lo}")
            deps.append([])
        else:
            mid = (lo + hi + 1) // 2
            pair = [build(lo, mid), build(mid, hi)]
            keys.append(f"sum-{lo}-{hi}")
            deps.append(pair)
        return len(keys) - 1

    root = build(0, leaves)
    return Graph("tree", keys, deps, [root])


def shuffle(n: int) -> Graph:
    """All to all: ``k`` inputs and ``k`` outputs, each output reads every input
    (k = sqrt of ``n`` edges, at least 2)."""
    k = max(2, int(round(n ** 0.5)))
    keys = [f"split-{i}" for i in range(k)] + [f"join-{i}" for i in range(k)]
    deps: list[list[int]] = [[] for _ in range(k)] + [list(range(k)) for _ in range(k)]
    return Graph("shuffle", keys, deps, list(range(k, 2 * k)))


def pinned(n: int) -> Graph:
    """Independent tasks, each restricted to one worker (``workers=``), round robin."""
    return Graph("pinned", [f"pin-{i}" for i in range(n)], [[] for _ in range(n)], list(range(n)), "pinned")


def gpu(n: int) -> Graph:
    """Independent tasks that each ask for one GPU, which every worker offers once."""
    return Graph("gpu", [f"gpu-{i}" for i in range(n)], [[] for _ in range(n)], list(range(n)), "gpu")


GRAPHS: dict[str, Callable[[int], Graph]] = {
    "independent": independent, "tree": tree, "chain": chain, "shuffle": shuffle, "pinned": pinned, "gpu": gpu,
}


def make_graph(name: str, size: int) -> Graph:
    """``size`` is the number of tasks, except for ``shuffle``, where it is the number
    of edges (k = sqrt(size))."""
    return GRAPHS[name](size)


# ------------------------------------------------------------------------ the results


@dataclass
class Result:
    system: str
    graph: str
    workers: int
    tasks: int
    edges: int
    #: CPU seconds inside the state machine: the submit, and everything after it
    submit_s: float = 0.0
    run_s: float = 0.0
    #: events handled (the submit and one per finished task)
    events: int = 0
    #: input bytes of tasks that were not on their worker when it was sent there, and all input bytes
    moved_bytes: int = 0
    input_bytes: int = 0
    #: bytes allocated by the submit (the state with its workers, the graph's keys and
    #: payloads) and still held after it, per task (with --memory; in a run of its own)
    bytes_per_task: float | None = None
    validations: int = 0
    error: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def us_per_task(self) -> float:
        return 1e6 * (self.submit_s + self.run_s) / max(self.tasks, 1)

    @property
    def tasks_per_s(self) -> float:
        return self.tasks / max(self.submit_s + self.run_s, 1e-9)

    @property
    def moved_share(self) -> float:
        return self.moved_bytes / self.input_bytes if self.input_bytes else 0.0

    def row(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(us_per_task=self.us_per_task, tasks_per_s=self.tasks_per_s, moved_share=self.moved_share)
        return d


# --------------------------------------------------------------------------- shoal


def run_shoal(graph: Graph, n_workers: int, nbytes: int = 100_000, duration: float = 0.001,
              validate_every: int = 0, memory: bool = False) -> Result:
    """Drive shoal's ``SchedulerState`` through ``graph`` on ``n_workers`` virtual
    workers (see the module docstring). With ``validate_every``, ``validate()`` runs
    after that many events (and at the end)."""
    from shoal.scheduler.events import AddWorkerEvent, ComputeTask, NewTask, TaskFinishedEvent, UpdateGraphEvent
    from shoal.scheduler.state import SchedulerState

    res = Result("shoal", graph.name, n_workers, len(graph.keys), graph.edges)
    workers = [f"tcp://10.{i // 65536}.{i // 256 % 256}.{i % 256}:9000" for i in range(n_workers)]

    def submit() -> tuple[SchedulerState, list[Any], float]:
        state = SchedulerState()
        offers = {"GPU": 1.0} if graph.constraint == "gpu" else {}
        state.handle(*(AddWorkerEvent(f"add-{i}", a, 1, resources=offers) for i, a in enumerate(workers)))
        keys = [k.encode().decode() for k in graph.keys]  # new strings: counted with --memory
        pinned = graph.constraint == "pinned"
        needs = {"GPU": 1.0} if graph.constraint == "gpu" else None
        tasks = [NewTask(k, b"payload", [keys[d] for d in deps], [workers[i % n_workers]] if pinned else None,
                         resources=needs) for i, (k, deps) in enumerate(zip(keys, graph.deps))]
        event = UpdateGraphEvent("graph", "client", tasks, [keys[i] for i in graph.wanted])
        del tasks, keys
        t0 = time.process_time()
        out = state.handle(event)
        return state, out, time.process_time() - t0

    if memory:
        res.bytes_per_task = _retained_per_task(submit, len(graph.keys))
    state, out, res.submit_s = submit()
    res.events = 1
    running: deque[ComputeTask] = deque()

    def collect(instructions: list[Any]) -> None:
        for ins in instructions:
            if type(ins) is ComputeTask:
                running.append(ins)
                for dep, holders in ins.who_has.items():
                    n = ins.nbytes.get(dep, 0)
                    res.input_bytes += n
                    if ins.worker not in holders:
                        res.moved_bytes += n

    collect(out)

    def finish(ins: ComputeTask, n: int) -> list[Any]:
        return state.handle(TaskFinishedEvent(f"done-{n}", ins.worker, ins.key, nbytes, duration))

    finish_all(res, running, finish, collect, state.validate, validate_every)
    counts = state.task_counts()
    res.extra["left"] = counts
    return res


def finish_all(res: Result, running: deque[Any], finish: Callable[[Any, int], Any], collect: Callable[[Any], None],
               validate: Callable[[], Any], validate_every: int) -> None:
    """Finish the tasks sent, oldest first, one event each: ``finish(task, n)`` (the
    only part timed, into ``res.run_s``) hands the n-th to the state, ``collect(out)``
    takes what it returned (the tasks it sends join ``running``); ``validate()`` runs
    every ``validate_every`` tasks and at the end."""
    clock = time.process_time
    spent = 0.0
    done = 0
    while running:
        task = running.popleft()
        t0 = clock()
        out = finish(task, done)
        spent += clock() - t0
        done += 1
        collect(out)
        if validate_every and done % validate_every == 0:
            validate()
            res.validations += 1
    res.run_s = spent
    res.events += done
    if validate_every:
        validate()
        res.validations += 1
    if done != res.tasks:
        res.error = f"{done} of {res.tasks} tasks ran"


def _retained_per_task(submit: Callable[[], Any], n_tasks: int) -> float:
    """Bytes allocated by ``submit()`` (which builds a state, makes the graph's inputs
    and submits them) and still held once its inputs are dropped, per task; traced in
    a run of its own, since tracing slows everything down."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        kept = submit()[0]  # the state (not the instructions it returned)
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    del kept
    return (after - before) / n_tasks


def _run_dask(graph: Graph, n_workers: int, nbytes: int = 100_000, duration: float = 0.001,
              validate_every: int = 0, memory: bool = False) -> Result:
    from bench.sim_dask import run_dask

    return run_dask(graph, n_workers, nbytes=nbytes, duration=duration, validate_every=validate_every,
                    memory=memory)


SYSTEMS: dict[str, Callable[..., Result]] = {"shoal": run_shoal, "dask": _run_dask}


# ------------------------------------------------------------------------------- CLI


def _collector_as_deployed(system: str) -> None:
    """The cyclic collector's thresholds of ``system``'s scheduler process: shoal's
    server holds :mod:`shoal.gcpolicy` (the young generation after 10,000 allocations),
    ``dask scheduler`` triples Python's three thresholds."""
    if system == "shoal":
        from shoal import gcpolicy

        gcpolicy.hold()  # (this child process ends with the run)
    elif system == "dask":
        g0, g1, g2 = gc.get_threshold()
        gc.set_threshold(g0 * 3, g1 * 3, g2 * 3)


def _one(system: str, graph: str, size: int, workers: int, memory: bool, validate_every: int,
         collector: str = "server") -> dict[str, Any]:
    """One run in this process (``--child``); ``collector`` "server" sets the collector
    as the system's scheduler process does, "python" leaves Python's defaults."""
    if collector == "server":
        _collector_as_deployed(system)
    g = make_graph(graph, size)
    try:
        res = SYSTEMS[system](g, workers, validate_every=validate_every, memory=memory)
    except Exception as exc:  # noqa: BLE001 - reported in the table
        res = Result(system, graph, workers, len(g.keys), g.edges, error=f"{type(exc).__name__}: {exc}")
    res.extra["collector"] = collector
    return res.row()


def _in_child(args: list[str], timeout: float) -> dict[str, Any]:
    import subprocess

    cmd = [sys.executable, os.path.abspath(__file__), "--child", *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=_ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f}s"}
    for line in proc.stdout.splitlines():
        if line.startswith("@@SIM@@ "):
            return json.loads(line[8:])
    return {"error": f"exit {proc.returncode}: {proc.stderr[-2000:]}"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default="shoal,dask")
    p.add_argument("--graphs", default="independent,tree,chain,shuffle",
                   help=f"comma-separated, of {', '.join(GRAPHS)}")
    p.add_argument("--workers", default="10,100,1000")
    p.add_argument("--tasks", default="10000,100000", help="tasks per graph (shuffle: edges)")
    p.add_argument("--quick", action="store_true",
                   help="400 tasks, 3 and 20 workers (unless --workers), validate() every 50 events")
    p.add_argument("--memory", action="store_true", help="measure bytes per task after submit (tracemalloc)")
    p.add_argument("--validate-every", type=int, default=0)
    p.add_argument("--gc", choices=("server", "python"), default="server",
                   help="the cyclic collector's thresholds: as each system's scheduler process sets them "
                        "(default), or Python's own")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--json", default="")
    p.add_argument("--child", nargs=7, metavar=("SYSTEM", "GRAPH", "SIZE", "WORKERS", "MEMORY", "VALIDATE", "GC"),
                   help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        system, graph, size, workers, mem, val, collector = a.child
        row = _one(system, graph, int(size), int(workers), mem == "1", int(val), collector)
        print("@@SIM@@ " + json.dumps(row), flush=True)
        return 0
    if a.quick:
        a.workers, a.tasks, a.validate_every = a.workers if a.workers != "10,100,1000" else "3,20", "400", 50
    rows = []
    print(f"{'graph':12} {'tasks':>8} {'workers':>7} {'system':6} {'us/task':>9} {'tasks/s':>10} "
          f"{'moved':>6} {'B/task':>7}")
    for graph in a.graphs.split(","):
        for size in map(int, a.tasks.split(",")):
            for workers in map(int, a.workers.split(",")):
                for system in a.systems.split(","):
                    row = _in_child([system, graph, str(size), str(workers), "1" if a.memory else "0",
                                     str(a.validate_every), a.gc], a.timeout)
                    row.setdefault("system", system)
                    row.update(graph_arg=graph, size_arg=size, workers_arg=workers)
                    rows.append(row)
                    if row.get("error"):
                        print(f"{graph:12} {row.get('tasks', size):>8} {workers:>7} {system:6} "
                              f"ERROR {row['error'][:200]}")
                        continue
                    bpt = row.get("bytes_per_task")
                    print(f"{graph:12} {row['tasks']:>8} {workers:>7} {system:6} {row['us_per_task']:>9.1f} "
                          f"{row['tasks_per_s']:>10,.0f} {row['moved_share']:>6.2f} "
                          f"{'' if bpt is None else f'{bpt:,.0f}':>7}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "argv": sys.argv[1:]}, f, indent=1)
    return 1 if any(r.get("error") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
