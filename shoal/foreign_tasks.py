"""Tasks for workers of other languages: a function named by language, module and
name, and arguments every language can read (protocol §4.5, families ``shoal.call``
and ``shoal.array``).

``shoal.foreign("js", "stats", "scale")`` names the function ``scale`` that the module
``stats`` of a JavaScript worker exports. Submitted like any function,
``client.submit(shoal.foreign("js", "stats", "scale"), x, 2.0)`` makes a task of
language ``"js"``: the scheduler places it only on a worker that registered that
language, and its payload is no pickle but a ``shoal.call``: the descriptor in the
header, the arguments packed with msgpack in the first frame. In those arguments:

- msgpack-native values travel as they are: nil, bools, ints, floats, str, bytes,
  lists and tuples (both as arrays), maps with str keys;
- a future (the value of another task) is ext type 3 over the msgpack of its key;
- a numpy array of a numeric or bool type is ext type 4 over the msgpack of
  ``[dtype, shape, frame]``: its bytes, C order and little-endian, are frame
  ``frame`` of the payload (counted after the first), so they are never copied into
  the header.

Anything else has no meaning in another language: submitting it raises
:class:`~shoal.errors.SerializationError` naming its type, and nothing is sent.

A value every language can read is an array in the family ``shoal.array`` (header
``{"dtype", "shape"}``, one frame of raw bytes): Python reads it as a numpy array
over the received bytes, without a copy.
"""

from __future__ import annotations

from typing import Any

import msgpack

from .errors import SerializationError
from .protocol.resources import language_problem
from .protocol.serialize import register_serializer
from .taskspec import Ref

__all__ = ["foreign", "ForeignFunction", "ForeignCall", "NeutralArray", "ARRAY_DTYPES", "EXT_REF", "EXT_ARRAY"]

#: the numpy type strings an array of every language may have (little-endian)
ARRAY_DTYPES = ("|b1", "|i1", "|u1", "<i2", "<u2", "<i4", "<u4", "<i8", "<u8", "<f4", "<f8")
#: ext types inside a ``shoal.call``'s arguments
EXT_REF = 3
EXT_ARRAY = 4
#: ext type of a tuple in shoal's messages (a key may be a tuple)
_EXT_TUPLE = 1
#: how deep arguments may nest
_MAX_DEPTH = 64


class ForeignFunction:
    """A function of a worker of another language (see the module): calling it here
    raises ``TypeError``; submit it instead."""

    __slots__ = ("language", "module", "function")

    def __init__(self, language: str, module: str, function: str) -> None:
        problem = language_problem(language)
        if problem is not None:
            raise ValueError(problem)
        for what, name in (("module", module), ("function", function)):
            if not isinstance(name, str) or not 1 <= len(name) <= 1000:
                raise ValueError(f"foreign(): the {what} is a name of 1 to 1000 characters, got {name!r:.100}")
        if language == "python":
            raise ValueError("foreign(): a Python function is submitted as itself")
        self.language = language
        self.module = module
        self.function = function

    @property
    def __name__(self) -> str:  # keys of its tasks: "scale-<token>", as for a Python function
        return self.function

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"{self!r} runs on a {self.language} worker: submit it (client.submit(fn, ...))")

    def __repr__(self) -> str:
        return f"foreign({self.language!r}, {self.module!r}, {self.function!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ForeignFunction) and (self.language, self.module, self.function) == (
            other.language, other.module, other.function)

    def __hash__(self) -> int:
        return hash((self.language, self.module, self.function))

    def __reduce__(self) -> Any:
        return ForeignFunction, (self.language, self.module, self.function)


def foreign(language: str, module: str, function: str) -> ForeignFunction:
    """The function ``function`` of module ``module`` on workers of ``language``
    (``"js"``, ...), to submit like a Python function."""
    return ForeignFunction(language, module, function)


