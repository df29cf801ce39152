"""Leases: a sender keeps a side-channel resource alive until the receiver has it.

A serializer family that moves data through a side channel (a shared-memory segment, a
device memory handle) calls :func:`lease` inside its ``dumps``, with a function that
frees the resource. The transport keeps the lease with the comm that sent the message
and ends it exactly once, at the first of: the receiver acknowledges that it has
deserialized the value, the connection closes or breaks, or the lease's timeout passes.
A receiver that forwards values without deserializing them does not acknowledge them.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Lease", "lease", "collecting", "active"]

logger = logging.getLogger("shoal.protocol.leases")

_ids = itertools.count(1)
_local = threading.local()

#: seconds a lease lasts when its family names no timeout
DEFAULT_TIMEOUT = 60.0


class Lease:
    """One resource a sent message depends on; :meth:`end` frees it, once."""

    __slots__ = ("id", "_release", "timeout", "_lock", "ended", "reason")

    def __init__(self, release: Callable[[], Any], timeout: float | None):
        self.id = next(_ids)
        self._release: Callable[[], Any] | None = release
        self.timeout = DEFAULT_TIMEOUT if timeout is None else timeout
        self._lock = threading.Lock()
        self.ended = False
        self.reason = ""

    def end(self, reason: str) -> bool:
        """Free the resource (``reason``: acknowledged, closed, timeout, failed); returns
        whether this call did it. Later calls do nothing."""
        with self._lock:
            release, self._release = self._release, None
            if release is None:
                return False
            self.ended = True
            self.reason = reason
        try:
            release()
        except Exception:
            logger.exception("releasing lease %d (%s) failed", self.id, reason)
        return True

    def __repr__(self) -> str:
        return f"<Lease {self.id} {'ended: ' + self.reason if self.ended else 'held'}>"


def lease(release: Callable[[], Any], timeout: float | None = None) -> int:
    """Inside a family's ``dumps``: hold a resource until the receiver has the value.

    Returns the lease id (the family may put it in its header). Raises ``RuntimeError``
    outside of a transport's serialization, where nobody could end the lease.
    """
    sink = getattr(_local, "sink", None)
    if sink is None:
        raise RuntimeError("lease() is only valid inside a serializer family's dumps() called by a transport")
    item = Lease(release, timeout)
    sink.append(item)
    return item.id


def active() -> bool:
    """Whether a transport is serializing right now (so :func:`lease` may be called)."""
    return getattr(_local, "sink", None) is not None


class collecting:
    """Context manager: leases taken inside go to the given list."""

    __slots__ = ("sink", "_outer")

    def __init__(self, sink: list[Lease] | None):
        self.sink = sink
        self._outer: Any = None

    def __enter__(self) -> list[Lease] | None:
        self._outer = getattr(_local, "sink", None)
        _local.sink = self.sink
        return self.sink

    def __exit__(self, *exc: Any) -> None:
        _local.sink = self._outer
