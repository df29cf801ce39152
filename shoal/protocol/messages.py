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
hold task keys, checked by :func:`key_problem`. The base (keys, segment infos,
:class:`Msg`) is in :mod:`.msgbase`, the coordination ops in :mod:`.coordination_msgs`,
the client's cluster operations in :mod:`.cluster_ops_msgs`, the check of resources in
:mod:`.resources`; this module re-exports them.
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from ..errors import ProtocolError
from .cluster_ops_msgs import CLUSTER_OPS_REQUESTS, UploadFileMsg
from .coordination_msgs import COORDINATION_REQUESTS, COORDINATION_STREAM
from .msgbase import MAX_KEY_DEPTH, Key, Msg, SegmentInfo, SegmentRef, key_problem, segment_info
from .resources import language_problem, resources_problem
from .serialize import SAME_PROCESS

__all__ = [
    "Msg",
    "decode",
    "to_wire",
    "for_destination",
    "key_problem",
    "SegmentInfo",
    "SegmentRef",
    "segment_info",
    "resources_problem",
    "MAX_KEY_DEPTH",
    "ONCE_MAX",
    "Key",
    "WORKER_TO_SCHEDULER",
    "SCHEDULER_TO_WORKER",
    "CLIENT_TO_SCHEDULER",
    "SCHEDULER_TO_CLIENT",
    "SCHEDULER_REQUESTS",
    "WORKER_REQUESTS",
    "NANNY_REQUESTS",
    "HANDSHAKE",
    "ALL_OPS",
]

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
    #: ``"neutral"``: the sender decodes only language-neutral encodings (§3, §4.5);
    #: absent: every family (a Python peer)
    reads: str | None = None
    #: ``"xxh3-64"``: the sender puts checksums after large frames and verifies them,
    #: if the peer says so too (§2.4); absent: no checksums on this connection
    checksums: str | None = None
    #: what the sender is: "scheduler", "worker", "nanny", "client", ... (§3); an end
    #: that dialed a scheduler refuses anything else
    role: str | None = None
    optional: ClassVar[tuple[str, ...]] = ("shm_probe", "reads", "checksums", "role")


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
    #: abstract resources it offers (``{"GPU": 2}``): tasks that ask for them run only here
    resources: dict[str, float] = {}
    #: the address of the nanny that runs its process ("": none), for ``restart-workers``
    nanny: str = ""
    #: the payload languages it runs (§4.6): tasks of other languages never go there
    languages: list[str] = msgspec.field(default_factory=lambda: ["python"])
    #: the optional ops of §8.2 it serves (None: all of them, as a Python worker)
    ops: list[str] | None = None
    optional: ClassVar[tuple[str, ...]] = ("resources", "nanny", "ops")


class TaskFinishedMsg(Msg, tag="task-finished"):
    key: Any
    nbytes: int | None = 0  # nil counts as 0
    duration: float | None = 0.0
    shm: Any = None  # segment info (§4.7) or nil
    value: Any = None  # a small value inline (opaque to the scheduler, which forwards it)
    stimulus_id: str = ""  # what caused it on the sender's side (§6)
    #: [start, stop, thread]: when it ran (epoch seconds, the worker's clock) and on
    #: which of the worker's task threads (for the task stream)
    timing: tuple[float, float, int] | None = None
    #: the inputs moved to this worker for it: [key text, from, bytes, path, start, stop]
    transfers: list[tuple[str, str, int, str, float, float]] = []
    key_fields: ClassVar[tuple[str, ...]] = ("key",)
    optional: ClassVar[tuple[str, ...]] = ("shm", "value", "stimulus_id", "timing", "transfers")
    segment_fields: ClassVar[tuple[tuple[str, bool], ...]] = (("shm", False),)


class AddReplicaMsg(Msg, tag="add-replica"):
    """The worker keeps a copy of a value it fetched from another host, in this segment
    (§4.7), which workers of its host may map: it holds it until ``free-keys``."""

    key: Any
    shm: Any
    nbytes: int = 0
    stimulus_id: str = ""  # what caused it on the sender's side (§6)
    key_fields: ClassVar[tuple[str, ...]] = ("key",)
    optional: ClassVar[tuple[str, ...]] = ("nbytes", "stimulus_id")
    segment_fields: ClassVar[tuple[tuple[str, bool], ...]] = (("shm", False),)


