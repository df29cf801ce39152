"""shoal.scheduler.state: the scheduler's decisions, driven by events alone.

No event loop, no sleeps: each test feeds events to :class:`SchedulerState` through a
small harness that calls ``validate()`` after every step, and asserts on the returned
instructions and on the state.
"""

from __future__ import annotations

from typing import Any

import pytest
from scheduler_harness import Sched, compute_of, computes, frees, msgs, reported, task

from shoal.scheduler.state import (
    AddClientEvent,
    AddWorkerEvent,
    ClientMsg,
    ComputeTask,
    InvalidTransition,
    NewTask,
    RemoveClientEvent,
    SchedulerState,
    UpdateGraphEvent,
)


# ------------------------------------------------------------------------ basic flow


def test_one_task_on_one_worker(s: Sched) -> None:
    s.add_worker("w1")
    out = s.submit(task("x"))
    # the client waits for x: the worker is asked to send a small value back inline
    assert out == [ComputeTask(out[0].stimulus_id, "w1", "x", "payload-x", {}, {}, s.ts("x").priority, report=True)]
    assert s.ts("x").state == "processing" and s.ts("x").processing_on is s.state.workers["w1"]

    out = s.finish("w1", "x", nbytes=123)
    assert msgs(out) == [("c", {"op": "key-in-memory", "key": "x", "nbytes": 123, "workers": ["w1"]})]
    assert s.ts("x").state == "memory"
    assert {ws.address for ws in s.ts("x").who_has} == {"w1"}
    assert s.state.workers["w1"].nbytes == 123
    assert not s.state.workers["w1"].processing


def test_chain_runs_in_order_and_frees_intermediates(s: Sched) -> None:
    s.add_worker("w1", nthreads=2)
    out = s.submit(task("a"), task("b", "a"), task("c", "b"), wanted=["c"])
    assert computes(out) == [("w1", "a")]
    assert s.states() == {"a": "processing", "b": "waiting", "c": "waiting"}

    out = s.finish("w1", "a", nbytes=10)
    b = compute_of(out, "b")
    assert (b.worker, b.who_has, b.nbytes) == ("w1", {"a": ["w1"]}, {"a": 10})
    assert not msgs(out), "nobody wants a"
    assert not frees(out), "b still needs a"

    out = s.finish("w1", "b", nbytes=20)
    assert computes(out) == [("w1", "c")]
    assert frees(out) == {"w1": {"a"}}, "a is freed once its only dependent is done"

    out = s.finish("w1", "c", nbytes=30)
    assert reported(out, "key-in-memory") == [("c", "c")]
    assert frees(out) == {"w1": {"b"}}
    assert s.states() == {"a": "released", "b": "released", "c": "memory"}
    assert s.state.workers["w1"].nbytes == 30

    out = s.release("c")
    assert frees(out) == {"w1": {"c"}}
    assert s.state.tasks == {}
    assert s.state.workers["w1"].nbytes == 0


def test_diamond_frees_the_root_after_both_branches(s: Sched) -> None:
    s.add_worker("w1", nthreads=4)
    out = s.submit(task("a"), task("b", "a"), task("c", "a"), task("d", "b", "c"), wanted=["d"])
    assert computes(out) == [("w1", "a")]
    out = s.finish("w1", "a")
    assert sorted(computes(out)) == [("w1", "b"), ("w1", "c")]
    out = s.finish("w1", "b")
    assert not frees(out) and not computes(out)
    assert set(s.ts("d").waiting_on) == {s.ts("c")}
    out = s.finish("w1", "c")
    assert frees(out) == {"w1": {"a"}}
    d = compute_of(out, "d")
    assert d.who_has == {"b": ["w1"], "c": ["w1"]}
    out = s.finish("w1", "d")
    assert frees(out) == {"w1": {"b", "c"}}
    assert reported(out, "key-in-memory") == [("c", "d")]


def test_tasks_go_out_in_priority_order(s: Sched) -> None:
    s.add_worker("w1", nthreads=1)  # room for 1 + ahead(2) tasks
    out = s.submit(*(task(f"t{i}") for i in range(6)))
    assert computes(out) == [("w1", "t0"), ("w1", "t1"), ("w1", "t2")]
    out = s.finish("w1", "t0")
    assert computes(out) == [("w1", "t3")]


# ------------------------------------------------------------------------- placement


