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
    CorruptedDataError,
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

from .errors import CancelledError, GraphError, InvalidKeyError, KilledWorker, LostDataError, RunOnceError

if TYPE_CHECKING:
    from .client import Client, Future, as_completed, wait
    from .client.progress import progress
    from .client.diagnostics import get_task_stream, performance_report
    from .foreign_tasks import foreign
    from .client.coordination import Event, Lock, Pub, Queue, Semaphore, Sub, Variable
    from .client.default import default_client, get_client
    from .client.future import fire_and_forget
    from .client.structure import futures_of
    from .comm.security import Security
    from .deploy import DeployError, LocalCluster, SlurmCluster, SSHCluster
    from .worker.context import get_worker, rejoin, secede, worker_client
    from .worker.plugin import WorkerPlugin
    from .scheduler.plugin import SchedulerPlugin
    from .client.actor import Actor, ActorFuture, BaseActorFuture

# the client and cluster layers load on first use: a worker process never needs them
_LAZY = {
    "Client": "shoal.client",
    "Future": "shoal.client",
    "as_completed": "shoal.client",
    "wait": "shoal.client",
    "progress": "shoal.client.progress",
    "get_task_stream": "shoal.client.diagnostics",
    "performance_report": "shoal.client.diagnostics",
    "foreign": "shoal.foreign_tasks",
    "Variable": "shoal.client.coordination",
    "Queue": "shoal.client.coordination",
    "Lock": "shoal.client.coordination",
    "Event": "shoal.client.coordination",
    "Semaphore": "shoal.client.coordination",
    "Pub": "shoal.client.coordination",
    "Sub": "shoal.client.coordination",
    "get_client": "shoal.client.default",
    "default_client": "shoal.client.default",
    "fire_and_forget": "shoal.client.future",
    "futures_of": "shoal.client.structure",
    "LocalCluster": "shoal.deploy",
    "SSHCluster": "shoal.deploy",
    "SlurmCluster": "shoal.deploy",
    "DeployError": "shoal.deploy",
    "Security": "shoal.comm.security",
    "get_worker": "shoal.worker.context",
    "secede": "shoal.worker.context",
    "rejoin": "shoal.worker.context",
    "worker_client": "shoal.worker.context",
    "WorkerPlugin": "shoal.worker.plugin",
    "SchedulerPlugin": "shoal.scheduler.plugin",
    "Actor": "shoal.client.actor",
    "ActorFuture": "shoal.client.actor",
    "BaseActorFuture": "shoal.client.actor",
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
    "SSHCluster",
    "SlurmCluster",
    "DeployError",
    "as_completed",
    "wait",
    "progress",
    "get_task_stream",
    "performance_report",
    "foreign",
    "Variable",
    "Queue",
    "Lock",
    "Event",
    "Semaphore",
    "Pub",
    "Sub",
    "get_client",
    "default_client",
    "fire_and_forget",
    "futures_of",
    "get_worker",
    "secede",
    "rejoin",
    "worker_client",
    "WorkerPlugin",
    "SchedulerPlugin",
    "Actor",
    "ActorFuture",
    "BaseActorFuture",
    "CancelledError",
    "GraphError",
    "InvalidKeyError",
    "KilledWorker",
    "LostDataError",
    "RunOnceError",
    "CommBrokenError",
    "CommClosedError",
    "CommConnectError",
    "CommError",
    "DeserializationError",
    "CorruptedDataError",
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
