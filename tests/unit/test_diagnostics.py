"""The scheduler's records for the dashboard (shoal.scheduler.diagnostics) and the
counts by key prefix the state machine keeps for them, on the state machine alone."""

from __future__ import annotations

import itertools
import math
from typing import Any

from scheduler_harness import Sched, computes, task

from shoal.scheduler.diagnostics import Diagnostics


def _diag(s: Sched, size: int = 100) -> Diagnostics:
    clock = itertools.count(1000.0)
    return Diagnostics(s.state, lambda: "tcp://sched:1", lambda: float(next(clock)), size=size)


def _prefixes(d: Diagnostics) -> dict[str, dict[str, Any]]:
    return {p["prefix"]: p for p in d.progress()["prefixes"]}


def test_progress_counts_tasks_by_prefix_through_their_lives(s: Sched) -> None:
    d = _diag(s)
    s.add_worker("w1")
    s.submit(task("inc-1"), task("inc-2"), task("sum-9", "inc-1", "inc-2"), wanted=["sum-9"])
    p = _prefixes(d)
    # one thread, tasks handed ahead: both inputs go to the worker at once
    assert p["inc"] == {"prefix": "inc", "total": 2, "done": 0, "waiting": 0, "processing": 2, "memory": 0,
                        "erred": 0}
    assert p["sum"]["waiting"] == 1 and p["sum"]["total"] == 1
    for key in ("inc-1", "inc-2"):
        s.finish("w1", key)
    p = _prefixes(d)
    # the inputs stay in memory while sum runs; done counts them
    assert p["inc"]["done"] == 2 and p["sum"]["processing"] == 1
    s.finish("w1", "sum-9")
    p = _prefixes(d)
    assert p["sum"]["done"] == 1 and p["sum"]["memory"] == 1
    assert p["inc"]["done"] == 2 and p["inc"]["memory"] == 0  # released once sum had them
    assert d.graph()["edges"] == [{"from": "inc", "to": "sum"}]
    s.release("sum-9")
    assert d.progress()["prefixes"] == []  # every task forgotten: their groups went too
    assert s.state.groups == {}


def test_a_task_that_runs_again_counts_as_done_once(s: Sched) -> None:
    d = _diag(s)
    s.add_worker("w1")
    s.add_worker("w2")
    s.submit(task("x-1"))
    s.finish(s.on("x-1"), "x-1")
    (holder,) = [ws.address for ws in s.ts("x-1").who_has]
    s.remove_worker(holder)  # lost: computed again
    s.finish(s.on("x-1"), "x-1")
    assert _prefixes(d)["x"]["done"] == 1 and _prefixes(d)["x"]["total"] == 1


def test_erred_tasks_and_their_story_show_on_the_task_page(s: Sched) -> None:
    d = _diag(s)
    s.add_worker("w1")
    s.submit(task("boom-1"), task("after-2", "boom-1"), wanted=["after-2"])
    d.task_ran("w1", "boom-1", [10.0, 10.5, 1], [], ok=False)
    s.err("w1", "boom-1", traceback="Traceback: ValueError", text="ValueError: no")
    page = d.task("boom-1")
    assert page is not None
    assert page["state"] == "erred" and page["error"] == "ValueError: no"
    assert page["traceback"] == "Traceback: ValueError"
    assert page["worker"] == "w1" and page["duration"] == 0.5
    assert [(t["start"], t["finish"]) for t in page["story"]][-1] == ("processing", "erred")
    after = d.task("after-2")
    assert after is not None and after["state"] == "erred" and after["error"] == "ValueError: no"
    assert after["dependencies"][0]["key"] == "boom-1"
    assert d.task("nothing-such") is None
    assert _prefixes(d)["boom"]["erred"] == 1


def test_tuple_keys_are_found_by_their_text(s: Sched) -> None:
    d = _diag(s)
    s.add_worker("w1")
    s.submit(task(("x-1a2b", 3)))
    page = d.task(str(("x-1a2b", 3)))
    assert page is not None and page["key"] == "('x-1a2b', 3)" and page["prefix"] == "x"
    assert d.search("1a2b") == ["('x-1a2b', 3)"]