class WorkerTaskErredMsg(Msg, tag="task-erred"):
    key: Any
    exception: Any = None  # opaque
    traceback: Any = None  # opaque or str or nil
    text: str = ""
    stimulus_id: str = ""  # what caused it on the sender's side (§6)
    timing: tuple[float, float, int] | None = None  # as task-finished's
    transfers: list[tuple[str, str, int, str, float, float]] = []
    key_fields: ClassVar[tuple[str, ...]] = ("key",)
    optional: ClassVar[tuple[str, ...]] = ("stimulus_id", "timing", "transfers")


class MissingDataMsg(Msg, tag="missing-data"):
    key: Any
    errant_worker: str
    stimulus_id: str = ""  # what caused it on the sender's side (§6)
    #: the holder took the request and did not serve the value (answered without it, or
    #: not within fetch-timeout); false: the fetch failed (a connection that could not
    #: be made or broke), which says nothing of the holder
    unserved: bool = False
    key_fields: ClassVar[tuple[str, ...]] = ("key",)
    optional: ClassVar[tuple[str, ...]] = ("stimulus_id", "unserved")


class RescheduleMsg(Msg, tag="reschedule"):
    key: Any
    stimulus_id: str = ""  # what caused it on the sender's side (§6)
    key_fields: ClassVar[tuple[str, ...]] = ("key",)
    optional: ClassVar[tuple[str, ...]] = ("stimulus_id",)


class LongRunningMsg(Msg, tag="long-running"):
    """A task seceded (``shoal.secede()``): it waits for other tasks and holds no thread."""

    key: Any
    stimulus_id: str = ""  # what caused it on the sender's side (§6)
    key_fields: ClassVar[tuple[str, ...]] = ("key",)
    optional: ClassVar[tuple[str, ...]] = ("stimulus_id",)


class HeartbeatMsg(Msg, tag="heartbeat"):
    pass


class WorkerMemoryMsg(Msg, tag="worker-memory"):
    """A worker's memory (bytes), every heartbeat interval and when it pauses or goes on:
    the scheduler places no task on a paused worker."""

    limit: int = 0  # 0: none
    managed: int = 0
    shm: int = 0
    spilled: int = 0
    unmanaged: int = 0
    process: int = 0
    paused: bool = False
    #: percent of one core the process used since the last report
    cpu: float = 0.0
    #: bytes moved into and out of the worker so far, by path (inproc, shm, tcp)
    transfers_in: dict[str, int] = {}
    transfers_out: dict[str, int] = {}
    optional: ClassVar[tuple[str, ...]] = ("cpu", "transfers_in", "transfers_out")


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
    #: abstract resources the task holds while it runs (nil: none)
    resources: dict[str, float] | None = None
    #: a barrier of shoal's shuffle: its inputs are not fetched; it runs on where they
    #: are (``who_has``, ``nbytes``, ``shm``), as :class:`shoal.worker.shuffle.Location`
    locate: bool = False
    #: its value has one dependent, which needs nothing else (it runs where this one
    #: did): the worker need not place the value in shared memory for its host
    local: bool = False
    key_fields: ClassVar[tuple[str, ...]] = ("key",)
    key_list_fields: ClassVar[tuple[str, ...]] = ("who_has", "nbytes")
    optional: ClassVar[tuple[str, ...]] = ("shm", "report", "stimulus_id", "resources", "locate", "local")
    segment_fields: ClassVar[tuple[tuple[str, bool], ...]] = (("shm", True),)


class FreeKeysMsg(Msg, tag="free-keys"):
    keys: list[Any]
    stimulus_id: str = ""  # what caused it on the sender's side (§6)
    key_list_fields: ClassVar[tuple[str, ...]] = ("keys",)
    optional: ClassVar[tuple[str, ...]] = ("stimulus_id",)


class CloseMsg(Msg, tag="close"):
    pass


class PluginAddMsg(Msg, tag="plugin-add"):
    """To a worker, on its stream: a worker plugin (opaque: pickled by the client) to
    set up before anything that follows (the plugins registered before it joined)."""

    plugin: Any
    name: str


class PluginAddRequestMsg(Msg, tag="plugin-add"):
    """To a worker, a request (from a client): set up this worker plugin; the reply
    comes once its ``setup`` returned (an error if it raised)."""

    plugin: Any
    name: str
    reply: bool = True


class PluginRemoveMsg(Msg, tag="plugin-remove"):
    """To a worker, a request: tear down and drop the worker plugin ``name``."""

    name: str
    reply: bool = True


class RegisterWorkerPluginMsg(Msg, tag="register-worker-plugin"):
    """To the scheduler: keep this worker plugin (opaque) for the workers that join
    from now on; the reply lists the workers there now (the client sends it to them),
    none when ``idempotent`` and one of that name is kept already."""

    plugin: Any
    name: str
    idempotent: bool = False
    reply: bool = True