def test_placement_prefers_the_worker_holding_most_input_bytes(s: Sched) -> None:
    for w in ("w1", "w2", "w3"):
        s.add_worker(w, nthreads=2)
    s.scatter({"small": ["w1"], "big": ["w2"]}, {"small": 10, "big": 1000})
    out = s.submit(task("z", "small", "big"))
    assert computes(out) == [("w2", "z")]
    assert compute_of(out, "z").who_has == {"small": ["w1"], "big": ["w2"]}
    assert compute_of(out, "z").nbytes == {"small": 10, "big": 1000}


def test_placement_ties_go_to_the_least_busy_worker(s: Sched) -> None:
    s.add_worker("w1", nthreads=2)
    s.add_worker("w2", nthreads=2)
    s.scatter({"x": ["w1", "w2"]}, {"x": 100})
    # w1 gets busy with a task restricted to it
    s.submit(task("busy", workers=["w1"]))
    assert s.on("busy") == "w1"
    out = s.submit(task("z", "x"))
    assert computes(out) == [("w2", "z")]
    # without inputs, the least busy worker (relative to its threads) gets the task
    s.submit(task("busy2", workers=["w2"]))
    out = s.submit(task("free"))
    assert computes(out) == [("w1", "free")]


def test_workers_get_at_most_nthreads_plus_ahead_and_the_rest_queue(s: Sched) -> None:
    s.add_worker("w1", nthreads=1)  # 1 thread + 2 ahead
    out = s.submit(*(task(f"t{i}") for i in range(10)))
    assert computes(out) == [("w1", f"t{i}") for i in range(3)]
    assert [ts.key for ts in sorted(s.state.queued)] == [f"t{i}" for i in range(3, 10)]
    assert all(s.ts(f"t{i}").state == "queued" for i in range(3, 10))

    # one slot frees: exactly one task goes out, the next by priority
    out = s.finish("w1", "t0")
    assert computes(out) == [("w1", "t3")]
    out = s.err("w1", "t1")
    assert computes(out) == [("w1", "t4")]

    # a new worker takes what it has room for, no more
    out = s.add_worker("w2", nthreads=1)
    assert computes(out) == [("w2", "t5"), ("w2", "t6"), ("w2", "t7")]
    assert len(s.state.workers["w1"].processing) == 3
    assert [ts.key for ts in sorted(s.state.queued)] == ["t8", "t9"]

    # released keys free their slots too
    out = s.release("t2")
    assert frees(out) == {"w1": {"t2"}}
    assert computes(out) == [("w1", "t8")]
    assert [ts.key for ts in s.state.queued] == ["t9"]


def test_no_look_ahead_gives_one_task_per_thread() -> None:
    s = Sched(ahead=0)
    s.add_worker("w1", nthreads=2)
    out = s.submit(*(task(f"t{i}") for i in range(5)))
    assert computes(out) == [("w1", "t0"), ("w1", "t1")]
    out = s.finish("w1", "t1")
    assert computes(out) == [("w1", "t2")]


def test_no_workers_queues_until_one_arrives(s: Sched) -> None:
    out = s.submit(task("a"), task("b", "a"))
    assert not computes(out)
    assert s.states() == {"a": "queued", "b": "waiting"}
    out = s.add_worker("w1")
    assert computes(out) == [("w1", "a")]


# ---------------------------------------------------------------------- restrictions


def test_restrictions_are_honoured(s: Sched) -> None:
    s.add_worker("w1", nthreads=1)
    s.add_worker("w2", nthreads=1)
    s.scatter({"x": ["w1"]}, {"x": 10**6})
    # w1 is idle and holds the input, but the task may only run on w2
    out = s.submit(*(task(f"r{i}", "x", workers=["w2"]) for i in range(4)))
    assert computes(out) == [("w2", "r0"), ("w2", "r1"), ("w2", "r2")]
    assert s.ts("r3").state == "queued"
    # w1 has room, but r3 does not go there
    out = s.submit(task("free"))
    assert computes(out) == [("w1", "free")]
    out = s.finish("w1", "free")
    assert not computes(out)
    assert s.ts("r3").state == "queued"
    # w2 frees a slot: r3 goes there
    out = s.finish("w2", "r0")
    assert computes(out) == [("w2", "r3")]


