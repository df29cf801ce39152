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

__all__ = ["dashboard"]

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
    params={"n": 10_000, "latency_n": 300, "rounds": 3},
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
                        page.goto(link)
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
