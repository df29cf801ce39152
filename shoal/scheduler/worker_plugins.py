"""The worker plugins a scheduler keeps for the workers that join later.

``client.register_plugin(WorkerPlugin())`` pickles the plugin; the scheduler keeps it
as it came (opaque: it never unpickles it), sends it to each worker that joins (the
first message on the worker's stream, so it is set up before any task arrives there),
and tells the client which workers are there now (the client sends it to them itself
and waits for their ``setup``). Registering and a worker joining are both handled on
the scheduler's loop, so each worker gets a plugin exactly once.
"""

from __future__ import annotations

from typing import Any

from ..rpc import BatchedSend

__all__ = ["WorkerPluginStore"]


class WorkerPluginStore:
    """Plugins by name, in the order they were registered (a name registered again
    replaces the plugin and goes last). ``workers()`` gives the addresses of the
    workers there now."""

    def __init__(self, workers: Any):
        self._workers = workers
        self.plugins: dict[str, Any] = {}

    def handlers(self) -> dict[str, Any]:
        """The scheduler's request handlers of this store."""
        return {"register-worker-plugin": self.register, "unregister-worker-plugin": self.unregister}

    def register(self, comm: Any, plugin: Any, name: str, idempotent: bool = False) -> dict[str, Any]:
        """Keep ``plugin`` under ``name`` (unless ``idempotent`` and one of that name is
        kept); returns ``{"workers": [...]}``, the workers to send it to now."""
        if idempotent and name in self.plugins:
            return {"workers": []}
        self.plugins.pop(name, None)
        self.plugins[name] = plugin
        return {"workers": sorted(self._workers())}

    def unregister(self, comm: Any, name: str) -> dict[str, Any]:
        """Forget the plugin ``name``; returns ``{"workers": [...]}``, the workers to
        remove it from. Raises ``ValueError`` if there is none."""
        if self.plugins.pop(name, None) is None:
            raise ValueError(f"the worker plugin {name!r} does not exist")
        return {"workers": sorted(self._workers())}

    def send_all(self, stream: BatchedSend) -> None:
        """Send every kept plugin to a worker that joins (``plugin-add``)."""
        for name, plugin in self.plugins.items():
            stream.send({"op": "plugin-add", "plugin": plugin, "name": name})
