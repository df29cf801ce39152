"""shoal.worker.state: a worker's decisions, driven by events alone.

No event loop, no threads, no sleeps: each test feeds events to :class:`WorkerState`
through a small harness that calls ``validate()`` after every step, and asserts on the
returned instructions (``Execute``, ``GatherDep``, ``SendMsg``) and on the state.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from test_worker_replay import assert_replays

from shoal.worker.state import (
    ComputeTaskEvent,
    Execute,
    ExecuteFailureEvent,
    ExecuteSuccessEvent,
    FreeKeysEvent,
    GatherDep,
    GatherDepFailureEvent,
    GatherDepSuccessEvent,
    MemoryTightEvent,
    Rejoin,
    RejoinEvent,
    SecedeEvent,
    SendMsg,
    UpdateDataEvent,
    WorkerState,
)
from worker_harness import ME, Wk, executes, gathers, ops, sent

# ----------------------------------------------------------------------- computing


def test_a_task_without_dependencies_executes(w: Wk) -> None:
    out = w.compute("x")
    assert out == [Execute(out[0].stimulus_id, "x")]
    assert w.state.tasks["x"].state == "executing"
    assert w.state.tasks["x"].payload == "payload-x"

    out = w.success("x", value=42, nbytes=8)
    (msg,) = sent(out)
    assert (msg["op"], msg["key"], msg["nbytes"]) == ("task-finished", "x", 8)
    assert w.state.data == {"x": 42}
    assert w.state.tasks["x"].state == "memory"
    assert not w.state.executing


def test_instructions_carry_the_event_stimulus_and_the_log_keeps_it(w: Wk) -> None:
    out = w(ComputeTaskEvent("compute-1", "x", "p", {}, {}, (0,)))
    assert [i.stimulus_id for i in out] == ["compute-1"]
    out = w(ExecuteSuccessEvent("done-1", "x", 1, 1))
    assert [i.stimulus_id for i in out] == ["done-1"]
    assert [(type(e).__name__, e.stimulus_id, e.key) for e in w.state.log.events] == [
        ("ComputeTaskEvent", "compute-1", "x"), ("ExecuteSuccessEvent", "done-1", "x")]
    assert [tuple(t) for t in w.state.story("x")] == [
        ("x", "released", "ready", "compute-1"), ("x", "ready", "executing", "compute-1"),
        ("x", "executing", "memory", "done-1")]


def test_messages_carry_the_stimulus_that_caused_them(w: Wk) -> None:
    out = w(ComputeTaskEvent("compute-1", "t", "p", {"a": ["p1"]}, {"a": 1}, (0,)),
            ComputeTaskEvent("compute-2", "u", "p", {"b": []}, {}, (0,)))
    assert [i.msg for i in out if isinstance(i, SendMsg)] == [{"op": "reschedule", "key": "u", "stimulus_id": "compute-2"}]
    out = w(GatherDepSuccessEvent("gather-1", "p1", {}, ["a"]))
    assert [i.msg for i in out if isinstance(i, SendMsg)] == [
        {"op": "missing-data", "key": "a", "errant_worker": "p1", "unserved": True, "stimulus_id": "gather-1"},
        {"op": "reschedule", "key": "t", "stimulus_id": "gather-1"},
    ]
    w(ComputeTaskEvent("compute-3", "x", "p", {}, {}, (0,)))
    (msg,) = [i.msg for i in w(ExecuteFailureEvent("erred-1", "x", "exc", "tb", "Boom"))]
    assert (msg["op"], msg["stimulus_id"]) == ("task-erred", "erred-1")
    w(ComputeTaskEvent("compute-4", "y", "p", {}, {}, (0,)))
    (msg,) = [i.msg for i in w(ExecuteSuccessEvent("done-1", "y", 1, 1))]
    assert (msg["op"], msg["stimulus_id"]) == ("task-finished", "done-1")


def test_a_failure_is_reported_and_forgotten(w: Wk) -> None:
    w.compute("x")
    out = w.failure("x", text="ZeroDivisionError: division by zero")
    assert sent(out) == [{"op": "task-erred", "key": "x", "exception": "exc", "traceback": "tb",
                          "text": "ZeroDivisionError: division by zero"}]
    assert w.state.tasks == {} and w.state.data == {}


def test_never_more_than_nthreads_and_ready_tasks_run_by_priority() -> None:
    w = Wk(nthreads=2, queued=0)
    out = w(*(w.compute_event(k, priority=(p,)) for k, p in [("a", 3), ("b", 1), ("c", 2), ("d", 0)]))
    assert executes(out) == ["d", "b"]
    assert w.states() == {"a": "ready", "b": "executing", "c": "ready", "d": "executing"}
    assert executes(w.success("d")) == ["c"]
    assert executes(w.success("c")) == ["a"]
    assert executes(w.success("b")) == []
    assert len(w.state.executing) == 1


def test_queued_tasks_wait_for_a_thread_in_the_pool_by_priority() -> None:
    w = Wk(nthreads=1, queued=1)
    out = w(*(w.compute_event(k, priority=(p,)) for k, p in [("a", 3), ("b", 1), ("c", 2)]))
    # one runs, one more waits in the thread pool: the thread goes on without the loop
    assert executes(out) == ["b", "c"]
    assert w.states() == {"a": "ready", "b": "executing", "c": "executing"}
    assert executes(w.success("b")) == ["a"]
    # released while it waited: it reports (the thread skips it) and is forgotten
    w.free("c")
    assert w.states()["c"] == "cancelled"
    out = w.failure("c", "released before it ran")
    assert not executes(out) and not ops(out)  # nothing reported to the scheduler
    assert "c" not in w.states()
    with pytest.raises(ValueError, match="queued"):
        WorkerState(ME, queued=-1)


def test_a_key_in_memory_is_reported_at_once(w: Wk) -> None:
    w.compute("x")
    w.success("x", nbytes=5)
    out = w.compute("x")
    assert ops(out) == [("task-finished", "x")] and not executes(out)
    w.scatter({"s": 1})
    out = w.compute("s")
    assert ops(out) == [("task-finished", "s")]


def test_a_task_resent_while_running_is_not_run_twice(w: Wk) -> None:
    w.compute("x")
    assert w.compute("x") == []
    assert ops(w.success("x")) == [("task-finished", "x")]


# ------------------------------------------------------------------------ fetching


def test_dependencies_are_gathered_in_one_batch_per_peer(w: Wk) -> None:
    out = w.compute("t", {"a": ["p1"], "b": ["p1"], "c": ["p2"]}, {"a": 10, "b": 20, "c": 30})
    assert not executes(out)
    got = sorted((peer, sorted(keys), total) for peer, keys, total in gathers(out))
    assert got == [("p1", ["a", "b"], 30), ("p2", ["c"], 30)]
    assert w.states() == {"t": "waiting", "a": "flight", "b": "flight", "c": "flight"}

    out = w.gathered("p1", {"a": 1, "b": 2}, ["a", "b"])
    assert out == []
    out = w.gathered("p2", {"c": 3}, ["c"])
    assert executes(out) == ["t"]
    assert w.state.data == {"a": 1, "b": 2, "c": 3}

    out = w.success("t")
    assert ops(out) == [("task-finished", "t")]
    # fetched copies are dropped once no local task needs them
    assert w.state.data == {"t": "value-t"}
    assert set(w.state.tasks) == {"t"}


def test_a_dependency_already_here_is_not_fetched(w: Wk) -> None:
    w.compute("a")
    w.success("a")
    out = w.compute("b", {"a": [ME]})
    assert executes(out) == ["b"] and not gathers(out)
    w.success("b")
    assert set(w.state.data) == {"a", "b"}, "a was computed here: the scheduler frees it"


def test_a_shared_dependency_is_fetched_once(w: Wk) -> None:
    out = w(w.compute_event("t1", {"a": ["p1"]}, priority=(0,)), w.compute_event("t2", {"a": ["p1"]}, priority=(1,)))
    assert gathers(out) == [("p1", ["a"], 1)]
    out = w.gathered("p1", {"a": 1}, ["a"])
    assert executes(out) == ["t1"]
    assert executes(w.success("t1")) == ["t2"]
    assert "a" in w.state.data, "t2 still needs a"
    assert w.success("t1") == [], "a duplicate report changes nothing"
    w.success("t2")
    assert set(w.state.data) == {"t1", "t2"}


def test_gather_bytes_limits_a_batch() -> None:
    w = Wk(gather_bytes=100)
    out = w.compute("t", {"a": ["p1"], "b": ["p1"]}, {"a": 60, "b": 60})
    ((peer, keys, total),) = gathers(out)
    assert (peer, len(keys), total) == ("p1", 1, 60)
    first = keys[0]
    out = w.gathered("p1", {first: 1}, keys)
    ((peer, keys, total),) = gathers(out)
    assert (peer, keys, total) == ("p1", [{"a": "b", "b": "a"}[first]], 60)


def test_a_single_dependency_larger_than_gather_bytes_is_still_fetched() -> None:
    w = Wk(gather_bytes=100)
    out = w.compute("t", {"a": ["p1"]}, {"a": 1000})
    assert gathers(out) == [("p1", ["a"], 1000)]


def test_transfer_bytes_bounds_the_bytes_in_flight_across_peers() -> None:
    w = Wk(max_gathers=4, transfer_bytes=100)
    assert w.state.gather_bytes == 100, "a request is within the bound too"
    out = w.compute("t", {"a": ["p1"], "b": ["p2"], "c": ["p3"]}, {"a": 60, "b": 30, "c": 60})
    assert gathers(out) == [("p1", ["a"], 60), ("p2", ["b"], 30)]
    assert w.state.in_flight_bytes() == 90
    assert w.state.tasks["c"].state == "fetch", "c waits for room"
    assert gathers(w.gathered("p2", {"b": 1}, ["b"])) == [], "still no room for 60 bytes"
    assert gathers(w.gathered("p1", {"a": 1}, ["a"])) == [("p3", ["c"], 60)]
    assert executes(w.gathered("p3", {"c": 1}, ["c"])) == ["t"]


def test_a_value_larger_than_transfer_bytes_comes_alone() -> None:
    w = Wk(transfer_bytes=100)
    out = w.compute("t", {"a": ["p1"], "b": ["p2"]}, {"a": 1000, "b": 10})
    assert gathers(out) == [("p1", ["a"], 1000)], "the only request in flight may exceed the bound"
    assert gathers(w.gathered("p1", {"a": 1}, ["a"])) == [("p2", ["b"], 10)]


def test_values_mapped_from_shared_memory_do_not_count_against_transfer_bytes() -> None:
    w = Wk(transfer_bytes=100)
    shm_info = ["segment", 0, 200]
    out = w(ComputeTaskEvent("c", "t", "p", {"a": ["p1"], "b": ["p2"]}, {"a": 200, "b": 90}, (0,), {"a": shm_info}))
    assert [type(i).__name__ for i in out].count("AttachShm") == 1
    assert gathers(out) == [("p2", ["b"], 90)]
    assert w.state.in_flight_bytes() == 90


def test_transfer_bytes_must_be_positive() -> None:
    with pytest.raises(ValueError, match="transfer_bytes"):
        WorkerState(ME, transfer_bytes=0)


def test_at_most_max_gathers_peers_at_once() -> None:
    w = Wk(max_gathers=2)
    deps = {f"d{i}": [f"p{i}"] for i in range(4)}
    out = w.compute("t", deps)
    assert len(gathers(out)) == 2
    busy = {peer for peer, _, _ in gathers(out)}
    peer = sorted(busy)[0]
    out = w.gathered(peer, {f"d{peer[1]}": 1}, [f"d{peer[1]}"])
    (new,) = gathers(out)
    assert new[0] not in busy
    assert len(w.state.in_flight_workers) == 2


def test_fetches_go_by_priority() -> None:
    w = Wk(max_gathers=1)
    out = w(w.compute_event("late", {"b": ["p2"]}, priority=(5,)), w.compute_event("soon", {"a": ["p1"]}, priority=(1,)))
    assert gathers(out) == [("p1", ["a"], 1)]


def test_missing_data_on_a_peer_is_reported_and_fetched_from_another(w: Wk) -> None:
    out = w.compute("t", {"a": ["p1", "p2"]})
    assert gathers(out) == [("p1", ["a"], 1)]
    out = w.gathered("p1", {}, ["a"])
    assert sent(out) == [{"op": "missing-data", "key": "a", "errant_worker": "p1", "unserved": True}]
    assert gathers(out) == [("p2", ["a"], 1)]
    out = w.gathered("p2", {"a": 1}, ["a"])
    assert executes(out) == ["t"]


def test_a_value_kept_for_this_host_is_a_replica_until_the_scheduler_frees_it(w: Wk) -> None:
    w.compute("t", {"a": ["p1"], "b": ["p1"]})
    # a came from another host and was put in a segment of this worker; b was not
    out = w(GatherDepSuccessEvent(w.sid(), "p1", {"a": 1, "b": 2}, ["a", "b"], {"a": 1 << 25, "b": 10},
                                  {"a": ["seg", 1 << 25, 10, [[4096, 1 << 25]], "tok"]}))
    assert sent(out, "add-replica") == [{"op": "add-replica", "key": "a", "nbytes": 1 << 25,
                                         "shm": ["seg", 1 << 25, 10, [[4096, 1 << 25]], "tok"]}]
    assert executes(out) == ["t"]
    w.success("t")
    # b, a private copy, goes with its last dependent; a stays for the scheduler
    assert "a" in w.state.data and "b" not in w.state.data
    w.free("a")
    assert "a" not in w.state.data


def test_missing_data_everywhere_gives_the_dependents_back(w: Wk) -> None:
    w(w.compute_event("t1", {"a": ["p1"]}), w.compute_event("t2", {"a": ["p1"], "b": ["p1"]}))
    out = w.gathered("p1", {"b": 2}, ["a", "b"])
    assert sorted(ops(out)) == [("missing-data", "a"), ("reschedule", "t1"), ("reschedule", "t2")]
    assert w.state.tasks == {} and w.state.data == {}, "b was only needed by t2"


def test_a_dependency_without_holders_gives_the_task_back(w: Wk) -> None:
    out = w.compute("t", {"a": ["p1"], "b": []})
    assert ops(out) == [("reschedule", "t")]
    assert not gathers(out)
    assert w.state.tasks == {}


def test_a_dependency_listed_here_but_absent_is_reported_missing(w: Wk) -> None:
    out = w.compute("t", {"a": [ME]})
    assert sent(out) == [{"op": "missing-data", "key": "a", "errant_worker": ME}, {"op": "reschedule", "key": "t"}]
    assert w.state.tasks == {}


def test_a_late_gather_reply_for_dropped_keys_is_ignored(w: Wk) -> None:
    w.compute("t", {"a": ["p1"]})
    w.free("t")
    assert w.state.tasks == {}
    assert w.state.in_flight_workers == {"p1": set()}, "the request is still out"
    out = w.gathered("p1", {"a": 1}, ["a"])
    assert out == [] and w.state.data == {} and not w.state.in_flight_workers


# ---------------------------------------------------------------------- free-keys


def test_free_keys_of_an_executing_task_cancels_it(w: Wk) -> None:
    w.compute("x")
    w.compute("y")
    assert w.free("x") == []
    assert w.state.tasks["x"].state == "cancelled"
    assert len(w.state.executing) == 1, "its thread is still busy"
    out = w.success("x")
    assert sent(out) == [], "a cancelled result is dropped"
    assert "x" not in w.state.data and "x" not in w.state.tasks
    assert executes(out) == ["y"]


def test_a_cancelled_failure_is_not_reported(w: Wk) -> None:
    w.compute("x")
    w.free("x")
    assert w.failure("x") == []
    assert w.state.tasks == {}


def test_a_cancelled_task_computed_again_resumes(w: Wk) -> None:
    w.compute("x")
    w.free("x")
    out = w.compute("x")
    assert out == [], "it is still running: no second Execute"
    assert ops(w.success("x")) == [("task-finished", "x")]


def test_free_keys_of_waiting_and_ready_tasks(w: Wk) -> None:
    w.compute("run")
    w.compute("ready")
    w.compute("wait", {"a": ["p1"]})
    w.free("ready", "wait")
    assert set(w.state.tasks) == {"run"}
    assert w.state.in_flight_workers == {"p1": set()}
    assert executes(w.success("run")) == []


def test_free_keys_of_a_value_still_needed_keeps_it(w: Wk) -> None:
    w.compute("x")
    w.success("x")
    w.compute("blocker")
    w.compute("t", {"x": [ME]})
    assert w.state.tasks["t"].state == "ready"
    assert w.free("x") == []
    assert w.state.data["x"] == "value-x", "t still needs x"
    assert executes(w.success("blocker")) == ["t"]
    w.success("t")
    assert "x" not in w.state.data and "x" not in w.state.tasks, "then it is dropped"


def test_free_keys_of_a_task_and_its_input_together_gives_nothing_back() -> None:
    w = Wk(nthreads=1)
    w.compute("busy")
    w.compute("a")  # ready, not started
    w.compute("b", {"a": []})  # waits for a, computed here
    assert w.states()["b"] == "waiting"
    assert w.free("a", "b") == []
    assert set(w.state.tasks) == {"busy"}


def test_free_keys_of_an_input_not_started_gives_its_dependent_back() -> None:
    w = Wk(nthreads=1)
    w.compute("busy")
    w.compute("a")
    w.compute("b", {"a": []})
    out = w.free("a")
    assert ops(out) == [("reschedule", "b")], "b cannot get a from anywhere now"
    assert set(w.state.tasks) == {"busy"}


def test_free_keys_of_an_input_not_started_fetches_it_if_held_elsewhere() -> None:
    w = Wk(nthreads=1)
    w.compute("busy")
    w.compute("a")
    w.compute("b", {"a": ["p1"]})
    out = w.free("a")
    assert gathers(out) == [("p1", ["a"], 1)]
    assert ops(out) == []


def test_free_keys_of_a_computed_value(w: Wk) -> None:
    w.compute("x")
    w.success("x")
    assert w.free("x") == []
    assert w.state.data == {} and w.state.tasks == {}


def test_a_cancelled_task_still_feeds_a_new_dependent(w: Wk) -> None:
    w.compute("a")
    w.free("a")
    out = w.compute("b", {"a": ["p1"]})
    assert not gathers(out), "a is being computed here already"
    out = w.success("a")
    assert sent(out) == [], "the scheduler did not ask for a any more"
    assert executes(out) == ["b"]
    out = w.success("b")
    assert ops(out) == [("task-finished", "b")]
    assert set(w.state.data) == {"b"}


def test_a_cancelled_task_that_fails_is_fetched_for_its_dependent(w: Wk) -> None:
    w.compute("a")
    w.free("a")
    w.compute("b", {"a": ["p1"]})
    out = w.failure("a")
    assert sent(out) == []
    assert gathers(out) == [("p1", ["a"], 1)]
    assert executes(w.gathered("p1", {"a": 1}, ["a"])) == ["b"]


def test_an_input_computed_here_then_freed_is_fetched_again(w: Wk) -> None:
    w.compute("u", {"t": ["p1"]})
    assert w.states() == {"u": "waiting", "t": "flight"}
    # the scheduler has t computed here after all (its holder may be going away)
    w.compute("t", {"d": ["p2"]})
    assert w.states() == {"u": "waiting", "t": "waiting", "d": "flight"}
    # and changes its mind: u still needs t, which p1 holds
    assert w.free("t") == []
    assert w.states() == {"u": "waiting", "t": "fetch"}
    assert [(t.start, t.finish) for t in w.state.story("t")] == [
        ("released", "fetch"), ("fetch", "flight"), ("flight", "released"), ("released", "waiting"),
        ("waiting", "fetch")]
    w.gathered("p2", {"d": 1}, ["d"])  # the late reply of the dropped fetch
    out = w.gathered("p1", {}, ["t"])  # the first request, which no longer asked for t
    assert gathers(out) == [("p1", ["t"], 1)]
    assert executes(w.gathered("p1", {"t": 1}, ["t"])) == ["u"]


def test_the_transition_table_covers_every_state() -> None:
    from typing import get_args

    from shoal.worker.model import TRANSITIONS, WState

    states = set(get_args(WState))
    assert set(TRANSITIONS) == states
    assert all(finishes <= states and start not in finishes for start, finishes in TRANSITIONS.items())


def test_an_illegal_transition_raises_and_changes_nothing(w: Wk) -> None:
    from shoal.statelog import InvalidTransition

    w.compute("x")
    ts = w.state.tasks["x"]
    before = len(w.state.log.transitions)
    with pytest.raises(InvalidTransition, match="executing -> waiting"):
        w.state._set_state(ts, "waiting")
    with pytest.raises(InvalidTransition, match="executing -> executing"):
        w.state._set_state(ts, "executing")
    assert ts.state == "executing" and len(w.state.log.transitions) == before


# ------------------------------------------------------------------------- scatter


def test_scattered_data_is_stored(w: Wk) -> None:
    assert w.scatter({"s": 10}) == []
    assert w.state.data == {"s": 10}
    assert w.state.tasks["s"].state == "memory"
    out = w.compute("t", {"s": [ME]})
    assert executes(out) == ["t"]
    w.success("t")
    assert set(w.state.data) == {"s", "t"}
    w.free("s")
    assert set(w.state.data) == {"t"}


def test_scattered_data_replaces_a_fetch(w: Wk) -> None:
    w.compute("t", {"a": ["p1"]})
    out = w.scatter({"a": 5})
    assert executes(out) == ["t"]
    assert w.state.data["a"] == 5
    # the late reply changes nothing
    w.gathered("p1", {"a": 6}, ["a"])
    assert w.state.data["a"] == 5


def test_scattered_data_for_a_running_task_leaves_the_computation(w: Wk) -> None:
    w.compute("x")
    assert w.scatter({"x": 5}) == []
    assert w.state.tasks["x"].state == "executing"
    assert ops(w.success("x", value=7)) == [("task-finished", "x")]
    assert w.state.data["x"] == 7


def test_scattered_data_for_a_cancelled_task_keeps_its_thread_busy(w: Wk) -> None:
    w.compute("x")
    w.free("x")
    w.scatter({"x": 5})
    assert w.state.data == {"x": 5}
    out = w.compute("y")
    assert executes(out) == [], "x's thread has not returned yet"
    out = w.success("x", value=7)
    assert sent(out) == []
    assert executes(out) == ["y"]
    assert w.state.data == {"x": 5}


def test_unknown_keys_are_ignored(w: Wk) -> None:
    assert w.success("ghost") == []
    assert w.failure("ghost") == []
    assert w.free("ghost") == []
    assert w.gathered("p9", {"ghost": 1}, ["ghost"]) == []
    assert w.gather_failed("p9", ["ghost"]) == []
    assert w.state.tasks == {} and w.state.data == {}


def test_a_worker_needs_a_thread() -> None:
    with pytest.raises(ValueError, match="at least one thread"):
        WorkerState(ME, nthreads=0)


def test_validate_catches_a_broken_invariant(w: Wk) -> None:
    w.compute("x")
    w.state.data["x"] = 1
    with pytest.raises(AssertionError):
        w.state.validate()
    del w.state.data["x"]


# =================================================================== stateful test


PEERS = ("p1", "p2", "p3")
KEYS = [f"k{i}" for i in range(10)]


class WorkerMachine(RuleBasedStateMachine):
    """Random plausible events from the scheduler, the executor and peers; at the end,
    with every thread and fetch answered, every task the scheduler still wants here was
    reported, and nothing is left but values the scheduler knows about."""

    def __init__(self) -> None:
        super().__init__()
        self.h = Wk(nthreads=2, max_gathers=2, gather_bytes=25, queued=1, resources={"GPU": 2})  # as a worker runs it
        #: keys with a running executor thread
        self.threads: set[Any] = set()
        #: of those, the threads that seceded, and those of them waiting to rejoin
        self.seceded: set[Any] = set()
        self.rejoining: set[Any] = set()
        #: outstanding GatherDep requests
        self.requests: dict[str, list[Any]] = {}
        #: keys the scheduler asked for and did not free since -> reported since?
        self.wanted: dict[Any, bool] = {}
        #: holders the scheduler named for each key
        self.told: dict[Any, set[str]] = {}

    def apply(self, *events: Any) -> list[Any]:
        out = self.h(*events)
        st_ = self.h.state
        for inst in out:
            if isinstance(inst, Execute):
                assert inst.key not in self.threads, f"{inst.key} is already running"
                assert st_.tasks[inst.key].state == "executing"
                self.threads.add(inst.key)
            elif isinstance(inst, Rejoin):
                assert inst.key in self.rejoining, f"{inst.key} rejoined without asking"
                self.rejoining.discard(inst.key)
                self.seceded.discard(inst.key)
            elif isinstance(inst, GatherDep):
                assert inst.worker not in self.requests, f"a second request to {inst.worker}"
                assert inst.worker != ME
                assert len(inst.keys) == 1 or inst.total_nbytes <= st_.gather_bytes
                if st_.transfer_bytes is not None:
                    # beyond the bound only as the one request in flight
                    assert st_.in_flight_bytes() <= st_.transfer_bytes or len(self.requests) == 0
                for k in inst.keys:
                    assert st_.tasks[k].state == "flight" and st_.tasks[k].coming_from == inst.worker
                self.requests[inst.worker] = list(inst.keys)
            elif isinstance(inst, SendMsg):
                op, key = inst.msg["op"], inst.msg["key"]
                if op == "long-running":
                    assert key in self.seceded and key in self.wanted, inst.msg
                elif op in ("task-finished", "task-erred", "reschedule"):
                    assert key in self.wanted, f"{op} for {key}, which the scheduler did not ask for (or freed)"
                    self.wanted[key] = True
                else:
                    assert op == "missing-data" and inst.msg["errant_worker"] in self.told.get(key, ()), inst.msg
        if st_.slots == st_.nthreads:  # else more may wait in the pool, by priority (validate() checks)
            assert len(self.threads - self.seceded) <= st_.slots
        assert len(self.requests) <= st_.max_gathers
        return out

    @rule(
        key=st.integers(0, len(KEYS) - 1),
        deps=st.lists(st.tuples(st.integers(0, len(KEYS) - 1), st.sets(st.sampled_from((*PEERS, ME)), max_size=2),
                                st.integers(1, 20)), max_size=3),
        priority=st.integers(0, 5),
        gpus=st.sampled_from([0, 0, 1, 2]),
    )
    def compute(self, key: int, deps: list[tuple[int, set[str], int]], priority: int, gpus: int) -> None:
        # dependencies have smaller indices, so the graph has no cycle
        who_has = {KEYS[d]: sorted(holders) for d, holders, _ in deps if d < key}
        nbytes = {KEYS[d]: n for d, _, n in deps if d < key}
        for k, holders in who_has.items():
            self.told.setdefault(k, set()).update(holders)
        self.wanted[KEYS[key]] = False
        self.apply(ComputeTaskEvent(self.h.sid(), KEYS[key], f"payload-{key}", who_has, nbytes, (priority,),
                                    resources={"GPU": gpus} if gpus else None))

    @precondition(lambda self: self.h.state.tasks)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        keys = data.draw(st.lists(st.sampled_from(sorted(self.h.state.tasks)), min_size=1, max_size=3))
        for k in keys:
            self.wanted.pop(k, None)
        self.apply(FreeKeysEvent(self.h.sid(), keys))

    @precondition(lambda self: self.threads - self.seceded)
    @rule(data=st.data())
    def secede(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.threads - self.seceded)))
        self.seceded.add(key)
        self.apply(SecedeEvent(self.h.sid(), key))

    @precondition(lambda self: self.seceded - self.rejoining)
    @rule(data=st.data())
    def rejoin(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.seceded - self.rejoining)))
        self.rejoining.add(key)
        self.apply(RejoinEvent(self.h.sid(), key))

    @rule(tight=st.booleans())
    def memory_tight(self, tight: bool) -> None:
        self.apply(MemoryTightEvent(self.h.sid(), tight))

    @precondition(lambda self: self.threads - self.rejoining)
    @rule(data=st.data(), ok=st.booleans(), nbytes=st.integers(1, 30))
    def thread_done(self, data: st.DataObject, ok: bool, nbytes: int) -> None:
        # a thread waiting to rejoin is blocked: it reports nothing
        key = data.draw(st.sampled_from(sorted(self.threads - self.rejoining)))
        self.threads.discard(key)
        self.seceded.discard(key)
        if ok:
            self.apply(ExecuteSuccessEvent(self.h.sid(), key, f"value-{key}", nbytes))
        else:
            self.apply(ExecuteFailureEvent(self.h.sid(), key, "exc", "tb", "Boom: x"))

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), fail=st.booleans())
    def gather_done(self, data: st.DataObject, fail: bool) -> None:
        peer = data.draw(st.sampled_from(sorted(self.requests)))
        keys = self.requests.pop(peer)
        if fail:
            self.apply(GatherDepFailureEvent(self.h.sid(), peer, keys, "connection refused"))
        else:
            present = data.draw(st.sets(st.sampled_from(keys)))
            self.apply(GatherDepSuccessEvent(self.h.sid(), peer, {k: f"value-{k}" for k in present}, keys,
                                             {k: 1 for k in present}))

    @rule(key=st.integers(0, len(KEYS) - 1))
    def scatter(self, key: int) -> None:
        self.apply(UpdateDataEvent(self.h.sid(), {KEYS[key]: f"scattered-{key}"}, {KEYS[key]: 3}))

    @invariant()
    def valid(self) -> None:
        self.h.state.validate()

    def teardown(self) -> None:
        for _ in range(1000):
            if not self.threads and not self.requests:
                break
            for key in sorted(self.threads - self.rejoining):
                self.threads.discard(key)
                self.seceded.discard(key)
                self.apply(ExecuteSuccessEvent(self.h.sid(), key, f"value-{key}", 1))
            for peer in sorted(self.requests):
                keys = self.requests.pop(peer)
                self.apply(GatherDepSuccessEvent(self.h.sid(), peer, {k: f"value-{k}" for k in keys}, keys,
                                                 {k: 1 for k in keys}))
        else:
            raise AssertionError("the worker never settled")
        s = self.h.state
        left = {k: (ts.state, ts.origin) for k, ts in s.tasks.items() if ts.state != "memory" or ts.origin == "fetched"}
        assert not left, f"settled, but not done: {left}"
        assert set(s.data) == set(s.tasks)
        assert not s.executing and not s.fetching and not s.in_flight_workers
        assert not s.seceded and not s.rejoining and not s.holding
        assert s.available_resources == s.total_resources
        unreported = [k for k, done in self.wanted.items() if not done]
        assert not unreported, f"never reported to the scheduler: {unreported}"
        # and the run replays from the log alone (one event per handle(), as here)
        assert_replays(s, self.h.out, **self.h.params)


class BoundedTransfersMachine(WorkerMachine):
    """The same with a bound on the bytes fetched at once (a worker with a memory limit)."""

    def __init__(self) -> None:
        super().__init__()
        self.h = Wk(nthreads=2, max_gathers=2, gather_bytes=25, queued=1, resources={"GPU": 2}, transfer_bytes=20)


TestWorkerMachine = WorkerMachine.TestCase
TestBoundedTransfersMachine = BoundedTransfersMachine.TestCase
TestWorkerMachine.settings = TestBoundedTransfersMachine.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def test_the_keys_a_worker_forgot_are_remembered_up_to_a_bound(monkeypatch) -> None:
    """What a worker released it remembers, the most recent last, at most RELEASED_KEYS
    of them: a same-host peer asking for one is answered at once."""
    from shoal.worker import state as wstate

    monkeypatch.setattr(wstate, "RELEASED_KEYS", 3)
    ws = wstate.WorkerState(nthreads=1, address="tcp://w:1")
    for i in range(5):
        key = f"k{i}"
        ws.handle(wstate.ComputeTaskEvent(f"c{i}", key, b"p", {}, {}, (i,)))
        ws.handle(wstate.ExecuteSuccessEvent(f"s{i}", key, i, 28, 0.001))
        ws.handle(wstate.FreeKeysEvent(f"f{i}", [key]))
        assert key not in ws.tasks
    assert list(ws.released) == ["k2", "k3", "k4"]
    ws.validate()
