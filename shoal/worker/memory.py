"""A worker's memory limit: how it is given, what the host has, and the thresholds.

A limit is given as bytes (``4_000_000_000``), a size (``"4GiB"``, ``"500 MB"``), a
fraction of the host's memory (``0.5``), ``"auto"`` (the host's memory, or its
cgroup's limit where that is lower, divided among the workers of the host), or
``0``/``None``/``"0"`` for none. :func:`parse_memory_limit` turns each into bytes or
``None``.

The thresholds are fractions of the limit (settings ``memory-target``,
``memory-spill``, ``memory-pause``, ``memory-terminate``; 0 turns one off), with
dask.distributed's defaults: values beyond the *target* (by their sizes) move to disk;
past *spill* of the process's memory the worker spills until it is below the target
again; past *pause* it starts no task and no fetch; past *terminate* its nanny
restarts it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from .. import config

__all__ = ["parse_bytes", "parse_memory_limit", "system_memory", "Thresholds", "format_bytes"]

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "p": 10**15, "pb": 10**15,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """The bytes ``text`` says: ``"4GiB"``, ``"500 MB"``, ``"1e9"``, ``"100"``.
    Raises ``ValueError`` for anything else (a negative size, an unknown unit)."""
    m = _SIZE.match(text)
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (say e.g. '4GiB', '500MB' or a number of bytes)")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not math.isfinite(value):
        raise ValueError(f"not a size: {text!r}")
    return int(value)


def format_bytes(n: float) -> str:
    """``n`` bytes for people: ``"1.50 GiB"``."""
    for unit, size in (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("kiB", 2**10)):
        if abs(n) >= 0.9 * size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _cgroup_limit() -> int | None:
    """The memory limit of this process's cgroup (v2, then v1), if it has one."""
    candidates = ["/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"]
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                parts = line.strip().split(":", 2)
                if len(parts) == 3 and parts[2] not in ("", "/"):
                    if parts[0] == "0":
                        candidates.insert(0, f"/sys/fs/cgroup{parts[2]}/memory.max")
                    elif "memory" in parts[1].split(","):
                        candidates.insert(0, f"/sys/fs/cgroup/memory{parts[2]}/memory.limit_in_bytes")
    except OSError:
        pass
    for path in candidates:
        try:
            with open(path) as f:
                raw = f.read().strip()
        except OSError:
            continue
        if raw.isdigit():
            return int(raw)
        # "max": no limit at this level
    return None


def system_memory() -> int:
    """The memory this host gives this process: its RAM, or its cgroup's limit where
    that is lower."""
    import psutil

    total = int(psutil.virtual_memory().total)
    limit = _cgroup_limit()
    return min(total, limit) if limit else total


def parse_memory_limit(limit: Any, n_workers: int = 1) -> int | None:
    """``limit`` in bytes, or ``None`` for no limit (``0``, ``None``, ``"0"``,
    ``"none"``). ``"auto"`` is :func:`system_memory` divided by ``n_workers`` (the
    workers started together on this host); a float in (0, 1] is that fraction of
    :func:`system_memory`. A limit above the host's memory is capped to it. Raises
    ``TypeError`` for a value of another type and ``ValueError`` for a negative or
    malformed one."""
    if n_workers < 1:
        raise ValueError(f"n_workers must be at least 1, got {n_workers}")
    if limit is None or limit is False:
        return None
    if isinstance(limit, bool) or not isinstance(limit, (int, float, str)):
        raise TypeError(f"memory_limit must be bytes, a size such as '4GiB', a fraction, 'auto' or 0, "
                        f"not {type(limit).__name__}")
    if isinstance(limit, str):
        text = limit.strip().lower()
        if text in ("0", "none", ""):
            return None
        if text == "auto":
            return max(1, system_memory() // n_workers)
        try:
            number = float(text)
        except ValueError:
            limit = parse_bytes(text)
        else:
            if not math.isfinite(number):
                raise ValueError(f"memory_limit must be a finite size, got {limit!r}")
            limit = number if "." in text or "e" in text else int(number)
    if isinstance(limit, float):
        if not math.isfinite(limit) or limit < 0:
            raise ValueError(f"memory_limit must be a size of at least 0, got {limit!r}")
        if limit == 0:
            return None
        if limit <= 1:
            return max(1, int(limit * system_memory()))
        limit = int(limit)
    if limit < 0:
        raise ValueError(f"memory_limit must be a size of at least 0, got {limit!r}")
    if limit == 0:
        return None
    return min(limit, system_memory())


@dataclass(frozen=True)
class Thresholds:
    """The memory thresholds of a worker with ``limit`` bytes, as bytes (``None``:
    that rule is off). Read from the settings when made with :meth:`from_config`."""

    limit: int
    target: int | None
    spill: int | None
    pause: int | None
    terminate: int | None

    @classmethod
    def from_config(cls, limit: int) -> Thresholds:
        def part(name: str) -> int | None:
            fraction = float(config.get(name))
            return int(fraction * limit) if fraction > 0 else None

        return cls(limit, part("memory-target"), part("memory-spill"), part("memory-pause"),
                   part("memory-terminate"))

