"""The worker-state test harness: a state that validates after every step, and
helpers to read the instructions it returns."""

from __future__ import annotations

import itertools
from typing import Any

from shoal.worker.state import (
    ComputeTaskEvent,
    Execute,
    ExecuteFailureEvent,
    ExecuteSuccessEvent,
    FreeKeysEvent,
    GatherDep,
    GatherDepFailureEvent,
    GatherDepSuccessEvent,
    Rejoin,
    RejoinEvent,
    SecedeEvent,
    SendMsg,
    UpdateDataEvent,
    WorkerState,
)

ME = "tcp://me:1"

# --------------------------------------------------------------------------- harness


class Wk:
    """Feeds events to a :class:`WorkerState` and validates it after every step."""

    def __init__(self, **kwargs: Any) -> None:
        self.params = kwargs
        self.state = WorkerState(ME, **kwargs)
        #: every instruction so far (for a replay from the log)
        self.out: list[Any] = []
        self._ids = itertools.count()

    def sid(self) -> str:
        return f"test-{next(self._ids)}"

    def __call__(self, *events: Any) -> list[Any]:
        out = self.state.handle(*events)
        self.state.validate()
        self.out.extend(out)
        return out

    def compute_event(self, key: Any, deps: dict[Any, list[str]] | None = None, nbytes: dict[Any, int] | None = None,
                      priority: tuple[int, ...] = (0,), resources: dict[str, float] | None = None) -> ComputeTaskEvent:
        deps = deps or {}
        return ComputeTaskEvent(self.sid(), key, f"payload-{key}", deps, nbytes or {k: 1 for k in deps}, priority,
                                resources=resources)

    def compute(self, key: Any, deps: dict[Any, list[str]] | None = None, nbytes: dict[Any, int] | None = None,
                priority: tuple[int, ...] = (0,), resources: dict[str, float] | None = None) -> list[Any]:
        return self(self.compute_event(key, deps, nbytes, priority, resources))

    def secede(self, key: Any) -> list[Any]:
        return self(SecedeEvent(self.sid(), key))

    def rejoin(self, key: Any) -> list[Any]:
        return self(RejoinEvent(self.sid(), key))

    def free(self, *keys: Any) -> list[Any]:
        return self(FreeKeysEvent(self.sid(), list(keys)))

    def success(self, key: Any, value: Any = None, nbytes: int = 1) -> list[Any]:
        return self(ExecuteSuccessEvent(self.sid(), key, f"value-{key}" if value is None else value, nbytes))

    def failure(self, key: Any, text: str = "Boom: x") -> list[Any]:
        return self(ExecuteFailureEvent(self.sid(), key, "exc", "tb", text))

    def gathered(self, worker: str, data: dict[Any, Any], requested: list[Any]) -> list[Any]:
        return self(GatherDepSuccessEvent(self.sid(), worker, data, requested, {k: 1 for k in data}))

    def gather_failed(self, worker: str, requested: list[Any]) -> list[Any]:
        return self(GatherDepFailureEvent(self.sid(), worker, requested, "connection refused"))

    def scatter(self, data: dict[Any, Any]) -> list[Any]:
        return self(UpdateDataEvent(self.sid(), data, {k: 1 for k in data}))

    def states(self) -> dict[Any, str]:
        return {k: ts.state for k, ts in self.state.tasks.items()}


def executes(out: list[Any]) -> list[Any]:
    return [i.key for i in out if isinstance(i, Execute)]


def rejoins(out: list[Any]) -> list[Any]:
    return [i.key for i in out if isinstance(i, Rejoin)]


def gathers(out: list[Any]) -> list[tuple[str, list[Any], int]]:
    return [(i.worker, i.keys, i.total_nbytes) for i in out if isinstance(i, GatherDep)]


def sent(out: list[Any], op: str | None = None) -> list[dict[str, Any]]:
    """The messages to the scheduler, less their ``stimulus_id`` (which is always the
    instruction's: see test_messages_carry_the_stimulus_that_caused_them)."""
    msgs = []
    for i in out:
        if isinstance(i, SendMsg) and (op is None or i.msg["op"] == op):
            assert i.msg["stimulus_id"] == i.stimulus_id, i
            msgs.append({k: v for k, v in i.msg.items() if k != "stimulus_id"})
    return msgs


def ops(out: list[Any]) -> list[tuple[str, Any]]:
    return [(m["op"], m["key"]) for m in sent(out)]