def test_restriction_to_no_existing_worker_errs_with_a_value_error(s: Sched) -> None:
    s.add_worker("w1")
    out = s.submit(task("a", workers=["tcp://nowhere:1"]), task("b", "a"), wanted=["a", "b"])
    assert not computes(out)
    erred = msgs(out, "task-erred")
    assert [(c, m["key"]) for c, m in erred] == [("c", "a"), ("c", "b")], "one report per key"
    for _, m in erred:
        assert m["kind"] == "ValueError"
        assert m["blame"] == "a"
        assert m["text"].startswith("ValueError:") and "tcp://nowhere:1" in m["text"]
    assert s.states() == {"a": "erred", "b": "erred"}


def test_restricted_task_errs_when_its_only_worker_leaves(s: Sched) -> None:
    s.add_worker("w1", nthreads=1)
    s.add_worker("w2", nthreads=1)
    s.submit(*(task(f"r{i}", workers=["w2"]) for i in range(4)))
    assert s.ts("r3").state == "queued"
    out = s.remove_worker("w2")
    # the processing ones erred as well: they cannot run anywhere now
    assert {m["key"] for _, m in msgs(out, "task-erred")} == {"r0", "r1", "r2", "r3"}
    assert all(m["kind"] == "ValueError" for _, m in msgs(out, "task-erred"))
    assert not computes(out)
    assert not s.state.queued


# ---------------------------------------------------------------------------- errors


def test_task_erred_propagates_to_dependents_with_the_blame(s: Sched) -> None:
    s.add_worker("w1")
    s(AddClientEvent(s.sid(), "c2"))
    s.submit(task("a"), task("b", "a"), task("c", "b"), wanted=["c"])
    s.submit(task("b"), wanted=["b"], client="c2")
    exc = object()
    out = s.err("w1", "a", exception=exc, traceback="Traceback...", text="ZeroDivisionError: division by zero")
    erred = {(c, m["key"]): m for c, m in msgs(out, "task-erred")}
    assert set(erred) == {("c", "c"), ("c2", "b")}
    for m in erred.values():
        assert m["exception"] is exc
        assert m["traceback"] == "Traceback..."
        assert m["text"] == "ZeroDivisionError: division by zero"
        assert m["blame"] == "a"
    assert not computes(out)
    assert s.states() == {"a": "erred", "b": "erred", "c": "erred"}
    assert s.ts("c").exception_blame is s.ts("a")


def test_submitting_onto_an_erred_dependency_reports_at_once(s: Sched) -> None:
    s.add_worker("w1")
    s.submit(task("a"))
    s.err("w1", "a", text="KeyError: 'k'")
    out = s.submit(task("b", "a"))
    assert [(c, m["key"], m["blame"], m["text"]) for c, m in msgs(out)] == [("c", "b", "a", "KeyError: 'k'")]
    assert not computes(out)
    out = s.submit(task("a"), client="c2")
    assert [(c, m["op"], m["key"]) for c, m in msgs(out)] == [("c2", "task-erred", "a")]


def test_retries_rerun_a_failed_task(s: Sched) -> None:
    s.add_worker("w1")
    s.add_worker("w2")
    s.submit(task("x", retries=2))
    w = s.on("x")
    out = s.err(w, "x")
    assert [k for _, k in computes(out)] == ["x"]
    assert not msgs(out)
    out = s.err(s.on("x"), "x")
    assert [k for _, k in computes(out)] == ["x"]
    out = s.err(s.on("x"), "x", text="Boom: third")
    assert reported(out, "task-erred") == [("c", "x")]
    assert msgs(out)[0][1]["text"] == "Boom: third"
    assert s.ts("x").state == "erred"


def test_a_retried_task_keeps_its_inputs(s: Sched) -> None:
    s.add_worker("w1")
    s.submit(task("a"), task("b", "a", retries=1), wanted=["b"])
    s.finish("w1", "a", nbytes=7)
    out = s.err("w1", "b")
    assert "a" not in frees(out).get("w1", set()), "a is still needed by the retry"
    assert compute_of(out, "b").who_has == {"a": ["w1"]}
    assert s.ts("a").state == "memory"
    out = s.finish("w1", "b")
    assert frees(out) == {"w1": {"a"}}


# ------------------------------------------------------------------ release / cancel


def test_release_forgets_tasks_and_frees_their_holders(s: Sched) -> None:
    s.add_worker("w1")
    s.add_worker("w2")
    s.scatter({"x": ["w1", "w2"]})
    s.submit(task("y"))
    s.finish(s.on("y"), "y")
    y_on = next(iter(s.ts("y").who_has)).address
    out = s.release("x", "y")
    expected: dict[str, set[Any]] = {"w1": {"x"}, "w2": {"x"}}
    expected[y_on].add("y")
    assert frees(out) == expected
    assert s.state.tasks == {}
    assert all(ws.nbytes == 0 and not ws.has_what for ws in s.state.workers.values())