class UnregisterWorkerPluginMsg(Msg, tag="unregister-worker-plugin"):
    """To the scheduler: forget the worker plugin ``name``; the reply lists the workers
    there now (the client has them remove it)."""

    name: str
    reply: bool = True


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
    #: higher runs first among runnable tasks (ties: submission order)
    priority: int = 0
    #: abstract resources it needs while it runs, ``{"GPU": 1}`` (nil: none)
    resources: dict[str, float] | None = None
    #: ``workers`` is a preference, not a restriction
    allow_other_workers: bool = False
    #: the language of its payload (§4.6): it runs only on workers that run that language
    language: str = "python"
    #: why it may run only once ("": it may run again): a task sent to a worker once
    #: errs (``RunOnce``), with this text, instead of running a second time (§9.2)
    once: str = ""
    #: it runs on where its inputs are, not on their values, and keeps them until it is
    #: released (a barrier of shoal's shuffle, §9.2)
    locate: bool = False


#: the longest ``once`` text of a task (:class:`TaskDef`)
ONCE_MAX = 2000


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


class FireAndForgetMsg(Msg, tag="fire-and-forget"):
    keys: list[Any] = []
    stimulus_id: str = ""  # what caused it on the sender's side (§6)
    key_list_fields: ClassVar[tuple[str, ...]] = ("keys",)
    optional: ClassVar[tuple[str, ...]] = ("stimulus_id",)


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
    #: how many workers to describe (-1: all)
    n_workers: int = -1
    reply: bool = True
    optional: ClassVar[tuple[str, ...]] = ("n_workers",)


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
    #: only these workers (nil: all)
    workers: list[str] | None = None
    reply: bool = True
    optional: ClassVar[tuple[str, ...]] = ("workers",)


class CountersMsg(Msg, tag="counters"):
    reply: bool = True


class GetTaskStreamMsg(Msg, tag="get-task-stream"):
    """To the scheduler: the task stream's records numbered ``since`` and after, at
    most ``limit`` (``client.get_task_stream``, the dashboard)."""

    since: int = 0
    limit: int = 100_000
    reply: bool = True


class DiagnosticsMsg(Msg, tag="diagnostics"):
    """To the scheduler: the figures of the dashboard at once (``performance_report``)."""

    reply: bool = True


class RetireAllMsg(Msg, tag="retire-all"):
    reply: bool = True


class ProgressMsg(Msg, tag="progress"):
    """To the scheduler: how far the tasks behind ``keys`` (and their dependencies)
    are, counted per key prefix (``shoal.progress``). ``id`` names the progress bar:
    the first request gives ``keys``, later polls only the id; ``stop`` ends it."""

    id: str
    keys: list[Any] | None = None
    complete: bool = True
    stop: bool = False
    reply: bool = True
    key_list_fields: ClassVar[tuple[str, ...]] = ("keys",)
    optional: ClassVar[tuple[str, ...]] = ("keys", "stop")


class NannyRestartMsg(Msg, tag="nanny-restart"):
    """To a nanny: stop its worker (killed after ``timeout`` seconds) and start a new one."""

    timeout: float | None = None
    reply: bool = True


class NannyCloseMsg(Msg, tag="nanny-close"):
    """To a nanny: stop its worker and end."""

    reply: bool = True


class GetDataMsg(Msg, tag="get-data"):
    keys: list[Any]
    reply: bool = True
    #: from a worker of the asked worker's host: wait for keys not yet heard of
    #: (the scheduler may have named the asked worker the host's fetcher of them)
    host_fetch: bool = False
    key_list_fields: ClassVar[tuple[str, ...]] = ("keys",)


class HasKeysMsg(Msg, tag="has-keys"):
    """To a worker, from the scheduler: which of ``keys`` it holds and serves now
    (answered ``{"held": [key, ...]}`` from its event loop, the values left unread):
    workers sent to fetch one of them said it did not hand it out (§7.3 ``missing-data``)."""

    keys: list[Any]
    reply: bool = True
    key_list_fields: ClassVar[tuple[str, ...]] = ("keys",)


class GetSlicesMsg(Msg, tag="get-slices"):
    """To a worker, from a worker assembling an output partition of shoal's shuffle:
    the rows of output partition ``index`` of those of ``keys`` (values of the
    shuffle's split tasks) it holds (answered ``{"held": [int], "rows": [Bundle]}``:
    the places in ``keys`` of those it holds, and their rows by column layout)."""

    keys: list[Any]
    index: int
    reply: bool = True
    key_list_fields: ClassVar[tuple[str, ...]] = ("keys",)


