"""The scheduler asks a value's last holder itself before it believes peers that say the
holder did not serve it (no IO: the question is an instruction, :class:`CheckHolder`,
and the answer an event, :class:`HolderCheckedEvent`). The holder that says it holds
the value keeps it; one that says it does not loses it (recomputed, or ``LostData``);
one that does not answer is removed only once ``max_unserved`` different workers said
it did not serve them, each counted once however often it says so."""

from __future__ import annotations

from typing import Any

from scheduler_harness import Sched, checks, compute_of, computes, reported, task, without_user_data
from shoal.scheduler.state import CloseWorkerStream


def holders(s: Sched, key: Any) -> set[str]:
    return {ws.address for ws in s.ts(key).who_has}


def closed(out: list[Any]) -> list[str]:
    return [i.worker for i in out if isinstance(i, CloseWorkerStream)]


def scattered_with_fetchers(s: Sched, *fetchers: str) -> None:
    """x scattered to "holder"; a task y_<f> needing it sent to each of ``fetchers``."""
    s.add_worker("holder")
    for f in fetchers:
        s.add_worker(f)
    s.scatter({"x": ["holder"]})
    s.submit(*[task(f"y_{f}", "x", workers=[f]) for f in fetchers])
    for f in fetchers:
        assert s.on(f"y_{f}") == f


def test_one_worker_saying_it_twice_counts_once_and_a_holder_that_holds_it_keeps_it(s: Sched) -> None:
    scattered_with_fetchers(s, "liar")
    out = s.missing("x", "holder", by="liar")
    assert checks(out) == [("holder", "x")]
    # again and again while the question is out: no second question, one reporter
    for _ in range(5):
        assert s.missing("x", "holder", by="liar") == []
    assert s.ts("x").unserved == ("liar",)
    out = s.checked("holder", "x", True)
    assert out == [] and holders(s, "x") == {"holder"} and s.states()["x"] == "memory"
    assert s.ts("x").unserved == () and s.ts("x").checking is None
    # the liar gives its task back: it is sent again, to fetch from the same holder
    out = s.reschedule("liar", "y_liar")
    assert compute_of(out, "y_liar").who_has == {"x": ["holder"]}
    # and saying it again asks again: each question costs one small request
    assert checks(s.missing("x", "holder", by="liar")) == [("holder", "x")]
    assert "holder" in s.state.workers


def test_two_workers_saying_it_of_a_holder_that_holds_it_change_nothing(s: Sched) -> None:
    scattered_with_fetchers(s, "a", "b")
    assert checks(s.missing("x", "holder", by="a")) == [("holder", "x")]
    assert s.missing("x", "holder", by="b") == []  # counted; the question is out already
    assert set(s.ts("x").unserved) == {"a", "b"}
    out = s.checked("holder", "x", True)
    assert out == [] and holders(s, "x") == {"holder"} and "holder" in s.state.workers
    assert s.ts("x").unserved == ()
    # the count starts again from nothing: one more word, one more question, no removal
    s.reschedule("a", "y_a")
    assert checks(s.missing("x", "holder", by="a")) == [("holder", "x")]
    assert closed(s.checked("holder", "x", None)) == []
    assert "holder" in s.state.workers and s.ts("x").unserved == ("a",)


def test_a_holder_that_says_it_does_not_hold_a_scattered_value_loses_it(s: Sched) -> None:
    scattered_with_fetchers(s, "a")
    s.missing("x", "holder", by="a")
    out = s.checked("holder", "x", False)
    # as its own missing-data: believed; a scattered value cannot be made again
    assert s.states() == {"x": "erred", "y_a": "erred"} and s.ts("x").error_kind == "LostData"
    assert sorted(reported(out, "task-erred")) == [("c", "x"), ("c", "y_a")]
    assert "holder" in s.state.workers and not closed(out)


def test_a_holder_that_says_it_does_not_hold_a_result_has_it_made_again(s: Sched) -> None:
    s.add_worker("holder")
    s.add_worker("a")
    s.submit(task("x", workers=["holder"]), task("y", "x", workers=["a"]), wanted=["y"])
    s.finish("holder", "x")
    s.missing("x", "holder", by="a")
    out = s.checked("holder", "x", False)
    assert computes(out) == [("holder", "x")] and not closed(out)
    assert s.states() == {"x": "processing", "y": "processing"}  # (y until a gives it back)
    s.reschedule("a", "y")
    out = s.finish("holder", "x")
    assert compute_of(out, "y").who_has == {"x": ["holder"]}


def test_a_holder_that_does_not_answer_stays_on_one_workers_word(s: Sched) -> None:
    scattered_with_fetchers(s, "a")
    s.missing("x", "holder", by="a")
    out = s.checked("holder", "x", None)
    assert out == [] and holders(s, "x") == {"holder"} and "holder" in s.state.workers
    # the count stays: its next report asks again (the answer may come this time)
    s.reschedule("a", "y_a")
    assert checks(s.missing("x", "holder", by="a")) == [("holder", "x")]
    assert closed(s.checked("holder", "x", None)) == []
    assert s.ts("x").unserved == ("a",)


