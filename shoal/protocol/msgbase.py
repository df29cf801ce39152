"""What every wire message is built on: the task key (:data:`Key`, checked by
:func:`key_problem`), segment infos (:class:`SegmentInfo`, :class:`SegmentRef`) and the
base struct :class:`Msg`. The messages themselves, their tables and the decoder are in
:mod:`.messages` (which re-exports these names)."""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any, ClassVar, TypeAlias

import msgspec

from ..errors import ProtocolError

__all__ = ["Key", "MAX_KEY_DEPTH", "key_problem", "SegmentInfo", "SegmentRef", "segment_info", "Msg"]

#: a task key: what :func:`key_problem` accepts (a str, bytes, a 64-bit int, a finite
#: float, or tuples of these); to the type checker, any hashable value. The one
#: definition: every layer imports it from here
Key: TypeAlias = Hashable

#: how deeply tuples may nest in a key
MAX_KEY_DEPTH = 16
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1


def key_problem(key: Any, depth: int = 0) -> str | None:
    """Why ``key`` is not a task key (a str of valid Unicode, bytes, a 64-bit int, a
    finite float, or a tuple of keys nested at most :data:`MAX_KEY_DEPTH` deep), or
    None if it is one."""
    typ = type(key)
    if typ is str:
        if key.isascii():
            return None
        try:
            key.encode()
        except UnicodeEncodeError as exc:
            return f"a str key must be valid Unicode ({exc.reason} at {exc.start})"
        return None
    if typ is bytes:
        return None
    if typ is float:
        # NaN equals nothing, itself included: a NaN key could never be found again
        return None if math.isfinite(key) else "a float key must be finite"
    if typ is int:
        return None if _INT_MIN <= key <= _INT_MAX else f"an int key must fit in 64 bits ({key.bit_length()} bits)"
    if typ is tuple:
        if depth >= MAX_KEY_DEPTH:
            return f"a key may nest tuples at most {MAX_KEY_DEPTH} deep"
        for k in key:
            problem = key_problem(k, depth + 1)
            if problem is not None:
                return problem
        return None
    return f"a key is a str, bytes, int, float or tuple of these, not {typ.__name__}"


class SegmentInfo(msgspec.Struct, array_like=True):
    """Where a value lies in shared memory (docs/protocol.md §4.7): on the wire the
    array ``[name, size, pickle_len, [[offset, length], ...], token]``, and a sixth
    element, the value's checksum, when its owner computed one (``shm-verify``)."""

    name: str
    size: int
    pickle_len: int
    spans: list[tuple[int, int]]
    token: str
    checksum: int | None = None

    def to_list(self) -> list[Any]:
        """The wire form, for the layers that store and forward it."""
        out = [self.name, self.size, self.pickle_len, [list(span) for span in self.spans], self.token]
        if self.checksum is not None:
            out.append(self.checksum)
        return out


class SegmentRef(msgspec.Struct, array_like=True, frozen=True):
    """One buffer of a ``shoal.same-host`` or ``shoal.runspec`` header's ``refs`` that
    lies in shared memory (docs/protocol.md §4.7): on the wire the array ``[name,
    size, offset, length, flag, token]``; flag 0 maps an existing segment, flag 1 a
    transfer segment that the receiver takes over."""

    name: str
    size: int
    offset: int
    length: int
    flag: int
    token: str

    @classmethod
    def parse(cls, value: Any) -> SegmentRef:
        """``value`` (a ref as a peer sent it) checked: the six elements with their
        types, the span inside the segment. Raises ``ValueError`` naming it."""
        try:
            ref = msgspec.convert(value, cls)
        except msgspec.ValidationError as exc:
            raise ValueError(f"malformed shared-memory reference {value!r:.200}: {exc}") from None
        if ref.offset < 0 or ref.length < 0 or ref.offset + ref.length > ref.size or ref.flag not in (0, 1):
            raise ValueError(f"malformed shared-memory reference {value!r:.200}")
        return ref

    def to_list(self) -> list[Any]:
        """The wire form, as headers carry it."""
        return [self.name, self.size, self.offset, self.length, self.flag, self.token]


def segment_info(value: Any) -> list[Any] | None:
    """``value`` checked as a segment info (nil allowed) and returned in its wire form.
    Raises :class:`ProtocolError` for anything else."""
    if value is None:
        return None
    try:
        return msgspec.convert(value, SegmentInfo).to_list()
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"malformed segment info: {exc}") from None


class Msg(msgspec.Struct, tag_field="op", forbid_unknown_fields=False):
    """Base of every message; ``op`` is the tag."""

    #: names of fields that hold one key, and of fields that hold a list of keys or a
    #: map keyed by keys (checked by :func:`decode`)
    key_fields: ClassVar[tuple[str, ...]] = ()
    key_list_fields: ClassVar[tuple[str, ...]] = ()
    #: fields the document calls optional: :func:`to_wire` leaves them out while they
    #: hold their default
    optional: ClassVar[tuple[str, ...]] = ()
    #: fields that hold a segment info (False) or a map of them by key (True)
    segment_fields: ClassVar[tuple[tuple[str, bool], ...]] = ()
