"""What the scheduler believes of its workers' reports (no IO): a report about a task is
believed from the worker the task was sent to, a copy or a missing value from a worker
sent to fetch it; the last holder of a value is not dropped on a peer's word: the
scheduler asks it (tests/unit/test_scheduler_holder_check.py has the details), and
removes it when it does not answer and ``max_unserved`` such workers said it did not
serve them."""

from __future__ import annotations

from typing import Any

from scheduler_harness import Sched, checks, compute_of, computes, frees, reported, task, without_user_data
from shoal.scheduler.state import (
    CloseWorkerStream,
    LongRunningEvent,
    ReplicaAddedEvent,
    TaskFinishedEvent,
    Warn,
)


def warnings(out: list[Any]) -> list[str]:
    return [i.text for i in out if isinstance(i, Warn)]


def holders(s: Sched, key: Any) -> set[str]:
    return {ws.address for ws in s.ts(key).who_has}


def test_a_task_finished_from_a_worker_never_given_the_task_is_not_believed(s: Sched) -> None:
    s.add_worker("w1")
    s.add_worker("liar")
    s.submit(task("x", workers=["w1"]), task("y", "x", workers=["w1"]), wanted=["y"])
    # while x runs on w1, and once it is in memory there: the liar's value goes nowhere
    for state in ("processing", "memory"):
        out = s(TaskFinishedEvent(s.sid(), "liar", "x", 8, value="wrong"))
        assert frees(out) == {"liar": {"x"}}
        assert len(warnings(out)) == (1 if state == "processing" else 0)  # (logged once per worker: see below)
        assert s.ts("x").state == state and "liar" not in holders(s, "x")
        assert s.ts("x").inline is None
        if state == "processing":
            s.finish("w1", "x")
    assert compute_of(s.instructions, "y").who_has == {"x": ["w1"]}
    # the holder saying it again changes nothing
    assert s(TaskFinishedEvent(s.sid(), "w1", "x", 8)) == []
    assert holders(s, "x") == {"w1"}
    # a key nobody has heard of: freed, not logged (a result released meanwhile)
    out = s(TaskFinishedEvent(s.sid(), "liar", "ghost", 8))
    assert frees(out) == {"liar": {"ghost"}} and warnings(out) == []


def test_a_late_report_of_a_worker_the_task_left_is_not_believed(s: Sched) -> None:
    s.add_worker("w1")
    s.add_worker("w2")
    s.submit(task("x", workers=["w1", "w2"]))
    first = s.on("x")
    second = "w2" if first == "w1" else "w1"
    s.cancel("x")  # the first worker is told to free it...
    s.submit(task("x", workers=[second]))  # ...and it runs elsewhere, then finishes
    assert frees(s.instructions) == {first: {"x"}}
    s.finish(second, "x")
    # the first worker's report crossed its free-keys: it holds nothing now
    out = s(TaskFinishedEvent(s.sid(), first, "x", 8))
    assert frees(out) == {first: {"x"}} and holders(s, "x") == {second}


def test_other_reports_about_a_task_count_only_from_its_worker(s: Sched) -> None:
    s.add_worker("w1")
    s.add_worker("w2")
    s.submit(task("x", workers=["w1"]))
    before = s.states()
    out = s.err("w2", "x") + s.reschedule("w2", "x") + s(LongRunningEvent(s.sid(), "w2", "x"))
    assert s.states() == before and s.on("x") == "w1"
    assert not s.state.workers["w1"].long_running and not computes(out) and not frees(out)
    assert len(warnings(out)) == 1  # the first report of w2 that is not believed; then at 10, 100, ...
    assert s.state.workers["w2"].disbelieved == 3


def test_disbelieved_reports_are_logged_at_each_tenfold(s: Sched) -> None:
    s.add_worker("w1")
    s.add_worker("w2")
    s.submit(task("x", workers=["w1"]))
    logged = [n for n in range(1, 201) if warnings(s.reschedule("w2", "x"))]
    assert logged == [1, 10, 100]


