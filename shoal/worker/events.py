"""Events the worker state takes and instructions it returns (plain data); see
:mod:`shoal.worker.state`. Events that carry user data say how the log keeps them
(``logged()``: without it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..protocol.messages import Key
from ..statelog import DROPPED

__all__ = [
    "Event",
    "ComputeTaskEvent",
    "FreeKeysEvent",
    "ExecuteSuccessEvent",
    "ExecuteFailureEvent",
    "GatherDepSuccessEvent",
    "GatherDepFailureEvent",
    "UpdateDataEvent",
    "DataLostEvent",
    "SecedeEvent",
    "RejoinEvent",
    "PauseEvent",
    "UnpauseEvent",
    "MemoryTightEvent",
    "Instruction",
    "Execute",
    "Rejoin",
    "GatherDep",
    "AttachShm",
    "SendMsg",
]


# ------------------------------------------------------------------------------ events


@dataclass
class Event:
    stimulus_id: str


@dataclass
class ComputeTaskEvent(Event):
    key: Key
    payload: Any
    who_has: dict[Key, list[str]]
    nbytes: dict[Key, int]
    priority: tuple[int, ...]
    #: inputs that their owners placed in shared memory: key -> segment description
    shm: dict[Key, Any] = field(default_factory=dict)
    #: a client waits for this value: send it along with task-finished if it is small
    report: bool = False
    #: abstract resources the task holds while it runs (``{"GPU": 1}``); None: none
    resources: dict[str, float] | None = None
    #: run on where its inputs are, not on their values (a shuffle's barrier)
    locate: bool = False
    #: its value will most likely be read here only: not worth placing in shared memory
    local: bool = False

    def logged(self) -> ComputeTaskEvent:
        """This event for the log: without the task's payload."""
        return ComputeTaskEvent(self.stimulus_id, self.key, _dropped(self.payload), self.who_has, self.nbytes,
                                self.priority, self.shm, self.report, self.resources, self.locate, self.local)


@dataclass
class FreeKeysEvent(Event):
    keys: list[Key]


@dataclass
class ExecuteSuccessEvent(Event):
    key: Key
    value: Any
    nbytes: int
    duration: float = 0.0
    #: where the value was placed in shared memory (reported to the scheduler)
    shm: Any = None
    #: the value itself, serialized for the scheduler, when small and wanted by a client
    inline: Any = None
    #: for the task stream: (start, stop, thread) and the inputs moved here for it
    timing: tuple[float, float, int] | None = None
    transfers: list[tuple[str, str, int, str, float, float]] | None = None
    #: the value's managed size, measured in the task's thread (None: not measured)
    managed: int | None = None

    def logged(self) -> ExecuteSuccessEvent:
        """This event for the log: without the value (nor its inline copy)."""
        return ExecuteSuccessEvent(self.stimulus_id, self.key, DROPPED, self.nbytes, self.duration, self.shm,
                                   _dropped(self.inline), self.timing, self.transfers, self.managed)


@dataclass
class ExecuteFailureEvent(Event):
    key: Key
    exception: Any
    traceback: Any
    text: str
    timing: tuple[float, float, int] | None = None
    transfers: list[tuple[str, str, int, str, float, float]] | None = None
    #: the task raised :class:`~shoal.errors.Reschedule`: it goes back to the scheduler
    reschedule: bool = False

    def logged(self) -> ExecuteFailureEvent:
        """This event for the log: without the exception object (its text stays)."""
        tb = self.traceback if isinstance(self.traceback, (str, type(None))) else DROPPED
        return ExecuteFailureEvent(self.stimulus_id, self.key, _dropped(self.exception), tb, self.text,
                                   self.timing, self.transfers, self.reschedule)


