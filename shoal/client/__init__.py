"""The client: :class:`Client`, :class:`Future`, :func:`wait`, :func:`as_completed`."""

from .client import Client
from .future import Future, as_completed, wait

__all__ = ["Client", "Future", "as_completed", "wait"]
