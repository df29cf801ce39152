"""Serializer families, chosen per (value type, destination).

A *family* turns one object into ``(header, frames)`` for a destination and back:

- ``dumps(obj, destination) -> (header, frames)``: ``header`` is plain msgpack-able
  data, ``frames`` a list of bytes-like objects sent out of band (never copied into a
  header);
- ``loads(header, frames) -> obj``.

The destination is one of ``"same-process"``, ``"same-host"`` or ``"remote"``, or
``"neutral"`` for a peer in another language (:mod:`.neutral`: no pickle). Families
are registered by type and looked up along the value's MRO, first for the destination at
hand; the built-in ``pickle`` family (pickle protocol 5 with out-of-band buffers,
cloudpickle for functions, lambdas and ``__main__`` objects) serves everything else.

:class:`Serialize` marks a value to be serialized by the transport (``to_serialize``);
:class:`Serialized` is a value that already is: a middle hop reads and forwards it
without deserializing, and the final receiver gets the original object back.
"""

from __future__ import annotations

import io
import pickle
import sys
import threading
from collections import ChainMap
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle

from ..errors import SerializationError, describe, short_repr

__all__ = [
    "SAME_PROCESS",
    "SAME_HOST",
    "REMOTE",
    "DESTINATIONS",
    "NEUTRAL",
    "ALL_DESTINATIONS",
    "Serialize",
    "Serialized",
    "to_serialize",
    "register_serializer",
    "serialize",
    "deserialize",
    "pickle_dumps",
    "pickle_loads",
    "forwarded",
    "sizeof",
]

SAME_PROCESS = "same-process"
SAME_HOST = "same-host"
REMOTE = "remote"
#: the Python destinations: what families serve unless they say otherwise
DESTINATIONS = (SAME_PROCESS, SAME_HOST, REMOTE)
#: a peer that reads only language-neutral encodings (a worker in another language:
#: see :mod:`.neutral`)
NEUTRAL = "neutral"
ALL_DESTINATIONS = (*DESTINATIONS, NEUTRAL)

Header = dict[str, Any]
Frames = list[Any]
DumpsFn = Callable[[Any, str], tuple[Header, Frames]]
LoadsFn = Callable[[Header, Sequence[Any]], Any]


class Serialize:
    """Wraps a value that the transport serializes for its destination.

    Over an in-process comm nothing is serialized: the wrapper itself travels, and a
    receiver that deserializes gets ``.data``.
    """

    __slots__ = ("data", "nbytes")

    def __init__(self, data: Any, nbytes: int | None = None):
        self.data = data
        #: the value's size when the sender knows it already (its store measured it):
        #: :func:`sizeof` then does not measure the value again
        self.nbytes = nbytes

    def __repr__(self) -> str:
        return f"<Serialize: {type(self.data).__name__}>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Serialize) and other.data is self.data

    def __hash__(self) -> int:
        return id(self.data)


def to_serialize(obj: Any, nbytes: int | None = None) -> Serialize:
    """Mark ``obj`` to be serialized by the transport that carries the message;
    ``nbytes``: its size, when known (see :attr:`Serialize.nbytes`)."""
    return Serialize(obj, nbytes)


class Serialized:
    """A value in serialized form: family name, family header and frames.

    A process that receives one without deserializing (the scheduler) can forward it:
    its frames cross the next hop untouched. ``deserialize(s)`` rebuilds the value.
    ``keep``, set only when something was adopted, holds what this process keeps alive
    for the value while it lives (side-channel resources taken over on receipt, see
    :func:`register_forwarding`); unset, it is not part of the pickled state.
    """

    __slots__ = ("family", "header", "frames", "keep")

    def __init__(self, family: str, header: Header, frames: Sequence[Any]):
        self.family = family
        self.header = header
        self.frames = list(frames)

    @property
    def nbytes(self) -> int:
        return sum(memoryview(f).nbytes for f in self.frames)

    def __repr__(self) -> str:
        return f"<Serialized {self.family}: {len(self.frames)} frames, {self.nbytes} bytes>"

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Serialized)
            and self.family == other.family
            and self.header == other.header
            and len(self.frames) == len(other.frames)
            and all(bytes(a) == bytes(b) for a, b in zip(self.frames, other.frames))
        )

    __hash__ = None  # type: ignore[assignment]


