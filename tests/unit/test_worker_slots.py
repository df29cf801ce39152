"""shoal.worker.state: who gets the worker's threads: priorities, resources, tasks
that secede and rejoin (events alone, as in test_worker_state)."""

from __future__ import annotations

from test_worker_replay import assert_replays
from worker_harness import Wk, executes, ops, rejoins, sent


# ----------------------------------------------------------------------- resources


def test_a_task_waits_for_its_resources_and_holds_them_until_its_thread_reports() -> None:
    w = Wk(nthreads=2, queued=0, resources={"GPU": 1})
    out = w(w.compute_event("a", resources={"GPU": 1}), w.compute_event("b", resources={"GPU": 1}),
            w.compute_event("c"))
    # two threads, one GPU: b stays ready (in order), c needs none and runs
    assert executes(out) == ["a", "c"]
    assert w.states() == {"a": "executing", "b": "ready", "c": "executing"}
    assert w.state.available_resources == {"GPU": 0.0}
    assert executes(w.success("c")) == []  # a thread is free, the GPU is not
    assert executes(w.success("a")) == ["b"]
    assert w.state.holding == {w.state.tasks["b"]: {"GPU": 1}}
    w.failure("b")  # an error gives them back too
    assert w.state.available_resources == {"GPU": 1.0} and not w.state.holding


def test_resources_are_held_while_a_task_waits_in_the_thread_pool() -> None:
    w = Wk(nthreads=1, queued=1, resources={"GPU": 1})
    out = w(w.compute_event("a"), w.compute_event("b", resources={"GPU": 1}), w.compute_event("c", resources={"GPU": 1}))
    assert executes(out) == ["a", "b"]  # b waits in the pool for a's thread, with the GPU
    assert w.state.available_resources == {"GPU": 0.0}
    assert executes(w.success("a")) == []  # c: the GPU is b's
    assert executes(w.success("b")) == ["c"]


def test_a_cancelled_task_gives_its_resources_back_when_its_thread_returns() -> None:
    w = Wk(nthreads=2, queued=0, resources={"GPU": 1})
    w.compute("a", resources={"GPU": 1})
    assert executes(w.compute("b", resources={"GPU": 1})) == []
    w.free("a")
    assert w.states()["a"] == "cancelled"
    assert w.state.available_resources == {"GPU": 0.0}  # its thread still runs
    assert executes(w.success("a")) == ["b"]
    assert "a" not in w.states()


def test_tasks_that_need_resources_start_in_order_and_others_pass_them() -> None:
    w = Wk(nthreads=4, queued=0, resources={"GPU": 2})
    assert executes(w.compute("x", resources={"GPU": 1}, priority=(0,))) == ["x"]
    out = w(w.compute_event("big", resources={"GPU": 2}, priority=(1,)),
            w.compute_event("small", resources={"GPU": 1}, priority=(2,)),
            w.compute_event("cpu", priority=(3,)))
    # one GPU is free: "small" would fit but must not pass "big"; "cpu" needs none
    assert executes(out) == ["cpu"]
    assert executes(w.success("x")) == ["big"]
    assert executes(w.success("big")) == ["small"]


def test_priority_decides_between_tasks_with_and_without_resources() -> None:
    w = Wk(nthreads=1, queued=0, resources={"GPU": 1})
    w.compute("first")
    w(w.compute_event("cpu", priority=(2,)), w.compute_event("gpu", resources={"GPU": 1}, priority=(1,)))
    assert executes(w.success("first")) == ["gpu"]
    assert executes(w.success("gpu")) == ["cpu"]


def test_a_task_that_needs_more_than_the_worker_has_errs() -> None:
    w = Wk(nthreads=1, resources={"GPU": 1})
    out = w.compute("x", resources={"GPU": 2, "MEM": 1})
    (msg,) = sent(out)
    assert (msg["op"], msg["key"]) == ("task-erred", "x")
    assert "needs resources {'GPU': 2, 'MEM': 1}" in msg["text"]
    assert not executes(out) and w.state.tasks == {}
    # a resource of amount 0 is no need at all
    assert executes(w.compute("y", resources={"TPU": 0})) == ["y"]


# ---------------------------------------------------------------- secede / rejoin