def test_release_of_a_processing_task_cancels_it(s: Sched) -> None:
    s.add_worker("w1")
    s.submit(task("a"), task("b", "a"), wanted=["b"])
    out = s.release("b")
    assert frees(out) == {"w1": {"a"}}
    assert s.state.tasks == {}
    assert not s.state.workers["w1"].processing
    # a late result of the cancelled task is freed at once
    out = s.finish("w1", "a")
    assert frees(out) == {"w1": {"a"}}
    assert s.state.tasks == {}


def test_release_keeps_keys_another_client_wants(s: Sched) -> None:
    s.add_worker("w1")
    s.submit(task("x"))
    s.submit(task("x"), client="c2")
    s.finish("w1", "x")
    out = s.release("x")
    assert not frees(out)
    assert set(s.ts("x").who_wants) == {"c2"}
    out = s(RemoveClientEvent(s.sid(), "c2"))
    assert frees(out) == {"w1": {"x"}}
    assert s.state.tasks == {}


def test_release_of_an_input_keeps_it_while_a_dependent_needs_it(s: Sched) -> None:
    s.add_worker("w1")
    s.submit(task("a"), task("b", "a"), wanted=["a", "b"])
    s.finish("w1", "a")
    out = s.release("a")
    assert not frees(out)
    assert s.ts("b").state == "processing"
    out = s.finish("w1", "b")
    assert frees(out) == {"w1": {"a"}}


def test_cancel_a_processing_task_and_its_dependents(s: Sched) -> None:
    s.add_worker("w1")
    s.submit(task("a"), task("b", "a"), task("c", "b"), wanted=["a", "c"])
    out = s.cancel("a")
    assert sorted(reported(out, "cancelled-key")) == [("c", "a"), ("c", "c")]
    assert frees(out) == {"w1": {"a"}}
    assert s.state.tasks == {}


def test_cancel_a_key_in_memory(s: Sched) -> None:
    s.add_worker("w1")
    s.submit(task("x"))
    s.finish("w1", "x")
    out = s.cancel("x")
    assert reported(out, "cancelled-key") == [("c", "x")]
    assert frees(out) == {"w1": {"x"}}
    assert s.state.tasks == {}


def test_cancel_leaves_what_another_client_wants(s: Sched) -> None:
    s.add_worker("w1")
    s.submit(task("a"), task("b", "a"), wanted=["a"])
    s.submit(task("b", "a"), wanted=["b"], client="c2")
    out = s.cancel("a")
    assert reported(out, "cancelled-key") == [("c", "a")]
    assert not frees(out), "c2 still needs a for b"
    assert s.states() == {"a": "processing", "b": "waiting"}
    out = s.finish("w1", "a")
    assert computes(out) == [("w1", "b")]
    out = s.finish("w1", "b")
    assert reported(out, "key-in-memory") == [("c2", "b")]
    assert frees(out) == {"w1": {"a"}}


def test_cancel_reaches_dependents_in_memory(s: Sched) -> None:
    s.add_worker("w1")
    s.submit(task("a"), task("b", "a"), wanted=["b"])
    s.finish("w1", "a")
    s.finish("w1", "b")
    assert s.states() == {"a": "released", "b": "memory"}
    out = s.cancel("a")
    assert reported(out, "cancelled-key") == [("c", "b")]
    assert frees(out) == {"w1": {"b"}}
    assert s.state.tasks == {}


def test_cancel_reports_each_key_once(s: Sched) -> None:
    s.add_worker("w1")
    s.submit(task("a"), task("b", "a"), wanted=["b"])
    s.finish("w1", "a")
    s.finish("w1", "b")
    out = s.cancel("a", "b")
    assert reported(out, "cancelled-key") == [("c", "b")]
    assert s.state.tasks == {}


# --------------------------------------------------------------------- graph checks


def test_a_graph_with_a_cycle_is_refused_and_changes_nothing(s: Sched) -> None:
    s.add_worker("w1")
    s.submit(task("x"))
    before = s.states()
    out = s.submit(task("p", "x"), task("a", "c"), task("b", "a"), task("c", "b"), wanted=["p", "b"])
    assert not computes(out)
    assert [(c, m["key"], m["kind"]) for c, m in msgs(out)] == [("c", "p", "GraphError"), ("c", "b", "GraphError")]
    assert all(m["text"].startswith("GraphError: the graph has a cycle") for _, m in msgs(out))
    assert s.states() == before
    assert set(s.ts("x").who_wants) == {"c"} and not s.ts("x").dependents


