"""shoal.scheduler.state: tasks that may run only once (``once``: what dask's "disk"
shuffle needs, whose splits append to a directory). Sent to a worker once, such a task
errs (``RunOnce``), with everything built on it, rather than go to a worker again,
whichever way a second run would come: its worker died or left while it ran, its value
was lost and is needed again, its worker gave it back, a retry. A task without
``once`` runs again as before. Driven by events alone, validated after every step."""

from __future__ import annotations

from typing import Any

import pytest
from scheduler_harness import Sched, computes, frees, msgs, task, without_user_data

from shoal.scheduler.state import NewTask

WHY = "its rows went into a store on disk"


def erred(out: list[Any]) -> dict[Any, dict[str, Any]]:
    """The ``task-erred`` reports among ``out``, by key."""
    return {m["key"]: m for _, m in msgs(out, "task-erred")}


def assert_run_once(report: dict[str, Any], blame: Any, why: str) -> None:
    assert report["kind"] == "RunOnce" and report["blame"] == blame, report
    text = report["text"]
    assert text.startswith(f"RunOnce: task {blame!r} may run only once"), text
    assert why in text and text.endswith(WHY), text


@pytest.mark.parametrize("crashed", [True, False], ids=["died", "left"])
def test_a_once_task_whose_worker_goes_while_it_runs_errs_with_its_dependents(s: Sched, crashed: bool) -> None:
    s.add_worker("w1")
    s.add_worker("w2")
    s.submit(task("a", once=WHY), task("b", "a"), wanted=["b"])
    out = s.remove_worker(s.on("a"), crashed=crashed)
    assert computes(out) == []
    assert set(erred(out)) == {"b"}  # (the client wants b only)
    assert_run_once(erred(out)["b"], "a", "its worker died while it ran" if crashed else "its worker left")
    assert s.states() == {"a": "erred", "b": "erred"}


def test_a_task_that_may_run_again_goes_to_another_worker(s: Sched) -> None:
    s.add_worker("w1")
    s.add_worker("w2")
    s.submit(task("a"), task("b", "a"), wanted=["b"])
    first = s.on("a")
    out = s.remove_worker(first)
    assert computes(out) == [("w2" if first == "w1" else "w1", "a")] and not erred(out)


def test_a_once_task_that_never_reached_a_worker_runs_when_its_input_comes_back(s: Sched) -> None:
    """Only a task sent to a worker counts as run: one that waited for its input runs
    once the input is made again."""
    s.add_worker("w1", nthreads=1)
    s.submit(task("a"), task("b", "a", once=WHY), wanted=["b"])
    s.add_worker("w2", nthreads=1)
    out = s.remove_worker("w1")  # a ran there: b never left "waiting"
    assert computes(out) == [("w2", "a")] and not erred(out)
    out = s.finish("w2", "a")
    assert computes(out) == [("w2", "b")]
    out = s.finish("w2", "b")
    assert [m["key"] for _, m in msgs(out, "key-in-memory")] == ["b"]


def test_a_lost_value_of_a_once_task_needed_again_errs(s: Sched) -> None:
    s.add_worker("w1")
    s.add_worker("w2")
    s.submit(task("a", workers=["w1"], once=WHY), task("slow", workers=["w2"]), task("c", "a", "slow"),
             wanted=["c"])
    s.finish("w1", "a")
    out = s.remove_worker("w1", crashed=False)
    assert computes(out) == []
    assert_run_once(erred(out)["c"], "a", "its value was lost with its worker, and is needed again")
    assert frees(out) == {"w2": {"slow"}}, "nobody needs slow any more"
    assert s.states() == {"a": "erred", "slow": "released", "c": "erred"}


def test_a_lost_value_of_a_once_task_that_nobody_needs_is_no_error(s: Sched) -> None:
    s.add_worker("w1")
    s.add_worker("w2")
    s.submit(task("a", workers=["w1"], once=WHY), task("b", "a", workers=["w2"]), wanted=["b"])
    s.finish("w1", "a")
    s.finish("w2", "b")
    out = s.remove_worker("w1")
    assert out == []
    assert s.states() == {"a": "released", "b": "memory"}


def test_a_once_task_given_back_by_its_worker_errs(s: Sched) -> None:
    s.add_worker("w1")
    s.submit(task("a", once=WHY))
    out = s.reschedule("w1", "a")
    assert computes(out) == []
    assert_run_once(erred(out)["a"], "a", "gave it back")


def test_a_once_task_that_raises_is_not_retried(s: Sched) -> None:
    s.add_worker("w1")
    s.submit(task("a", retries=2, once=WHY))
    out = s.err("w1", "a", text="Boom: a")
    assert computes(out) == []
    assert [(k, m["kind"], m["text"]) for k, m in erred(out).items()] == [("a", "", "Boom: a")]


