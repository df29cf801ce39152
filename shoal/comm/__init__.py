"""Transports: ``Comm``, ``Listener``, ``connect()``, ``listen()`` and the scheme registry.

Importing this package registers the built-in ``inproc://`` and ``tcp://`` backends.
"""

from . import inproc, tcp  # noqa: F401  (registers the backends)
from .core import (
    Backend,
    Comm,
    Listener,
    connect,
    get_backend,
    listen,
    local_info,
    parse_address,
    register_backend,
)

__all__ = [
    "Backend",
    "Comm",
    "Listener",
    "connect",
    "get_backend",
    "listen",
    "local_info",
    "parse_address",
    "register_backend",
]
