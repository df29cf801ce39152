"""Transports: ``Comm``, ``Listener``, ``connect()``, ``listen()`` and the scheme registry.

Importing this package registers the built-in ``inproc://``, ``tcp://`` and ``tls://`` backends and
the ``shoal.same-host`` serializer family.
"""

from . import inproc, shm_family, tcp, tls  # noqa: F401  (registers the backends and the same-host family)
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