def _disk_shuffle(s: Sched) -> None:
    """The shape of dask's disk shuffle, as the client marks it: a store and splits
    that append their input's rows to it (once), a barrier, and collects that read it
    back (they may run again while the store is there); the splits placed on w1 and
    w2."""
    s.submit(
        task("store", workers=["w1"], once=WHY),
        task("i0", workers=["w1"]), task("i1", workers=["w2"]),
        task("x0", "store", "i0", workers=["w1"], once=WHY), task("x1", "store", "i1", workers=["w2"], once=WHY),
        task("barrier", "x0", "x1"),
        task("c0", "store", "barrier"), task("c1", "store", "barrier"),
        task("out", "c0", "c1"),
        wanted=["out"])


def test_a_disk_shuffle_whose_finished_split_is_lost_errs_and_its_running_split_is_dropped(s: Sched) -> None:
    s.add_worker("w1", nthreads=2)
    s.add_worker("w2", nthreads=2)
    _disk_shuffle(s)
    for key in ("store", "i0", "x0"):
        s.finish("w1", key)
    s.finish("w2", "i1")
    assert s.on("x1") == "w2"
    out = s.remove_worker("w1")
    assert computes(out) == [], "no part of the shuffle runs a second time"
    report = erred(out)["out"]
    assert report["blame"] in ("store", "x0")
    assert_run_once(report, report["blame"], "its value was lost with its worker, and is needed again")
    assert frees(out) == {"w2": {"i1", "x1"}}, "the split still running, and its input, are of no use any more"
    assert s.states()["barrier"] == s.states()["out"] == "erred"
    fresh, replayed = s.replay()
    assert without_user_data(replayed) == without_user_data(s.instructions)
    assert {k: ts.once for k, ts in fresh.tasks.items()} == {k: ts.once for k, ts in s.state.tasks.items()}


def _shuffled(s: Sched) -> None:
    """The disk shuffle run up to ``out``, the task after it (processing on w1, which
    holds the collects' values; all else is released)."""
    s.add_worker("w1", nthreads=2)
    s.add_worker("w2", nthreads=2)
    _disk_shuffle(s)
    for worker, key in (("w1", "store"), ("w1", "i0"), ("w2", "i1"), ("w1", "x0"), ("w2", "x1")):
        s.finish(worker, key)
    for key in ("barrier", "c0", "c1"):
        s.finish(s.on(key), key)
    assert s.on("out") == "w1"
    assert {k for k, state in s.states().items() if state == "memory"} == {"c0", "c1"}


def test_a_disk_shuffle_is_done_with_when_a_worker_goes_after_it(s: Sched) -> None:
    _shuffled(s)
    assert s.remove_worker("w2") == []
    out = s.finish("w1", "out")
    assert [m["key"] for _, m in msgs(out, "key-in-memory")] == ["out"]


def test_a_lost_value_read_from_a_disk_shuffle_errs_when_the_store_is_needed_again(s: Sched) -> None:
    """The collects may run again, but they need the store, released once they were
    done: a second run of it (an empty store) may not be."""
    _shuffled(s)
    out = s.remove_worker("w1")
    assert computes(out) == []
    assert_run_once(erred(out)["out"], "store", "its value was lost with its worker, and is needed again")


def test_a_collect_whose_worker_dies_runs_again_while_the_store_is_there(s: Sched) -> None:
    s.add_worker("w1", nthreads=2)
    s.add_worker("w2", nthreads=2)
    s.submit(
        task("store", workers=["w1"], once=WHY),
        task("x0", "store", workers=["w1"], once=WHY), task("x1", "store", workers=["w2"], once=WHY),
        task("barrier", "x0", "x1", workers=["w1"]),
        NewTask("c0", "payload-c0", ["store", "barrier"], ["w2"], loose_restrictions=True),
        wanted=["c0"])
    for worker, key in (("w1", "store"), ("w1", "x0"), ("w2", "x1"), ("w1", "barrier")):
        s.finish(worker, key)
    assert s.on("c0") == "w2"
    out = s.remove_worker("w2")
    assert computes(out) == [("w1", "c0")] and not erred(out)
    out = s.finish("w1", "c0")
    assert [m["key"] for _, m in msgs(out, "key-in-memory")] == ["c0"]


def test_validate_finds_a_once_task_waiting_to_run_again(s: Sched) -> None:
    s.add_worker("w1")
    s.submit(task("a", once=WHY), task("b", "a"), wanted=["b"])
    s.finish("w1", "a")
    assert s.ts("a").sent
    s.ts("b").sent = False
    with pytest.raises(AssertionError):
        s.state.validate()
    s.ts("b").sent = True
