"""Values every language reads: the destination ``neutral`` and its families
(protocol §4.5: ``shoal.value``, ``shoal.array``).

A peer that says in its handshake that it ``reads`` only ``"neutral"`` encodings (a
worker written in another language, §3) is sent no pickle. Towards it a value is

- ``shoal.value``: header ``{}``, frames ``[msgpack of the value, buffer_1, ...]``,
  the value msgpack-native (nil, bool, int, float, str, bin, arrays, maps with str
  keys; tuples travel as arrays), its numpy arrays as ext type 4 over the msgpack of
  ``[dtype, shape, i]`` whose bytes (C order, little-endian) are ``buffer_i``;
- ``shoal.array``: a :class:`NeutralArray` (a numpy array that should travel so, also
  between Python processes): header ``{"dtype", "shape"}``, one frame of raw bytes.

Any other type raises :class:`~shoal.errors.SerializationError` naming it: there is no
meaning to give it in another language. Python reads both families back as Python
values, numpy arrays over the received bytes (no copy). Families registered for a type
without naming destinations serve only the Python ones; one that also serves
``neutral`` says so (``destinations=[..., NEUTRAL]``), and its receivers in other
languages must know it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack

from ..errors import SerializationError
from .serialize import DESTINATIONS, NEUTRAL, register_serializer

__all__ = ["ARRAY_DTYPES", "EXT_TUPLE", "EXT_REF", "EXT_ARRAY", "NeutralArray", "to_neutral", "from_neutral",
           "array_parts", "array_from_parts", "pack_key"]

#: the numpy type strings an array of every language may have (little-endian)
ARRAY_DTYPES = ("|b1", "|i1", "|u1", "<i2", "<u2", "<i4", "<u4", "<i8", "<u8", "<f4", "<f8")
#: ext types: a tuple (in keys), a dependency (in a ``shoal.call``), an array
EXT_TUPLE = 1
EXT_REF = 3
EXT_ARRAY = 4
#: how deep a value may nest
MAX_DEPTH = 64
_NEUTRAL_TYPES = ("None, bool, int, float, str, bytes, lists, tuples, dicts with str keys, "
                  "numpy arrays of numbers or bools")


def to_neutral(value: Any, buffers: list[Any], extra: Callable[[Any], Any] | None = None,
               what: str = "a value sent to a worker of another language", depth: int = 0) -> Any:
    """``value`` as msgpack-native data, its arrays as ext 4 over ``buffers`` (appended
    to; frame ``i`` is ``buffers[i - 1]``). ``extra(value)`` gives the ext of a type of
    the caller's (a dependency in a ``shoal.call``), or None. Raises
    :class:`SerializationError` naming the first part of another type."""
    if depth > MAX_DEPTH:
        raise SerializationError(f"{what} nests deeper than {MAX_DEPTH}")
    typ = type(value)
    if value is None or typ in (bool, str, bytes, float):
        return value
    if typ is int:
        if not -(1 << 63) <= value < (1 << 64):
            raise SerializationError(f"{what}: an int of {value.bit_length()} bits has no meaning in another language")
        return value
    if typ in (list, tuple):
        return [to_neutral(v, buffers, extra, what, depth + 1) for v in value]
    if typ is dict:
        out = {}
        for k, v in value.items():
            if type(k) is not str:
                raise SerializationError(f"{what}: a map key must be a str, got {type(k).__name__}")
            out[k] = to_neutral(v, buffers, extra, what, depth + 1)
        return out
    if typ is bytearray or typ is memoryview:
        return bytes(value)
    if _is_ndarray(value) or typ is NeutralArray:
        dtype, shape, raw = array_parts(value.array if typ is NeutralArray else value)
        buffers.append(raw)
        return msgpack.ExtType(EXT_ARRAY, msgpack.packb([dtype, shape, len(buffers)]))
    if extra is not None:
        ext = extra(value)
        if ext is not None:
            return ext
    raise SerializationError(
        f"{what}: a value of type {typ.__module__}.{typ.__qualname__} has no meaning in another language "
        f"(there: {_NEUTRAL_TYPES})")


def from_neutral(data: Any, frames: Any, ext: Callable[[int, bytes], Any] | None = None) -> Any:
    """The value that msgpack ``data`` encodes, its ext 4 arrays over ``frames``
    (``frames[i]``), tuples (ext 1) as tuples; ``ext(code, data)`` decodes the caller's
    other ext types. Raises ``ValueError`` for anything malformed."""

    def hook(code: int, payload: bytes) -> Any:
        if code == EXT_TUPLE:
            return tuple(msgpack.unpackb(payload, ext_hook=hook, raw=False))
        if code == EXT_ARRAY:
            parts = msgpack.unpackb(payload, raw=False)
            if type(parts) is not list or len(parts) != 3:
                raise ValueError(f"an array is [dtype, shape, frame], got {parts!r:.100}")
            dtype, shape, index = parts
            if type(index) is not int or not 1 <= index < len(frames):
                raise ValueError(f"an array names frame {index!r:.20} of {len(frames)}")
            return array_from_parts(dtype, shape, frames[index])
        if ext is not None:
            return ext(code, payload)
        raise ValueError(f"unknown ext type {code} in a neutral value")

    return msgpack.unpackb(data, ext_hook=hook, raw=False, strict_map_key=False)


def _is_ndarray(value: Any) -> bool:
    typ = type(value)
    return typ.__module__ == "numpy" and typ.__name__ == "ndarray"


def array_parts(array: Any) -> tuple[str, list[int], memoryview]:
    """The dtype string, shape and raw bytes (C order, little-endian) of a numpy array
    of a numeric or bool type; a copy only when it is not so already."""
    import numpy as np

    dtype = array.dtype
    if dtype.byteorder == ">":
        dtype = dtype.newbyteorder("<")
    if dtype.str not in ARRAY_DTYPES:
        raise SerializationError(f"a numpy array of dtype {array.dtype} has no meaning in another language "
                                 f"(dtypes: {', '.join(ARRAY_DTYPES)})")
    array = np.ascontiguousarray(array, dtype=dtype)
    return dtype.str, list(array.shape), memoryview(array).cast("B")


def array_from_parts(dtype: Any, shape: Any, raw: Any) -> Any:
    """The numpy array over ``raw`` (no copy) that ``dtype`` and ``shape`` describe;
    ``ValueError`` for a dtype, shape or length that do not fit."""
    import numpy as np

    if dtype not in ARRAY_DTYPES:
        raise ValueError(f"an array of dtype {dtype!r:.60} (dtypes: {', '.join(ARRAY_DTYPES)})")
    if type(shape) is not list or len(shape) > 32 or not all(type(n) is int and n >= 0 for n in shape):
        raise ValueError(f"an array's shape is a list of at most 32 ints >= 0, got {shape!r:.100}")
    dt = np.dtype(dtype)
    count = 1
    for n in shape:
        count *= n
    view = memoryview(raw).cast("B")
    if view.nbytes != count * dt.itemsize:
        raise ValueError(
            f"an array of shape {shape} and dtype {dtype} has {count * dt.itemsize} bytes, got {view.nbytes}")
    return np.frombuffer(view, dtype=dt).reshape(shape)


def pack_key(key: Any) -> bytes:
    """A task key as shoal's messages carry it (tuples as ext 1)."""
    return msgpack.packb(key, use_bin_type=True, default=_key_default, strict_types=True)