def test_a_task_depending_on_itself_is_a_cycle(s: Sched) -> None:
    out = s.submit(task("a", "a"))
    assert [m["kind"] for _, m in msgs(out)] == ["GraphError"]
    assert s.state.tasks == {}


def test_an_unknown_dependency_is_refused_and_changes_nothing(s: Sched) -> None:
    s.add_worker("w1")
    out = s.submit(task("a"), task("b", "a", "ghost"), wanted=["b"], client="c9")
    assert [(c, m["key"], m["kind"]) for c, m in msgs(out)] == [("c9", "b", "GraphError")]
    assert "'ghost'" in msgs(out)[0][1]["text"]
    assert s.state.tasks == {}
    assert "c9" not in s.state.clients
    assert not s.state.workers["w1"].processing


def test_a_graph_needing_a_refused_graphs_key_is_refused_for_the_first_reason(s: Sched) -> None:
    # the parts of a big graph: the second is refused, and the third needs its keys
    s.add_worker("w1")
    s.submit(task("a"), wanted=["a"])
    s.submit(task("b", "a", "ghost"), wanted=["b"])
    for later in (task("c", "b"), task("d", "c")):  # a chain of refusals keeps the first reason
        out = s.submit(later, wanted=[later.key])
        [(_, m)] = msgs(out)
        assert m["kind"] == "GraphError" and m["key"] == later.key
        assert "of a graph refused before: task 'b' depends on unknown key 'ghost'" in m["text"]
    assert set(s.state.tasks) == {"a"}
    # made later after all, then forgotten: an unknown key again, not a refused one
    s.submit(task("b", "a"), wanted=["b"])
    s.finish("w1", "a")
    s.finish("w1", "b")
    s.release("b")
    out = s.submit(task("e", "b"), wanted=["e"])
    [(_, m)] = msgs(out)
    assert "depends on unknown key 'b'" in m["text"]


def test_resubmitting_a_key_in_memory_reports_it_at_once(s: Sched) -> None:
    s.add_worker("w1")
    s.submit(task("x"))
    s.finish("w1", "x", nbytes=5)
    out = s.submit(task("x"), client="c2")
    assert out == [ClientMsg(out[0].stimulus_id, "c2", {"op": "key-in-memory", "key": "x", "nbytes": 5, "workers": ["w1"]})]
    assert set(s.ts("x").who_wants) == {"c", "c2"}


def test_resubmitting_a_freed_intermediate_recomputes_it(s: Sched) -> None:
    s.add_worker("w1")
    s.submit(task("a"), task("b", "a"), wanted=["b"])
    s.finish("w1", "a")
    s.finish("w1", "b")
    assert s.ts("a").state == "released"
    out = s.submit(task("a"))
    assert computes(out) == [("w1", "a")]
    out = s.finish("w1", "a")
    assert reported(out, "key-in-memory") == [("c", "a")]


# ------------------------------------------------------------------ workers leaving


def test_removed_worker_processing_tasks_go_elsewhere(s: Sched) -> None:
    s.add_worker("w1", nthreads=1)
    s.submit(task("a"), task("b"))
    assert computes(s.add_worker("w2")) == []
    on_w1 = {ts.key for ts in s.state.workers["w1"].processing}
    assert on_w1 == {"a", "b"}
    out = s.remove_worker("w1")
    assert sorted(computes(out)) == [("w2", "a"), ("w2", "b")]
    assert not frees(out)
    assert s.ts("a").suspicious == 1


def test_values_only_the_removed_worker_held_are_recomputed(s: Sched) -> None:
    s.add_worker("w1")
    s.submit(task("a"), task("b", "a"), task("c", "b"), wanted=["c"])
    for k in "abc":
        s.finish("w1", k)
    assert s.states() == {"a": "released", "b": "released", "c": "memory"}
    s.add_worker("w2")
    out = s.remove_worker("w1")
    assert reported(out, "lost-key") == [("c", "c")]
    # c's inputs were freed: the whole chain runs again
    assert computes(out) == [("w2", "a")]
    assert s.states() == {"a": "processing", "b": "waiting", "c": "waiting"}
    out = s.finish("w2", "a")
    assert computes(out) == [("w2", "b")]
    out = s.finish("w2", "b")
    assert computes(out) == [("w2", "c")]
    out = s.finish("w2", "c")
    assert reported(out, "key-in-memory") == [("c", "c")]


