"""The layers import downwards only, and the public API is what it says."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import shoal

# each layer with the layers it may import (besides itself, errors, config and _loop)
LAYERS = {
    "shoal.protocol": set(),
    "shoal.comm": {"shoal.protocol"},
    "shoal.rpc": {"shoal.protocol", "shoal.comm"},
    "shoal.taskspec": {"shoal.protocol"},
    # payloads for workers of other languages, beside the Python ones
    "shoal.foreign_tasks": {"shoal.protocol", "shoal.taskspec"},
    "shoal.scheduler.server": {"shoal.protocol", "shoal.comm", "shoal.rpc", "shoal.scheduler"},
    "shoal.worker.server": {"shoal.protocol", "shoal.comm", "shoal.rpc", "shoal.taskspec", "shoal.worker"},
    # the client stands on the servers: actor refs and task context (worker), plugins (scheduler)
    "shoal.client": {"shoal.protocol", "shoal.comm", "shoal.rpc", "shoal.taskspec", "shoal.foreign_tasks",
                     "shoal.scheduler", "shoal.worker"},
    # served by the scheduler (which imports it only when it starts one); .server: the
    # package itself imports nothing
    "shoal.dashboard.server": {"shoal.protocol", "shoal.comm", "shoal.rpc", "shoal.scheduler"},
}
ALWAYS = {"shoal", "shoal.errors", "shoal.config", "shoal._loop", "shoal.testing", "shoal.statelog", "shoal.gcpolicy"}


def _layer_of(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_a_layer_imports_no_higher_layer(layer):
    code = f"import sys, json, {layer}; print(json.dumps(sorted(m for m in sys.modules if m.startswith('shoal'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    loaded = {_layer_of(m) for m in json.loads(out.stdout)}
    allowed = LAYERS[layer] | ALWAYS | {_layer_of(layer)}
    assert loaded <= allowed, f"{layer} pulls in {sorted(loaded - allowed)}"


def test_state_machines_do_no_io():
    for module in ("shoal.scheduler.state", "shoal.worker.state"):
        code = f"import sys, {module}; print('asyncio' in sys.modules, 'socket' in sys.modules)"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
        # shoal/__init__ loads the protocol layer (no asyncio); the state machine adds none
        assert out.stdout.split()[0] == "False", f"{module} imports asyncio"


def test_public_api_is_pinned():
    assert sorted(shoal.__all__) == sorted([
        "__version__", "Client", "Future", "LocalCluster", "SSHCluster", "SlurmCluster", "DeployError",
        "as_completed", "wait",
        "CancelledError", "GraphError", "InvalidKeyError", "KilledWorker", "LostDataError", "RunOnceError",
        "CommBrokenError", "CommClosedError", "CommConnectError", "CommError",
        "DeserializationError", "CorruptedDataError", "HandshakeError", "ProtocolError", "RemoteError",
        "SerializationError", "ShoalError",
        "Serialize", "Serialized", "deserialize", "dumps_function", "loads_function",
        "register_serializer", "serialize", "to_serialize",
        "Security", "AuthenticationError",
        # the dask.distributed names (issue 12)
        "progress", "get_client", "default_client", "fire_and_forget", "futures_of",
        "get_worker", "secede", "rejoin", "worker_client",
        "Variable", "Queue", "Lock", "Event", "Semaphore", "Pub", "Sub",
        "WorkerPlugin", "SchedulerPlugin", "Actor", "ActorFuture", "BaseActorFuture",
        # diagnostics (issue 14)
        "get_task_stream", "performance_report", "foreign",
    ])
    for name in shoal.__all__:
        assert getattr(shoal, name) is not None


def test_a_dask_users_first_cell_imports():
    """The imports of dask.distributed's docs and example notebooks, from shoal."""
    from shoal import (  # noqa: F401
        Actor, CancelledError, Client, Event, Future, KilledWorker, LocalCluster, Lock, Pub, Queue,
        SchedulerPlugin, Semaphore, Sub, Variable, WorkerPlugin, as_completed, default_client,
        fire_and_forget, futures_of, get_client, get_worker, progress, rejoin, secede, wait, worker_client,
    )
    import concurrent.futures

    assert issubclass(CancelledError, concurrent.futures.CancelledError)
    assert issubclass(shoal.SerializationError, TypeError)