class ForeignCall:
    """The payload of a task of another language: ``fn(*args, **kwargs)``, the
    arguments with futures already turned into :class:`~shoal.taskspec.Ref`\\ s."""

    __slots__ = ("fn", "args", "kwargs", "_frames")

    def __init__(self, fn: ForeignFunction, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> None:
        self.fn = fn
        self.args = args
        self.kwargs = kwargs or {}
        #: the header and frames, made once (at submit, where they are checked)
        self._frames: tuple[dict[str, Any], list[Any]] | None = None

    def __repr__(self) -> str:
        return f"ForeignCall({self.fn!r}, {len(self.args)} args)"

    def frames(self) -> tuple[dict[str, Any], list[Any]]:
        """The ``shoal.call`` header and frames; raises :class:`SerializationError` for
        an argument no other language can read."""
        if self._frames is None:
            buffers: list[Any] = []
            packed = msgpack.packb([_neutral(list(self.args), buffers, 0), _neutral(self.kwargs, buffers, 0)],
                                   use_bin_type=True)
            header = {"language": self.fn.language, "module": self.fn.module, "function": self.fn.function}
            self._frames = header, [packed, *buffers]
        header, frames = self._frames
        return dict(header), list(frames)


def _neutral(value: Any, buffers: list[Any], depth: int) -> Any:
    """``value`` as msgpack-native data with ext 3 and ext 4 (see the module)."""
    if depth > _MAX_DEPTH:
        raise SerializationError(f"the arguments of a foreign task nest deeper than {_MAX_DEPTH}")
    typ = type(value)
    if value is None or typ in (bool, str, bytes, float):
        return value
    if typ is int:
        if not -(1 << 63) <= value < (1 << 64):
            raise SerializationError(f"an int of {value.bit_length()} bits has no meaning in another language")
        return value
    if typ in (list, tuple):
        return [_neutral(v, buffers, depth + 1) for v in value]
    if typ is dict:
        out = {}
        for k, v in value.items():
            if type(k) is not str:
                raise SerializationError(
                    f"a map key of a foreign task's arguments must be a str, got {type(k).__name__}")
            out[k] = _neutral(v, buffers, depth + 1)
        return out
    if typ is Ref:
        return msgpack.ExtType(EXT_REF, _pack_key(value.key))
    if typ is bytearray or typ is memoryview:
        return bytes(value)
    if _is_ndarray(value):
        dtype, shape, raw = array_parts(value)
        buffers.append(raw)
        return msgpack.ExtType(EXT_ARRAY, msgpack.packb([dtype, shape, len(buffers)]))
    raise SerializationError(
        f"a value of type {typ.__module__}.{typ.__qualname__} has no meaning on a worker of another language "
        "(arguments of foreign tasks: None, bool, int, float, str, bytes, lists, dicts with str keys, "
        "numpy arrays of numbers or bools, futures)")


def _pack_key(key: Any) -> bytes:
    """A task key as shoal's messages carry it (tuples as ext 1)."""
    return msgpack.packb(key, use_bin_type=True, default=_key_default, strict_types=True)


def _key_default(obj: Any) -> Any:
    if type(obj) is tuple:
        return msgpack.ExtType(_EXT_TUPLE, _pack_key(list(obj)))
    raise SerializationError(f"a key of type {type(obj).__name__} cannot be packed")


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


def _call_dumps(call: ForeignCall, destination: str) -> tuple[dict[str, Any], list[Any]]:
    return call.frames()


def _call_loads(header: Any, frames: Any) -> ForeignCall:
    """A ``shoal.call`` read back (tests; a Python worker does not run one): refs and
    arrays decoded."""
    if not frames:
        raise ValueError("a shoal.call has at least one frame")

    def hook(code: int, data: bytes) -> Any:
        if code == EXT_REF:
            return Ref(msgpack.unpackb(data, ext_hook=hook, raw=False))
        if code == _EXT_TUPLE:
            return tuple(msgpack.unpackb(data, ext_hook=hook, raw=False))
        if code == EXT_ARRAY:
            dtype, shape, index = msgpack.unpackb(data, raw=False)
            if type(index) is not int or not 1 <= index < len(frames):
                raise ValueError(f"an array argument names frame {index!r:.20} of {len(frames)}")
            return array_from_parts(dtype, shape, frames[index])
        raise ValueError(f"unknown ext type {code} in a shoal.call")

    args, kwargs = msgpack.unpackb(frames[0], ext_hook=hook, raw=False, strict_map_key=True)
    fn = ForeignFunction(header.get("language"), header.get("module"), header.get("function"))
    return ForeignCall(fn, tuple(args), kwargs)


register_serializer(ForeignCall, _call_dumps, _call_loads, name="shoal.call")
register_serializer(NeutralArray, _array_dumps, _array_loads, name="shoal.array")
