"""shoal: a distributed task scheduler where the cost of moving a value matches the
distance it travels (by reference in one process, shared memory on one host, TCP
across hosts)."""

from __future__ import annotations

from .errors import (
    AuthenticationError,
    CommBrokenError,
    CommClosedError,
    CommConnectError,
    CommError,
    DeserializationError,
    HandshakeError,
    ProtocolError,
    RemoteError,
    SerializationError,
    ShoalError,
)
from .protocol import (
    Serialize,
    Serialized,
    deserialize,
    dumps_function,
    loads_function,
    register_serializer,
    serialize,
    to_serialize,
)

from typing import TYPE_CHECKING, Any

from .errors import CancelledError, GraphError, InvalidKeyError, KilledWorker, LostDataError

if TYPE_CHECKING:
    from .client import Client, Future, as_completed, wait
    from .comm.security import Security
    from .deploy import LocalCluster

# the client and cluster layers load on first use: a worker process never needs them
_LAZY = {
    "Client": "shoal.client",
    "Future": "shoal.client",
    "as_completed": "shoal.client",
    "wait": "shoal.client",
    "LocalCluster": "shoal.deploy",
    "Security": "shoal.comm.security",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'shoal' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "Client",
    "Future",
    "LocalCluster",
    "as_completed",
    "wait",
    "CancelledError",
    "GraphError",
    "InvalidKeyError",
    "KilledWorker",
    "LostDataError",
    "CommBrokenError",
    "CommClosedError",
    "CommConnectError",
    "CommError",
    "DeserializationError",
    "HandshakeError",
    "AuthenticationError",
    "ProtocolError",
    "RemoteError",
    "SerializationError",
    "ShoalError",
    "Serialize",
    "Serialized",
    "deserialize",
    "dumps_function",
    "loads_function",
    "register_serializer",
    "serialize",
    "to_serialize",
    "Security",
]
