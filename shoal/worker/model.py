"""What a worker knows of a key (plain data): its record, its states, and the legal
changes between them. See :mod:`shoal.worker.state` for the theory of operation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from ..protocol.messages import Key

__all__ = ["SHM", "WState", "WTask", "STATES", "TRANSITIONS"]

#: the pseudo-peer that stands for "map it from shared memory" in fetch bookkeeping
SHM = "shm://"

#: a key's state on a worker (see :mod:`shoal.worker.state`, and ``TRANSITIONS``)
WState = Literal["released", "waiting", "ready", "executing", "cancelled", "fetch", "flight", "memory"]


@dataclass(eq=False)
class WTask:
    key: Key
    #: written by :meth:`WorkerState._set_state` only
    state: WState = "released"
    payload: Any = None
    #: a client waits for the value (the scheduler said so): small ones travel inline
    report: bool = False
    #: its value will most likely be read here only (the scheduler said so): it is not
    #: placed in shared memory for the host
    local: bool = False
    priority: tuple[int, ...] = (0,)
    #: "compute" (the scheduler's), "fetched" (a local copy), "scattered", "replica" (a
    #: copy from another host the scheduler was told of): all but "fetched" are held
    #: until the scheduler frees them
    origin: str = "fetched"
    dependencies: set[WTask] = field(default_factory=set)
    dependents: set[WTask] = field(default_factory=set)
    waiting_for_data: set[WTask] = field(default_factory=set)
    who_has: set[str] = field(default_factory=set)
    #: the holder the scheduler listed first (one of this host, or the worker of this
    #: host fetching the value from another): asked before the others
    ask_first: str | None = None
    nbytes: int = 0
    coming_from: str | None = None
    #: where the value lies in shared memory, if its owner placed it there
    shm: Any = None
    #: abstract resources it holds while it runs (``{"GPU": 1}``); None: none
    resources: dict[str, float] | None = None
    #: order of creation: breaks ties of priority, so runs do not depend on set order
    seq: int = 0
    #: a task run on where its inputs are (``locate``): {input key: (holders, nbytes,
    #: segment)}; None for others
    located: dict[Key, tuple[list[str], int, Any]] | None = None

    def __repr__(self) -> str:
        return f"<WTask {self.key!r} {self.state}>"

    def __lt__(self, other: WTask) -> bool:
        return (self.priority, self.seq) < (other.priority, other.seq)


#: the states a key rests in between two calls of ``handle()`` (``released`` is passed through)
STATES = frozenset(get_args(WState)) - {"released"}

#: the legal changes of a key's state: start -> the states it may go to. Every other
#: pair (a self-transition too) is a bug: ``_set_state`` raises ``InvalidTransition``.
TRANSITIONS: dict[WState, frozenset[WState]] = {
    # a new record: an input to fetch, a task to compute (inputs missing, or all here),
    # a value scattered here
    "released": frozenset({"fetch", "waiting", "ready", "memory"}),
    # asked of a peer (or to be mapped from shared memory); dropped: computed or
    # scattered here instead, no longer needed, or no holder left
    "fetch": frozenset({"flight", "released"}),
    # arrived; missing there or unreachable (the next holder, or a segment that did not
    # map: ask its holders); dropped: as for fetch, or it cannot travel
    "flight": frozenset({"memory", "fetch", "released"}),
    # inputs all here; freed but needed by a local task and held elsewhere; freed, given
    # back (an input cannot be had) or erred (an input cannot travel)
    "waiting": frozenset({"ready", "fetch", "released"}),
    # given a thread; freed: as for waiting
    "ready": frozenset({"executing", "fetch", "released"}),
    # done; freed while its thread runs; failed but needed by a local task and held
    # elsewhere; failed (reported)
    "executing": frozenset({"memory", "cancelled", "fetch", "released"}),
    # computed again while its thread runs; done and needed by a local task (or its
    # value scattered here meanwhile); failed but needed and held elsewhere; done or
    # failed, and not needed
    "cancelled": frozenset({"executing", "memory", "fetch", "released"}),
    # freed while a thread still computes it (its value was scattered meanwhile); freed
    "memory": frozenset({"cancelled", "released"}),
}