def test_long_searches_pause_between_slices_and_see_what_changed(s: Sched, monkeypatch: Any) -> None:
    import shoal.scheduler.diagnostics as diagnostics

    monkeypatch.setattr(diagnostics, "SCAN_SLICE", 10)
    d = _diag(s)
    s.add_worker("w1")
    s.submit(*[task(("y", i)) for i in range(45)], task("y-last"))
    steps = d.search_steps("y", limit=100)
    next(steps)  # a pause: the scheduler runs, and forgets one key
    s.release(("y", 44))
    pauses = 1 + sum(1 for _ in iter(lambda: next(steps, "end"), "end"))
    assert pauses == 4  # 46 keys, a pause after every 10
    assert d.search("y", limit=100) == [str(("y", i)) for i in range(44)] + ["y-last"]
    # a page for a key that is not a str: found by its text in slices too, and not once forgotten
    steps = d.task_steps(str(("y", 30)))
    assert next(steps) is None
    s.release(("y", 30))
    assert diagnostics.run_steps(steps) is None
    assert d.task(str(("y", 31)))["key"] == str(("y", 31))


def test_the_task_stream_is_a_bounded_ring_read_by_index(s: Sched) -> None:
    d = _diag(s, size=5)
    for i in range(8):
        d.task_ran("w1", f"t-{i}", [float(i), i + 0.5, 1], [], ok=True)
    got = d.task_stream(0)
    assert [r["key"] for r in got["records"]] == [f"t-{i}" for i in range(3, 8)]
    assert got["next"] == 8
    assert d.task_stream(8) == {"next": 8, "records": []}
    assert [r["index"] for r in d.task_stream(6)["records"]] == [6, 7]
    page = d.task_stream(3, limit=2)
    assert [r["index"] for r in page["records"]] == [3, 4] and page["next"] == 5
    assert d.task_stream(10**9) == {"next": 8, "records": []}


def test_what_a_peer_says_for_the_task_stream_is_checked(s: Sched) -> None:
    d = _diag(s)
    d.task_ran("w1", "a-1", [math.nan, 5.0, 1], [
        ["in-1", "w2", 100, "tcp", 1.0, 2.0],
        ["in-2", "w2", -5, "shm", 1.0, 1.0],  # a negative size counts as 0
        ["in-3", "w2", 100, "carrier-pigeon", 1.0, 2.0],  # no such path: dropped
        ["in-4", "w2", 100, "tcp", math.inf, 2.0],  # not a time: dropped
        "garbage",
    ], ok=True)
    (record,) = d.task_stream()["records"]
    assert record["start"] == record["stop"]  # no usable timing: an instant, when heard
    assert [(t["key"], t["bytes"], t["path"]) for t in record["transfers"]] == [("in-1", 100, "tcp"), ("in-2", 0, "shm")]
    d.worker_figures("w1", math.nan, {"tcp": 10, "shm": "x", "odd": 3}, None)
    s.add_worker("w1")
    (row,) = d.workers()
    assert row["cpu"] == 0.0 and row["transfers_in"] == {"inproc": 0, "shm": 0, "tcp": 10}
    assert d.transfers()["tcp"] == 10
    d.worker_left("w1")
    assert d.transfers()["tcp"] == 10  # totals never go back when a worker leaves


def test_summary_counts_from_the_groups(s: Sched) -> None:
    d = _diag(s)
    s.add_worker("w1", nthreads=4)
    out = s.submit(*[task(f"inc-{i}") for i in range(6)])
    assert len(computes(out)) == 6
    s.finish("w1", "inc-0")
    summary = d.summary()
    assert summary["workers"] == 1 and summary["threads"] == 4 and summary["tasks"] == 6
    assert summary["memory"] == 1 and summary["processing"] == 5 and summary["address"] == "tcp://sched:1"


class _Watched:
    """A value that notes each time it is pickled."""

    pickled: list[int] = []

    def __reduce__(self) -> Any:
        _Watched.pickled.append(1)
        return (_Watched, ())


def test_a_workers_traffic_looks_into_values_only_when_they_may_lie_in_shared_memory() -> None:
    # finding a value's bytes in segments pickles it: a shuffle's small frames cost
    # as much again as sending them when every value served or fetched was looked into
    from shoal.protocol import SAME_HOST
    from shoal.worker.diagnostics import Traffic

    _Watched.pickled.clear()
    t = Traffic()
    t.served(SAME_HOST, {"small": 100}, {"small": _Watched()})
    t.fetched(SAME_HOST, {"small": 100}, {"small": _Watched()}, "tcp://peer:1", 1.0, 2.0)
    assert _Watched.pickled == []
    assert t.sent == {"inproc": 0, "shm": 0, "tcp": 100} and t.received == t.sent
    t.fetched(SAME_HOST, {"big": 1 << 20}, {"big": _Watched()}, "tcp://peer:1", 1.0, 2.0)
    assert _Watched.pickled == [1]  # it may lie in a segment: looked into (it does not)
    assert t.received == {"inproc": 0, "shm": 0, "tcp": 100 + (1 << 20)}
    assert [a[3] for a in t.arrivals.take(["small", "big"])] == ["tcp", "tcp"]
