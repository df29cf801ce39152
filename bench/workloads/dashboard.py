"""What the dashboard costs: tiny tasks and round trips with the dashboard off, and
with its status page open in a browser (headless Chromium, Debian's, driven by
Playwright), which keeps a live connection to the scheduler and redraws as tasks run.

- ``dashboard``: one child runs, alternately and ``rounds`` times each, a cluster
  without a dashboard and a cluster with one whose /status page is open in Chromium;
  in each, ``n`` tiny tasks (map + gather, tasks/s) and ``latency_n`` sequential round
  trips (median microseconds). The ratios (``*_browser_vs_off``) come from the same
  child, so they see the same machine. Chromium runs on the same 2 cores: what a user
  with the page open on the cluster's host would see.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from ..registry import Workload
from .cluster import ShoalSession, _tiny_once, _warm_up, noop

__all__ = ["dashboard", "dashboard_scale"]

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]

dashboard = Workload(
    "dashboard",
    "shoal only: tiny_tasks (n inc tasks, map + gather) and latency (latency_n sequential "
    "no-op round trips, median) on 2 worker processes x 1 thread, with no dashboard and "
    "with the dashboard's /status page open in headless Chromium (same child, "
    "alternating, `rounds` times each).",
    metrics={"throughput_off": "tasks/s", "throughput_browser": "tasks/s",
             "latency_off": "us", "latency_browser": "us",
             "throughput_browser_vs_off": "x", "latency_browser_vs_off": "x ref"},
    # 40,000 tasks (8-10 s a round): with 10,000 one drawing pass is a large part of the window
    params={"n": 40_000, "latency_n": 300, "rounds": 3},
    quick={"n": 200, "latency_n": 20, "rounds": 1},
    timeout=900,
)


def _latency_once(s: Any, n: int) -> float:
    samples = []
    for i in range(n):
        t0 = time.perf_counter()
        s.result(s.submit(noop, i))
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def _measure(s: Any, n: int, latency_n: int) -> tuple[float, float]:
    _warm_up(s)
    return _tiny_once(s, n), _latency_once(s, latency_n)


@dashboard.system("shoal")
def _dashboard(n: int, latency_n: int, rounds: int) -> dict[str, Any]:
    from playwright.sync_api import sync_playwright

    off: list[tuple[float, float]] = []
    on: list[tuple[float, float]] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            for _ in range(rounds):
                with ShoalSession() as s:
                    off.append(_measure(s, n, latency_n))
                with ShoalSession(dashboard_address="127.0.0.1:0") as s:
                    link = s.cluster.dashboard_link
                    if not link:
                        raise RuntimeError("the cluster has no dashboard (is shoal[dashboard] installed?)")
                    page = browser.new_page()
                    try:
                        page.goto(link)  # (its token logs the page in, which then goes on to /status)
                        page.wait_for_url("**/status", timeout=60_000)
                        # open and settled: its charts made and its first updates drawn
                        page.wait_for_function("() => window.shoalDashboard && window.shoalDashboard.updates() >= 2",
                                               timeout=60_000)
                        on.append(_measure(s, n, latency_n))
                    finally:
                        page.close()
        finally:
            browser.close()
    t_off = statistics.median(t for t, _ in off)
    t_on = statistics.median(t for t, _ in on)
    l_off = statistics.median(latency for _, latency in off)
    l_on = statistics.median(latency for _, latency in on)
    return {"throughput_off": t_off, "throughput_browser": t_on, "latency_off": l_off, "latency_browser": l_on,
            "throughput_browser_vs_off": t_on / t_off, "latency_browser_vs_off": l_on / l_off}


dashboard_scale = Workload(
    "dashboard_scale",
    "shoal only, the state machine alone (no IO): `workers` virtual workers and `tasks` "
    "tasks known (in 20 prefixes, chains of 10), a full task-stream ring; milliseconds of "
    "the scheduler's loop each view of the dashboard takes (its JSON included), the "
    "longest pause of a search through every key, and a full garbage collection.",
    metrics={"build": "s", "summary": "ms", "workers_view": "ms", "progress": "ms", "graph": "ms",
             "task_stream_1000": "ms", "search_total": "ms", "search_longest_slice": "ms",
             "task_page": "ms", "full_gc": "ms"},
    params={"workers": 1000, "tasks": 1_000_000},
    quick={"workers": 50, "tasks": 20_000},
    timeout=900,
)


def _best_ms(f: Any, *args: Any) -> float:
    from shoal.dashboard.server import _encode

    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        _encode(f(*args))
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


@dashboard_scale.system("shoal")
def _dashboard_scale(workers: int, tasks: int) -> dict[str, Any]:
    import gc
    import itertools

    from shoal.scheduler.diagnostics import Diagnostics
    from shoal.scheduler.state import AddWorkerEvent, NewTask, SchedulerState, TaskFinishedEvent, UpdateGraphEvent

    t0 = time.perf_counter()
    state = SchedulerState()
    ids = (f"bench-{i}" for i in itertools.count())
    state.handle(*[AddWorkerEvent(next(ids), f"tcp://10.0.{i // 250}.{i % 250}:9000", 2) for i in range(workers)])
    clock = itertools.count()
    d = Diagnostics(state, lambda: "tcp://scheduler:1", lambda: 1e9 + next(clock) * 1e-4)
    paths = {"inproc": 1, "shm": 2, "tcp": 3}
    for w in state.workers:
        d.worker_figures(w, 50.0, paths, paths)
    batch = 100_000
    for lo in range(0, tasks, batch):
        new = [NewTask(f"p{(i * 20) // tasks}-{i}", b"x", [f"p{(i * 20) // tasks}-{i - 1}"] if i % 10 and i > lo else [],
                       None, 0) for i in range(lo, min(tasks, lo + batch))]
        state.handle(UpdateGraphEvent(next(ids), "client", new, [t.key for t in new]))
    for ws in list(state.workers.values()):
        for ts in list(ws.processing):
            state.handle(TaskFinishedEvent(next(ids), ws.address, ts.key, 8))
    while len(d.stream) < d.stream.maxlen:  # a full ring, each record with one input moved
        d.task_ran("tcp://10.0.0.1:9000", "p0-1", [1.0, 1.001, 1], [["p0-0", "tcp://10.0.0.2:9000", 100, "tcp", 1.0, 1.0005]], True)
    build = time.perf_counter() - t0
    out: dict[str, Any] = {"build": build, "summary": _best_ms(d.summary), "workers_view": _best_ms(d.workers),
                           "progress": _best_ms(d.progress), "graph": _best_ms(d.graph),
                           "task_stream_1000": _best_ms(d.task_stream, d.next_index - 1000, 1000),
                           "task_page": _best_ms(d.task, f"p1-{tasks // 20 + 5}")}
    steps = d.search_steps("no such key", 20)
    longest = total = 0.0
    while True:
        t = time.perf_counter()
        try:
            next(steps)
        except StopIteration:
            break
        finally:
            dt = time.perf_counter() - t
            longest, total = max(longest, dt), total + dt
    out["search_total"], out["search_longest_slice"] = total * 1e3, longest * 1e3
    gc.collect()
    t = time.perf_counter()
    gc.collect()
    out["full_gc"] = (time.perf_counter() - t) * 1e3
    out["known"] = f"{len(state.tasks)} tasks, {len(state.workers)} workers, {len(d.stream)} records"
    return out