# --------------------------------------------------------------------------- families


class _Family:
    __slots__ = ("name", "dumps", "loads")

    def __init__(self, name: str, dumps: DumpsFn, loads: LoadsFn):
        self.name = name
        self.dumps = dumps
        self.loads = loads


AdoptFn = Callable[["Serialized"], bool]
ForwardFn = Callable[["Serialized", str], tuple[Header, Frames]]


_lock = threading.Lock()
_families: dict[str, _Family] = {}
_by_type: dict[tuple[type, str], _Family] = {}
_lookup_cache: dict[tuple[type, str], _Family] = {}


def register_serializer(
    cls: type,
    dumps: DumpsFn,
    loads: LoadsFn,
    destinations: Sequence[str] | None = None,
    name: str | None = None,
) -> None:
    """Use ``dumps``/``loads`` for ``cls`` and its subclasses, for the given destinations.

    ``destinations`` defaults to the three Python ones (add :data:`NEUTRAL` for a
    family that peers in other languages read). ``name`` (default: the class's
    qualified name) travels in the message so the receiver finds the same family; both
    ends must register it. Raises ``ValueError`` for an unknown destination or a name
    already taken by other functions.
    """
    dests = tuple(DESTINATIONS if destinations is None else destinations)
    bad = [d for d in dests if d not in ALL_DESTINATIONS]
    if bad:
        raise ValueError(f"unknown destination(s) {bad}; expected some of {ALL_DESTINATIONS}")
    name = name or f"{cls.__module__}.{cls.__qualname__}"
    with _lock:
        old = _families.get(name)
        if old is not None and (old.dumps is not dumps or old.loads is not loads):
            # re-registering the same name replaces it (e.g. a reloaded module)
            for key, fam in list(_by_type.items()):
                if fam is old:
                    del _by_type[key]
        family = _Family(name, dumps, loads)
        _families[name] = family
        for dest in dests:
            _by_type[(cls, dest)] = family
        _lookup_cache.clear()


#: family name -> (adopt, forward): see :func:`register_forwarding`
_forwarding: dict[str, tuple[AdoptFn | None, ForwardFn | None]] = {}


def register_forwarding(family: str, adopt: AdoptFn | None = None, forward: ForwardFn | None = None) -> None:
    """Hooks for values of ``family`` that a process carries without deserializing
    them (a scheduler forwarding a task's payload); such a process need not have the
    family's ``dumps``/``loads`` at all.

    - ``adopt(serialized) -> bool``: called on receipt of a value that came with leases
      (:mod:`.leases`) and stays serialized. It may take the side-channel resources
      over (kept in ``serialized.keep``, ``serialized.header`` rewritten to name them as
      its own); returning True acknowledges the leases, so that the sender lets go of
      them. Without it, such leases end by their timeout.
    - ``forward(serialized, destination) -> (header, frames)``: what to send for such a
      value to ``destination`` (e.g. the bytes themselves for a peer that cannot reach
      the side channel). Without it, the value goes as it came.
    """
    with _lock:
        _forwarding[family] = (adopt, forward)


def forwarded(s: Serialized, destination: str) -> Serialized:
    """``s`` as it would be sent to ``destination`` by a process that keeps it
    serialized (its family's forward hook applied, see :func:`register_forwarding`);
    ``s`` itself when nothing changes. Raises what the hook raises (a value whose
    side-channel references are broken)."""
    forward = _forwarding.get(s.family, (None, None))[1]
    if forward is None:
        return s
    header, frames = forward(s, destination)
    if header is s.header and frames is s.frames:
        return s
    return Serialized(s.family, header, frames)


def _family_for(obj: Any, destination: str) -> _Family:
    typ = type(obj)
    key = (typ, destination)
    fam = _lookup_cache.get(key)
    if fam is None:
        for base in typ.__mro__:
            fam = _by_type.get((base, destination))
            if fam is not None:
                break
        else:
            fam = _families["pickle"]
        _lookup_cache[key] = fam
    return fam


