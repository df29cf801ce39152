"""``client.register_plugin(WorkerPlugin())`` for worker plugins (a mixin of
:class:`~shoal.Client`; :meth:`~shoal.client.plugins.Plugins.register_plugin` sends
worker plugins here).

The client pickles the plugin (every worker gets a copy of its own, in-process workers
too) and asks the scheduler to keep it for the workers that join later; the scheduler
keeps it opaque and names the workers there now, which the client asks to set it up,
waiting for their ``setup``. A plugin that cannot be pickled fails here, before any
worker hears of it.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, cast

from ..errors import CommError, SerializationError, describe
from ..protocol import REMOTE, serialize
from ..rpc import PooledRPC

if TYPE_CHECKING:
    from .client import Client

__all__ = ["WorkerPluginMethods"]


class WorkerPluginMethods:
    """The worker-plugin methods of :class:`~shoal.Client` (a mixin)."""

    def _register_worker_plugin(self, plugin: Any, name: str | None, idempotent: bool | None) -> Any:
        """Register ``plugin`` with every worker and the workers that join later;
        returns ``{worker: {"status": "OK"}}`` for the workers that set it up now.
        Raises :class:`~shoal.SerializationError` (a ``TypeError``) if it cannot be
        pickled, and what a worker's ``setup`` (or unpickling it there) raised."""
        from ..worker.plugin import plugin_name

        name = name or plugin_name(plugin)
        try:
            payload = serialize(plugin, REMOTE)
        except Exception as exc:
            raise SerializationError(f"the worker plugin {name!r} cannot be pickled (each worker gets a copy): "
                                     f"{describe(exc)}") from exc
        return cast("Client", self)._sync(self._add_worker_plugin, payload, name, bool(idempotent))

    async def _add_worker_plugin(self, payload: Any, name: str, idempotent: bool) -> dict[str, Any]:
        client = cast("Client", self)
        reply = await client._scheduler_rpc().register_worker_plugin(plugin=payload, name=name, idempotent=idempotent)
        return await self._tell_workers(reply["workers"], "plugin_add", plugin=payload, name=name)

    def unregister_worker_plugin(self, name: str) -> Any:
        """Remove the worker plugin ``name`` from every worker (its ``teardown`` runs)
        and from those that join later; returns ``{worker: {"status": "OK"}}``. Raises
        ``ValueError`` if no such plugin is registered."""
        return cast("Client", self)._sync(self._remove_worker_plugin, name)

    async def _remove_worker_plugin(self, name: str) -> dict[str, Any]:
        reply = await cast("Client", self)._scheduler_rpc().unregister_worker_plugin(name=name)
        return await self._tell_workers(reply["workers"], "plugin_remove", name=name)

    async def _tell_workers(self, workers: list[str], op: str, **kwargs: Any) -> dict[str, Any]:
        pool = cast("Client", self)._pool
        assert pool is not None
        results = await asyncio.gather(*(getattr(PooledRPC(pool, w), op)(**kwargs) for w in workers),
                                       return_exceptions=True)
        for w, result in zip(workers, results):
            if isinstance(result, BaseException) and not _worker_gone(result):
                raise result
        return {w: {"status": "OK"} for w, r in zip(workers, results) if not isinstance(r, BaseException)}


def _worker_gone(exc: BaseException) -> bool:
    """A worker that left meanwhile (it cannot be reached): nothing to set up there."""
    return isinstance(exc, (CommError, OSError))
