"""The workload registry.

A :class:`Workload` has a name, a description, the metrics it reports, default and
``--quick`` parameters, and one function per system::

    tiny_tasks = Workload(
        "tiny_tasks",
        "Throughput of 10,000 no-op tasks submitted at once",
        metrics={"throughput": "tasks/s"},
        params={"n": 10_000},
        quick={"n": 100},
    )

    @tiny_tasks.system("shoal")
    def _(n):
        ...                       # runs in a fresh child process
        return {"throughput": n / elapsed, "note": "anything non-numeric is info"}

    @tiny_tasks.system("dask")
    def _(n):
        ...

A system function receives the parameters as keyword arguments and returns a dict:
numbers under the declared metric names are measurements; strings (and other
non-numbers) are reported as info (e.g. which event loop was used). It runs in a fresh
interpreter started by ``bench/run.py`` (see ``bench/_child.py``), so it may import what
it likes and leave state behind. Anything that starts processes with ``spawn`` must be
importable: define process targets at module level in the workload's module.

Put a workload in any module under ``bench/workloads/``; modules there are imported
automatically.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Workload", "WORKLOADS", "UNITS", "load_all", "get"]

# unit -> True when a lower value is better
UNITS: dict[str, bool] = {
    "ns": True,
    "us": True,
    "ms": True,
    "s": True,
    "MB": True,
    "GB/s": False,
    "MB/s": False,
    "tasks/s": False,
    "calls/s": False,
    "x": False,  # a ratio where higher is better (e.g. shoal bandwidth / plain socket)
    "x ref": True,  # a ratio to a reference where lower is better (e.g. shoal time / asyncio streams time)
}

SystemFn = Callable[..., dict[str, Any]]

WORKLOADS: dict[str, Workload] = {}


@dataclass
class Workload:
    name: str
    description: str
    metrics: dict[str, str]  # metric name -> unit (a key of UNITS)
    params: dict[str, Any] = field(default_factory=dict)
    quick: dict[str, Any] = field(default_factory=dict)  # overrides of params for --quick
    timeout: float = 900.0  # seconds one child process may take
    systems: dict[str, SystemFn] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for metric, unit in self.metrics.items():
            if unit not in UNITS:
                raise ValueError(f"{self.name}.{metric}: unknown unit {unit!r}; add it to UNITS")
        if self.name in WORKLOADS:
            raise ValueError(f"workload {self.name!r} is registered twice")
        WORKLOADS[self.name] = self

    def system(self, name: str) -> Callable[[SystemFn], SystemFn]:
        """Decorator: ``fn`` measures this workload on system ``name``."""

        def register(fn: SystemFn) -> SystemFn:
            if name in self.systems:
                raise ValueError(f"{self.name}: system {name!r} is registered twice")
            self.systems[name] = fn
            return fn

        return register

    def resolve_params(self, quick: bool, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
        out = dict(self.params)
        if quick:
            out.update(self.quick)
        for key, value in (overrides or {}).items():
            if key not in out:
                raise KeyError(f"workload {self.name!r} has no parameter {key!r} (has {sorted(out)})")
            out[key] = value
        return out


def load_all() -> dict[str, Workload]:
    """Import every module of ``bench.workloads`` and return the registry."""
    from . import workloads

    for info in pkgutil.iter_modules(workloads.__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{workloads.__name__}.{info.name}")
    return WORKLOADS


def get(name: str) -> Workload:
    load_all()
    try:
        return WORKLOADS[name]
    except KeyError:
        raise KeyError(f"unknown workload {name!r}; known: {', '.join(sorted(WORKLOADS))}") from None
