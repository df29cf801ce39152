"""Scheduler plugins: user code told what the scheduler does (dask's SchedulerPlugin).

A plugin is an object of the scheduler's own process: the scheduler unpickles nothing a
peer sends, so ``client.register_plugin(SchedulerPlugin())`` works only when the
scheduler runs in the client's process (a LocalCluster), and a scheduler in another
process takes plugins from ``Scheduler(plugins=[...])`` or ``scheduler.add_plugin``.

Hooks run on the scheduler's event loop, after the state machine has handled the event
that caused them (never from inside it). A hook that raises is logged and the
scheduler carries on.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

from ..statelog import transitions_since

__all__ = ["SchedulerPlugin", "call_async", "call_hook", "tell_plugins"]

logger = logging.getLogger("shoal.scheduler")


class SchedulerPlugin:
    """Subclass and override what you need; every hook does nothing by default.

    ``start``/``close`` may be coroutine functions.
    """

    #: plugins registered under one name replace each other
    name: str | None = None

    def start(self, scheduler: Any) -> Any:
        """Called once the plugin is added (the scheduler is running)."""

    def close(self) -> Any:
        """Called when the plugin is removed or the scheduler closes."""

    def update_graph(self, scheduler: Any, *, client: str, keys: set[Any], tasks: list[Any], **kwargs: Any) -> None:
        """A client submitted a graph: ``keys`` it wants, ``tasks`` the new keys."""

    def transition(self, key: Any, start: str, finish: str, *args: Any, stimulus_id: str = "",
                   **kwargs: Any) -> None:
        """A task changed state (``released``, ``waiting``, ``queued``, ``processing``,
        ``memory``, ``erred``, ``forgotten``)."""

    def add_worker(self, scheduler: Any, worker: str) -> None:
        """A worker joined."""

    def remove_worker(self, scheduler: Any, worker: str, **kwargs: Any) -> None:
        """A worker left or was removed."""

    def add_client(self, scheduler: Any, client: str) -> None:
        """A client connected."""

    def remove_client(self, scheduler: Any, client: str) -> None:
        """A client disconnected."""


async def call_async(plugin: SchedulerPlugin, name: str, *args: Any) -> None:
    """``plugin.name(*args)``, awaited if it is a coroutine; an exception is logged."""
    try:
        result = getattr(plugin, name)(*args)
        if inspect.isawaitable(result):
            await result
    except Exception:  # noqa: BLE001 - user code: logged, the scheduler goes on
        logger.exception("scheduler plugin %r failed in %s()", type(plugin).__name__, name)


def call_hook(plugins: dict[str, SchedulerPlugin], name: str, *args: Any, **kwargs: Any) -> None:
    """Call hook ``name`` of every plugin; exceptions are logged, never raised."""
    for plugin in list(plugins.values()):
        hook = getattr(plugin, name, None)
        if hook is None:
            continue
        try:
            hook(*args, **kwargs)
        except Exception:  # noqa: BLE001 - user code: logged, the scheduler goes on
            logger.exception("scheduler plugin %r failed in %s()", type(plugin).__name__, name)


def tell_plugins(scheduler: Any, event: Any, instructions: list[Any], last: Any) -> None:
    """The hooks ``event`` calls for, after the state handled it: what it is (a worker
    or client came or went, a graph), then the transitions it caused (those logged
    after ``last``, the log's last entry before)."""
    from .events import (AddClientEvent, AddWorkerEvent, CloseWorkerStream, RemoveClientEvent,
                         RemoveWorkerEvent, UpdateGraphEvent)

    plugins = scheduler.plugins
    if isinstance(event, AddWorkerEvent):
        call_hook(plugins, "add_worker", scheduler=scheduler, worker=event.address)
    elif isinstance(event, RemoveWorkerEvent):
        call_hook(plugins, "remove_worker", scheduler=scheduler, worker=event.address,
                  stimulus_id=event.stimulus_id)
    elif isinstance(event, AddClientEvent):
        call_hook(plugins, "add_client", scheduler=scheduler, client=event.client)
    elif isinstance(event, RemoveClientEvent):
        call_hook(plugins, "remove_client", scheduler=scheduler, client=event.client)
    elif isinstance(event, UpdateGraphEvent):
        call_hook(plugins, "update_graph", scheduler, client=event.client, keys=set(event.wanted),
                  tasks=[t.key for t in event.tasks], stimulus_id=event.stimulus_id)
    for inst in instructions:
        if isinstance(inst, CloseWorkerStream):
            call_hook(plugins, "remove_worker", scheduler=scheduler, worker=inst.worker,
                      stimulus_id=inst.stimulus_id)
    for key, start, finish, stimulus_id in transitions_since(scheduler.state.log.transitions, last):
        call_hook(plugins, "transition", key, start, finish, stimulus_id=stimulus_id)
