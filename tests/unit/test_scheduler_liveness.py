"""The scheduler's liveness rule (``worker_ttl``), driven by events alone: no event
loop, no sleeps, no clock but the times written into the events.

The server turns every batch a worker sends (heartbeat or not) into a
:class:`HeartbeatEvent`; that half is tested in tests/integration/test_liveness.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from scheduler_harness import Sched, computes, msgs, reported, task

from shoal.scheduler.state import (
    AddWorkerEvent,
    CheckLivenessEvent,
    CloseWorkerStream,
    HeartbeatEvent,
)

TTL = 10.0


@pytest.fixture
def s() -> Iterator[Sched]:
    h = Sched(worker_ttl=TTL)
    yield h
    h.state.validate()


def add(s: Sched, address: str, now: float = 0.0, nthreads: int = 1) -> list[Any]:
    return s(AddWorkerEvent(s.sid(), address, nthreads, now=now))


def beat(s: Sched, worker: str, now: float) -> list[Any]:
    return s(HeartbeatEvent(s.sid(), worker, now))


def check(s: Sched, now: float) -> list[Any]:
    return s(CheckLivenessEvent(s.sid(), now))


def closed(out: list[Any]) -> list[tuple[str, float]]:
    return [(i.worker, i.silent_for) for i in out if isinstance(i, CloseWorkerStream)]


def test_a_silent_worker_is_removed_after_the_ttl_and_its_tasks_go_elsewhere(s: Sched) -> None:
    add(s, "w1")
    s.submit(task("a"), task("b"), task("x"))
    s.finish("w1", "x")  # a value only w1 holds
    add(s, "w2")
    assert s.on("a") == s.on("b") == "w1"
    for now in (5.0, 10.0):
        beat(s, "w2", now)
        assert check(s, now) == []  # 10 s of silence is not more than the ttl
    beat(s, "w2", 11.0)
    assert check(s, 11.0) == [], "one check alone removes nobody"
    assert s.state.workers["w1"].overdue
    out = check(s, 12.0)
    assert closed(out) == [("w1", 12.0)]
    assert isinstance(out[0], CloseWorkerStream), "the stream ends before anything else happens"
    assert set(s.state.workers) == {"w2"}
    assert sorted(computes(out)) == [("w2", "a"), ("w2", "b"), ("w2", "x")]
    assert reported(out, "lost-key") == [("c", "x")]
    # a task that freezes its worker counts like one that kills it
    assert s.ts("a").suspicious == s.ts("b").suspicious == 1
    last = s.state.log.events[-1]
    assert type(last).__name__ == "CheckLivenessEvent"
    assert [(t.start, t.finish, t.stimulus_id) for t in s.state.story("a")][-3:] == [
        ("processing", "released", last.stimulus_id), ("released", "waiting", last.stimulus_id),
        ("waiting", "processing", last.stimulus_id)]


def test_a_task_that_freezes_three_workers_errs_with_killed_worker(s: Sched) -> None:
    add(s, "w1")
    s.submit(task("x"))
    now = 0.0
    for i in (1, 2, 3):
        add(s, f"w{i + 1}", now=now)
        assert s.on("x") == f"w{i}"
        out: list[Any] = []
        while not closed(out):
            now += 1.0
            beat(s, f"w{i + 1}", now)
            out = check(s, now)
        assert closed(out) == [(f"w{i}", 12.0)]  # one check to mark it, one to remove it
    ((client, m),) = msgs(out, "task-erred")
    assert (client, m["key"], m["kind"]) == ("c", "x", "KilledWorker")
    assert set(s.state.workers) == {"w4"}


def test_workers_silent_together_go_together_and_only_the_others_take_over(s: Sched) -> None:
    add(s, "w1")
    s.submit(task("a"))
    add(s, "w2")
    s.submit(task("b"), task("c"), task("d"), task("e"))
    add(s, "w3")
    assert {s.on(k) for k in "abcde"} == {"w1", "w2"}
    beat(s, "w3", 11.0)
    check(s, 11.0)
    beat(s, "w3", 12.0)
    out = check(s, 12.0)
    assert closed(out) == [("w1", 12.0), ("w2", 12.0)]
    assert {w for w, _ in computes(out)} == {"w3"}
    assert set(s.state.workers) == {"w3"}


def test_a_worker_that_keeps_sending_stays(s: Sched) -> None:
    add(s, "w1")
    s.submit(task("a"))
    for i in range(1, 200):
        now = i * 0.5
        if i % 4 == 0:
            beat(s, "w1", now)  # every 2 s, well within the ttl
        assert check(s, now) == []
    assert s.on("a") == "w1" and not s.state.workers["w1"].overdue


def test_a_message_after_a_late_check_saves_the_worker(s: Sched) -> None:
    """The scheduler's own loop stalled for 30 s: its first check comes before it read
    what the worker sent meanwhile. That check marks the worker; the message clears the
    mark; the next check keeps the worker."""
    add(s, "w1")
    s.submit(task("a"))
    assert check(s, 30.0) == []
    assert s.state.workers["w1"].overdue
    beat(s, "w1", 30.0)
    assert not s.state.workers["w1"].overdue
    assert check(s, 31.0) == []
    assert s.on("a") == "w1"


def test_the_time_of_a_late_message_does_not_move_last_seen_back(s: Sched) -> None:
    add(s, "w1")
    beat(s, "w1", 9.0)
    beat(s, "w1", 4.0)
    assert s.state.workers["w1"].last_seen == 9.0


def test_ttl_0_disables_the_rule() -> None:
    s = Sched(worker_ttl=0)
    add(s, "w1")
    s.submit(task("a"))
    for now in (1e3, 1e6, 1e9):
        assert check(s, now) == []
    assert s.on("a") == "w1" and not s.state.workers["w1"].overdue


def test_a_worker_registered_without_a_time_counts_from_the_next_check(s: Sched) -> None:
    s(AddWorkerEvent(s.sid(), "w1", 1))
    assert check(s, 1000.0) == []
    assert s.state.workers["w1"].last_seen == 1000.0
    assert check(s, 1010.0) == []
    assert closed(check(s, 1011.0) + check(s, 1012.0)) == [("w1", 12.0)]


def test_clients_are_never_removed_for_their_silence(s: Sched) -> None:
    add(s, "w1")
    s.submit(task("a"))
    s.finish("w1", "a")
    for now in (0.5, 1.0, 1e6, 1e6 + 1):
        beat(s, "w1", now)
        check(s, now)
    assert s.ts("a").state == "memory" and set(s.ts("a").who_wants) == {"c"}
    assert s.state.clients == {"c"}


def test_time_keeping_events_are_logged_too(s: Sched) -> None:
    """A replay needs them: heartbeats say when a worker was last heard of."""
    add(s, "w1")
    before = len(s.state.log.events)
    beat(s, "w1", 1.0)
    check(s, 1.0)
    beat(s, "ghost", 2.0)  # a worker already gone: ignored, but logged
    assert [type(e).__name__ for e in list(s.state.log.events)[before:]] == [
        "HeartbeatEvent", "CheckLivenessEvent", "HeartbeatEvent"]
