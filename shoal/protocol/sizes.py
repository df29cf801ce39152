"""The managed size of a value: what a worker counts against its memory target.

:func:`managed_sizeof` is ``dask.sizeof.sizeof`` where dask is installed (imported at
the first value that needs it, so a worker holding only bytes and arrays never pays
for the import), else a small registry of shoal's own: numpy arrays (broadcast ones by
the memory they really use), pandas objects, bytes, memoryviews, and containers
estimated from a sample of their items. Types registered here with
:func:`register_sizeof` win over both, so a user can size their own objects whether or
not dask is there.

It never raises: a user's ``__sizeof__`` or ``nbytes`` may raise anything, and such a
value then counts as 64 bytes. The hot-path :func:`shoal.protocol.sizeof` (every
result, every transfer) takes an object's ``nbytes`` and guesses plain containers from
their own size, and asks this for the rest.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["register_sizeof", "register_lazy_sizeof", "managed_sizeof", "UNKNOWN_SIZE"]

#: what a value counts as when it cannot say its size
UNKNOWN_SIZE = 64
#: items a container is estimated from
SAMPLE = 10
#: how deep containers are looked into (a self-referential list ends here)
MAX_DEPTH = 4

SizeFn = Callable[[Any], int]
_F = TypeVar("_F", bound=Callable[..., int])

#: registered with :func:`register_sizeof` (and shoal's Serialize/Serialized): before dask
_user: dict[type, SizeFn] = {}
#: shoal's own, used when dask is not installed
_builtin: dict[type, SizeFn] = {}
#: top-level module name -> function registering sizes of that module's types, called
#: once the module is imported (so that sizing never imports numpy or pandas itself)
_lazy: dict[str, Callable[[], None]] = {}
#: type -> resolved size function (``None``: ask dask); cleared on every registration
_resolved: dict[type, SizeFn | None] = {}
#: dask.sizeof.sizeof once looked for: ``False`` before, ``None`` when dask is missing
_dask: Any = False

# exact types whose size dask and the registry agree on, answered without a lookup
_LEN = (bytes, bytearray)
_SCALAR = (int, float, bool, str, type(None), complex)


def register_sizeof(*types: type) -> Callable[[SizeFn], SizeFn]:
    """Decorator: ``@register_sizeof(MyType)`` makes ``fn(obj) -> int`` the size of
    instances of ``MyType`` and its subclasses (before dask's, if dask is installed).
    Returns the function unchanged."""

    def register(fn: SizeFn) -> SizeFn:
        for t in types:
            _user[t] = fn
        _resolved.clear()
        return fn

    return register


def register_lazy_sizeof(module: str) -> Callable[[Callable[[], None]], Callable[[], None]]:
    """Decorator: the function registers (with :func:`_register_builtin`) the sizes of
    ``module``'s types; it runs when a value of a type from that module is first sized
    and the module is imported. Returns the function unchanged."""

    def register(fn: Callable[[], None]) -> Callable[[], None]:
        _lazy[module] = fn
        _resolved.clear()
        return fn

    return register


def _register_builtin(*types: type) -> Callable[[_F], _F]:
    def register(fn: _F) -> _F:
        for t in types:
            _builtin[t] = fn
        _resolved.clear()
        return fn

    return register


def managed_sizeof(obj: Any, strict: bool = False) -> int:
    """Bytes ``obj`` holds (see the module), never less than 0. It never raises; with
    ``strict``, what the value's own measure (its ``__sizeof__``, a registered size
    function) raises is raised instead of counting it as :data:`UNKNOWN_SIZE`."""
    t = type(obj)
    if t in _LEN:
        return len(obj)
    if t in _SCALAR:
        return sys.getsizeof(obj)
    try:
        return max(int(_sizeof(obj, 0)), 0)
    except KeyboardInterrupt:
        raise
    except BaseException:  # noqa: BLE001 - a user's __sizeof__/nbytes may raise anything
        if strict:
            raise
        return UNKNOWN_SIZE


def _sizeof(obj: Any, depth: int) -> int:
    t = type(obj)
    if t in _LEN:
        return len(obj)
    if getattr(t, "__shoal_handle__", False):
        return UNKNOWN_SIZE  # a handle on something remote (an actor): asking it is a call
    try:
        fn = _resolved[t]
    except KeyError:
        fn = _resolved[t] = _resolve(t)
    if fn is None:
        return int(_dask(obj))
    if fn is _sized_container:
        return _sized_container(obj, depth)
    return int(fn(obj))


def _resolve(t: type) -> SizeFn | None:
    """The size function of type ``t``: a user's registration along its MRO, else dask
    (``None``) when dask is installed, else the registry's."""
    for base in t.__mro__:
        if base in _user:
            return _user[base]
    if _dask_sizeof() is not None:
        return None
    _load_lazy(t)
    for base in t.__mro__:
        if base in _builtin:
            return _builtin[base]
    return _default


