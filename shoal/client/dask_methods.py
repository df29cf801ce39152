"""The methods dask's all-to-all exchanges use on a shoal cluster.

dask picks how to shuffle a dataframe (``shuffle``, ``merge``, ``set_index``,
``sort_values``, a groupby's or ``drop_duplicates``' ``split_out``) and how to rechunk
an array when it lowers the expression: mostly inside ``.compute()``, before any
scheduler sees the graph. Finding no dask.distributed client it picks ``"disk"`` for
dataframes: a partd directory on the local disk of whichever worker runs the first
task, which the other tasks then write into and read from by its path. That is right
only while every worker sees that directory (one host) and no task runs twice (a split
recomputed after a worker died appends its rows again). ``"tasks"`` is right on any
cluster, so until shoal has a shuffle of its own, dask is made to pick it: while a
shoal client is the default, or one lowers a collection
(``client.compute``/``persist``/``get``), dask's config holds ``"tasks"`` for each
method the user left unset (:func:`hold`, :func:`release`, :func:`chosen`); when the
last holder lets go, each setting still at shoal's choice goes back to what it was.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["METHODS", "chosen", "hold", "release"]

#: dask config key -> the method shoal has dask use when the user set none
METHODS = {"dataframe.shuffle.method": "tasks", "array.rechunk.method": "tasks"}

_lock = threading.Lock()
_holders = 0
#: what each key set by shoal held before (``_MISSING``: it was not there)
_before: dict[str, Any] = {}
_MISSING = object()


def _dask_config() -> Any:
    try:
        import dask.config
    except ImportError:
        return None
    return dask.config


def hold() -> None:
    """From now on until the matching :func:`release`, dask picks :data:`METHODS` for
    the methods the user left unset (``None`` or absent in dask's config)."""
    global _holders
    with _lock:
        _holders += 1
        if _holders > 1:
            return
        cfg = _dask_config()
        if cfg is None:
            return
        for key, method in METHODS.items():
            value = cfg.get(key, _MISSING)
            if value is None or value is _MISSING:
                _before[key] = value
                cfg.set({key: method})


def release() -> None:
    """Undo one :func:`hold`; after the last, each method still at shoal's choice is
    what it was before (a setting the user made meanwhile stays)."""
    global _holders
    with _lock:
        if _holders == 0:
            return
        _holders -= 1
        if _holders > 0:
            return
        cfg = _dask_config()
        before = dict(_before)
        _before.clear()
        if cfg is None:
            return
        for key, value in before.items():
            if cfg.get(key, None) != METHODS[key]:
                continue  # the user's own choice since: it stands
            if value is _MISSING:
                _remove(cfg.config, key.split("."))
            else:
                cfg.set({key: value})


def _remove(config: dict[str, Any], path: list[str]) -> None:
    """Take ``path`` (a key split at its dots) out of dask's nested ``config``."""
    for part in path[:-1]:
        config = config.get(part)  # type: ignore[assignment]
        if not isinstance(config, dict):
            return
    config.pop(path[-1], None)


@contextlib.contextmanager
def chosen() -> Iterator[None]:
    """A block in which dask picks :data:`METHODS` for the methods the user left
    unset (what lowering a collection for a shoal cluster needs)."""
    hold()
    try:
        yield
    finally:
        release()
