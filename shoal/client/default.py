"""The default client: the one dask's ``.compute()``/``.persist()`` and
``shoal.get_client()`` use.

A client made with ``set_as_default=True`` (the default, as in dask.distributed)
becomes dask's scheduler while it is open (``dask.config`` ``scheduler`` set to its
``get``; ``dask.persist`` finds the client behind it). The most recent open default
client wins; when it closes, the one before it is the default again, and when the
last closes, dask's ``scheduler`` setting is what it was before the first. (Every
open client, default or not, has dask's shuffles and rechunks use methods that are
right on any cluster: :mod:`.dask_methods`.)
"""

from __future__ import annotations

import importlib.util
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .client import Client

__all__ = ["default_client", "get_client", "set_default", "unset_default"]

_lock = threading.Lock()
_defaults: list[Client] = []
#: dask's ``scheduler`` setting before the first default client (when dask is installed)
_before: list[Any] = []
_MISSING = object()


def _dask_config() -> Any:
    if importlib.util.find_spec("dask") is None:
        return None
    import dask.config

    return dask.config


def set_default(client: Client) -> None:
    """``client`` is the default from now on."""
    with _lock:
        first = not _defaults
        if client in _defaults:
            _defaults.remove(client)
        cfg = _dask_config()
        if first and cfg is not None:
            _before[:] = [cfg.config.get("scheduler", _MISSING)]
        _defaults.append(client)
        if cfg is not None:
            cfg.set(scheduler=client.get)


def unset_default(client: Client) -> None:
    """``client`` closed: the previous default client (or dask's own setting) again."""
    with _lock:
        if client not in _defaults:
            return
        was_current = _defaults[-1] is client
        _defaults.remove(client)
        cfg = _dask_config()
        if cfg is None or not was_current:
            return
        current = cfg.config.get("scheduler", None)
        if getattr(current, "__self__", None) is not client:
            return  # the user chose another scheduler meanwhile: theirs stands
        if _defaults:
            cfg.set(scheduler=_defaults[-1].get)
        else:
            before = _before[0] if _before else _MISSING
            if before is _MISSING:
                cfg.config.pop("scheduler", None)
            else:
                cfg.set(scheduler=before)


def default_client() -> Client:
    """The most recent open default client; ``ValueError`` when there is none."""
    with _lock:
        for client in reversed(_defaults):
            if client.status == "running":
                return client
    raise ValueError("No clients found. Start a client first: client = shoal.Client()")


def get_client(address: str | None = None, timeout: float | None = None) -> Client:
    """The client to use here: inside a task, a client of the worker running it (one
    per worker, reused); elsewhere the default client (or, given ``address``, a
    default client connected to that scheduler, or a new one). Raises ``ValueError``
    when there is no client and no address to connect to."""
    from ..worker import context  # type: ignore[attr-defined]

    client = context.task_client()
    if client is not None:
        return client
    if address is None:
        return default_client()
    with _lock:
        for c in reversed(_defaults):
            if c.status == "running" and address in (c.scheduler_address, getattr(c.cluster, "scheduler_address", "")):
                return c
    from .client import Client as _Client

    return _Client(address, timeout=30.0 if timeout is None else timeout)
