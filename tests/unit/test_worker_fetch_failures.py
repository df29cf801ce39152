"""shoal.worker.state: fetches that fail, driven by events alone (as
test_worker_state.py): a peer given up on, the counts of failures per peer, what the
scheduler hears (``missing-data``, ``reschedule``) and what the tasks that needed the
values do."""

from __future__ import annotations

from typing import Any

from shoal.worker.state import (
    GatherDepFailureEvent,
    SendMsg,
)
from worker_harness import Wk, executes, gathers, ops, sent


def test_gather_failure_forgets_that_peer() -> None:
    w = Wk(max_gathers=1)
    w(w.compute_event("t1", {"a": ["p1", "p2"]}, priority=(0,)), w.compute_event("t2", {"b": ["p1", "p3"]}, priority=(1,)))
    # both inputs come from p1 in one request
    assert {k for k, ts in w.state.tasks.items() if ts.state == "flight"} == {"a", "b"}
    out = w.gather_failed("p1", ["a", "b"])
    assert all("p1" not in ts.who_has for ts in w.state.tasks.values())
    assert sorted(ops(out)) == [("missing-data", "a"), ("missing-data", "b")]
    # one peer at a time (max_gathers=1), by priority
    assert gathers(out) == [("p2", ["a"], 1)]


def test_missing_data_says_whether_the_holder_took_the_request_and_did_not_serve() -> None:
    """A fetch that failed on the way says nothing of the holder; one it took and did
    not answer in time (the fetch deadline) is ``unserved``, as an answer without the
    key is: only those count towards the scheduler removing a last holder."""
    for unserved in (False, True):
        w = Wk()
        w(w.compute_event("t1", {"a": ["p1", "p2"]}))
        out = w(GatherDepFailureEvent(w.sid(), "p1", ["a"], "no answer", exception="the error", unserved=unserved))
        reports = [i.msg for i in out if isinstance(i, SendMsg) and i.msg["op"] == "missing-data"]
        assert len(reports) == 1 and reports[0].get("unserved", False) is unserved


def test_gather_failure_gives_back_tasks_whose_inputs_had_no_other_holder() -> None:
    w = Wk(gather_bytes=100)
    out = w(w.compute_event("t1", {"a": ["p1"]}, {"a": 60}, priority=(0,)),
            w.compute_event("t2", {"d": ["p1"]}, {"d": 60}, priority=(1,)))
    assert gathers(out) == [("p1", ["a"], 60)]
    assert w.state.tasks["d"].state == "fetch"
    out = w.gather_failed("p1", ["a"])
    assert sorted(ops(out)) == [("missing-data", "a"), ("reschedule", "t1"), ("reschedule", "t2")]
    assert w.state.tasks == {}


def test_values_a_peer_cannot_send_fail_the_tasks_that_need_them() -> None:
    w = Wk(nthreads=2)
    w(w.compute_event("t1", {"a": ["p1", "p2"]}), w.compute_event("t2", {"a": ["p1", "p2"], "c": ["p3"]}))
    w.gathered("p3", {"c": 3}, ["c"])
    out = w(GatherDepFailureEvent(w.sid(), "p1", ["a"], "p1 cannot send ['a'] here: cannot pickle",
                                  unsendable="the error"))
    # no other holder is asked and nothing is given back: the same value fails the same way
    assert sorted(ops(out)) == [("task-erred", "t1"), ("task-erred", "t2")]
    assert all(m["exception"] == "the error" and "cannot pickle" in m["text"] for m in sent(out))
    assert gathers(out) == [] and w.state.tasks == {} and w.state.data == {}
    assert not w.state.in_flight_workers


def _fetch_fails(w: Wk, peer: str, keys: list[Any]) -> list[Any]:
    return w(GatherDepFailureEvent(w.sid(), peer, keys, "could not fetch: out of descriptors", exception="the error"))


