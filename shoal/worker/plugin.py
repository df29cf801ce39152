"""Worker plugins: user code that a worker calls when it starts one, when it closes, and
after each change of a key's state there (as dask.distributed's ``WorkerPlugin``).

A plugin never runs inside the worker's state machine: the worker calls
``transition`` after each ``handle()`` call, for the transitions that call logged.
Whatever a plugin raises is logged and changes nothing else.
"""

from __future__ import annotations

import inspect
import logging
import uuid
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

from ..statelog import transitions_since

from ..protocol import Serialize, Serialized, deserialize

if TYPE_CHECKING:
    from ..comm import Comm
    from .server import Worker

__all__ = ["WorkerPlugin", "plugin_name", "call_hook", "tell_transitions", "add_plugin", "remove_plugin",
           "plugin_add", "plugin_remove", "unwrap_plugin"]

logger = logging.getLogger("shoal.worker")


class WorkerPlugin:
    """Subclass and override what you need; register it with
    ``client.register_plugin(plugin)`` (every worker, and workers that join later, get a
    copy) or ``await worker.add_plugin(plugin)``.

    A plugin whose ``name`` attribute is set replaces a plugin of that name (the old
    one is torn down first); without one, each registration adds a plugin.
    ``setup`` and ``teardown`` may be coroutine functions (the worker awaits them).
    """

    def setup(self, worker: Worker) -> Any:
        """Called when the plugin is added to ``worker`` (on its event loop thread)."""

    def teardown(self, worker: Worker) -> Any:
        """Called when ``worker`` closes, or when the plugin is replaced."""

    def transition(self, key: Hashable, start: str, finish: str, **kwargs: Any) -> None:
        """Called after ``key`` went from state ``start`` to ``finish`` on the worker
        (``kwargs``: ``stimulus_id``). Keep it short: it runs on the event loop."""


def plugin_name(plugin: Any) -> str:
    """The name a plugin is registered under: its ``name`` attribute, else its class
    name with a unique suffix."""
    name = getattr(plugin, "name", None)
    if isinstance(name, str) and name:
        return name
    return f"{type(plugin).__name__}-{uuid.uuid4().hex[:12]}"


async def call_hook(plugin: Any, hook: str, *args: Any) -> BaseException | None:
    """Call ``plugin.<hook>(*args)``, awaiting it if it returns an awaitable; returns
    the exception it raised (logged), or ``None``."""
    method = getattr(plugin, hook, None)
    if method is None:
        return None
    try:
        result = method(*args)
        if inspect.isawaitable(result):
            await result
    except Exception as exc:  # noqa: BLE001 - user code: logged, never fatal
        logger.exception("worker plugin %s: %s() raised", plugin_name(plugin), hook)
        return exc
    return None


def tell_transitions(plugins: dict[str, Any], log: Any, last: Any) -> None:
    """Call each plugin's ``transition`` for the transitions in ``log`` (a state
    machine's ``log.transitions``) after ``last`` (the newest before the ``handle()``
    call that made them; None: all), oldest first; what a plugin raises is logged."""
    for key, start, finish, stimulus_id in transitions_since(log, last):
        for name, plugin in list(plugins.items()):
            hook = getattr(plugin, "transition", None)
            if hook is None:
                continue
            try:
                hook(key, start, finish, stimulus_id=stimulus_id)
            except Exception:  # noqa: BLE001 - user code: logged, never fatal
                logger.exception("worker plugin %s: transition(%r, %r, %r) raised", name, key, start, finish)


async def add_plugin(worker: Worker, plugin: Any, name: str | None = None, catch_errors: bool = True) -> None:
    """Add a :class:`WorkerPlugin` (any object with some of its methods) to ``worker``
    under ``name`` (default: its ``name`` attribute, else a unique name), replacing
    (and tearing down) the plugin of that name; awaits its ``setup(worker)``. What the
    plugin raises is logged (and, with ``catch_errors=False``, raised here after; the
    plugin stays added either way)."""
    name = name or plugin_name(plugin)
    old = worker.plugins.pop(name, None)
    if old is not None:
        await call_hook(old, "teardown", worker)
    worker.plugins[name] = plugin
    exc = await call_hook(plugin, "setup", worker)
    if exc is not None and not catch_errors:
        raise exc


async def remove_plugin(worker: Worker, name: str) -> None:
    """Remove the plugin ``name`` from ``worker`` (awaiting its ``teardown(worker)``).
    Raises ``ValueError`` if there is none."""
    plugin = worker.plugins.pop(name, None)
    if plugin is None:
        raise ValueError(f"no plugin named {name!r} on worker {worker.address}")
    await call_hook(plugin, "teardown", worker)


async def plugin_add(worker: Worker, comm: Comm, plugin: Any, name: str) -> str:
    """The worker's ``plugin-add`` request (from a client): unpickle the plugin and add
    it; raises what unpickling or its ``setup`` raised (the client raises it then)."""
    await add_plugin(worker, unwrap_plugin(plugin), name, catch_errors=False)
    return "OK"


async def plugin_remove(worker: Worker, comm: Comm, name: str) -> str:
    """The worker's ``plugin-remove`` request; ``ValueError`` if there is no such plugin."""
    await remove_plugin(worker, name)
    return "OK"


def unwrap_plugin(plugin: Any) -> Any:
    """A plugin as a client sent it (pickled, or by reference in this process): the
    object, a copy of this worker's own. Raises what unpickling raises."""
    if isinstance(plugin, Serialize):
        plugin = plugin.data
    return deserialize(plugin) if isinstance(plugin, Serialized) else plugin