class SplitOutputsMsg(Msg, tag="split-outputs"):
    """To a worker, from a worker about to assemble output partitions of shoal's
    shuffle: for each of ``keys`` (values of the shuffle's split tasks) it holds, the
    output partitions that split has rows for (answered ``{"held": [int], "outputs":
    [[int]]}``: the places in ``keys`` of those it holds, and their outputs)."""

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


class ActorExecuteMsg(Msg, tag="actor-execute"):
    key: Any
    method: str
    args: Any = ()
    kwargs: Any = None
    reply: bool = True
    key_fields: ClassVar[tuple[str, ...]] = ("key",)


class ActorAttributeMsg(Msg, tag="actor-attribute"):
    key: Any
    attribute: str
    reply: bool = True
    key_fields: ClassVar[tuple[str, ...]] = ("key",)


class TransferStatsMsg(Msg, tag="transfer-stats"):
    reply: bool = True


# ------------------------------------------------------------------ tables by direction


def _table(*types: type[Msg]) -> dict[str, type[Msg]]:
    return {t.__struct_config__.tag: t for t in types}  # type: ignore[misc]


HANDSHAKE = _table(HandshakeMsg, HandshakeAuthMsg, HandshakeShmMsg, HandshakeRefusedMsg)
WORKER_TO_SCHEDULER = _table(TaskFinishedMsg, WorkerTaskErredMsg, MissingDataMsg, RescheduleMsg,
                             LongRunningMsg, HeartbeatMsg, WorkerMemoryMsg, UnregisterMsg, AddReplicaMsg)
SCHEDULER_TO_WORKER = _table(ComputeTaskMsg, FreeKeysMsg, CloseMsg, PluginAddMsg)
CLIENT_TO_SCHEDULER = _table(UpdateGraphMsg, ReleaseKeysMsg, CancelKeysMsg, HeartbeatMsg, CloseClientMsg,
                             FireAndForgetMsg, *COORDINATION_STREAM)
SCHEDULER_TO_CLIENT = _table(KeyInMemoryMsg, TaskErredMsg, CancelledKeyMsg, LostKeyMsg)
SCHEDULER_REQUESTS = _table(IdentityMsg, SchedulerInfoMsg, WhoHasMsg, UpdateDataMsg, NcoresMsg, CountersMsg,
                            RetireAllMsg, RegisterWorkerMsg, RegisterClientMsg, ProgressMsg, GetTaskStreamMsg, DiagnosticsMsg,
                            RegisterWorkerPluginMsg, UnregisterWorkerPluginMsg, *COORDINATION_REQUESTS,
                            *CLUSTER_OPS_REQUESTS)
WORKER_REQUESTS = _table(GetDataMsg, ScatterDataMsg, RunMsg, IdentityMsg, TransferStatsMsg, ActorExecuteMsg,
                        ActorAttributeMsg, PluginAddRequestMsg, PluginRemoveMsg, UploadFileMsg, HasKeysMsg,
                        GetSlicesMsg, SplitOutputsMsg)
NANNY_REQUESTS = _table(IdentityMsg, NannyRestartMsg, NannyCloseMsg)
CONTROL = _table(LeaseAckMsg)

#: every message struct, for the documentation check
ALL_OPS: tuple[type[Msg], ...] = tuple(
    {t: None for table in (HANDSHAKE, CONTROL, WORKER_TO_SCHEDULER, SCHEDULER_TO_WORKER, CLIENT_TO_SCHEDULER,
                           SCHEDULER_TO_CLIENT, SCHEDULER_REQUESTS, WORKER_REQUESTS, NANNY_REQUESTS)
     for t in table.values()}
)