def _load_lazy(t: type) -> None:
    for base in t.__mro__:
        top = base.__module__.partition(".")[0]
        loader = _lazy.pop(top, None)
        if loader is not None and top in sys.modules:
            loader()
        elif loader is not None:
            _lazy[top] = loader  # not imported yet: nothing of it can be here


def _dask_sizeof() -> Any:
    global _dask
    if _dask is False:
        dask_sizeof: Any
        try:
            from dask.sizeof import sizeof as dask_sizeof
        except Exception:  # noqa: BLE001 - missing, or broken by its own imports: ours then
            dask_sizeof = None
        _dask = dask_sizeof
    return _dask


def _default(obj: Any) -> int:
    return sys.getsizeof(obj)


@_register_builtin(memoryview)
def _memoryview(obj: memoryview) -> int:
    return obj.nbytes


@_register_builtin(list, tuple, set, frozenset, dict)
def _sized_container(obj: Any, depth: int = 0) -> int:
    """The container's own size plus its items', estimated from :data:`SAMPLE` of
    them (a dict: its keys and values); deeper than :data:`MAX_DEPTH`, items count as
    :data:`UNKNOWN_SIZE` each."""
    own = sys.getsizeof(obj)
    n = len(obj)
    if n == 0:
        return own
    if depth >= MAX_DEPTH:
        return own + n * UNKNOWN_SIZE
    items = obj.items() if isinstance(obj, dict) else obj
    sample = list(itertools.islice(items, SAMPLE))
    if isinstance(obj, dict):
        total = sum(_item(k, depth) + _item(v, depth) for k, v in sample)
    else:
        total = sum(_item(x, depth) for x in sample)
    return own + total * n // len(sample)


def _item(x: Any, depth: int) -> int:
    try:
        return _sizeof(x, depth + 1)
    except KeyboardInterrupt:
        raise
    except BaseException:  # noqa: BLE001 - one item that cannot say its size
        return UNKNOWN_SIZE


@register_lazy_sizeof("numpy")
def _register_numpy() -> None:
    import numpy as np

    @_register_builtin(np.ndarray)
    def _ndarray(x: Any) -> int:
        if 0 in x.strides:
            # a broadcast view: only the memory behind its non-repeated axes is there
            x = x[tuple(slice(None) if s != 0 else slice(1) for s in x.strides)]
        return int(x.nbytes)

    @_register_builtin(np.generic)
    def _scalar(x: Any) -> int:
        return int(x.nbytes) + 16


@register_lazy_sizeof("pandas")
def _register_pandas() -> None:
    import pandas as pd

    def object_bytes(values: Any) -> int:
        # strings and other objects: estimated from a sample, as for containers
        n = len(values)
        if n == 0:
            return 0
        sample = [values[i] for i in range(0, n, max(n // SAMPLE, 1))][:SAMPLE]
        return sum(_item(v, 0) for v in sample) * n // len(sample)

    def column_bytes(s: Any) -> int:
        size = int(s.memory_usage(index=False, deep=False))
        if s.dtype == object:
            size += object_bytes(s.array)
        return size

    @_register_builtin(pd.DataFrame)
    def _frame(df: Any) -> int:
        return 100 + _index(df.index) + sum(column_bytes(df.iloc[:, i]) for i in range(df.shape[1]))

    @_register_builtin(pd.Series)
    def _series(s: Any) -> int:
        return 100 + _index(s.index) + column_bytes(s)

    @_register_builtin(pd.Index)
    def _index(ix: Any) -> int:
        size = int(ix.memory_usage(deep=False))
        if ix.dtype == object:
            size += object_bytes(ix.array)
        return 100 + size


def _register_shoal() -> None:
    from .serialize import Serialize, Serialized

    # values kept serialized (forwarded payloads) hold their frames; dask cannot know
    _user.setdefault(Serialized, lambda s: int(s.nbytes))
    _user.setdefault(Serialize, lambda s: managed_sizeof(s.data))


_register_shoal()
