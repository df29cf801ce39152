"""shoal: a distributed task scheduler where the cost of moving a value matches the
distance it travels (by reference in one process, shared memory on one host, TCP
across hosts)."""

from __future__ import annotations

from .errors import (
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

from .client import Client, Future, as_completed, wait
from .deploy import LocalCluster
from .errors import CancelledError, GraphError, KilledWorker, LostDataError

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
    "KilledWorker",
    "LostDataError",
    "CommBrokenError",
    "CommClosedError",
    "CommConnectError",
    "CommError",
    "DeserializationError",
    "HandshakeError",
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
]