def decode(table: dict[str, type[Msg]], msg: Any, where: str = "") -> Msg:
    """``msg`` (a received map) as the struct of its op in ``table``.

    Raises :class:`ProtocolError` naming the op and the field for anything that is
    not such a message: not a map, an op the table does not have, a missing or
    mistyped field, a key that is not a key. A struct of the table's type (what a
    peer of this process hands over in-process, see :func:`for_destination`) is
    returned as it is.
    """
    if type(msg) is not dict:
        if isinstance(msg, Msg) and table.get(msg.__struct_config__.tag) is type(msg):  # type: ignore[arg-type]
            # a struct: written by a peer in this process (an in-process comm hands over
            # objects; from a socket only maps arrive), already typed
            return msg
        raise ProtocolError(f"{where}expected a message (a map with an 'op'), got {type(msg).__name__}")
    op = msg.get("op")
    typ = table.get(op) if type(op) is str else None
    if typ is None:
        raise ProtocolError(f"{where}unknown op {op!r:.60} (expected one of {', '.join(sorted(table))})")
    try:
        out = msgspec.convert(msg, typ)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"{where}malformed {op!r}: {exc}") from None
    plan = _PLANS.get(typ)
    if plan is None:
        plan = _PLANS[typ] = _plan(typ)
    key_fields, key_list_fields, kind, segment_fields = plan
    for name in key_fields:
        k = getattr(out, name)
        if type(k) is not str or not k.isascii():  # (most keys: checked here, no call)
            problem = key_problem(k)
            if problem is not None:
                raise ProtocolError(f"{where}malformed {op!r}: field {name!r}: {problem}")
    for name in key_list_fields:
        value = getattr(out, name)
        for k in value if value is not None else ():
            if type(k) is not str or not k.isascii():
                problem = key_problem(k)
                if problem is not None:
                    raise ProtocolError(f"{where}malformed {op!r}: a key in {name!r}: {problem}")
    if kind == 1:
        _check_tasks(out)  # type: ignore[arg-type]
    elif kind == 2:
        problem = resources_problem(out.resources)  # type: ignore[attr-defined]
        if problem is not None:
            raise ProtocolError(f"{where}malformed {op!r}: field 'resources': {problem}")
        if typ is RegisterWorkerMsg:
            languages = out.languages  # type: ignore[attr-defined]
            if not 1 <= len(languages) <= 16:
                raise ProtocolError(f"{where}malformed {op!r}: field 'languages': 1 to 16 of them, got {len(languages)}")
            for language in languages:
                problem = language_problem(language)
                if problem is not None:
                    raise ProtocolError(f"{where}malformed {op!r}: field 'languages': {problem}")
            ops = out.ops  # type: ignore[attr-defined]
            if ops is not None and (len(ops) > 64 or not all(1 <= len(o) <= 64 for o in ops)):
                raise ProtocolError(f"{where}malformed {op!r}: field 'ops': at most 64 op names of 1 to 64 characters")
    if segment_fields:
        _check_segments(out, where, str(op))
    return out


#: per message struct: what decode() checks beyond its types (see _plan)
_PLANS: dict[type[Msg], tuple[tuple[str, ...], tuple[str, ...], int, Any]] = {}


def _plan(typ: type[Msg]) -> tuple[tuple[str, ...], tuple[str, ...], int, Any]:
    """(key fields, key-list fields, 1 for update-graph's tasks or 2 for resources and
    languages (register-worker, compute-task) or 0, segment fields) of ``typ``."""
    kind = 1 if typ is UpdateGraphMsg else 2 if typ is RegisterWorkerMsg or typ is ComputeTaskMsg else 0
    return tuple(typ.key_fields), tuple(typ.key_list_fields), kind, typ.segment_fields


def _check_segments(msg: Msg, where: str, op: str) -> None:
    """Segment infos are named structs on receipt (then kept in their wire form, which
    is what the layers above store and forward)."""
    for name, many in msg.segment_fields:
        value = getattr(msg, name)
        if value is None:
            continue  # (most messages: no segment)
        try:
            if many:
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
        problem = resources_problem(task.resources)
        if problem is not None:
            raise ProtocolError(f"malformed 'update-graph': task {i}: resources: {problem}")
        problem = language_problem(task.language)
        if problem is not None:
            raise ProtocolError(f"malformed 'update-graph': task {i}: language: {problem}")
        if len(task.once) > ONCE_MAX:
            raise ProtocolError(f"malformed 'update-graph': task {i}: once: {len(task.once)} characters, "
                                f"at most {ONCE_MAX}")


def for_destination(msg: Msg, destination: str) -> Msg | dict[str, Any]:
    """``msg`` as it goes to a peer at ``destination``: the struct itself to a peer in
    this process (passed by reference, nothing converted twice), else its map."""
    return msg if destination == SAME_PROCESS else to_wire(msg)


def to_wire(msg: Msg) -> dict[str, Any]:
    """The map that carries ``msg``: its op first, then every field but optional ones
    that hold their default."""
    out: dict[str, Any] = {"op": msg.__struct_config__.tag}
    out.update(msgspec.structs.asdict(msg))
    for name in msg.optional:
        value = out[name]
        if value is None or value is False or (type(value) is str and not value):
            del out[name]  # optional fields default to nil, false or ""
    return out