@dataclass
class GatherDepSuccessEvent(Event):
    worker: str
    #: values received; requested keys absent here were missing on the peer
    data: dict[Key, Any]
    requested: list[Key]
    #: the values' managed sizes, measured as they arrived (what the store counts)
    nbytes: dict[Key, int] = field(default_factory=dict)
    #: values from another host this worker put in segments of its own (their infos),
    #: for the workers of its host to map: kept as replicas the scheduler knows of
    shm: dict[Key, Any] = field(default_factory=dict)

    def logged(self) -> GatherDepSuccessEvent:
        """This event for the log: which keys came, without their values."""
        return GatherDepSuccessEvent(self.stimulus_id, self.worker, dict.fromkeys(self.data, DROPPED),
                                     self.requested, self.nbytes, self.shm)


@dataclass
class GatherDepFailureEvent(Event):
    worker: str
    requested: list[Key]
    text: str = ""
    #: the peer answered, but cannot send these values here (they do not serialize):
    #: the error (as it travels in ``task-erred``) for the tasks that need them
    unsendable: Any = None
    #: why the fetch failed, as it travels in ``task-erred``: the tasks that need these
    #: values err with it if this worker gives up on the peer (``max_peer_failures``)
    exception: Any = None
    #: the peer took the request and did not answer within fetch-timeout (not a
    #: connection that failed on the way)
    unserved: bool = False

    def logged(self) -> GatherDepFailureEvent:
        """This event for the log: without the exceptions (their text stays)."""
        if self.unsendable is None and self.exception is None:
            return self
        return GatherDepFailureEvent(self.stimulus_id, self.worker, self.requested, self.text,
                                     _dropped(self.unsendable), _dropped(self.exception), self.unserved)


@dataclass
class UpdateDataEvent(Event):
    data: dict[Key, Any]
    nbytes: dict[Key, int]

    def logged(self) -> UpdateDataEvent:
        """This event for the log: which keys came, without their values."""
        return UpdateDataEvent(self.stimulus_id, dict.fromkeys(self.data, DROPPED), self.nbytes)


@dataclass
class DataLostEvent(Event):
    """Values this worker held are gone: their spill files did not give back what was
    written (:class:`~shoal.worker.spill.CorruptSpillFile`). With ``task``: the task
    that was to run with them (its thread never started), or whose inputs could not be
    read now for a reason that may pass (``keys`` empty then): it goes back to the
    scheduler."""

    keys: list[Key]
    task: Key | None = None


@dataclass
class SecedeEvent(Event):
    """The running task ``key`` left the thread pool (``shoal.secede()``): its thread
    no longer counts against ``nthreads`` (it keeps its resources)."""

    key: Key


@dataclass
class RejoinEvent(Event):
    """The seceded task ``key`` wants a thread slot back (``shoal.rejoin()``); its
    thread waits for the ``Rejoin`` instruction."""

    key: Key


@dataclass
class PauseEvent(Event):
    """The worker's memory passed its pause threshold (or its disk is full): no task
    starts and no fetch begins until :class:`UnpauseEvent`."""


@dataclass
class UnpauseEvent(Event):
    """The worker's memory fell below its pause threshold: work goes on."""


@dataclass
class MemoryTightEvent(Event):
    """The worker's memory passed its target (``tight``), or fell below it again: while
    it is tight no task is handed to the thread pool ahead of a free thread (a task
    started ahead makes its result while the last one is still being spilled)."""

    tight: bool = True


def _dropped(value: Any) -> Any:
    """``value`` as the log keeps it: :data:`~shoal.statelog.DROPPED` unless ``None``
    (which the state machine tells apart from a value, so a replay must see it)."""
    return None if value is None else DROPPED


# ------------------------------------------------------------------------ instructions


@dataclass
class Instruction:
    stimulus_id: str


@dataclass
class Execute(Instruction):
    key: Key


@dataclass
class GatherDep(Instruction):
    worker: str
    keys: list[Key]
    total_nbytes: int


@dataclass
class AttachShm(Instruction):
    """Map these inputs from shared memory (no peer involved); answer with
    ``GatherDepSuccessEvent``/``GatherDepFailureEvent`` from worker ``SHM``."""

    keys: list[Key]
    infos: list[Any]


@dataclass
class Rejoin(Instruction):
    """The seceded task ``key`` has a thread slot again: wake its thread."""

    key: Key


@dataclass
class SendMsg(Instruction):
    msg: dict[str, Any]
