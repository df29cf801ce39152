"""Placement by resources, priorities and worker restrictions on the scheduler's state
(no IO): where a task may run, in which order, and what it holds while it runs."""

from __future__ import annotations

import pytest

from scheduler_harness import Sched, computes, msgs
from shoal.scheduler.state import AddWorkerEvent, NewTask


def add(s: Sched, address: str, nthreads: int = 1, name: str = "", **resources: float) -> list:
    return s(AddWorkerEvent(s.sid(), address, nthreads, name=name, resources=resources))


def t(key: str, *deps: str, priority: int = 0, resources: dict | None = None, workers: list | None = None,
      loose: bool = False) -> NewTask:
    return NewTask(key, f"p-{key}", list(deps), workers, 0, priority, resources, loose)


def test_a_task_that_asks_for_resources_runs_only_where_they_are():
    s = Sched()
    add(s, "tcp://cpu:1", 4)
    add(s, "tcp://gpu:1", 4, GPU=1)
    out = s.submit(t("a", resources={"GPU": 1}))
    assert computes(out) == [("tcp://gpu:1", "a")]
    (inst,) = [i for i in out if getattr(i, "key", None) == "a"]
    assert inst.resources == {"GPU": 1}
    assert s.state.workers["tcp://gpu:1"].used_resources == {"GPU": 1}


def test_resources_are_held_while_the_task_runs_and_freed_after():
    s = Sched()
    add(s, "tcp://gpu:1", 8, GPU=2)
    out = s.submit(t("a", resources={"GPU": 1}), t("b", resources={"GPU": 1}), t("c", resources={"GPU": 1}))
    assert sorted(k for _, k in computes(out)) == ["a", "b"]  # two GPUs: the third waits
    assert s.ts("c").state == "queued"
    out = s.finish("tcp://gpu:1", "a")
    assert computes(out) == [("tcp://gpu:1", "c")]
    s.finish("tcp://gpu:1", "b")
    s.finish("tcp://gpu:1", "c")
    assert s.state.workers["tcp://gpu:1"].used_resources == {}


def test_a_task_without_resources_is_not_held_back_by_them():
    s = Sched()
    add(s, "tcp://gpu:1", 2, GPU=1)
    out = s.submit(t("a", resources={"GPU": 1}), t("b", resources={"GPU": 1}), t("plain"))
    assert sorted(k for _, k in computes(out)) == ["a", "plain"]


def test_resources_no_worker_offers_wait_for_one_to_join():
    s = Sched()
    add(s, "tcp://cpu:1", 2)
    out = s.submit(t("a", resources={"GPU": 1}))
    assert computes(out) == [] and not msgs(out, "task-erred")
    assert s.ts("a").state == "queued"
    out = add(s, "tcp://gpu:1", 1, GPU=1)
    assert computes(out) == [("tcp://gpu:1", "a")]


def test_a_worker_that_dies_gives_its_resources_back_with_its_tasks():
    s = Sched()
    add(s, "tcp://gpu:1", 1, GPU=1)
    add(s, "tcp://gpu:2", 1, GPU=1)
    s.submit(t("a", resources={"GPU": 1}))
    first = s.on("a")
    out = s.remove_worker(first)
    other = "tcp://gpu:2" if first == "tcp://gpu:1" else "tcp://gpu:1"
    assert computes(out) == [(other, "a")]


def test_higher_priority_runs_first_and_ties_keep_submission_order():
    s = Sched()
    s.submit(t("low-1"), t("high", priority=10), t("low-2"), t("mid", priority=5))
    out = add(s, "tcp://w:1", 1)  # room for nthreads * (1 + ahead) = 3
    assert [k for _, k in computes(out)] == ["high", "mid", "low-1"]
    out = s.finish("tcp://w:1", "high")
    assert [k for _, k in computes(out)] == ["low-2"]


def test_priority_orders_the_tasks_a_worker_is_sent():
    s = Sched()
    add(s, "tcp://w:1", 1)
    out = s.submit(t("a", priority=-1), t("b", priority=3))
    sent = {i.key: i.priority for i in out if hasattr(i, "priority")}
    assert sent["b"] < sent["a"]  # lower tuple runs first on the worker


def test_workers_may_name_a_worker_or_a_host():
    s = Sched()
    add(s, "tcp://10.0.0.1:1", 1, name="alice")
    add(s, "tcp://10.0.0.2:1", 1, name="bob")
    out = s.submit(t("by-name", workers=["bob"]), t("by-host", workers=["10.0.0.1"]))
    assert sorted(computes(out)) == [("tcp://10.0.0.1:1", "by-host"), ("tcp://10.0.0.2:1", "by-name")]


