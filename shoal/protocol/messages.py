"""Every wire message as a typed struct: one per op, one table per direction.

A message crosses as a msgpack map whose ``op`` names it (docs/protocol.md); here each
op is a :class:`msgspec.Struct` tagged by ``op``, and each direction of each kind of
connection has its table of the ops it may carry (:data:`WORKER_TO_SCHEDULER`, ...).
:func:`decode` is where a peer's message is checked, completely: an unknown op, a
missing or mistyped field, a key that is not a key, are a :class:`ProtocolError` that
names the op and the field. Fields added later get defaults, so older peers' messages
still decode; unknown fields are ignored. :func:`to_wire` turns a struct back into the
map that is sent (the comm layer serializes maps: out-of-band values, tuples).

Fields typed ``Any`` hold values the receiver forwards or decodes later (payloads,
exceptions, segment infos: their own checks apply where they are used); ``key`` fields
hold task keys, checked by :func:`key_problem`.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any, ClassVar, TypeAlias

import msgspec

from ..errors import ProtocolError

__all__ = [
    "Msg",
    "decode",
    "to_wire",
    "key_problem",
    "SegmentInfo",
    "segment_info",
    "MAX_KEY_DEPTH",
    "Key",
    "WORKER_TO_SCHEDULER",
    "SCHEDULER_TO_WORKER",
    "CLIENT_TO_SCHEDULER",
    "SCHEDULER_TO_CLIENT",
    "SCHEDULER_REQUESTS",
    "WORKER_REQUESTS",
    "HANDSHAKE",
    "ALL_OPS",
]

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
    array ``[name, size, pickle_len, [[offset, length], ...], token]``."""

    name: str
    size: int
    pickle_len: int
    spans: list[tuple[int, int]]
    token: str

    def to_list(self) -> list[Any]:
        """The wire form, for the layers that store and forward it."""
        return [self.name, self.size, self.pickle_len, [list(span) for span in self.spans], self.token]


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


# ------------------------------------------------------------------ handshake (§3)


class HandshakeMsg(Msg, tag="handshake"):
    protocol: int
    nonce: bytes
    auth: bool = False


class HandshakeAuthMsg(Msg, tag="handshake-auth"):
    proof: bytes | None = None
    pid: int = 0
    host: str = ""
    shm_probe: list[str] | None = None
    optional: ClassVar[tuple[str, ...]] = ("shm_probe",)


class HandshakeShmMsg(Msg, tag="handshake-shm"):
    can_map: bool = False


class HandshakeRefusedMsg(Msg, tag="handshake-refused"):
    reason: str = ""
    protocol: int = 0


class LeaseAckMsg(Msg, tag="shoal-lease-ack"):
    ids: list[int] = []


# ------------------------------------------------------------------ worker <-> scheduler (§7)


class RegisterWorkerMsg(Msg, tag="register-worker"):
    address: str
    nthreads: int
    host: str = ""
    pid: int = 0
    name: str = ""
    reply: bool = True


class TaskFinishedMsg(Msg, tag="task-finished"):
    key: Any
    nbytes: int | None = 0  # nil counts as 0
    duration: float | None = 0.0
    shm: Any = None  # segment info (§4.7) or nil
    value: Any = None  # a small value inline (opaque to the scheduler, which forwards it)
    stimulus_id: str = ""  # what caused it on the sender's side (§6)
    key_fields: ClassVar[tuple[str, ...]] = ("key",)
    optional: ClassVar[tuple[str, ...]] = ("shm", "value", "stimulus_id")
    segment_fields: ClassVar[tuple[tuple[str, bool], ...]] = (("shm", False),)


class WorkerTaskErredMsg(Msg, tag="task-erred"):
    key: Any
    exception: Any = None  # opaque
    traceback: Any = None  # opaque or str or nil
    text: str = ""
    stimulus_id: str = ""  # what caused it on the sender's side (§6)
    key_fields: ClassVar[tuple[str, ...]] = ("key",)
    optional: ClassVar[tuple[str, ...]] = ("stimulus_id",)


class MissingDataMsg(Msg, tag="missing-data"):
    key: Any
    errant_worker: str
    stimulus_id: str = ""  # what caused it on the sender's side (§6)
    key_fields: ClassVar[tuple[str, ...]] = ("key",)
    optional: ClassVar[tuple[str, ...]] = ("stimulus_id",)


class RescheduleMsg(Msg, tag="reschedule"):
    key: Any
    stimulus_id: str = ""  # what caused it on the sender's side (§6)
    key_fields: ClassVar[tuple[str, ...]] = ("key",)
    optional: ClassVar[tuple[str, ...]] = ("stimulus_id",)


class HeartbeatMsg(Msg, tag="heartbeat"):
    pass


class UnregisterMsg(Msg, tag="unregister"):
    pass