def test_lost_input_of_a_waiting_task_is_recomputed(s: Sched) -> None:
    s.add_worker("w1")
    s.add_worker("w2")
    s.submit(task("a"), task("b", workers=["w2"]), task("c", "a", "b"), wanted=["c"])
    assert s.on("a") == "w1"
    s.finish("w1", "a")
    assert set(s.ts("c").waiting_on) == {s.ts("b")}
    out = s.remove_worker("w1", crashed=False)
    assert computes(out) == [("w2", "a")]
    assert set(s.ts("c").waiting_on) == {s.ts("a"), s.ts("b")}
    s.finish("w2", "b")
    out = s.finish("w2", "a")
    assert computes(out) == [("w2", "c")]


def test_lost_input_restricted_to_the_lost_worker_errs(s: Sched) -> None:
    s.add_worker("w1")
    s.add_worker("w2")
    s.submit(task("a", workers=["w1"]), task("b", workers=["w2"]), task("c", "a", "b"), wanted=["c"])
    s.finish("w1", "a")
    out = s.remove_worker("w1", crashed=False)
    assert not computes(out), "a may only run on w1"
    assert [(m["key"], m["kind"], m["blame"]) for _, m in msgs(out, "task-erred")] == [("c", "ValueError", "a")]
    # b is not needed any more
    assert frees(out) == {"w2": {"b"}}


def test_lost_input_of_a_queued_task_sends_it_back_to_waiting(s: Sched) -> None:
    s.add_worker("w1", nthreads=1)
    s.add_worker("w2", nthreads=1)
    s.submit(*(task(f"busy{i}", workers=["w2"]) for i in range(3)))
    s.submit(task("a"), task("b", "a", workers=["w2"]), wanted=["b"])
    assert s.on("a") == "w1"
    s.finish("w1", "a")
    assert s.ts("b").state == "queued"
    s.add_worker("w3")
    out = s.remove_worker("w1")
    assert computes(out) == [("w3", "a")]
    assert s.states()["b"] == "waiting" and not s.state.queued
    out = s.finish("w3", "a")
    assert not computes(out), "w2 is still full"
    assert s.ts("b").state == "queued"
    out = s.finish("w2", "busy0")
    assert computes(out) == [("w2", "b")]


def test_a_task_running_on_three_dying_workers_is_killed(s: Sched) -> None:
    s.add_worker("w1")
    s.submit(task("x"), task("y", "x"), wanted=["y"])
    for i in (1, 2):
        out = s.add_worker(f"w{i + 1}")
        out = s.remove_worker(f"w{i}")
        assert computes(out) == [(f"w{i + 1}", "x")]
    # leaving cleanly does not count
    s.add_worker("w4")
    out = s.remove_worker("w3", crashed=False)
    assert computes(out) == [("w4", "x")]
    assert s.ts("x").suspicious == 2
    out = s.remove_worker("w4")
    assert not computes(out)
    (c, m), = msgs(out, "task-erred")
    assert (c, m["key"], m["kind"], m["blame"]) == ("c", "y", "KilledWorker", "x")
    assert m["text"].startswith("KilledWorker:") and "'x'" in m["text"]
    assert s.states() == {"x": "erred", "y": "erred"}


def test_scattered_data_lost_with_its_worker_errs_as_lost_data(s: Sched) -> None:
    s.add_worker("w1")
    s.add_worker("w2")
    s.scatter({"x": ["w1"]}, {"x": 50})
    s.submit(task("y", "x", workers=["w2"]))
    assert s.ts("y").state == "processing"
    out = s.remove_worker("w1")
    assert reported(out, "lost-key") == [("c", "x")]
    erred = {m["key"]: m for _, m in msgs(out, "task-erred")}
    assert set(erred) == {"x", "y"}
    assert erred["x"]["kind"] == "LostData" and erred["x"]["text"].startswith("LostData:")
    assert erred["y"]["kind"] == "LostData" and erred["y"]["blame"] == "x"
    assert frees(out) == {"w2": {"y"}}, "y cannot get its input: stop it"
    assert s.states() == {"x": "erred", "y": "erred"}


