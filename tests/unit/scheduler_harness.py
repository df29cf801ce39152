"""The scheduler-state test harness: a state that validates after every step, and
helpers to read the instructions it returns."""

from __future__ import annotations

import dataclasses
import itertools
from collections import defaultdict
from typing import Any

from shoal.scheduler.state import (
    AddWorkerEvent,
    CancelKeysEvent,
    ClientMsg,
    ComputeTask,
    CheckHolder,
    FreeKeys,
    HolderCheckedEvent,
    MissingDataEvent,
    NewTask,
    ReleaseKeysEvent,
    RemoveWorkerEvent,
    RescheduleEvent,
    SchedulerState,
    TaskErredEvent,
    TaskFinishedEvent,
    TaskState,
    UpdateDataEvent,
    UpdateGraphEvent,
)


class Sched:
    """Feeds events to a :class:`SchedulerState` and validates it after every step."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.state = SchedulerState(**kwargs)
        self._ids = itertools.count()
        #: every instruction returned so far, in order (a replay must return the same)
        self.instructions: list[Any] = []

    def sid(self) -> str:
        return f"test-{next(self._ids)}"

    def __call__(self, *events: Any) -> list[Any]:
        out = self.state.handle(*events)
        self.state.validate()
        self.instructions.extend(out)
        return out

    def replay(self) -> tuple[SchedulerState, list[Any]]:
        """A fresh state fed the events this one logged, and what it returned."""
        fresh = SchedulerState(**self.kwargs)
        out: list[Any] = []
        for call in self.state.log.calls():
            out.extend(fresh.handle(*call))
        return fresh, out

    def ts(self, key: Any) -> TaskState:
        return self.state.tasks[key]

    def on(self, key: Any) -> str:
        """The worker ``key`` is processing on."""
        ws = self.ts(key).processing_on
        assert ws is not None, f"{key!r} is not processing"
        return ws.address

    def add_worker(self, address: str, nthreads: int = 1, languages: tuple[str, ...] = ("python",)) -> list[Any]:
        return self(AddWorkerEvent(self.sid(), address, nthreads, languages=languages))

    def remove_worker(self, address: str, crashed: bool = True) -> list[Any]:
        return self(RemoveWorkerEvent(self.sid(), address, crashed))

    def submit(self, *tasks: NewTask, wanted: list[Any] | None = None, client: str = "c") -> list[Any]:
        if wanted is None:
            wanted = [t.key for t in tasks]
        return self(UpdateGraphEvent(self.sid(), client, list(tasks), wanted))

    def finish(self, worker: str, key: Any, nbytes: int = 1) -> list[Any]:
        return self(TaskFinishedEvent(self.sid(), worker, key, nbytes))

    def err(self, worker: str, key: Any, exception: Any = "exc", traceback: Any = "tb", text: str = "Boom: x") -> list[Any]:
        return self(TaskErredEvent(self.sid(), worker, key, exception, traceback, text))

    def release(self, *keys: Any, client: str = "c") -> list[Any]:
        return self(ReleaseKeysEvent(self.sid(), client, list(keys)))

    def cancel(self, *keys: Any, client: str = "c") -> list[Any]:
        return self(CancelKeysEvent(self.sid(), client, list(keys)))

    def scatter(self, who_has: dict[Any, list[str]], nbytes: dict[Any, int] | None = None, client: str = "c") -> list[Any]:
        return self(UpdateDataEvent(self.sid(), client, who_has, nbytes or {k: 1 for k in who_has}))

    def missing(self, key: Any, errant_worker: str, by: str | None = None, unserved: bool = True) -> list[Any]:
        """``by`` (default: the errant worker itself) did not get ``key`` from it:
        ``unserved``, it answered without it (or not in time); else the fetch failed."""
        return self(MissingDataEvent(self.sid(), key, errant_worker, errant_worker if by is None else by, unserved))

    def checked(self, worker: str, key: Any, held: bool | None, why: str = "it did not answer") -> list[Any]:
        """``worker``'s answer to the scheduler's question about ``key`` (None: none came)."""
        return self(HolderCheckedEvent(self.sid(), worker, key, held, why))

    def reschedule(self, worker: str, key: Any) -> list[Any]:
        return self(RescheduleEvent(self.sid(), worker, key))

    def states(self) -> dict[Any, str]:
        return {k: ts.state for k, ts in self.state.tasks.items()}


def task(key: Any, *deps: Any, workers: list[str] | None = None, retries: int = 0, payload: Any = None,
         language: str = "python", once: str = "") -> NewTask:
    return NewTask(key, f"payload-{key}" if payload is None else payload, list(deps), workers, retries,
                   language=language, once=once)


def computes(out: list[Any]) -> list[tuple[str, Any]]:
    return [(i.worker, i.key) for i in out if isinstance(i, ComputeTask)]


def compute_of(out: list[Any], key: Any) -> ComputeTask:
    (inst,) = [i for i in out if isinstance(i, ComputeTask) and i.key == key]
    return inst


def checks(out: list[Any]) -> list[tuple[str, Any]]:
    """The questions to holders: ``(worker, key)``."""
    return [(i.worker, i.key) for i in out if isinstance(i, CheckHolder)]


def frees(out: list[Any]) -> dict[str, set[Any]]:
    d: dict[str, set[Any]] = defaultdict(set)
    for i in out:
        if isinstance(i, FreeKeys):
            d[i.worker] |= set(i.keys)
    return dict(d)


def msgs(out: list[Any], op: str | None = None) -> list[tuple[str, dict[str, Any]]]:
    return [(i.client, i.msg) for i in out if isinstance(i, ClientMsg) and (op is None or i.msg["op"] == op)]


def reported(out: list[Any], op: str) -> list[tuple[str, Any]]:
    return [(c, m["key"]) for c, m in msgs(out, op)]


def without_user_data(instructions: list[Any]) -> list[Any]:
    """Instructions with the opaque user data the log leaves out (payloads, values,
    exceptions) blanked, for comparing a replay with the run it replays."""
    out = []
    for inst in instructions:
        if isinstance(inst, ComputeTask):
            inst = dataclasses.replace(inst, payload=None)
        elif isinstance(inst, ClientMsg):
            inst = dataclasses.replace(inst, msg={k: v for k, v in inst.msg.items()
                                                  if k not in ("value", "exception", "traceback")})
        out.append(inst)
    return out
