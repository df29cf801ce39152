"""How often CPython's cyclic garbage collector runs while shoal serves in a process.

The collector starts a young-generation pass every 700 allocations (Python's default
``gc.get_threshold()[0]``), and every tenth pass of the middle generation becomes a
pass over every tracked object of the process. A scheduler or a worker allocates a
few dozen objects per task, and the state of the tasks in flight lives long: the full
passes then cost about a third of the event loop's time on tiny tasks (measured with
``perf``: ``gc_collect_main`` and its visitors), while they find almost nothing to
free, since shoal's objects die by reference counting.

While a scheduler or a worker runs in this process (:func:`hold`, one call per
server), the young generation's threshold is at least the ``gc-threshold`` setting
(10,000 allocations; ``SHOAL_GC_THRESHOLD=0`` leaves the collector as it is): the
older generations' thresholds stay, so each kind of pass comes ~14 times less often.
When the last of them closes (:func:`release`) the thresholds go back to what they
were, unless someone changed them meanwhile (then theirs stay).

A block that makes objects by the thousand and keeps them all (a big graph, in the
client or the scheduler) runs with the collector off (:class:`collector_off`).
"""

from __future__ import annotations

import gc
import threading

from . import config

__all__ = ["hold", "release", "holders", "collector_off"]

_lock = threading.Lock()
_holders = 0
#: the thresholds before the first hold, and those it set (None: it changed nothing)
_saved: tuple[int, int, int] | None = None
_ours: tuple[int, int, int] | None = None


def hold() -> None:
    """A server starts in this process: the first raises the young generation's
    threshold to the ``gc-threshold`` setting (never lowers it)."""
    global _holders, _saved, _ours
    with _lock:
        _holders += 1
        if _holders > 1:
            return
        wanted = int(config.get("gc-threshold"))
        before = gc.get_threshold()
        if wanted <= 0 or before[0] == 0 or before[0] >= wanted:
            return  # off, the collector's automatic passes are off, or already rarer
        gc.set_threshold(wanted, *before[1:])
        _saved, _ours = before, gc.get_threshold()


def release() -> None:
    """A server closed: the last one puts the thresholds back (if they are still the
    ones :func:`hold` set)."""
    global _holders, _saved, _ours
    with _lock:
        if _holders == 0:
            return
        _holders -= 1
        if _holders or _saved is None:
            return
        if gc.get_threshold() == _ours:
            gc.set_threshold(*_saved)
        _saved = _ours = None


def holders() -> int:
    """How many servers of this process hold the policy now."""
    return _holders


class collector_off:
    """The cyclic collector off for a block that makes objects by the thousand and
    keeps them all (a graph's tasks, as the client converts them or the scheduler
    takes them in): its passes would free nothing.

    When the block ends, what it made is still in the youngest generation: the next
    young and middle passes would each walk all of it (1.0 and 1.7 s for a dask graph
    of 444,450 tasks) only to promote it. It goes to the oldest generation at once
    instead (freezing moves every tracked object to the permanent generation, and
    unfreezing moves them all on to the oldest), where a full pass still collects any
    cycle among them."""

    def __enter__(self) -> None:
        self.was = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc: object) -> None:
        if self.was:
            gc.freeze()
            gc.unfreeze()
            gc.enable()
