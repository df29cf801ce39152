"""Adaptive scaling's policy: pure functions of the scheduler's state (no IO, no
clock), used by :class:`shoal.deploy.adaptive.Adaptive` on a scheduler in the cluster's
process and by the scheduler's ``adaptive-plan`` op for a cluster whose scheduler runs
elsewhere (an SSHCluster's). The theory of operation is in :mod:`shoal.deploy.adaptive`.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import Any

from .model import WorkerState
from .state import SchedulerState

__all__ = ["desired_workers", "retirable", "retirement_order", "plan", "UNKNOWN_TASK_DURATION"]

#: seconds a task is expected to take while no task's duration is known
UNKNOWN_TASK_DURATION = 0.5


def desired_workers(state: SchedulerState, threads_per_worker: int, target_duration: float) -> int:
    """How many workers of ``threads_per_worker`` threads the runnable tasks of
    ``state`` ask for, to be done in about ``target_duration`` seconds (0: none
    runnable)."""
    ready = len(state.queued) + sum(len(ws.processing) for ws in state.workers.values())
    if ready == 0:
        return 0
    duration = state.average_duration if state.average_duration > 0 else UNKNOWN_TASK_DURATION
    threads = min(ready, max(1, math.ceil(ready * duration / target_duration)))
    return math.ceil(threads / threads_per_worker)


def _unique(ws: WorkerState, going: Collection[WorkerState] = ()) -> list[Any]:
    """The values someone needs (a client, a waiting task) that no worker but ``ws``
    and those ``going`` holds."""
    return [ts for ts in ws.has_what
            if (ts.who_wants or ts.waiters) and not any(o is not ws and o not in going for o in ts.who_has)]


def retirable(ws: WorkerState, going: Collection[WorkerState] = ()) -> bool:
    """Whether ``ws`` may be retired, with the workers ``going`` (retired at the same
    time), without losing anything: it runs nothing, and every value someone needs that
    it holds has a holder that stays."""
    return not ws.processing and not _unique(ws, going)


def retirement_order(state: SchedulerState, addresses: Mapping[str, str]) -> list[str]:
    """The names of ``addresses`` (name -> worker address, ``""`` while starting),
    in the order they are best retired (see the module); the newest (last in
    ``addresses``) first among equals."""

    def cost(item: tuple[int, str]) -> tuple[Any, ...]:
        order, name = item
        ws = state.workers.get(addresses[name])
        if ws is None:
            return (0, 0, 0, 0, -order)  # not joined yet: nothing there
        unique = sum(max(ts.nbytes, 0) for ts in _unique(ws))
        return (1, len(ws.processing), unique, len(ws.has_what), -order)

    return [name for _, name in sorted(enumerate(addresses), key=cost)]


def plan(state: SchedulerState, addresses: Mapping[str, str], threads_per_worker: int,
         target_duration: float) -> tuple[int, list[str]]:
    """``(desired, names)``: the workers the load asks for (:func:`desired_workers`),
    and the names of ``addresses`` (name -> worker address, ``""`` while starting) that
    may be retired, best first (:func:`retirement_order`), each one retirable together
    with those before it: retiring the first ``k`` of them, for any ``k``, loses
    nothing."""
    desired = desired_workers(state, threads_per_worker, target_duration)
    names: list[str] = []
    going: list[WorkerState] = []
    for name in retirement_order(state, addresses):
        ws = state.workers.get(addresses[name])
        if ws is not None and retirable(ws, going):
            names.append(name)
            going.append(ws)
    return desired, names