class ComputeTaskMsg(Msg, tag="compute-task"):
    key: Any
    payload: Any
    who_has: dict[Any, list[str]] = {}
    nbytes: dict[Any, int] = {}
    priority: list[int] = []
    shm: dict[Any, Any] | None = None
    report: bool = False
    stimulus_id: str = ""  # what caused it on the sender's side (§6)
    key_fields: ClassVar[tuple[str, ...]] = ("key",)
    key_list_fields: ClassVar[tuple[str, ...]] = ("who_has", "nbytes")
    optional: ClassVar[tuple[str, ...]] = ("shm", "report", "stimulus_id")
    segment_fields: ClassVar[tuple[tuple[str, bool], ...]] = (("shm", True),)


class FreeKeysMsg(Msg, tag="free-keys"):
    keys: list[Any]
    stimulus_id: str = ""  # what caused it on the sender's side (§6)
    key_list_fields: ClassVar[tuple[str, ...]] = ("keys",)
    optional: ClassVar[tuple[str, ...]] = ("stimulus_id",)


class CloseMsg(Msg, tag="close"):
    pass


# ------------------------------------------------------------------ client <-> scheduler (§9)


class RegisterClientMsg(Msg, tag="register-client"):
    client: str
    reply: bool = True


class TaskDef(msgspec.Struct, forbid_unknown_fields=False):
    """One task of an ``update-graph``."""

    key: Any
    payload: Any = None
    deps: list[Any] = []
    workers: list[str] | None = None
    retries: int = 0


class UpdateGraphMsg(Msg, tag="update-graph"):
    tasks: list[TaskDef] = []
    wanted: list[Any] = []
    stimulus_id: str = ""  # what caused it on the sender's side (§6)
    key_list_fields: ClassVar[tuple[str, ...]] = ("wanted",)
    optional: ClassVar[tuple[str, ...]] = ("stimulus_id",)


class ReleaseKeysMsg(Msg, tag="release-keys"):
    keys: list[Any] = []
    stimulus_id: str = ""  # what caused it on the sender's side (§6)
    key_list_fields: ClassVar[tuple[str, ...]] = ("keys",)
    optional: ClassVar[tuple[str, ...]] = ("stimulus_id",)


class CancelKeysMsg(Msg, tag="cancel-keys"):
    keys: list[Any] = []
    stimulus_id: str = ""  # what caused it on the sender's side (§6)
    key_list_fields: ClassVar[tuple[str, ...]] = ("keys",)
    optional: ClassVar[tuple[str, ...]] = ("stimulus_id",)


class CloseClientMsg(Msg, tag="close-client"):
    pass


class KeyInMemoryMsg(Msg, tag="key-in-memory"):
    key: Any
    nbytes: int = 0
    workers: list[str] = []
    shm: Any = None
    value: Any = None  # a small value inline, as the worker reported it
    key_fields: ClassVar[tuple[str, ...]] = ("key",)
    optional: ClassVar[tuple[str, ...]] = ("shm", "value")
    segment_fields: ClassVar[tuple[tuple[str, bool], ...]] = (("shm", False),)


class TaskErredMsg(Msg, tag="task-erred"):
    """A task (or ``blame``, a dependency) failed; ``kind`` is ``""`` for an exception
    the task raised, else the scheduler's own error (``"KilledWorker"``, ...)."""

    key: Any
    exception: Any = None
    traceback: Any = None
    text: str = ""
    kind: str = ""
    blame: Any = None
    key_fields: ClassVar[tuple[str, ...]] = ("key",)


class CancelledKeyMsg(Msg, tag="cancelled-key"):
    key: Any
    key_fields: ClassVar[tuple[str, ...]] = ("key",)


class LostKeyMsg(Msg, tag="lost-key"):
    key: Any
    key_fields: ClassVar[tuple[str, ...]] = ("key",)


# ------------------------------------------------------------------ requests (§8, §9.3)


class IdentityMsg(Msg, tag="identity"):
    reply: bool = True


class SchedulerInfoMsg(Msg, tag="scheduler-info"):
    reply: bool = True


class WhoHasMsg(Msg, tag="who-has"):
    keys: list[Any] | None = None
    reply: bool = True


class UpdateDataMsg(Msg, tag="update-data"):
    """To the scheduler: scattered values and their holders."""

    who_has: dict[Any, list[str]] = {}
    nbytes: dict[Any, int] = {}
    client: str = ""
    shm: dict[Any, Any] | None = None
    reply: bool = True
    key_list_fields: ClassVar[tuple[str, ...]] = ("who_has", "nbytes")
    segment_fields: ClassVar[tuple[tuple[str, bool], ...]] = (("shm", True),)


class NcoresMsg(Msg, tag="ncores"):
    reply: bool = True


class CountersMsg(Msg, tag="counters"):
    reply: bool = True


class RetireAllMsg(Msg, tag="retire-all"):
    reply: bool = True


class GetDataMsg(Msg, tag="get-data"):
    keys: list[Any]
    reply: bool = True
    key_list_fields: ClassVar[tuple[str, ...]] = ("keys",)


