"""Which workers went silent: the scheduler's liveness rule (no IO, no clock).

Theory of operation
-------------------
Every batch of messages a worker sends is a sign of life: the server turns it into a
:class:`~.events.HeartbeatEvent` carrying the time it arrived (a worker with nothing
else to say sends a ``heartbeat`` op every ``heartbeat-interval`` seconds). Every
``min(worker_ttl / 4, 1)`` seconds the server sends a
:class:`~.events.CheckLivenessEvent` with the time now; all times are on the server's
monotonic clock, which this module never reads.

A worker is removed at a check that finds it silent for longer than ``worker_ttl`` if
the check before found so too; any message in between clears the mark. One check alone
removes nobody because a scheduler whose own event loop was stalled may run its check
before it has read the messages that queued up during the stall: the second check
comes after them.
"""

from __future__ import annotations

from collections.abc import Iterable

from .model import WorkerState

__all__ = ["note_seen", "expired"]


def note_seen(ws: WorkerState, now: float) -> None:
    """Record that ``ws`` sent something at ``now``."""
    if ws.last_seen is None or now > ws.last_seen:
        ws.last_seen = now
    ws.overdue = False


def expired(workers: Iterable[WorkerState], now: float, ttl: float) -> list[tuple[WorkerState, float]]:
    """Apply a check at ``now``: return the workers to remove, each with the seconds it
    was silent, and mark those found silent for the first time. ``ttl <= 0`` disables
    the rule (nothing is returned or marked)."""
    if ttl <= 0:
        return []
    out: list[tuple[WorkerState, float]] = []
    for ws in workers:
        if ws.last_seen is None:
            ws.last_seen = now  # registered without a time: its silence starts now
            continue
        silent = now - ws.last_seen
        if silent <= ttl:
            ws.overdue = False
        elif ws.overdue:
            out.append((ws, silent))
        else:
            ws.overdue = True
    return out