def test_allow_other_workers_makes_workers_a_preference():
    s = Sched()
    add(s, "tcp://a:1", 1)
    out = s.submit(t("x", workers=["tcp://gone:1"], loose=True), t("y", workers=["tcp://gone:1"]))
    assert computes(out) == [("tcp://a:1", "x")]
    assert [m["key"] for _, m in msgs(out, "task-erred")] == ["y"]  # strict: no such worker


def test_loose_restrictions_prefer_the_named_worker_while_it_has_room():
    s = Sched()
    add(s, "tcp://a:1", 1)
    add(s, "tcp://b:1", 1)
    out = s.submit(*(t(f"x{i}", workers=["tcp://b:1"], loose=True) for i in range(3)))
    assert {w for w, _ in computes(out)} == {"tcp://b:1"}


@pytest.mark.parametrize("priority", [0, 7])
def test_the_log_replays_placement_by_resources_and_priority(priority):
    s = Sched()
    add(s, "tcp://gpu:1", 2, GPU=1)
    s.submit(t("a", resources={"GPU": 1}, priority=priority), t("b", resources={"GPU": 1}), t("c"))
    s.finish("tcp://gpu:1", s.state.tasks["a"].key)
    fresh, out = s.replay()
    assert [(i.worker, i.key) for i in out if hasattr(i, "payload")] == \
        [(i.worker, i.key) for i in s.instructions if hasattr(i, "payload")]


def test_the_tasks_of_one_graph_go_to_workers_by_priority():
    s = Sched()
    add(s, "tcp://w:1", 1)  # room for 3
    out = s.submit(t("low-1"), t("high", priority=10), t("low-2"), t("mid", priority=5), t("top", priority=20))
    assert [k for _, k in computes(out)] == ["top", "high", "mid"]
    assert [ts.key for ts in sorted(s.state.queued)] == ["low-1", "low-2"]


def test_queued_tasks_for_workers_that_all_left_err_and_the_others_wait_on():
    s = Sched()
    add(s, "tcp://10.0.0.1:1", 1, name="alpha")
    add(s, "tcp://10.0.0.2:1", 1)
    s.submit(*[t(f"busy-{i}") for i in range(6)])  # both workers full
    s.submit(t("by-name", workers=["alpha"]), t("by-host", workers=["10.0.0.1"]),
             t("by-either", workers=["alpha", "tcp://10.0.0.2:1"]), t("loosely", workers=["alpha"], loose=True))
    assert {ts.key for ts in s.state.queued} >= {"by-name", "by-host", "by-either", "loosely"}
    out = s.remove_worker("tcp://10.0.0.1:1")
    # named only the worker that left (by its name, by its host): they cannot run anywhere
    assert sorted(m["key"] for _, m in msgs(out, "task-erred")) == ["by-host", "by-name"]
    assert s.ts("by-either").state == s.ts("loosely").state == "queued"
    s.finish("tcp://10.0.0.2:1", sorted(ts.key for ts in s.state.workers["tcp://10.0.0.2:1"].processing)[0])
    s.state.validate()


def test_a_worker_with_room_takes_the_first_queued_task_it_may_run() -> None:
    """Queued tasks wait in buckets by what they ask of their worker; a worker that has
    room again takes, of all the buckets it may serve, the first task by priority."""
    s = Sched()
    s(AddWorkerEvent(s.sid(), "a", 1, resources={"GPU": 1}))
    s(AddWorkerEvent(s.sid(), "b", 1))
    s(AddWorkerEvent(s.sid(), "js", 1, languages=("javascript",)))
    fill = [NewTask(f"fill-{i}", b"p") for i in range(6)] + [
        NewTask(f"fill-js-{i}", b"p", language="javascript") for i in range(3)]
    s.submit(*fill)  # every worker full (1 thread + 2 ahead)
    s.submit(NewTask("gpu", b"p", resources={"GPU": 1}, priority=1), NewTask("on-b", b"p", restrictions=["b"], priority=2),
             NewTask("any", b"p"), NewTask("js", b"p", language="javascript", priority=3))
    assert {ts.key for ts in s.state.queued} == {"gpu", "on-b", "any", "js"}
    # a finishes: the GPU task (priority 1) comes before "any"; "on-b" and "js" are not its
    running_on = {w: sorted(ts.key for ts in s.state.workers[w].processing) for w in ("a", "b", "js")}
    out = s.finish("a", running_on["a"][0])
    assert [k for w, k in computes(out)] == ["gpu"]
    # b finishes: "on-b" (priority 2) before "any"
    out = s.finish("b", running_on["b"][0])
    assert [k for w, k in computes(out)] == ["on-b"]
    out = s.finish("b", running_on["b"][1])
    assert [k for w, k in computes(out)] == ["any"]
    # the JavaScript worker takes the JavaScript task, and only it
    out = s.finish("js", running_on["js"][0])
    assert computes(out) == [("js", "js")]
    assert not s.state.queued
    s.state.validate()