def serialize(obj: Any, destination: str = REMOTE) -> Serialized:
    """Serialize ``obj`` for ``destination`` with its family.

    Returns a :class:`Serialized`. Raises :class:`SerializationError` naming the type
    (and, inside containers, the place) of the part that could not be serialized.
    """
    if destination not in ALL_DESTINATIONS:
        raise ValueError(f"unknown destination {destination!r}; expected one of {ALL_DESTINATIONS}")
    if isinstance(obj, Serialized):
        return obj
    if isinstance(obj, Serialize):
        obj = obj.data
    fam = _family_for(obj, destination)
    header, frames = family_dumps(fam, obj, destination)
    return Serialized(fam.name, header, frames)


def family_dumps(fam: _Family, obj: Any, destination: str,
                 where: Callable[[], str] | None = None) -> tuple[Header, Frames]:
    """``fam.dumps(obj, destination)``; whatever it raises (a user's ``__reduce__`` may
    raise anything, ``SystemExit`` included) becomes a :class:`SerializationError`
    naming the part of ``obj`` that failed (``where()``: the place of ``obj`` in its
    message, asked for only then), with the original as its cause."""
    try:
        return fam.dumps(obj, destination)
    except (SerializationError, KeyboardInterrupt):
        raise
    except BaseException as exc:  # noqa: BLE001 - see above
        raise _describe_failure(obj, exc, "" if where is None else where()) from exc


def deserialize(s: Serialized) -> Any:
    """Rebuild the value of ``s``; raises whatever the family's ``loads`` raises."""
    fam = _families.get(s.family)
    if fam is None:
        raise KeyError(
            f"no serializer family named {s.family!r} is registered in this process"
        )
    return fam.loads(s.header, s.frames)


def _describe_failure(obj: Any, exc: BaseException, path: str) -> SerializationError:
    """Find the innermost part of ``obj`` that fails to pickle and name where it is."""
    return unserializable(obj, exc, path)


def unserializable(obj: Any, exc: BaseException, path: str = "") -> SerializationError:
    """The error for ``obj`` failing to pickle with ``exc``: it names the innermost
    part of ``obj`` that fails (``args[0]``, ``function``), below ``path``."""
    where, culprit = _find_unpicklable(obj, path, depth=0)
    return SerializationError(f"cannot serialize {_typename(culprit)!r} at {where or '<value>'}: {describe(exc)}")


