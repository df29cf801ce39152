"""Events the scheduler state takes and instructions it returns (plain data)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..protocol.messages import Key
from ..statelog import DROPPED


# ------------------------------------------------------------------------------ events


@dataclass
class Event:
    stimulus_id: str


@dataclass
class AddWorkerEvent(Event):
    address: str
    nthreads: int
    host: str = ""
    pid: int = 0
    name: str = ""
    resources: dict[str, float] = field(default_factory=dict)
    #: the payload languages it runs
    languages: tuple[str, ...] = ("python",)
    #: when it registered, on the clock of :class:`CheckLivenessEvent` (None: its
    #: silence is counted from the next check)
    now: float | None = None


@dataclass
class RemoveWorkerEvent(Event):
    address: str
    #: whether the worker died (its running tasks count as suspicious) or left cleanly
    crashed: bool = True


@dataclass
class HeartbeatEvent(Event):
    """The worker sent something at ``now`` (a heartbeat or any other message: all
    are signs of life)."""

    worker: str
    now: float


@dataclass
class CheckLivenessEvent(Event):
    """A tick of the clock: workers silent for longer than ``worker_ttl`` go."""

    now: float


@dataclass
class AddClientEvent(Event):
    client: str


@dataclass
class RemoveClientEvent(Event):
    client: str


@dataclass(slots=True)
class NewTask:
    """One task of a graph: dependencies are keys; ``payload`` stays opaque."""

    key: Key
    payload: Any
    dependencies: list[Key] = field(default_factory=list)
    restrictions: list[str] | None = None
    retries: int = 0
    #: higher runs first (ties: submission order)
    priority: int = 0
    resources: dict[str, float] | None = None
    loose_restrictions: bool = False
    #: the language of its payload: it runs only on workers that run that language
    language: str = "python"
    #: why it may run only once ("": it may run again; see ``TaskState.once``)
    once: str = ""
    #: it runs on where its inputs are (a shuffle's barrier): see SchedulerState.locating
    locate: bool = False


#: a graph of more tasks than this is logged by its size only (:meth:`UpdateGraphEvent.logged`;
#: the log's own bound, ``StateLog.tasks``, is as many tasks of all its graphs)
LOGGED_GRAPH_MAX = 10_000


@dataclass
class UpdateGraphEvent(Event):
    client: str
    tasks: list[NewTask]
    #: keys the client holds futures for
    wanted: list[Key]
    #: in a logged copy: how many tasks (and wanted keys) it left out
    omitted: int = 0

    def logged(self) -> UpdateGraphEvent:
        """This event for the log: the tasks without their payloads. A graph of more
        than :data:`LOGGED_GRAPH_MAX` tasks is logged without its tasks and wanted
        keys, only their number (``omitted``): its copy would cost about as much as the
        scheduler's own record of the graph (a million tasks, 110 MB), and the log is
        bounded. A replay stops being exact there, as it does where the log's bound
        drops old events."""
        if len(self.tasks) > LOGGED_GRAPH_MAX:
            return UpdateGraphEvent(self.stimulus_id, self.client, [], [], omitted=len(self.tasks))
        tasks = [NewTask(t.key, DROPPED, t.dependencies, t.restrictions, t.retries, t.priority, t.resources,
                         t.loose_restrictions, t.language, t.once, t.locate) for t in self.tasks]
        return UpdateGraphEvent(self.stimulus_id, self.client, tasks, self.wanted)


@dataclass
class TaskFinishedEvent(Event):
    worker: str
    key: Key
    nbytes: int = 0
    #: seconds the task ran on the worker
    duration: float = 0.0
    #: where the worker placed the value in shared memory (opaque), if it did
    shm: Any = None
    #: the (small) value itself, opaque, for the clients that wait for it
    value: Any = None

    def logged(self) -> TaskFinishedEvent:
        """This event for the log: without the value."""
        if self.value is None:
            return self
        return TaskFinishedEvent(self.stimulus_id, self.worker, self.key, self.nbytes, self.duration, self.shm, DROPPED)


@dataclass
class TaskErredEvent(Event):
    worker: str
    key: Key
    exception: Any = None
    traceback: Any = None
    exception_text: str = ""

    def logged(self) -> TaskErredEvent:
        """This event for the log: without the exception object (its text stays)."""
        if self.exception is None and isinstance(self.traceback, (str, type(None))):
            return self
        return TaskErredEvent(self.stimulus_id, self.worker, self.key,
                              None if self.exception is None else DROPPED,
                              self.traceback if isinstance(self.traceback, (str, type(None))) else DROPPED,
                              self.exception_text)


@dataclass
class ReleaseKeysEvent(Event):
    """A client no longer holds futures for these keys."""

    client: str
    keys: list[Key]


@dataclass
class CancelKeysEvent(Event):
    """A client cancels these keys: released, and its futures learn they were cancelled."""

    client: str
    keys: list[Key]


@dataclass
class UpdateDataEvent(Event):
    """Values placed directly on workers (``scatter``): ``{key: [worker, ...]}``."""

    client: str
    who_has: dict[Key, list[str]]
    nbytes: dict[Key, int]
    #: segment infos of values their one holder keeps in shared memory (like results')
    shm: dict[Key, Any] = field(default_factory=dict)


@dataclass
class RemoveReplicasEvent(Event):
    """Drop these copies of values in memory (``rebalance``, ``replicate`` with fewer
    copies): ``{key: [worker, ...]}``. A copy is dropped only while another worker
    holds the key, and not from a worker whose running tasks need it."""

    who_has: dict[Key, list[str]]


@dataclass
class ReplicaAddedEvent(Event):
    """``worker`` keeps a copy of ``key``'s value that it fetched, in segment ``shm``
    (opaque), for the workers of its host to map."""

    worker: str
    key: Key
    shm: Any


@dataclass
class MissingDataEvent(Event):
    """Worker ``worker`` asked ``errant_worker`` for ``key`` and did not get it (it
    answered without it, or not at all); ``worker`` may be ``errant_worker`` itself,
    which then says that it does not hold the key."""

    key: Key
    errant_worker: str
    #: the worker that says so ("": not known, and not believed)
    worker: str = ""
    #: ``errant_worker`` took the request and did not serve the value (answered
    #: without it, or not in time); false: the fetch failed on the way
    unserved: bool = False


@dataclass
class HolderCheckedEvent(Event):
    """What ``worker``, asked by the scheduler itself (:class:`CheckHolder`), said of
    ``key``: ``held`` true, it holds the value and serves it; false, it does not hold
    it; None, no answer within the deadline, or it could not be asked (``why``)."""

    worker: str
    key: Key
    held: bool | None
    why: str = ""


@dataclass
class RescheduleEvent(Event):
    """A worker gives a task back (e.g. its inputs could not be fetched)."""

    worker: str
    key: Key


@dataclass
class LongRunningEvent(Event):
    """A task running on ``worker`` seceded (it waits for other tasks): it no longer
    holds one of the worker's threads."""

    worker: str
    key: Key


