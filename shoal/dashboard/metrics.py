"""``/metrics``: the scheduler's figures in Prometheus' text format.

A custom collector reads :meth:`~shoal.scheduler.diagnostics.Diagnostics.counters` at
each scrape (nothing is kept up to date in between), on a registry of its own: a
process may run several schedulers (tests do), and prometheus_client's global registry
would mix them up. Series are named ``shoal_*``; see docs/dashboard.md for the list.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..scheduler.diagnostics import PATHS, Diagnostics
from ..scheduler.model import STATES

__all__ = ["MAX_PREFIXES", "MEMORY_KINDS", "Metrics"]

#: memory figures of a worker, as ``kind`` labels
MEMORY_KINDS = ("managed", "shm", "spilled", "unmanaged", "process")
#: prefixes shown by shoal_prefix_tasks at most (the largest): each is a label value,
#: and a graph of many thousand prefixes would make each scrape a megabyte
MAX_PREFIXES = 500
#: the per-prefix states shown (those of the progress view)
PREFIX_STATES = ("waiting", "processing", "memory", "erred")


class _Collector(Collector):
    def __init__(self, diagnostics: Diagnostics) -> None:
        self.diagnostics = diagnostics

    def collect(self) -> Iterator[Metric]:
        c = self.diagnostics.counters()
        summary = c["summary"]
        yield GaugeMetricFamily("shoal_workers", "Workers connected to the scheduler", value=summary["workers"])
        yield GaugeMetricFamily("shoal_threads", "Threads of all workers", value=summary["threads"])

        tasks = GaugeMetricFamily("shoal_tasks", "Tasks the scheduler knows, by state", labels=["state"])
        counts = c["tasks"]
        for state in STATES:
            if state != "forgotten":
                tasks.add_metric([state], counts.get(state, 0))
        yield tasks

        by_prefix = GaugeMetricFamily("shoal_prefix_tasks", "Tasks the scheduler knows, by key prefix and state "
                                      f"(the {MAX_PREFIXES} largest prefixes)", labels=["prefix", "state"])
        prefixes = c["progress"]
        for p in sorted(prefixes, key=lambda p: -p["total"])[:MAX_PREFIXES]:
            for kind in PREFIX_STATES:
                by_prefix.add_metric([p["prefix"], kind], p[kind])
        yield by_prefix

        yield CounterMetricFamily("shoal_tasks_done", "Tasks that reached memory (each counted once)",
                                  value=c["done"])

        memory = GaugeMetricFamily("shoal_worker_memory_bytes", "Memory of each worker, by kind",
                                   labels=["worker", "kind"])
        cpu = GaugeMetricFamily("shoal_worker_cpu_percent", "CPU use of each worker's process (percent of one core)",
                                labels=["worker"])
        for w in c["workers"]:
            for kind in MEMORY_KINDS:
                memory.add_metric([w["address"], kind], w["memory"][kind])
            cpu.add_metric([w["address"]], w["cpu"])
        yield memory
        yield cpu

        moved = CounterMetricFamily("shoal_transfer_bytes", "Bytes moved into workers, by path "
                                    "(inproc: by reference, shm: shared memory, tcp)", labels=["path"])
        transfers = c["transfers"]
        for path in PATHS:
            moved.add_metric([path], transfers[path])
        yield moved

        yield CounterMetricFamily("shoal_task_stream_records", "Task-stream records made (tasks that ran)",
                                  value=c["task_stream_total"])


class Metrics:
    """The Prometheus exposition of one scheduler's ``diagnostics``."""

    def __init__(self, diagnostics: Diagnostics) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_Collector(diagnostics))

    def text(self) -> bytes:
        """The series now, in the text format (``CONTENT_TYPE_LATEST``)."""
        return generate_latest(self.registry)