def _find_unpicklable(obj: Any, path: str, depth: int) -> tuple[str, Any]:
    """The innermost part of ``obj`` that fails to pickle, and its path: into dicts,
    lists, tuples and objects that name their parts (``__serialization_parts__``, a
    list of ``(name, value)``: a task's function and arguments)."""
    if depth < 50:
        items: list[tuple[str, Any]] = []
        if type(obj) is dict:
            items = [(f"{path}[{short_repr(k)}]", v) for k, v in obj.items()]
        elif type(obj) in (list, tuple):
            items = [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
        else:
            parts = getattr(type(obj), "__serialization_parts__", None)
            if parts is not None:
                items = [(f"{path}.{name}" if path else name, v) for name, v in parts(obj)]
        for sub_path, value in items:
            try:
                pickle_dumps(value, buffer_callback=lambda b: None)
            except KeyboardInterrupt:
                raise
            except BaseException:  # noqa: BLE001 - as in serialize()
                return _find_unpicklable(value, sub_path, depth + 1)
    return path, obj


def _typename(obj: Any) -> str:
    typ = type(obj)
    return typ.__qualname__ if typ.__module__ == "builtins" else f"{typ.__module__}.{typ.__qualname__}"


# ----------------------------------------------------------------- pickle (the default)


def _needs_cloudpickle(data: bytes) -> bool:
    return b"__main__" in data


def pickle_dumps(obj: Any, buffer_callback: Callable[[Any], Any] | None = None) -> bytes:
    """Pickle protocol 5; cloudpickle for what plain pickle cannot do by reference."""
    buffers: list[Any] = []
    try:
        data = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
        if not _needs_cloudpickle(data):
            if buffer_callback is not None:
                for b in buffers:
                    buffer_callback(b)
            elif buffers:
                # no out-of-band sink: pickle again in-band
                data = pickle.dumps(obj, protocol=5)
            return data
    except (pickle.PicklingError, AttributeError, TypeError):
        # lambdas, closures, local classes: cloudpickle pickles them by value
        pass
    out = io.BytesIO()
    _CloudPickler(out, protocol=5, buffer_callback=buffer_callback).dump(obj)
    return out.getvalue()


def _reduce_memoryview(mv: memoryview) -> tuple[Any, tuple[Any, ...]]:
    # cloudpickle turns a memoryview into bytes; keep its type, format and shape
    problem = _memoryview_problem(mv)
    if problem:
        raise pickle.PicklingError(f"cannot pickle a memoryview: {problem}")
    # a copy: a PickleBuffer exporting from a memoryview can crash CPython's cyclic GC
    # (tp_clear of a memoryview that still has exports) when both become garbage
    data = pickle.PickleBuffer(mv.tobytes())
    assert mv.shape is not None  # a memoryview's shape is always a tuple (typeshed allows None)
    return _rebuild_memoryview, (data, mv.format, list(mv.shape), mv.readonly)


def _rebuild_memoryview(data: Any, fmt: str, shape: list[int], readonly: bool) -> memoryview:
    mv = _cast_back(data, fmt, shape)
    if readonly:
        return mv.toreadonly()
    return mv if not mv.readonly else _cast_back(bytearray(mv), fmt, shape)


def _memoryview_problem(mv: memoryview) -> str | None:
    """Why a receiver could not rebuild ``mv`` from its bytes with ``cast``, or None."""
    try:
        # typeshed lists literal formats only (and omits 'n', 'N'); this probes any
        memoryview(b"").cast("B").cast(mv.format)  # type: ignore[call-overload]
    except (ValueError, TypeError):
        return f"its format {mv.format!r} is not a native single-item format"
    assert mv.shape is not None  # a memoryview's shape is always a tuple (typeshed allows None)
    if mv.ndim > 1 and 0 in mv.shape:
        return f"its shape {mv.shape} is empty along a dimension"
    return None


def _cast_back(data: Any, fmt: str, shape: Sequence[int]) -> memoryview:
    """A memoryview of ``format``/``shape`` on the bytes of ``data`` (no copy)."""
    mv = memoryview(data).cast("B")
    if len(shape) == 1:  # also right for empty views, which cast(fmt, shape) refuses
        # the ignores: typeshed's cast takes literal formats only, fmt comes from the sender
        return mv if fmt == "B" else mv.cast(fmt)  # type: ignore[call-overload]
    return mv.cast(fmt, list(shape))  # type: ignore[call-overload]


class _CloudPickler(cloudpickle.Pickler):
    dispatch_table = ChainMap({memoryview: _reduce_memoryview}, cloudpickle.Pickler.dispatch_table)


def pickle_loads(data: Any, buffers: Sequence[Any] = ()) -> Any:
    return pickle.loads(data, buffers=buffers)


def _pickle_family_dumps(obj: Any, destination: str) -> tuple[Header, Frames]:
    buffers: list[pickle.PickleBuffer] = []
    data = pickle_dumps(obj, buffer_callback=buffers.append)
    return {}, [data, *(b.raw() for b in buffers)]


def _pickle_family_loads(header: Header, frames: Sequence[Any]) -> Any:
    return pickle.loads(frames[0], buffers=frames[1:])


# ----------------------------------------------------------------- bytes-like values

_BYTES_TYPES: dict[type, str] = {bytes: "bytes", bytearray: "bytearray", memoryview: "memoryview"}


def _bytes_dumps(obj: Any, destination: str) -> tuple[Header, Frames]:
    kind = _BYTES_TYPES.get(type(obj))
    if kind is None:  # a subclass: pickle keeps its type
        _, frames = _pickle_family_dumps(obj, destination)
        return {"kind": "pickle"}, frames
    if kind != "memoryview":
        return {"kind": kind}, [obj]
    problem = _memoryview_problem(obj)
    if problem:
        # refuse here rather than send what the receiver cannot rebuild
        raise SerializationError(
            f"cannot serialize a memoryview: {problem} (send the exporting object, "
            "e.g. the numpy array, or mv.cast('B'))"
        )
    data = obj.cast("B") if obj.c_contiguous else memoryview(obj.tobytes())
    return {"kind": kind, "format": obj.format, "shape": list(obj.shape)}, [data]


def _bytes_loads(header: Header, frames: Sequence[Any]) -> Any:
    kind = header["kind"]
    if kind == "pickle":
        return _pickle_family_loads(header, frames)
    frame = frames[0]
    if kind == "bytes":
        return frame if type(frame) is bytes else bytes(frame)
    if kind == "bytearray":
        return frame if type(frame) is bytearray else bytearray(frame)
    return _cast_back(frame, header["format"], header["shape"])


def sizeof(obj: Any, strict: bool = False) -> int:
    """A cheap estimate of the bytes ``obj`` occupies, used to decide on offloading.
    An object that cannot say its size (its ``nbytes`` or ``__sizeof__`` raises) counts
    as 64 bytes; with ``strict`` the error is raised instead (a worker measuring a
    task's result fails that task with it)."""
    try:
        return _sizeof(obj)
    except Exception:  # noqa: BLE001 - a user's nbytes/__sizeof__ may raise anything
        if strict:
            raise
        return 64


def sizes(obj: Any) -> tuple[int, int]:
    """``(sizeof(obj, strict=True), its managed size)`` (see :mod:`.sizes`), measuring
    it once where the two are the same measure (anything but scalars, bytes, objects
    with an ``nbytes`` and plain containers): what a worker measures a task's result
    by, in the task's thread. Raises what :func:`sizeof` raises with ``strict``."""
    rough = _rough_sizeof(obj)
    if rough is not None:
        return rough, _managed_sizeof(obj, False)
    try:
        size = _managed_sizeof(obj, True)
    except TypeError:
        return 64, _managed_sizeof(obj, False)
    return size, size


def _sizeof(obj: Any) -> int:
    rough = _rough_sizeof(obj)
    if rough is not None:
        return rough
    # anything else by its managed size (a user's registration, else dask's sizeof):
    # sys.getsizeof asks __sizeof__, and pandas' walks every string of a frame (1.6 ms
    # for 5 rows, 27 ms for 100,000 strings, on every result and every transfer);
    # dask samples them
    if isinstance(obj, Serialize):
        obj = obj.data
    try:
        return _managed_sizeof(obj, True)
    except TypeError:
        return 64


def _rough_sizeof(obj: Any) -> int | None:
    """``obj``'s size when it is quick to tell (a scalar, bytes, an ``nbytes``, a
    plain container's own size); ``None`` for the others."""
    typ = type(obj)
    if typ is int or typ is float or typ is str or typ is bool or obj is None:
        return sys.getsizeof(obj)  # (the common arguments and results: no lookups)
    if typ is bytes:
        return len(obj)
    if isinstance(obj, Serialize):
        if obj.nbytes is not None:
            return obj.nbytes
        obj = obj.data
        typ = type(obj)
    if isinstance(obj, Serialized):
        return obj.nbytes
    if isinstance(obj, (bytes, bytearray)):
        return len(obj)
    if isinstance(obj, memoryview):
        return obj.nbytes
    if getattr(typ, "__shoal_handle__", False):
        return 64  # a handle on something remote (an actor): asking it would be a call
    nbytes = getattr(obj, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    if typ is list or typ is tuple or typ is set or typ is dict:
        # a rough guess at the elements; exact sizing would cost as much as pickling
        return sys.getsizeof(obj) * 8
    return None


def _managed_sizeof(obj: Any, strict: bool) -> int:
    from .sizes import managed_sizeof  # (sizes imports this module as it loads)

    return managed_sizeof(obj, strict)


class BigInt:
    """An int too large for msgpack, on its way out of band (family ``int``: its
    decimal digits in the header, so that a receiver rebuilds it without unpickling)."""

    __slots__ = ("value",)

    def __init__(self, value: int):
        self.value = value


def _int_dumps(obj: Any, destination: str) -> tuple[Header, Frames]:
    return {"int": str(obj.value)}, []


def _int_loads(header: Header, frames: Sequence[Any]) -> Any:
    digits = header["int"]
    if not isinstance(digits, str) or len(digits) > 4300:
        raise ValueError("an int family value holds at most 4300 decimal digits")
    return int(digits)


register_serializer(object, _pickle_family_dumps, _pickle_family_loads, name="pickle")
register_serializer(BigInt, _int_dumps, _int_loads, name="int")
for _t in _BYTES_TYPES:
    register_serializer(_t, _bytes_dumps, _bytes_loads, name="bytes")