def test_a_holder_that_does_not_answer_is_removed_on_two_workers_word(s: Sched) -> None:
    scattered_with_fetchers(s, "a", "b")
    s.missing("x", "holder", by="a")
    assert s.checked("holder", "x", None) == []
    # a second worker: asked again, and no answer again
    assert checks(s.missing("x", "holder", by="b")) == [("holder", "x")]
    out = s.checked("holder", "x", None, "it did not answer the scheduler's has-keys within 5s")
    assert closed(out) == ["holder"] and "holder" not in s.state.workers
    (why,) = [i.why for i in out if isinstance(i, CloseWorkerStream)]
    assert "(a, b)" in why and "within 5s" in why
    assert s.states() == {"x": "erred", "y_a": "erred", "y_b": "erred"} and s.ts("x").error_kind == "LostData"


def test_max_unserved_different_workers_are_needed() -> None:
    s = Sched(max_unserved=3)
    scattered_with_fetchers(s, "a", "b", "c")
    s.missing("x", "holder", by="a")
    s.missing("x", "holder", by="b")
    s.missing("x", "holder", by="b")
    assert closed(s.checked("holder", "x", None)) == []
    assert checks(s.missing("x", "holder", by="c")) == [("holder", "x")]
    assert closed(s.checked("holder", "x", None)) == ["holder"]


def test_failed_fetches_ask_nothing(s: Sched) -> None:
    """A fetch that failed on the way says nothing of the holder: no question."""
    scattered_with_fetchers(s, "a")
    for _ in range(3):
        assert s.missing("x", "holder", by="a", unserved=False) == []
    assert s.ts("x").unserved == () and s.ts("x").checking is None


def test_only_the_answer_to_the_question_out_counts(s: Sched) -> None:
    scattered_with_fetchers(s, "a", "b")
    s.add_worker("other")
    # never asked
    assert s.checked("holder", "x", None) == [] and s.checked("other", "x", False) == []
    assert s.checked("holder", "unknown", False) == []
    s.missing("x", "holder", by="a")
    s.missing("x", "holder", by="b")
    # a copy appears meanwhile: the question is no longer about the one holder
    s.scatter({"x": ["other"]})
    assert s.ts("x").checking is None and s.ts("x").unserved == ()
    assert s.checked("holder", "x", None) == [] and holders(s, "x") == {"holder", "other"}
    # the holder leaves while asked: its late answer changes nothing
    s.missing("x", "holder", by="a")  # one of two: dropped at once, and told to free it
    assert holders(s, "x") == {"other"}
    s.missing("x", "other", by="a")
    assert s.ts("x").checking == "other"
    s.remove_worker("other")
    assert s.checked("other", "x", None) == [] and s.states()["x"] == "erred"


def test_a_removed_holder_that_comes_back_is_not_answered_for(s: Sched) -> None:
    scattered_with_fetchers(s, "a")
    s.missing("x", "holder", by="a")
    s.remove_worker("holder")  # x is lost with it (scattered: LostData)
    s.add_worker("holder")
    assert s.checked("holder", "x", False) == [] and "holder" in s.state.workers


def test_a_run_with_questions_replays_the_same(s: Sched) -> None:
    scattered_with_fetchers(s, "a", "b")
    s.missing("x", "holder", by="a")
    s.checked("holder", "x", True)
    s.reschedule("a", "y_a")
    s.missing("x", "holder", by="a")
    s.missing("x", "holder", by="b")
    s.checked("holder", "x", None)
    fresh, out = s.replay()
    assert without_user_data(out) == without_user_data(s.instructions)
    assert {k: ts.state for k, ts in fresh.tasks.items()} == s.states()
    assert "holder" not in fresh.workers


def test_tasks_given_back_while_the_holder_is_asked_wait_for_the_answer(s: Sched) -> None:
    """The fetching worker gives its task back right after its report: sent again at
    once, it would fetch from the holder in question again (and count one more failure
    against it). It goes out again once the answer is in."""
    scattered_with_fetchers(s, "a", "b")
    s.missing("x", "holder", by="a")
    assert s.reschedule("a", "y_a") == [] and s.on("y_a") == "a"
    out = s.checked("holder", "x", True)
    assert compute_of(out, "y_a").who_has == {"x": ["holder"]}
    # not held: the task waits for the value (scattered here: it errs with LostData)
    s.missing("x", "holder", by="b")
    assert s.reschedule("b", "y_b") == []
    out = s.checked("holder", "x", False)
    assert s.states()["y_b"] == "erred" and s.ts("x").error_kind == "LostData"


def test_a_task_given_back_for_a_result_that_is_lost_waits_for_it_to_be_made_again(s: Sched) -> None:
    s.add_worker("holder")
    s.add_worker("a")
    s.add_worker("b")
    s.submit(task("x", workers=["holder"]), task("y", "x", workers=["a"]), task("z", "x", workers=["b"]),
             wanted=["y", "z"])
    s.finish("holder", "x")
    s.missing("x", "holder", by="a")
    s.missing("x", "holder", by="b")
    assert s.reschedule("a", "y") == [] and s.reschedule("b", "z") == []
    out = s.checked("holder", "x", None)
    assert closed(out) == ["holder"]
    assert s.states() == {"x": "erred", "y": "erred", "z": "erred"}  # (x may only run on holder, gone)


def test_a_parked_task_that_leaves_is_forgotten_there(s: Sched) -> None:
    scattered_with_fetchers(s, "a")
    s.missing("x", "holder", by="a")
    s.reschedule("a", "y_a")
    s.remove_worker("a")  # y_a leaves a: it waits for a worker it may run on (none)
    assert s.state._parked == {}
    assert s.checked("holder", "x", True) == []