class ScatterDataMsg(Msg, tag="update-data"):
    """To a worker: values to hold (``Client.scatter``)."""

    data: dict[Any, Any]
    reply: bool = True
    key_list_fields: ClassVar[tuple[str, ...]] = ("data",)


class RunMsg(Msg, tag="run"):
    function: Any
    args: Any = ()
    kwargs: Any = None
    reply: bool = True


class TransferStatsMsg(Msg, tag="transfer-stats"):
    reply: bool = True


# ------------------------------------------------------------------ tables by direction


def _table(*types: type[Msg]) -> dict[str, type[Msg]]:
    return {t.__struct_config__.tag: t for t in types}  # type: ignore[misc]


HANDSHAKE = _table(HandshakeMsg, HandshakeAuthMsg, HandshakeShmMsg, HandshakeRefusedMsg)
WORKER_TO_SCHEDULER = _table(TaskFinishedMsg, WorkerTaskErredMsg, MissingDataMsg, RescheduleMsg,
                             HeartbeatMsg, UnregisterMsg)
SCHEDULER_TO_WORKER = _table(ComputeTaskMsg, FreeKeysMsg, CloseMsg)
CLIENT_TO_SCHEDULER = _table(UpdateGraphMsg, ReleaseKeysMsg, CancelKeysMsg, HeartbeatMsg, CloseClientMsg)
SCHEDULER_TO_CLIENT = _table(KeyInMemoryMsg, TaskErredMsg, CancelledKeyMsg, LostKeyMsg)
SCHEDULER_REQUESTS = _table(IdentityMsg, SchedulerInfoMsg, WhoHasMsg, UpdateDataMsg, NcoresMsg, CountersMsg,
                            RetireAllMsg, RegisterWorkerMsg, RegisterClientMsg)
WORKER_REQUESTS = _table(GetDataMsg, ScatterDataMsg, RunMsg, IdentityMsg, TransferStatsMsg)
CONTROL = _table(LeaseAckMsg)

#: every message struct, for the documentation check
ALL_OPS: tuple[type[Msg], ...] = tuple(
    {t: None for table in (HANDSHAKE, CONTROL, WORKER_TO_SCHEDULER, SCHEDULER_TO_WORKER, CLIENT_TO_SCHEDULER,
                           SCHEDULER_TO_CLIENT, SCHEDULER_REQUESTS, WORKER_REQUESTS) for t in table.values()}
)


def decode(table: dict[str, type[Msg]], msg: Any, where: str = "") -> Msg:
    """``msg`` (a received map) as the struct of its op in ``table``.

    Raises :class:`ProtocolError` naming the op and the field for anything that is
    not such a message: not a map, an op the table does not have, a missing or
    mistyped field, a key that is not a key.
    """
    if type(msg) is not dict:
        raise ProtocolError(f"{where}expected a message (a map with an 'op'), got {type(msg).__name__}")
    op = msg.get("op")
    typ = table.get(op) if type(op) is str else None
    if typ is None:
        raise ProtocolError(f"{where}unknown op {op!r:.60} (expected one of {', '.join(sorted(table))})")
    try:
        out = msgspec.convert(msg, typ)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"{where}malformed {op!r}: {exc}") from None
    for name in typ.key_fields:
        problem = key_problem(getattr(out, name))
        if problem is not None:
            raise ProtocolError(f"{where}malformed {op!r}: field {name!r}: {problem}")
    for name in typ.key_list_fields:
        value = getattr(out, name)
        for k in value if value is not None else ():
            problem = key_problem(k)
            if problem is not None:
                raise ProtocolError(f"{where}malformed {op!r}: a key in {name!r}: {problem}")
    if typ is UpdateGraphMsg:
        _check_tasks(out)  # type: ignore[arg-type]
    if typ.segment_fields:
        _check_segments(out, where, str(op))
    return out


def _check_segments(msg: Msg, where: str, op: str) -> None:
    """Segment infos are named structs on receipt (then kept in their wire form, which
    is what the layers above store and forward)."""
    for name, many in msg.segment_fields:
        value = getattr(msg, name)
        try:
            if many:
                if value is not None:
                    setattr(msg, name, {k: segment_info(v) for k, v in value.items()})
            else:
                setattr(msg, name, segment_info(value))
        except ProtocolError as exc:
            raise ProtocolError(f"{where}malformed {op!r}: field {name!r}: {exc}") from None


def _check_tasks(msg: UpdateGraphMsg) -> None:
    for i, task in enumerate(msg.tasks):
        for k in (task.key, *task.deps):
            problem = key_problem(k)
            if problem is not None:
                raise ProtocolError(f"malformed 'update-graph': task {i}: {problem}")


def to_wire(msg: Msg) -> dict[str, Any]:
    """The map that carries ``msg``: its op first, then every field but optional ones
    that hold their default."""
    out: dict[str, Any] = {"op": msg.__struct_config__.tag}
    optional = msg.optional
    for name in msg.__struct_fields__:
        value = getattr(msg, name)
        if name in optional and (value is None or value is False or value == ""):
            continue  # optional fields default to nil, false or ""
        out[name] = value
    return out
