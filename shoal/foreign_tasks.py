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

from .protocol.neutral import (
    ARRAY_DTYPES,
    EXT_ARRAY,
    EXT_REF,
    NeutralArray,
    from_neutral,
    pack_key,
    to_neutral,
)
from .protocol.resources import language_problem
from .protocol.serialize import DESTINATIONS, NEUTRAL, register_serializer
from .taskspec import Ref

__all__ = ["foreign", "ForeignFunction", "ForeignCall", "NeutralArray", "ARRAY_DTYPES", "EXT_REF", "EXT_ARRAY"]

_WHAT = "an argument of a foreign task"


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
            packed = msgpack.packb([to_neutral(list(self.args), buffers, _ref_ext, _WHAT),
                                    to_neutral(self.kwargs, buffers, _ref_ext, _WHAT)], use_bin_type=True)
            header = {"language": self.fn.language, "module": self.fn.module, "function": self.fn.function}
            self._frames = header, [packed, *buffers]
        header, frames = self._frames
        return dict(header), list(frames)


def _ref_ext(value: Any) -> Any:
    """A dependency (a future turned into a :class:`~shoal.taskspec.Ref`) as ext 3."""
    if type(value) is Ref:
        return msgpack.ExtType(EXT_REF, pack_key(value.key))
    return None


def _call_dumps(call: ForeignCall, destination: str) -> tuple[dict[str, Any], list[Any]]:
    return call.frames()


def _call_loads(header: Any, frames: Any) -> ForeignCall:
    """A ``shoal.call`` read back (tests; a Python worker does not run one): refs and
    arrays decoded."""
    if not frames:
        raise ValueError("a shoal.call has at least one frame")

    def ref(code: int, data: bytes) -> Any:
        if code == EXT_REF:
            return Ref(from_neutral(data, ()))
        raise ValueError(f"unknown ext type {code} in a shoal.call")

    args, kwargs = from_neutral(frames[0], frames, ref)
    if type(args) is not list or type(kwargs) is not dict:
        raise ValueError("a shoal.call's arguments are [args, kwargs]")
    fn = ForeignFunction(header.get("language"), header.get("module"), header.get("function"))
    return ForeignCall(fn, tuple(args), kwargs)


register_serializer(ForeignCall, _call_dumps, _call_loads, destinations=[*DESTINATIONS, NEUTRAL], name="shoal.call")
