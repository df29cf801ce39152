"""``client.register_plugin`` for scheduler plugins (a mixin of :class:`~shoal.Client`).

A :class:`~shoal.SchedulerPlugin` is an object of the scheduler's process (the
scheduler unpickles nothing a peer sends), so it can be registered from a client of a
scheduler that runs in the same process (a LocalCluster's); for a scheduler elsewhere
the error says so. Worker plugins go to every worker (:mod:`shoal.worker.plugin`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from ..scheduler.plugin import SchedulerPlugin

if TYPE_CHECKING:
    from ..scheduler.server import Scheduler
    from .client import Client

__all__ = ["Plugins"]


class Plugins:
    """The plugin methods of :class:`~shoal.Client` (a mixin)."""

    def register_plugin(self, plugin: Any, name: str | None = None, idempotent: bool | None = None) -> Any:
        """Register a :class:`~shoal.SchedulerPlugin` with the scheduler or a
        :class:`~shoal.WorkerPlugin` with every worker (and the workers that join
        later). ``name`` defaults to ``plugin.name`` or the class name; with
        ``idempotent``, a plugin already registered under that name is kept. Raises
        ``TypeError`` for anything else and ``ValueError`` for a scheduler plugin when
        the scheduler is in another process."""
        client = cast("Client", self)
        if isinstance(plugin, SchedulerPlugin):
            return client._sync(self._register_scheduler_plugin, plugin, name, bool(idempotent))
        register_worker_plugin = getattr(self, "_register_worker_plugin", None)
        if register_worker_plugin is not None and _is_worker_plugin(plugin):
            return register_worker_plugin(plugin, name, idempotent)
        raise TypeError(f"register_plugin() takes a SchedulerPlugin or a WorkerPlugin, got {type(plugin).__name__}")

    def register_scheduler_plugin(self, plugin: SchedulerPlugin, name: str | None = None,
                                  idempotent: bool | None = None) -> Any:
        """:meth:`register_plugin` for a scheduler plugin (dask's older name)."""
        return self.register_plugin(plugin, name, idempotent)

    def unregister_scheduler_plugin(self, name: str) -> Any:
        """Remove the scheduler plugin ``name`` (``KeyError`` if there is none)."""
        return cast("Client", self)._sync(self._unregister_scheduler_plugin, name)

    def _local_scheduler(self) -> Scheduler:
        scheduler = getattr(cast("Client", self).cluster, "scheduler", None)
        if scheduler is None:
            raise ValueError(
                "a SchedulerPlugin is an object of the scheduler's process, and this client's scheduler "
                f"({cast('Client', self).scheduler_address}) runs in another one: shoal's scheduler never "
                "unpickles what a peer sends. Pass it to the scheduler where it starts "
                "(Scheduler(plugins=[...])), or use a LocalCluster in this process")
        return cast("Scheduler", scheduler)

    async def _register_scheduler_plugin(self, plugin: SchedulerPlugin, name: str | None, idempotent: bool) -> None:
        scheduler = self._local_scheduler()
        name = name or getattr(plugin, "name", None) or type(plugin).__name__
        if idempotent and name in scheduler.plugins:
            return
        await _on_loop_of(scheduler, scheduler.add_plugin(plugin, name))

    async def _unregister_scheduler_plugin(self, name: str) -> None:
        scheduler = self._local_scheduler()
        await _on_loop_of(scheduler, scheduler.remove_plugin(name))


def _is_worker_plugin(plugin: Any) -> bool:
    from ..worker.plugin import WorkerPlugin

    return isinstance(plugin, WorkerPlugin)


async def _on_loop_of(scheduler: Scheduler, coro: Any) -> Any:
    """Run ``coro`` on the scheduler's loop (this one, or the cluster's thread's)."""
    import asyncio

    loop = getattr(scheduler, "loop", None)
    if loop is None or loop is asyncio.get_running_loop():
        return await coro
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))
