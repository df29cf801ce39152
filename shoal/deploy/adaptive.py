"""Adaptive scaling: ``cluster.adapt(minimum=, maximum=)`` adds workers while tasks wait
for threads and retires idle ones whose data is safe.

Theory of operation
-------------------
The policy is three pure functions of the scheduler's state (no IO, no clock: the
tests call them on a state they built):

- :func:`desired_workers`: the runnable tasks (queued on the scheduler, or processing
  on a worker: sent there, running or waiting for a thread) times the average task
  duration (0.5 s while none is known, as dask) is the work at hand; spread over
  ``target_duration`` seconds it asks for that many threads (never more than there are
  tasks, at least one while there is any), hence workers.
- :func:`retirable`: a worker may go when it runs nothing and every value it holds has
  another holder or is needed by nobody (no client wants it, no task waits for it).
  Values are not moved: a worker holding the only copy of a needed value stays.
- :func:`retirement_order`: the order ``cluster.scale(n)`` retires in: workers still
  starting, then idle ones holding nothing, then those whose values are elsewhere, then
  the fewest bytes that exist nowhere else (the scheduler computes those again; a
  scattered one is lost), and the newest first among equals.

:class:`Adaptive` runs the policy every ``interval`` seconds on the cluster's event
loop. It scales up at once to what the load asks for (within ``minimum`` and
``maximum``); it retires a worker only after ``wait_count`` checks in a row found it
retirable and not needed, so a pause between two bursts does not cost workers.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from typing import Any, Protocol

from ..scheduler.adaptive import desired_workers, retirable, retirement_order

__all__ = ["Adaptive", "desired_workers", "retirable", "retirement_order", "parse_seconds"]

logger = logging.getLogger("shoal.deploy")

_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


def parse_seconds(value: float | str, what: str) -> float:
    """``1``, ``0.5``, ``"1s"``, ``"100ms"``, ``"2 minutes"``... -> seconds (dask's time
    strings). Raises ``ValueError`` for anything else, or a value not > 0."""
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[-+]?[0-9]+)?)\s*([a-z]*)\s*", value.lower())
        unit = m.group(2) if m else ""
        unit = {"seconds": "s", "second": "s", "sec": "s", "minutes": "m", "minute": "m", "hours": "h",
                "hour": "h", "milliseconds": "ms"}.get(unit, unit or "s")
        if m is None or unit not in _UNITS:
            raise ValueError(f"{what}: {value!r} is not a duration (e.g. 1, 0.5, '1s', '100ms')")
        seconds = float(m.group(1)) * _UNITS[unit]
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise TypeError(f"{what}: a duration is a number of seconds or a string like '1s', got {type(value).__name__}")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{what} must be a positive, finite duration, got {value!r}")
    return seconds


class Adaptable(Protocol):
    """What :class:`Adaptive` asks of a cluster."""

    status: str

    def _addresses(self) -> dict[str, str]:
        """``{worker name: address}``, ``""`` for those not joined (yet)."""

    async def _adaptive_plan(self, addresses: dict[str, str], target_duration: float) -> tuple[int, list[str]] | None:
        """:func:`~shoal.scheduler.adaptive.plan` on the scheduler's state, or None."""

    async def _scale(self, n: int) -> None: ...

    async def _retire_safely(self, names: list[str]) -> list[str]: ...


class Adaptive:
    """Keeps ``cluster``'s workers between ``minimum`` and ``maximum``, as many as the
    load asks for (see the module); returned by ``cluster.adapt()``. ``stop()`` ends
    it (the workers stay as they are)."""

    def __init__(self, cluster: Adaptable, minimum: int = 0, maximum: float = math.inf,
                 interval: float | str = "1s", wait_count: int = 3, target_duration: float | str = "5s"):
        if not isinstance(minimum, int) or minimum < 0:
            raise ValueError(f"minimum must be an integer >= 0, got {minimum!r}")
        if not (isinstance(maximum, int) or maximum == math.inf) or maximum < minimum:
            raise ValueError(f"maximum must be an integer >= minimum ({minimum}), or math.inf; got {maximum!r}")
        if not isinstance(wait_count, int) or wait_count < 1:
            raise ValueError(f"wait_count must be an integer >= 1, got {wait_count!r}")
        self.cluster = cluster
        self.minimum = minimum
        self.maximum = maximum
        self.interval = parse_seconds(interval, "interval")
        self.wait_count = wait_count
        self.target_duration = parse_seconds(target_duration, "target_duration")
        #: how many checks in a row found each worker (by name) retirable and not needed
        self.close_counts: dict[str, int] = {}
        self._task: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped = False

    def start(self, loop: asyncio.AbstractEventLoop) -> Adaptive:
        """Run on ``loop`` (the cluster's), from any thread; returns self."""
        self._loop = loop

        def begin() -> None:
            if self._task is None and not self._stopped:
                self._task = asyncio.ensure_future(self._run())

        _call_on(loop, begin)
        return self

    def stop(self) -> None:
        """Stop adapting (from any thread); the workers stay as they are."""
        self._stopped = True
        loop = self._loop
        if loop is not None and not loop.is_closed():
            _call_on(loop, self._cancel)

    def _cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()

    @property
    def running(self) -> bool:
        return not self._stopped and self._loop is not None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)  # a period, not a wait for a condition
            try:
                await self.adapt()
            except asyncio.CancelledError:
                raise
            except Exception:
                # a bug, or workers that would not start: try again at the next check
                logger.exception("adaptive scaling of %r failed", self.cluster)

    async def adapt(self) -> None:
        """One check: scale up to what the load asks for (within ``minimum`` and
        ``maximum``), or retire workers that were retirable and not needed
        ``wait_count`` checks in a row. The cluster's ``_adaptive_plan`` reads the
        scheduler's state (:func:`~shoal.scheduler.adaptive.plan`), in this process or
        through the scheduler's ``adaptive-plan`` op."""
        cluster = self.cluster
        if cluster.status != "running":
            return
        addresses = cluster._addresses()
        planned = await cluster._adaptive_plan(addresses, self.target_duration)
        if planned is None:
            return  # no scheduler to ask (yet)
        desired, retirable_names = planned
        target = int(max(self.minimum, min(self.maximum, desired)))
        have = len(addresses)
        if target >= have:
            self.close_counts.clear()
            if target > have:
                await cluster._scale(target)
            return
        candidates = retirable_names[: have - target]
        self.close_counts = {name: self.close_counts.get(name, 0) + 1 for name in candidates}
        ready = [name for name, n in self.close_counts.items() if n >= self.wait_count]
        if ready:
            for name in ready:
                del self.close_counts[name]
            await cluster._retire_safely(ready)

    def __repr__(self) -> str:
        return (f"<Adaptive minimum={self.minimum} maximum={self.maximum} interval={self.interval:g}s "
                f"{'running' if self.running else 'stopped'}>")


def _call_on(loop: asyncio.AbstractEventLoop, fn: Any) -> None:
    """Call ``fn()`` on ``loop``: now when this is its thread, else soon."""
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        fn()
    else:
        loop.call_soon_threadsafe(fn)