def test_scattered_value_lost_while_a_dependent_waits(s: Sched) -> None:
    s.add_worker("w1", nthreads=1)
    s.add_worker("w2", nthreads=1)
    s.scatter({"x": ["w1"]})
    s.submit(task("slow", workers=["w2"]), task("y", "x", "slow"), wanted=["y"])
    assert set(s.ts("y").waiting_on) == {s.ts("slow")}
    out = s.remove_worker("w1")
    erred = {m["key"]: m for _, m in msgs(out, "task-erred")}
    assert erred["y"]["kind"] == "LostData" and erred["y"]["blame"] == "x"
    assert frees(out) == {"w2": {"slow"}}, "nobody needs slow any more"
    assert s.states() == {"x": "erred", "y": "erred", "slow": "released"}
    s.release("y")
    assert s.states() == {"x": "erred"}, "x is wanted by the client who scattered it"


# --------------------------------------------------------------------- worker reports


def test_missing_data_drops_the_replica_and_recomputes_the_last(s: Sched) -> None:
    s.add_worker("w1", nthreads=1)
    s.add_worker("w2", nthreads=1)
    s.submit(task("x"))
    w = s.on("x")
    s.finish(w, "x", nbytes=8)
    other = "w2" if w == "w1" else "w1"
    s.scatter({"x": [other]}, {"x": 8})  # a second copy
    assert {ws.address for ws in s.ts("x").who_has} == {"w1", "w2"}
    out = s.missing("x", "w1")  # w1 says it does not have it
    assert out == []
    assert {ws.address for ws in s.ts("x").who_has} == {"w2"}
    assert s.state.workers["w1"].nbytes == 0
    out = s.missing("x", "w2")
    assert reported(out, "lost-key") == [("c", "x")]
    assert [k for _, k in computes(out)] == ["x"]
    # stale reports are ignored
    assert s.missing("x", "w2") == []
    assert s.missing("x", "nobody") == []


def test_reschedule_sends_the_task_again(s: Sched) -> None:
    s.add_worker("w1", nthreads=1)
    s.submit(task("a"), task("b", "a"), wanted=["b"])
    s.finish("w1", "a")
    out = s.reschedule("w1", "b")
    assert computes(out) == [("w1", "b")]
    assert compute_of(out, "b").who_has == {"a": ["w1"]}
    assert "a" not in frees(out).get("w1", set())
    # a reschedule from a worker not running it is ignored (and logged: "a" ran here, and is done)
    assert s.reschedule("w2", "b") == []
    assert [type(i).__name__ for i in s.reschedule("w1", "a")] == ["Warn"]
    assert s.states() == {"a": "memory", "b": "processing"}


def test_unknown_keys_and_workers_are_ignored(s: Sched) -> None:
    s.add_worker("w1")
    s.submit(task("x"))
    before = s.states()
    # a result nobody wants: the worker may drop it
    assert frees(s.finish("w1", "ghost")) == {"w1": {"ghost"}}
    assert s.finish("w9", "x") == []
    assert s.err("w1", "ghost") == []
    assert s.err("w9", "x") == []
    assert s.release("ghost") == []
    assert s.cancel("ghost") == []
    assert s.missing("ghost", "w1") == []
    assert s.reschedule("w1", "ghost") == []
    assert s.remove_worker("w9") == []
    assert s.scatter({"y": ["w9"]}) == []
    assert s.states() == before


def test_a_late_result_from_another_worker_is_freed(s: Sched) -> None:
    s.add_worker("w1")
    s.add_worker("w2")
    s.submit(task("x"))
    w = s.on("x")
    other = "w2" if w == "w1" else "w1"
    out = s.finish(other, "x")
    assert frees(out) == {other: {"x"}}
    assert s.ts("x").state == "processing"


# ---------------------------------------------------------------------- scatter


def test_scatter_wakes_tasks_waiting_for_that_key(s: Sched) -> None:
    s.add_worker("w1", nthreads=1)
    s.submit(task("slow"), task("x", "slow"), task("y", "x"), wanted=["y"])
    assert s.states() == {"slow": "processing", "x": "waiting", "y": "waiting"}
    out = s.scatter({"x": ["w1"]})
    assert frees(out) == {"w1": {"slow"}}, "nobody needs slow any more"
    assert computes(out) == [("w1", "y")]
    assert compute_of(out, "y").who_has == {"x": ["w1"]}


