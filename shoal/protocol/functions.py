"""Functions to bytes and back, with a bounded cache on the loading side.

The same function bytes give the same function object: a worker that receives one
function in a thousand tasks deserializes it once.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from .. import config
from .serialize import pickle_dumps, pickle_loads

__all__ = ["dumps_function", "loads_function", "function_cache_info", "clear_function_cache"]

_lock = threading.Lock()
_loads_cache: OrderedDict[bytes, Any] = OrderedDict()
_stats = {"hits": 0, "misses": 0}


def dumps_function(func: Callable[..., Any]) -> bytes:
    """Serialize a callable: by reference when importable, by value (cloudpickle) when
    it is a lambda, a closure or defined in ``__main__``. Raises ``PicklingError`` or
    ``TypeError`` when neither works."""
    return pickle_dumps(func)


def loads_function(data: bytes) -> Any:
    """Return the callable for ``data``; the same bytes give the same object while the
    cache (``function-cache-size`` entries of at most ``function-cache-max-bytes``)
    holds it. Raises whatever unpickling raises (e.g. ``ModuleNotFoundError``)."""
    cacheable = len(data) <= config.get("function-cache-max-bytes")
    if cacheable:
        key = bytes(data)
        with _lock:
            func = _loads_cache.get(key)
            if func is not None:
                _loads_cache.move_to_end(key)
                _stats["hits"] += 1
                return func
    func = pickle_loads(data)
    with _lock:
        _stats["misses"] += 1
        if cacheable:
            _loads_cache[key] = func
            while len(_loads_cache) > config.get("function-cache-size"):
                _loads_cache.popitem(last=False)
    return func


def function_cache_info() -> dict[str, int]:
    """``{"hits", "misses", "size"}`` of this process's function cache."""
    with _lock:
        return {**_stats, "size": len(_loads_cache)}


def clear_function_cache() -> None:
    with _lock:
        _loads_cache.clear()
        _stats["hits"] = _stats["misses"] = 0
