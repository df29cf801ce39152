"""The scheduler state's log: the events it handled (user data dropped) and every
transition with its stimulus, bounded; a key's story; a replay of the log into a fresh
state gives the same instructions."""

from __future__ import annotations

import pytest
from scheduler_harness import Sched, task, without_user_data

from shoal.scheduler import events
from shoal.scheduler.state import AddClientEvent, AddWorkerEvent, TaskFinishedEvent, UpdateGraphEvent
from shoal.statelog import DROPPED, StateLog


def test_instructions_carry_the_event_stimulus_and_the_log_keeps_it(s: Sched) -> None:
    s(AddWorkerEvent("add-w1", "w1", 1))
    out = s(UpdateGraphEvent("graph-1", "c", [task("x")], ["x"]))
    assert [i.stimulus_id for i in out] == ["graph-1"]
    out = s(TaskFinishedEvent("done-x", "w1", "x", 1))
    assert [i.stimulus_id for i in out] == ["done-x"]
    assert [(e.stimulus_id, type(e).__name__) for e in s.state.log.events] == [
        ("add-w1", "AddWorkerEvent"), ("graph-1", "UpdateGraphEvent"), ("done-x", "TaskFinishedEvent")]
    # and the story of x says which stimulus moved it where
    assert [(t.start, t.finish, t.stimulus_id) for t in s.state.story("x")] == [
        ("released", "waiting", "graph-1"), ("waiting", "processing", "graph-1"),
        ("processing", "memory", "done-x")]


def test_log_is_bounded() -> None:
    h = Sched(log_size=3)
    for i in range(10):
        h(AddClientEvent(f"s{i}", f"c{i}"))
    assert [e.stimulus_id for e in h.state.log.events] == ["s7", "s8", "s9"]


def test_a_recorded_log_replays_into_a_fresh_state() -> None:
    """The log keeps the events themselves (user data dropped): fed to a fresh state
    they give the same instructions, transitions and end state."""
    h = Sched()
    h.add_worker("w1", nthreads=2)
    h.add_worker("w2")
    h.submit(task("a"), task("b"), task("c", "a", "b"), task("e", "a"))
    h.finish(h.on("a"), "a")
    h.err(h.on("b"), "b")
    h.submit(task("d"))
    h.remove_worker("w2")
    for key in ("d", "e"):
        h.finish(h.on(key), key, nbytes=10)
    logged = list(h.state.log.events)
    assert all(t.payload is DROPPED for ev in logged for t in getattr(ev, "tasks", ()))
    fresh, replayed = h.replay()
    assert without_user_data(replayed) == without_user_data(h.instructions)
    assert list(fresh.log.transitions) == list(h.state.log.transitions)
    assert {k: ts.state for k, ts in fresh.tasks.items()} == {k: ts.state for k, ts in h.state.tasks.items()}


def test_a_big_graph_is_logged_by_its_size_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The log keeps no copy of a graph over its bound (a copy of a million tasks
    would cost as much as the scheduler's record of them); smaller graphs are kept
    whole. The graph runs the same either way."""
    monkeypatch.setattr(events, "LOGGED_GRAPH_MAX", 3)
    s = Sched()
    s.add_worker("w1")
    s(UpdateGraphEvent("small", "c", [task("a"), task("b", "a")], ["b"]))
    s(UpdateGraphEvent("big", "c", [task(f"x{i}") for i in range(4)], [f"x{i}" for i in range(4)]))
    small, big = s.state.log.stimuli("small", "big")
    assert [t.key for t in small.tasks] == ["a", "b"] and small.wanted == ["b"] and small.omitted == 0
    assert (big.tasks, big.wanted, big.omitted) == ([], [], 4)
    states = {k: ts.state for k, ts in s.state.tasks.items()}
    assert (states.pop("a"), states.pop("b")) == ("processing", "waiting")
    assert sorted(states) == ["x0", "x1", "x2", "x3"] and set(states.values()) <= {"processing", "queued"}
    s.state.validate()


def test_the_log_holds_a_bounded_number_of_graph_tasks() -> None:
    """Many graphs under the single-graph bound still cost the log no more than its
    bound of tasks: the oldest events go first."""
    log = StateLog(events=100, tasks=5)
    for i in range(4):
        log.event(UpdateGraphEvent(f"g{i}", "c", [task(f"x{i}"), task(f"y{i}", f"x{i}")], [f"y{i}"]))
        log.event(AddClientEvent(f"a{i}", f"c{i}"))
    assert [e.stimulus_id for e in log.events] == ["a1", "g2", "a2", "g3", "a3"]
    assert sum(len(getattr(e, "tasks", ())) for e in log.events) == 4
    assert [len(c) for c in log.calls()] == [1, 1, 1, 1, 1]