def test_a_replica_is_believed_only_from_a_worker_sent_to_fetch_it(s: Sched) -> None:
    s.add_worker("w1")
    s.add_worker("w2")
    s.add_worker("w3")
    s.submit(task("x", workers=["w1"]))
    s.finish("w1", "x")
    out = s(ReplicaAddedEvent(s.sid(), "w3", "x", ["seg-w3"]))
    assert frees(out) == {"w3": {"x"}} and len(warnings(out)) == 1
    assert holders(s, "x") == {"w1"} and s.ts("x").shm is None
    s.submit(task("y", "x", workers=["w2"]))
    assert s(ReplicaAddedEvent(s.sid(), "w2", "x", ["seg-w2"])) == []
    assert holders(s, "x") == {"w1", "w2"} and s.ts("x").shm == {"w2": ["seg-w2"]}


def test_a_peers_missing_data_is_ignored_unless_it_was_sent_to_fetch_the_value(s: Sched) -> None:
    s.add_worker("w1")
    s.add_worker("w2")
    s.scatter({"x": ["w1"]})
    for by in ("w2", "", "nobody"):
        out = s.missing("x", "w1", by=by)
        assert not frees(out) and not reported(out, "lost-key") and not reported(out, "task-erred")
        assert holders(s, "x") == {"w1"} and s.ts("x").state == "memory"
    assert s.state.workers["w2"].disbelieved == 1


def test_a_holders_own_word_that_it_lacks_a_value_is_believed(s: Sched) -> None:
    s.add_worker("w1")
    s.scatter({"x": ["w1"]})
    out = s.missing("x", "w1")
    assert s.states() == {"x": "erred"} and reported(out, "task-erred") == [("c", "x")]
    assert s.ts("x").error_kind == "LostData"


def test_a_peer_that_did_not_get_a_value_drops_one_holder_of_several(s: Sched) -> None:
    s.add_worker("w1")
    s.add_worker("w2")
    s.add_worker("w3")
    s.scatter({"x": ["w1", "w2"]})
    s.submit(task("y", "x", workers=["w3"]))
    out = s.missing("x", "w1", by="w3")
    # dropped, and told to free it should it hold it still: nothing is left behind (and
    # nothing asked: another holder is left)
    assert holders(s, "x") == {"w2"} and frees(out) == {"w1": {"x"}} and checks(out) == []
    assert s.state.workers["w1"].nbytes == 0


def test_the_last_holder_is_kept_on_one_word_and_removed_when_it_does_not_serve(s: Sched) -> None:
    s.add_worker("bad", nthreads=2)
    s.submit(task("x"), task("other", workers=["bad"]), wanted=["x", "other"])
    s.finish("bad", "x")
    s.add_worker("w1", nthreads=2)
    s.add_worker("w2", nthreads=2)
    s.submit(task("y", "x", workers=["w1"]), task("y2", "x", workers=["w2"]), task("z", "x"),
             wanted=["y", "y2", "z"])
    assert s.on("z") == "bad"  # where its input is
    # w1 did not get x from bad (no answer, or an answer without it): kept, on one word,
    # and bad is asked whether it holds x
    out = s.missing("x", "bad", by="w1")
    assert checks(out) == [("bad", "x")] and holders(s, "x") == {"bad"}
    # w1 gives y back: sent again once the answer is in
    assert s.reschedule("w1", "y") == []
    # w1 again, while the question is out: the same worker counts once
    assert s.missing("x", "bad", by="w1") == []
    out = s.checked("bad", "x", None)
    assert "bad" in s.state.workers and compute_of(out, "y").who_has == {"x": ["bad"]}
    # a second worker sent to fetch it, and bad does not answer the question again:
    # removed, as a dead worker is, and what it held or ran is made again elsewhere
    assert checks(s.missing("x", "bad", by="w2")) == [("bad", "x")]
    out = s.checked("bad", "x", None, "it did not answer within 300s")
    closed = [i for i in out if isinstance(i, CloseWorkerStream)]
    assert [i.worker for i in closed] == ["bad"]
    assert "did not hand it out to 2 workers" in closed[0].why and "300s" in closed[0].why
    assert "bad" not in s.state.workers
    assert reported(out, "lost-key") == [("c", "x")]
    assert len(computes(out)) == 1 and computes(out)[0][1] == "x"
    # (y and y2 stay until their workers give them back, right after their missing-data)
    assert s.states() == {"x": "processing", "other": "erred", "y": "processing", "y2": "processing",
                          "z": "waiting"}
    assert s.ts("other").error_kind == "ValueError"  # it may only run on bad, which is gone
    assert s.ts("z").suspicious == 0  # bad did not die: its tasks count no failure
    assert s.reschedule("w1", "y") == [] and s.reschedule("w2", "y2") == []  # they wait for x now
    where = s.on("x")
    out = s.finish(where, "x")
    assert compute_of(out, "y").who_has == {"x": [where]} and compute_of(out, "y2").who_has == {"x": [where]}


