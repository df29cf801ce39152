"""shoal.worker.state: values a worker can no longer read back (a spill file that failed
its checksum) are lost here: the scheduler hears ``missing-data`` from the worker
itself, and the local tasks that needed them go back to it (``reschedule``)."""

from __future__ import annotations

from test_worker_replay import assert_replays
from worker_harness import ME, Wk, executes, ops, sent

from shoal.worker.state import DataLostEvent


def lose(w: Wk, keys: list[str], task: str | None = None) -> list[object]:
    """The store dropped ``keys`` (as it does when their files fail), then the event."""
    for k in keys:
        w.state.data.pop(k, None)
    return w(DataLostEvent(w.sid(), keys, task))


def test_an_input_lost_as_its_task_was_to_start_sends_both_back_and_frees_the_slot() -> None:
    w = Wk(nthreads=1)
    w.compute("x")
    w.success("x")
    assert executes(w.compute("y", {"x": [ME]})) == ["y"]
    w.compute("z")  # waits for the thread
    out = lose(w, ["x"], task="y")
    assert sent(out) == [{"op": "missing-data", "key": "x", "errant_worker": ME},
                         {"op": "reschedule", "key": "y"}]
    # the thread y never started is free: the next task runs
    assert executes(out) == ["z"]
    assert w.states() == {"z": "executing"}
    assert "x" not in w.state.data
    assert_replays(w.state, w.out)


def test_a_value_lost_while_serving_a_peer_sends_its_waiting_dependents_back() -> None:
    w = Wk(nthreads=1)
    w.compute("x")
    w.success("x")
    w.compute("busy")  # holds the one thread
    w.compute("y", {"x": [ME]})  # ready, waiting for the thread
    w.compute("u", {"x": [ME], "a": ["tcp://peer:1"]})  # waiting for a
    out = lose(w, ["x"])
    assert ops(out) == [("missing-data", "x"), ("reschedule", "y"), ("reschedule", "u")]
    assert w.states() == {"busy": "executing"}
    assert_replays(w.state, w.out, nthreads=1)


def test_a_scattered_value_lost_is_reported_like_any_other() -> None:
    w = Wk()
    w.scatter({"s": 1})
    assert sent(lose(w, ["s"])) == [{"op": "missing-data", "key": "s", "errant_worker": ME}]
    assert w.states() == {}


def test_inputs_that_cannot_be_read_now_send_the_task_back_and_keep_the_values() -> None:
    w = Wk(nthreads=1)
    w.compute("x")
    w.success("x")
    w.compute("y", {"x": [ME]})
    out = w(DataLostEvent(w.sid(), [], "y"))
    assert ops(out) == [("reschedule", "y")]
    assert w.states() == {"x": "memory"}


def test_keys_unknown_or_not_in_memory_are_left_alone() -> None:
    w = Wk()
    w.compute("x")  # executing
    assert lose(w, ["x", "nope"]) == []
    assert w.states() == {"x": "executing"}