def _key_default(obj: Any) -> Any:
    if type(obj) is tuple:
        return msgpack.ExtType(EXT_TUPLE, pack_key(list(obj)))
    raise SerializationError(f"a key of type {type(obj).__name__} cannot be packed")


class NeutralArray:
    """A numpy array to send in the family ``shoal.array`` (wrap it: by default, numpy
    arrays travel pickled between Python processes)."""

    __slots__ = ("array",)

    def __init__(self, array: Any) -> None:
        self.array = array


def _array_dumps(value: NeutralArray, destination: str) -> tuple[dict[str, Any], list[Any]]:
    dtype, shape, raw = array_parts(value.array)
    return {"dtype": dtype, "shape": shape}, [raw]


def _array_loads(header: Any, frames: Any) -> Any:
    if len(frames) != 1:
        raise ValueError(f"a shoal.array has one frame, got {len(frames)}")
    return array_from_parts(header.get("dtype"), header.get("shape"), frames[0])


def _value_dumps(value: Any, destination: str) -> tuple[dict[str, Any], list[Any]]:
    buffers: list[Any] = []
    return {}, [msgpack.packb(to_neutral(value, buffers), use_bin_type=True), *buffers]


def _value_loads(header: Any, frames: Any) -> Any:
    if not frames:
        raise ValueError("a shoal.value has at least one frame")
    return from_neutral(frames[0], frames)


register_serializer(NeutralArray, _array_dumps, _array_loads, destinations=[*DESTINATIONS, NEUTRAL],
                    name="shoal.array")
# everything else towards a neutral peer (and, for tests or by choice, any destination)
register_serializer(object, _value_dumps, _value_loads, destinations=[NEUTRAL], name="shoal.value")