def test_scatter_of_a_key_being_computed_keeps_the_computation(s: Sched) -> None:
    s.add_worker("w1", nthreads=1)
    s.add_worker("w2", nthreads=1)
    s.submit(task("x", workers=["w1"]))
    out = s.scatter({"x": ["w1", "w2"]})
    assert frees(out) == {"w2": {"x"}}, "the copy is not used; w1 will report the computed value"
    assert s.ts("x").state == "processing"
    out = s.finish("w1", "x")
    assert reported(out, "key-in-memory") == [("c", "x")]


def test_scatter_adds_replicas_and_clients(s: Sched) -> None:
    s.add_worker("w1")
    s.add_worker("w2")
    s.scatter({"x": ["w1"]}, {"x": 40})
    s.scatter({"x": ["w2"]}, {"x": 40}, client="c2")
    assert {ws.address for ws in s.ts("x").who_has} == {"w1", "w2"}
    assert set(s.ts("x").who_wants) == {"c", "c2"}
    assert s.state.workers["w2"].nbytes == 40


# ----------------------------------------------------------------------- payloads


class Untouchable:
    """A payload that raises on any use at all."""

    def __getattribute__(self, name: str) -> Any:
        raise AssertionError(f"the scheduler looked at the payload ({name})")

    def __eq__(self, other: object) -> bool:
        raise AssertionError("the scheduler compared the payload")

    def __hash__(self) -> int:
        raise AssertionError("the scheduler hashed the payload")

    def __bool__(self) -> bool:
        raise AssertionError("the scheduler tested the payload")

    def __repr__(self) -> str:
        raise AssertionError("the scheduler printed the payload")

    def __reduce__(self) -> Any:
        raise AssertionError("the scheduler pickled the payload")


def test_the_scheduler_never_touches_payloads(s: Sched) -> None:
    s.add_worker("w1")
    s.add_worker("w2")
    payloads = {k: Untouchable() for k in "abcd"}
    out = s.submit(
        NewTask("a", payloads["a"]), NewTask("b", payloads["b"], ["a"], retries=1),
        NewTask("c", payloads["c"], ["a"]), NewTask("d", payloads["d"], ["b", "c"]), wanted=["d"])
    sent = [i for i in out if isinstance(i, ComputeTask)]
    for _ in range(20):
        if not sent:
            break
        inst = sent.pop(0)
        assert inst.payload is payloads[inst.key]
        if inst.key == "b" and s.ts("b").retries:
            out = s.err(inst.worker, "b")
        elif inst.key == "c" and s.ts("c").suspicious == 0:
            s.add_worker("w3")
            out = s.remove_worker(inst.worker)
        else:
            out = s.finish(inst.worker, inst.key)
        sent += [i for i in out if isinstance(i, ComputeTask)]
    assert s.ts("d").state == "memory"
    assert s.state.payload_deserializations == 0


# ------------------------------------------------------------------- transitions


def test_an_illegal_transition_raises_and_changes_nothing(s: Sched) -> None:
    s.submit(task("a"), task("b", "a"))
    b = s.ts("b")
    before = (b.state, set(b.waiting_on), b.processing_on)
    with pytest.raises(InvalidTransition, match="waiting -> memory"):
        s.state._transition(b, "memory")
    assert (b.state, set(b.waiting_on), b.processing_on) == before
    s.state.validate()


def test_a_worker_with_no_threads_is_refused(s: Sched) -> None:
    with pytest.raises(ValueError, match="0 threads"):
        s.add_worker("w1", nthreads=0)
    assert s.state.workers == {}


def test_validate_catches_a_broken_invariant(s: Sched) -> None:
    s.add_worker("w1")
    s.submit(task("x"))
    s.ts("x").state = "memory"
    with pytest.raises(AssertionError):
        s.state.validate()
    s.ts("x").state = "processing"


def test_wanted_key_unknown_to_everyone_is_reported_not_left_hanging():
    s = SchedulerState()
    out = s.handle(AddWorkerEvent("w", "tcp://w1", 1), UpdateGraphEvent("g", "c1", [], ["nowhere"]))
    msgs = [i.msg for i in out if isinstance(i, ClientMsg)]
    assert msgs and msgs[0]["op"] == "task-erred" and msgs[0]["kind"] == "KeyError"
    assert "nowhere" in msgs[0]["text"]
    s.validate()


def test_a_replica_of_a_key_no_longer_in_memory_is_freed(s: Sched) -> None:
    from shoal.scheduler.state import ReplicaAddedEvent

    s.add_worker("w1")
    s.add_worker("w2")
    assert frees(s(ReplicaAddedEvent(s.sid(), "w2", "gone", ["seg"]))) == {"w2": {"gone"}}