@dataclass
class WorkerMemoryEvent(Event):
    """``worker`` said how much memory it uses (bytes: limit, managed, shm, spilled,
    unmanaged, process) and whether it is paused (then it gets no new task)."""

    worker: str
    memory: dict[str, int]
    paused: bool = False


#: the client name under which fire-and-forget keys are held until they end
FIRE_AND_FORGET = "fire-and-forget"


@dataclass
class FireAndForgetEvent(Event):
    """Run these keys to the end even if every client lets go of them."""

    keys: list[Key]


@dataclass
class FailKeysEvent(Event):
    """Err these keys (and their dependents) with ``text``: what an internal error
    leaves of the tasks of the stimulus it broke, so that their clients hear why
    instead of waiting for ever. Keys in memory, erred or unknown are left alone."""

    keys: list[Key]
    text: str



# ------------------------------------------------------------------------ instructions


@dataclass
class Instruction:
    stimulus_id: str


@dataclass
class ComputeTask(Instruction):
    worker: str
    key: Key
    payload: Any
    who_has: dict[Key, list[str]]
    nbytes: dict[Key, int]
    priority: tuple[int, ...]
    #: inputs in shared memory: key -> where (as their owners reported it)
    shm: dict[Key, Any] = field(default_factory=dict)
    #: a client waits for the value: the worker may send it back inline
    report: bool = False
    #: abstract resources it holds while it runs
    resources: dict[str, float] | None = None
    #: run it on where its inputs are (who_has, nbytes, shm), not on their values
    locate: bool = False
    #: its one dependent needs nothing else: no need to place its value for the host
    local: bool = False


@dataclass
class FreeKeys(Instruction):
    worker: str
    keys: list[Key]


@dataclass
class CloseWorkerStream(Instruction):
    """The state removed this worker without its connection ending: end it, so the
    worker, should it come back to life, sees that it is gone."""

    worker: str
    #: seconds the scheduler had heard nothing from it
    silent_for: float
    #: why it was removed, when not for its silence
    why: str = ""


@dataclass
class CheckHolder(Instruction):
    """Ask ``worker``, over a connection of the scheduler's own, whether it holds
    ``key`` and serves it (``has-keys``), and say what it answered
    (:class:`HolderCheckedEvent`): workers sent to fetch the value said it did not
    hand it out."""

    worker: str
    key: Key


@dataclass
class Warn(Instruction):
    """Log ``text`` as a warning: something a worker sent that the state did not
    believe (a report about a task it was not given), or what it did about it."""

    text: str


@dataclass
class ClientMsg(Instruction):
    client: str
    msg: dict[str, Any]