def test_fetches_failing_from_one_peer_again_and_again_err_the_tasks_at_last() -> None:
    """The scheduler sends a task back here after each failed fetch (the task may only
    run here, or its other inputs are here): the third failure in a row errs it."""
    w = Wk(max_peer_failures=3)
    for _ in range(2):
        assert gathers(w.compute("t", {"a": ["p1"]})) == [("p1", ["a"], 1)]
        out = _fetch_fails(w, "p1", ["a"])
        assert sorted(ops(out)) == [("missing-data", "a"), ("reschedule", "t")]
    assert w.state.peer_failures == {"p1": 2}
    w.compute("t", {"a": ["p1"]})
    out = _fetch_fails(w, "p1", ["a"])
    assert ops(out) == [("task-erred", "t")]
    (msg,) = sent(out)
    assert msg["exception"] == "the error"
    assert "out of descriptors" in msg["text"] and "3 fetches from it failed in a row" in msg["text"]
    assert w.state.tasks == {} and not w.state.in_flight_workers


def test_given_up_on_a_peer_the_other_holders_are_asked() -> None:
    w = Wk(max_peer_failures=1)
    w.compute("t", {"a": ["p1", "p2"]})
    out = _fetch_fails(w, "p1", ["a"])
    assert sent(out) == [] and gathers(out) == [("p2", ["a"], 1)]
    out = w.gathered("p2", {"a": 1}, ["a"])
    assert executes(out) == ["t"]


def test_a_fetch_that_works_clears_the_count_of_its_peer() -> None:
    w = Wk(max_peer_failures=2)
    w.compute("t1", {"a": ["p1"]})
    _fetch_fails(w, "p1", ["a"])
    w.compute("t1", {"a": ["p1"]})
    w.gathered("p1", {"a": 1}, ["a"])
    assert w.state.peer_failures == {}
    w.compute("t2", {"b": ["p1"]})
    assert ops(_fetch_fails(w, "p1", ["b"])) == [("missing-data", "b"), ("reschedule", "t2")]


def test_failing_peers_are_counted_for_a_bounded_number_of_peers() -> None:
    from shoal.worker import fetching as fetching_module

    w = Wk()
    for i in range(fetching_module._MAX_FAILING_PEERS + 10):
        w.compute(f"t{i}", {f"a{i}": [f"p{i}"]})
        _fetch_fails(w, f"p{i}", [f"a{i}"])
    assert len(w.state.peer_failures) == fetching_module._MAX_FAILING_PEERS
    assert "p0" not in w.state.peer_failures and f"p{fetching_module._MAX_FAILING_PEERS + 9}" in w.state.peer_failures


def test_a_holder_that_keeps_answering_without_the_value_is_given_up_on() -> None:
    """An answer with none of the keys asked counts as a failed fetch: the scheduler,
    having asked the holder, may believe it still and send the task back here; the
    third such answer in a row errs the task instead of going round for ever."""
    w = Wk(max_peer_failures=3)
    for n in (1, 2):
        w.compute("t", {"a": ["p1"]})
        out = w.gathered("p1", {}, ["a"])
        assert sent(out) == [{"op": "missing-data", "key": "a", "errant_worker": "p1", "unserved": True},
                             {"op": "reschedule", "key": "t"}]
        assert w.state.peer_failures == {"p1": n}
    w.compute("t", {"a": ["p1"]})
    out = w.gathered("p1", {}, ["a"])
    (msg,) = sent(out)
    assert msg["op"] == "task-erred" and msg["key"] == "t" and msg["exception"] is None
    assert msg["text"].startswith("CommError: cannot fetch input 'a' from p1: it answered without it")
    assert "3 fetches from it failed in a row" in msg["text"]
    assert w.state.tasks == {} and not w.state.in_flight_workers


def test_an_answer_with_some_of_the_keys_is_no_failure() -> None:
    w = Wk(max_peer_failures=1, nthreads=2)
    w.compute("t1", {"a": ["p1"], "b": ["p1"]})
    out = w.gathered("p1", {"a": 1}, ["a", "b"])
    assert sent(out) == [{"op": "missing-data", "key": "b", "errant_worker": "p1", "unserved": True},
                         {"op": "reschedule", "key": "t1"}]
    assert w.state.peer_failures == {}


def test_given_up_on_a_holder_that_answers_without_the_others_are_asked() -> None:
    w = Wk(max_peer_failures=1)
    [(first, _, _)] = gathers(w.compute("t", {"a": ["p1", "p2"]}))
    other = "p2" if first == "p1" else "p1"
    out = w.gathered(first, {}, ["a"])
    assert sent(out) == [] and gathers(out) == [(other, ["a"], 1)]
    assert executes(w.gathered(other, {"a": 1}, ["a"])) == ["t"]
