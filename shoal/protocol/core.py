"""Messages to frames and back.

A message is any nesting of dict/list/tuple/str/bytes/int/float/bool/None with
:class:`Serialize` and :class:`Serialized` values anywhere inside. ``dumps`` turns it
into a list of frames:

- ``frames[0]``: the message as msgpack. Tuples travel as msgpack ext type 1 so they come
  back as tuples; every value that goes out of band is replaced by ext type 2 holding its
  index in the table.
- ``frames[1]`` (only when there are out-of-band values): the table, msgpack
  ``[[family, header, n_frames, opaque], ...]``.
- ``frames[2:]``: every family's frames, in table order, never copied.

``opaque`` entries (``to_serialize`` values and objects msgpack cannot carry) come back
as :class:`Serialized` when the receiver does not deserialize; transparent entries
(bytearray, memoryview, large bytes, big ints) always come back as the value.

``dumps`` works in two steps so that a transport can run the costly one off its event
loop: :func:`prepare` walks the message (cheap) and :meth:`Prepared.frames` runs the
families' serializers.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from contextvars import ContextVar
from functools import partial
from typing import Any

import msgpack
import msgspec

from ..errors import ProtocolError, SerializationError
from .leases import Lease, collecting
from .msgbase import Msg
from .serialize import (
    ALL_DESTINATIONS,
    BigInt,
    REMOTE,
    Serialize,
    Serialized,
    _family_for,
    _forwarding,
    deserialize as _deserialize,
    family_dumps,
    sizeof,
)

__all__ = ["dumps", "loads", "prepare", "Prepared", "unwrap", "INLINE_BYTES_LIMIT"]

EXT_TUPLE = 1
EXT_OOB = 2
#: tuples (msgpack ext 1) nest at most this deep in a received message
MAX_NESTING = 32
# bytes values larger than this leave the header and travel as their own frame
INLINE_BYTES_LIMIT = 1 << 16
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1
_NO_HOOKS = (None, None)


def _default(obj: Any) -> Any:
    if type(obj) is tuple:
        return msgpack.ExtType(EXT_TUPLE, _pack(list(obj)))
    raise TypeError(f"cannot pack {type(obj).__name__}")  # the walk makes this unreachable


_packers = threading.local()
_PACKER_KEEP = 1 << 20  # a packer whose buffer grew beyond this is dropped, not kept


def _pack(obj: Any) -> bytes:
    # msgpack.packb builds a Packer (and mallocs its 256 KiB buffer) per call: reuse one
    # per thread. A nested call (a tuple, from _default) finds none and makes its own.
    packer = getattr(_packers, "packer", None)
    if packer is None:
        packer = msgpack.Packer(default=_default, strict_types=True, use_bin_type=True)
    else:
        _packers.packer = None
    data = packer.pack(obj)
    if len(data) <= _PACKER_KEEP:
        _packers.packer = packer
    return data


class Prepared:
    """A message walked for out-of-band values; :meth:`frames` serializes them."""

    __slots__ = ("msg", "values", "paths_src", "leases")

    def __init__(self, msg: Any, values: list[tuple[Any, bool]], paths_src: Any):
        #: leases the families took while serializing (see :mod:`.leases`)
        self.leases: list[Lease] = []
        self.msg = msg
        self.values = values  # (value, opaque)
        self.paths_src = paths_src

    @property
    def nbytes(self) -> int:
        """Estimated size of the out-of-band values."""
        return sum(sizeof(v) for v, _ in self.values)

    def frames(self, destination: str = REMOTE, leases: bool = True) -> list[Any]:
        """Serialize: ``[header, table, *family frames]``. Raises ``ValueError`` for an
        unknown destination and :class:`SerializationError` for a value that cannot be
        serialized, before returning anything."""
        if destination not in ALL_DESTINATIONS:
            raise ValueError(f"unknown destination {destination!r}; expected one of {ALL_DESTINATIONS}")
        try:
            header = _pack(self.msg)
        except (TypeError, ValueError) as exc:  # e.g. a str with lone surrogates
            raise SerializationError(f"cannot pack the message: {type(exc).__name__}: {exc}") from exc
        if not self.values:
            return [header]
        table: list[list[Any]] = []
        frames: list[Any] = [header, b""]
        try:
            for i, (value, opaque) in enumerate(self.values):
                if isinstance(value, Serialized):
                    family, fheader, fframes = value.family, value.header, value.frames
                    forward = _forwarding.get(family, _NO_HOOKS)[1]
                    if forward is not None:
                        fheader, fframes = forward(value, destination)
                    taken: list[Lease] | None = []
                else:
                    obj = value.data if isinstance(value, Serialize) else value
                    fam = _family_for(obj, destination)
                    with collecting([] if leases else None) as taken:
                        try:
                            fheader, fframes = family_dumps(fam, obj, destination, partial(_path_of, self.paths_src, i))
                        finally:
                            self.leases.extend(taken or ())
                    family = fam.name
                entry = [family, fheader, len(fframes), opaque]
                if taken:
                    entry.append([lz.id for lz in taken])
                table.append(entry)
                frames.extend(fframes)
            try:
                frames[1] = _pack(table)
            except TypeError as exc:
                raise SerializationError(f"a serializer family returned a header msgpack cannot carry: {exc}") from exc
        except BaseException:
            self.end_leases("failed")  # nothing was sent: nobody will acknowledge
            raise
        return frames

    def end_leases(self, reason: str) -> None:
        """End every lease this message took (it was not, or will not be, delivered)."""
        for lz in self.leases:
            lz.end(reason)


def prepare(msg: Any) -> Prepared:
    """Walk ``msg``, pulling out every value that travels out of band."""
    values: list[tuple[Any, bool]] = []
    return Prepared(_walk(msg, values), values, msg)


def dumps(msg: Any, destination: str = REMOTE) -> list[Any]:
    """Serialize a message into frames for ``destination``.

    Raises :class:`SerializationError` (naming the value's type and its place in the
    message) before anything is produced if some value cannot be serialized.
    """
    return prepare(msg).frames(destination, leases=False)


def _oob(value: Any, opaque: bool, values: list[tuple[Any, bool]]) -> msgpack.ExtType:
    values.append((value, opaque))
    return msgpack.ExtType(EXT_OOB, (len(values) - 1).to_bytes(4, "little"))


def _walk(obj: Any, values: list[tuple[Any, bool]], opaque: bool = True) -> Any:
    typ = type(obj)
    if typ is str or typ is float or typ is bool or obj is None:
        return obj
    if typ is int:
        return obj if _INT_MIN <= obj <= _INT_MAX else _oob(BigInt(obj), False, values)
    if typ is dict:
        items = None
        for i, (k, v) in enumerate(obj.items()):
            # keys before values (the order _path_of counts in); keys are transparent:
            # a receiver that does not deserialize still needs hashable keys
            # (str keys and plain scalar values, the common case, inline)
            k2 = k if type(k) is str else _walk(k, values, opaque=False)
            tv = type(v)
            v2 = (
                v
                if tv is str or tv is bool or v is None or tv is float or (tv is int and _INT_MIN <= v <= _INT_MAX)
                else _walk(v, values, opaque)
            )
            if v2 is not v or k2 is not k:
                if items is None:
                    items = list(obj.items())
                items[i] = (k2, v2)
        return obj if items is None else dict(items)  # same key order as obj
    if typ is list or typ is tuple:
        out_l = None
        for i, v in enumerate(obj):
            v2 = _walk(v, values, opaque)
            if v2 is not v:
                if out_l is None:
                    out_l = list(obj)
                out_l[i] = v2
        if out_l is None:
            return obj
        return out_l if typ is list else tuple(out_l)
    if typ is bytes:
        return obj if len(obj) <= INLINE_BYTES_LIMIT else _oob(obj, False, values)
    if typ is bytearray or typ is memoryview:
        return _oob(obj, False, values)
    # Serialize/Serialized values and anything msgpack cannot carry as it is travel
    # through their serializer family
    return _oob(obj, opaque, values)


def _path_of(msg: Any, index: int) -> str:
    """The place (``args[1]['lock']``) of the index-th out-of-band value of ``msg``."""
    counter = [0]

    def find(obj: Any, path: str) -> str | None:
        typ = type(obj)
        if typ is dict:
            for k, v in obj.items():
                r = find(k, f"{path}<key {k!r}>")
                if r is not None:
                    return r
                r = find(v, _sub(path, k))
                if r is not None:
                    return r
            return None
        if typ is list or typ is tuple:
            for i, v in enumerate(obj):
                r = find(v, f"{path}[{i}]")
                if r is not None:
                    return r
            return None
        if typ in (str, float, bool, type(None)) or (typ is int and _INT_MIN <= obj <= _INT_MAX):
            return None
        if typ is bytes and len(obj) <= INLINE_BYTES_LIMIT:
            return None
        if counter[0] == index:
            return path or "<message>"
        counter[0] += 1
        return None

    return find(msg, "") or "<message>"


def _sub(path: str, key: Any) -> str:
    if not path and type(key) is str and key.isidentifier():
        return key
    return f"{path}[{key!r}]"


#: the lease ids of the table entry whose family ``loads`` runs now (empty: it came
#: without any): a family takes a side channel over only if its sender leased it
decoding_leases: ContextVar[tuple[int, ...]] = ContextVar("decoding_leases", default=())


def loads(frames: Sequence[Any], deserialize: bool = True, leases: list[int] | None = None) -> Any:
    """Rebuild a message from frames.

    With ``deserialize=False``, opaque values come back as :class:`Serialized` (to be
    forwarded untouched). The ids of the leases of the values deserialized here are
    appended to ``leases`` (the transport acknowledges them to the sender). Raises
    :class:`ProtocolError` for frames that do not form a message; exceptions of a
    family's ``loads`` propagate unchanged.
    """
    if not frames:
        raise ProtocolError("a message needs at least one frame")
    entries: list[Any] = []
    if len(frames) > 1:
        try:
            # family headers may hold tuples (packed as EXT_TUPLE), e.g. a shape
            table = msgpack.unpackb(frames[1], use_list=True, raw=False, ext_hook=_ExtHook(None))
        except Exception as exc:
            raise ProtocolError(f"malformed out-of-band table: {exc}") from exc
        if not isinstance(table, list):
            raise ProtocolError("malformed out-of-band table: not a list")
        pos = 2
        for entry in table:
            if (
                not isinstance(entry, list)
                or len(entry) not in (4, 5)
                or not isinstance(entry[0], str)
                or not isinstance(entry[2], int)
                or entry[2] < 0
                or (len(entry) == 5 and not (isinstance(entry[4], list) and all(type(i) is int for i in entry[4])))
            ):
                raise ProtocolError(f"malformed out-of-band table entry: {entry!r:.200}")
            family, fheader, n, opaque = entry[:4]
            if pos + n > len(frames):
                raise ProtocolError("out-of-band table names more frames than were sent")
            s = Serialized(family, fheader if isinstance(fheader, dict) else {}, frames[pos : pos + n])
            pos += n
            if not deserialize and not opaque and not _plain(s):
                # a receiver that keeps values opaque (the scheduler) runs no family's
                # code on what a peer sent, and so never unpickles
                raise ProtocolError(
                    f"an out-of-band value of family {family!r} where this receiver decodes "
                    "only plain bytes (a value for it to forward must be marked opaque)"
                )
            if deserialize or not opaque:
                leased = decoding_leases.set(tuple(entry[4]) if len(entry) == 5 else ())
                try:
                    entries.append(_deserialize(s))
                finally:
                    decoding_leases.reset(leased)
                if len(entry) == 5 and leases is not None:
                    leases.extend(entry[4])
            else:
                if len(entry) == 5 and entry[4] and leases is not None:
                    # kept serialized: its family may take the side channel over
                    adopt = _forwarding.get(family, _NO_HOOKS)[0]
                    if adopt is not None and adopt(s):
                        leases.extend(entry[4])
                entries.append(s)
        if pos != len(frames):
            raise ProtocolError(f"{len(frames) - pos} frame(s) not named by the out-of-band table")

    try:
        return _unpack(frames[0], _ExtHook(entries))
    except ProtocolError:
        raise
    except Exception as exc:
        raise ProtocolError(f"malformed message header: {type(exc).__name__}: {exc}") from exc


_PLAIN_BYTES = ("bytes", "bytearray", "memoryview")


def _plain(s: Serialized) -> bool:
    """Whether ``s`` is plain bytes or a big int, which the ``bytes`` and ``int``
    families rebuild without running anything a peer chose (the ``bytes`` family's
    ``pickle`` kind, for subclasses, is not plain)."""
    if s.family == "int":
        return True
    return s.family == "bytes" and s.header.get("kind") in _PLAIN_BYTES


class _ExtHook:
    """Rebuilds tuples and out-of-band references while unpacking a header (or, with
    ``entries`` None, tuples only: the out-of-band table's family headers, a shape).

    A class rather than a closure: a closure that passes itself to ``_unpack`` is a
    reference cycle, which would keep every received value alive until the cyclic GC.
    Each nested tuple is a nested call of the unpacker (whose frame holds a large
    stack of its own): ``depth`` bounds them, or a small crafted message would
    overflow the C stack.
    """

    __slots__ = ("entries", "depth")

    def __init__(self, entries: list[Any] | None):
        self.entries = entries
        self.depth = 0

    def __call__(self, code: int, data: bytes) -> Any:
        where = "" if self.entries is not None else " in the out-of-band table"
        if code == EXT_TUPLE:
            if self.depth >= MAX_NESTING:
                raise ProtocolError(f"tuples nested more than {MAX_NESTING} deep{where}")
            self.depth += 1
            try:
                return tuple(_unpack(data, self))
            finally:
                self.depth -= 1
        if code == EXT_OOB and self.entries is not None:
            i = int.from_bytes(data, "little")
            if i >= len(self.entries):
                raise ProtocolError(f"reference to out-of-band value {i} of {len(self.entries)}")
            return self.entries[i]
        raise ProtocolError(f"unknown msgpack extension type {code}{where}")


def _unpack(data: Any, ext_hook: Any) -> Any:
    return msgpack.unpackb(data, ext_hook=ext_hook, strict_map_key=False, raw=False, use_list=True)


def unwrap(msg: Any) -> Any:
    """Replace :class:`Serialize` values by their objects and :class:`Serialized` values
    by their deserialized objects; returns ``msg`` itself when it holds neither.

    In-process comms use this for receivers that deserialize: the message and every
    object in it are the very objects that were written.
    """
    typ = type(msg)
    if typ is Serialize:
        return msg.data
    if typ is Serialized:
        return _deserialize(msg)
    if typ is dict:
        out = None
        for k, v in msg.items():
            v2 = unwrap(v)
            if v2 is not v:
                if out is None:
                    out = dict(msg)
                out[k] = v2
        return msg if out is None else out
    if isinstance(msg, Msg):
        # a message struct handed over by a peer in this process (its values by reference)
        changed = None
        for name in msg.__struct_fields__:
            v = getattr(msg, name)
            v2 = unwrap(v)
            if v2 is not v:
                if changed is None:
                    changed = {}
                changed[name] = v2
        return msg if changed is None else msgspec.structs.replace(msg, **changed)
    if typ is list or typ is tuple:
        out_l = None
        for i, v in enumerate(msg):
            v2 = unwrap(v)
            if v2 is not v:
                if out_l is None:
                    out_l = list(msg)
                out_l[i] = v2
        if out_l is None:
            return msg
        return out_l if typ is list else tuple(out_l)
    return msg