def test_a_seceded_task_frees_its_slot_and_tells_the_scheduler() -> None:
    w = Wk(nthreads=1, queued=0)
    w.compute("a")
    assert executes(w.compute("b")) == []
    out = w.secede("a")
    assert sent(out) == [{"op": "long-running", "key": "a"}]
    assert executes(out) == ["b"]  # a's thread still runs, without a slot
    assert w.state.seceded == {w.state.tasks["a"]}
    assert w.secede("a") == []  # once is enough
    w.success("b")
    assert rejoins(w.rejoin("a")) == ["a"]  # a slot is free: at once
    assert w.state.executing == {w.state.tasks["a"]} and not w.state.seceded


def test_rejoin_waits_for_a_slot_and_goes_before_ready_tasks() -> None:
    w = Wk(nthreads=1, queued=1)
    w.compute("a")
    w.secede("a")
    out = w(w.compute_event("b"), w.compute_event("c"), w.compute_event("d"))
    assert executes(out) == ["b", "c"]  # a slot and one ahead in the pool
    assert w.rejoin("a") == []
    # b's thread is free, but c takes it: a still waits, and no new task starts
    out = w.success("b")
    assert not executes(out) and not rejoins(out)
    assert w.states()["d"] == "ready"
    out = w.success("c")
    assert rejoins(out) == ["a"] and executes(out) == ["d"]  # d waits in the pool behind a
    w.success("a")
    w.success("d")
    assert not w.state.executing and not w.state.seceded and not w.state.rejoining


def test_a_seceded_task_may_finish_without_rejoining(w: Wk) -> None:
    w.compute("a")
    w.secede("a")
    out = w.success("a")
    assert ops(out) == [("task-finished", "a")]
    assert w.states() == {"a": "memory"} and not w.state.seceded


def test_a_seceded_task_keeps_its_resources() -> None:
    w = Wk(nthreads=1, queued=0, resources={"GPU": 1})
    w.compute("a", resources={"GPU": 1})
    w.secede("a")
    assert executes(w.compute("b", resources={"GPU": 1})) == []  # a slot, but no GPU
    assert executes(w.compute("c")) == ["c"]
    w.success("c")
    assert executes(w.success("a")) == ["b"]


def test_a_cancelled_seceded_task_tells_the_scheduler_nothing(w: Wk) -> None:
    w.compute("a")
    w.free("a")
    assert sent(w.secede("a")) == []
    assert rejoins(w.rejoin("a")) == ["a"]
    w.failure("a")
    assert w.state.tasks == {}


def test_a_seceded_task_computed_again_while_cancelled_is_long_running_again(w: Wk) -> None:
    w.compute("a")
    w.free("a")
    w.secede("a")
    out = w.compute("a")
    assert sent(out) == [{"op": "long-running", "key": "a"}]
    assert ops(w.success("a")) == [("task-finished", "a")]


def test_rejoin_of_a_task_that_did_not_secede_answers_at_once(w: Wk) -> None:
    w.compute("a")
    assert rejoins(w.rejoin("a")) == ["a"]
    assert rejoins(w.rejoin("ghost")) == ["ghost"]
    assert w.secede("ghost") == []


def test_secede_and_rejoin_replay_from_the_log() -> None:
    w = Wk(nthreads=1, queued=1, resources={"GPU": 1})
    w.compute("a", resources={"GPU": 1})
    w.secede("a")
    w.compute("b", resources={"GPU": 1})
    w.compute("c")
    w.rejoin("a")
    w.success("c")
    w.success("a")
    w.success("b")
    assert_replays(w.state, w.out, **w.params)


# ---------------------------------------------------------------------- priorities


def test_a_more_urgent_task_overtakes_one_handed_to_the_pool_ahead() -> None:
    w = Wk(nthreads=1, queued=1)
    assert executes(w.compute("busy", priority=(5,))) == ["busy"]
    assert executes(w.compute("later", priority=(5,))) == ["later"]  # waits in the pool
    # more urgent than one waiting in the pool: it goes there too (the pool runs by priority)
    assert executes(w.compute("urgent", priority=(1,))) == ["urgent"]
    # not more urgent than anything handed over: it waits here
    assert executes(w.compute("last", priority=(9,))) == []
    assert w.states()["last"] == "ready"
    assert executes(w.success("busy")) == []  # two are still handed over: no room yet
    assert executes(w.success("urgent")) == ["last"]


def test_without_tasks_ahead_nothing_overtakes() -> None:
    w = Wk(nthreads=1, queued=0)
    assert executes(w.compute("busy", priority=(5,))) == ["busy"]
    assert executes(w.compute("urgent", priority=(1,))) == []