def test_failed_fetches_from_the_last_holder_never_remove_it(s: Sched) -> None:
    """A fetch that failed on the way (no descriptor on either side, a connection that
    broke) says nothing of the holder: however many such reports come, it stays, and
    the fetching worker bounds its own attempts."""
    s.add_worker("a", nthreads=2)
    s.submit(task("x", workers=["a"]), wanted=["x"])
    s.finish("a", "x")
    s.add_worker("b", nthreads=2)
    s.submit(task("y", "x", workers=["b"]), wanted=["y"])
    for _ in range(5):
        out = s.missing("x", "a", by="b", unserved=False)
        assert not [i for i in out if isinstance(i, CloseWorkerStream)]
        assert holders(s, "x") == {"a"} and "a" in s.state.workers
        s.reschedule("b", "y")
    assert s.states() == {"x": "memory", "y": "processing"}


def test_a_scattered_value_its_holder_does_not_serve_errs_with_lost_data(s: Sched) -> None:
    s.add_worker("w1")
    s.add_worker("w2")
    s.add_worker("bad")
    s.scatter({"x": ["bad"]})
    s.submit(task("y", "x", workers=["w1"]), task("y2", "x", workers=["w2"]), wanted=["y", "y2"])
    s.missing("x", "bad", by="w1")
    s.missing("x", "bad", by="w2")
    assert s.ts("x").state == "memory"
    out = s.checked("bad", "x", None)
    assert s.states() == {"x": "erred", "y": "erred", "y2": "erred"}
    assert sorted(reported(out, "task-erred")) == [("c", "x"), ("c", "y"), ("c", "y2")]
    assert s.ts("y").exception_blame is s.ts("x") and s.ts("x").error_kind == "LostData"


def test_the_count_starts_again_with_each_new_holder(s: Sched) -> None:
    s.add_worker("w1")
    s.add_worker("w2")
    s.add_worker("w3")
    s.scatter({"x": ["w1"]})
    s.submit(task("y", "x", workers=["w3"]))
    s.missing("x", "w1", by="w3")
    assert s.ts("x").unserved == ("w3",) and s.ts("x").checking == "w1"
    s.scatter({"x": ["w2"]})
    assert s.ts("x").unserved == () and s.ts("x").checking is None
    assert s.checked("w1", "x", None) == []  # the answer to a question no longer asked
    s.missing("x", "w2", by="w3")  # one of two: dropped at once
    assert holders(s, "x") == {"w1"}
    s.missing("x", "w1", by="w3")
    assert "w1" in s.state.workers and s.ts("x").unserved == ("w3",)


def test_a_run_with_untrusted_reports_replays_the_same(s: Sched) -> None:
    s.add_worker("w1")
    s.add_worker("bad")
    s.submit(task("x", workers=["bad"]), wanted=["x"])
    s(TaskFinishedEvent(s.sid(), "w1", "x", 8))
    s.finish("bad", "x")
    s.submit(task("y", "x", workers=["w1"]), wanted=["y"])
    s.missing("x", "bad", by="w1")
    s.checked("bad", "x", True)
    s.reschedule("w1", "y")
    s.missing("x", "bad", by="w1")
    s.checked("bad", "x", None)
    fresh, out = s.replay()
    assert without_user_data(out) == without_user_data(s.instructions)
    assert {k: ts.state for k, ts in fresh.tasks.items()} == s.states()
