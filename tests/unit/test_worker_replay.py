"""A worker's log replays its run: the events it keeps (values dropped), fed to a fresh
:class:`WorkerState` with the same parameters, give the same instructions and leave
the same states. So a bug met in a cluster can be run again from ``state.log``."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import weakref
from typing import Any

from shoal.statelog import DROPPED
from shoal.worker.state import (
    SHM,
    AttachShm,
    ComputeTaskEvent,
    Execute,
    ExecuteFailureEvent,
    ExecuteSuccessEvent,
    FreeKeysEvent,
    GatherDep,
    GatherDepFailureEvent,
    GatherDepSuccessEvent,
    Instruction,
    SendMsg,
    UpdateDataEvent,
    WorkerState,
)

ME = "tcp://me:1"
PARAMS: dict[str, Any] = {"nthreads": 2, "queued": 1, "max_gathers": 2, "gather_bytes": 100, "max_peer_failures": 2}


class Value:
    """A user's value: only the state's ``data`` may hold it (weakly referenceable)."""

    def __init__(self, name: str) -> None:
        self.name = name


class Run:
    """Drives a WorkerState one event per ``handle()`` call, as the server does for
    results and fetches, validating it after each; keeps every instruction."""

    def __init__(self) -> None:
        self.state = WorkerState(ME, **PARAMS)
        self.out: list[Instruction] = []
        self.calls = 0
        self._ids = itertools.count()

    def sid(self, what: str) -> str:
        return f"{what}-{next(self._ids)}"

    def __call__(self, event: Any) -> list[Instruction]:
        out = self.state.handle(event)
        self.calls += 1
        self.state.validate()
        self.out.extend(out)
        return out

    def compute(self, key: str, deps: dict[Any, list[str]] | None = None, priority: int = 0,
                shm: dict[Any, Any] | None = None, report: bool = False) -> list[Instruction]:
        deps = deps or {}
        return self(ComputeTaskEvent(self.sid("compute"), key, Value(f"payload-{key}"), deps,
                                     {k: 10 for k in deps}, (priority,), shm or {}, report))

    def done(self, key: str, inline: bool = False) -> list[Instruction]:
        value = Value(key)
        return self(ExecuteSuccessEvent(self.sid(f"task-finished-{key}"), key, value, 8, 0.5,
                                        None, ("inline", value) if inline else None))

    def erred(self, key: str) -> list[Instruction]:
        return self(ExecuteFailureEvent(self.sid(f"task-erred-{key}"), key, ZeroDivisionError("boom"),
                                        "Traceback: ...", "ZeroDivisionError: boom"))

    def gathered(self, worker: str, keys: list[Any], present: list[str]) -> list[Instruction]:
        data: dict[Any, Any] = {k: Value(k) for k in present}
        return self(GatherDepSuccessEvent(self.sid("gather"), worker, data, keys, {k: 10 for k in data}))

    def gather_failed(self, worker: str, keys: list[Any], unsendable: bool = False) -> list[Instruction]:
        if unsendable:
            return self(GatherDepFailureEvent(self.sid("gather-unsendable"), worker, keys, "cannot pickle",
                                              TypeError("cannot pickle")))
        return self(GatherDepFailureEvent(self.sid("gather-failed"), worker, keys, "connection refused",
                                          exception=ConnectionRefusedError("refused")))

    def free(self, *keys: str) -> list[Instruction]:
        return self(FreeKeysEvent(self.sid("free"), list(keys)))

    def scatter(self, **values: Any) -> list[Instruction]:
        data: dict[Any, Any] = dict(values)
        return self(UpdateDataEvent(self.sid("update-data"), data, {k: 10 for k in values}))


def only(out: list[Instruction], kind: type) -> Any:
    (inst,) = [i for i in out if isinstance(i, kind)]
    return inst


def drive(run: Run) -> None:
    """A plausible stretch of a worker's life: tasks with inputs here and on peers,
    fetches that succeed, miss and fail, a task freed while it runs, errors, a scatter,
    shared memory that does not map, values that cannot travel, a peer given up on."""
    assert [i.key for i in run.compute("a") if isinstance(i, Execute)] == ["a"]
    gd = run.compute("b", {"x": ["p1"], "y": ["p2"]}, priority=1)
    assert sorted(i.worker for i in gd if isinstance(i, GatherDep)) == ["p1", "p2"]
    run.compute("c", {"a": [], "x": ["p1"]}, priority=2)  # a is computed here
    run.gathered("p1", ["x"], ["x"])
    run.gather_failed("p2", ["y"])  # y has no other holder: b goes back
    run.compute("d", priority=3)  # queued for a thread
    run.free("d")  # ... and freed: its thread will skip it
    run.done("a")  # c may run now
    run(ExecuteFailureEvent(run.sid("task-skipped-d"), "d", None, "", "released before it ran"))
    run.erred("c")
    run.compute("e", {"z": ["p1", "p3"]}, priority=4)
    run.gathered("p1", ["z"], [])  # not there after all: ask p3
    run.gathered("p3", ["z"], ["z"])
    run.scatter(s=Value("s"))
    run.compute("f", {"s": [ME], "e": []}, priority=5)
    run.done("e")
    run.done("f", inline=True)
    run.compute("g", {"w": ["p4"]}, priority=6)
    run.gather_failed("p4", ["w"], unsendable=True)  # g errs: w cannot travel
    attach = only(run.compute("h", {"v": ["p5"]}, priority=7, shm={"v": {"name": "seg-v"}}), AttachShm)
    assert attach.keys == ["v"]
    run.gathered(SHM, ["v"], [])  # the segment did not map: ask its holder
    run.gathered("p5", ["v"], ["v"])
    run.compute("i", {"q": ["p6"]}, priority=8)  # h runs; i waits for q
    run.free("h")  # while running
    run.gather_failed("p6", ["q"])  # i goes back ...
    run.compute("i", {"q": ["p6"]}, priority=8)  # ... and comes again
    run.gather_failed("p6", ["q"])  # the second failure in a row: i errs
    run.done("h")  # cancelled: dropped
    run.free("a", "e")


def normal(inst: Instruction) -> tuple[Any, ...]:
    """An instruction, with the user data it carries (values, exceptions) left out:
    a replay has :data:`DROPPED` there."""
    fields = {f.name: getattr(inst, f.name) for f in dataclasses.fields(inst)}
    if isinstance(inst, SendMsg):
        fields["msg"] = {k: ("<data>" if k in ("value", "exception") else v) for k, v in inst.msg.items()}
    return (type(inst).__name__, fields)


def assert_replays(state: WorkerState, out: list[Instruction], **params: Any) -> None:
    """Feeding ``state``'s logged events, call by call (as they were handled,
    ``log.calls()``), to a fresh ``WorkerState(address, **params)`` gives the
    instructions ``out`` (less user data) and leaves the same states."""
    events = list(state.log.events)
    replay = WorkerState(state.address, **params)
    again: list[Instruction] = []
    for call in state.log.calls():
        again.extend(replay.handle(*call))
        replay.validate()
    assert [normal(i) for i in again] == [normal(i) for i in out]
    assert {k: ts.state for k, ts in replay.tasks.items()} == {k: ts.state for k, ts in state.tasks.items()}
    assert set(replay.data) == set(state.data)
    assert list(replay.log.transitions) == list(state.log.transitions)
    # the replay's own log is the same events again
    assert [dataclasses.astuple(e) for e in replay.log.events] == [dataclasses.astuple(e) for e in events]


def test_the_log_replays_the_run() -> None:
    run = Run()
    drive(run)
    ops = [i.msg["op"] for i in run.out if isinstance(i, SendMsg)]
    # the run went where it should have: every kind of report was made
    assert {"task-finished", "task-erred", "missing-data", "reschedule"} <= set(ops)
    assert len(run.state.log.events) == run.calls, "every event is logged"
    assert_replays(run.state, run.out, **PARAMS)


def test_the_log_keeps_no_user_data() -> None:
    run = Run()
    drive(run)

    def user_data(obj: Any) -> bool:
        if isinstance(obj, (Value, BaseException)):
            return True
        if isinstance(obj, dict):
            return any(map(user_data, obj.values()))
        return isinstance(obj, (list, tuple)) and any(map(user_data, obj))

    for ev in run.state.log.events:
        assert not user_data(dataclasses.astuple(ev)), ev
    kinds = {type(e).__name__: e for e in run.state.log.events}
    assert kinds["ComputeTaskEvent"].payload is DROPPED
    assert kinds["ExecuteSuccessEvent"].value is DROPPED
    assert kinds["GatherDepSuccessEvent"].data == {"v": DROPPED}
    assert kinds["UpdateDataEvent"].data == {"s": DROPPED}
    failure = next(e for e in run.state.log.events if isinstance(e, ExecuteFailureEvent) and e.key == "c")
    assert (failure.exception, failure.traceback, failure.text) == (DROPPED, "Traceback: ...", "ZeroDivisionError: boom")
    skipped = next(e for e in run.state.log.events if isinstance(e, ExecuteFailureEvent) and e.key == "d")
    assert skipped.exception is None, "None stays None: the machine tells it from an exception"


def test_values_and_payloads_are_not_kept_alive_by_the_log() -> None:
    run = Run()
    payload, value = Value("payload"), Value("value")
    refs = [weakref.ref(payload), weakref.ref(value)]
    run(ComputeTaskEvent("compute-1", "k", payload, {}, {}, (0,)))
    run(ExecuteSuccessEvent("task-finished-k-1", "k", value, 8))
    assert run.state.data["k"] is value
    run.free("k")
    del payload, value
    gc.collect()
    assert [r() for r in refs] == [None, None]
    assert [type(e).__name__ for e in run.state.log.events] == ["ComputeTaskEvent", "ExecuteSuccessEvent",
                                                                 "FreeKeysEvent"]


def test_story_tells_each_transition_with_its_stimulus() -> None:
    run = Run()
    drive(run)
    story = [(t.start, t.finish, t.stimulus_id.rsplit("-", 1)[0]) for t in run.state.story("q")]
    assert story == [
        ("released", "fetch", "compute"), ("fetch", "flight", "compute"), ("flight", "released", "gather-failed"),
        ("released", "fetch", "compute"), ("fetch", "flight", "compute"), ("flight", "released", "gather-failed"),
    ]
    assert [t.key for t in run.state.story("a", "d")] == [t[0] for t in run.state.log.transitions
                                                          if t[0] in ("a", "d")]


def test_events_handled_together_replay_together() -> None:
    """A worker hands a batch of its scheduler's messages to one ``handle()`` call and
    starts tasks by priority at its end: the log keeps the calls, and a replay makes
    the same calls (one event per call would start them in arrival order)."""
    state = WorkerState("w", nthreads=1, queued=0)
    batch = [ComputeTaskEvent(f"s{i}", key, f"payload-{key}", {}, {}, (prio,))
             for i, (key, prio) in enumerate([("low", 9), ("high", 1), ("mid", 5)])]
    out = state.handle(*batch)
    assert [i.key for i in out if isinstance(i, Execute)] == ["high"]
    assert [len(call) for call in state.log.calls()] == [3]
    assert_replays(state, out, nthreads=1, queued=0)
