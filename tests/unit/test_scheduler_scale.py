"""The scheduler's state at size (no IO): its work per event does not grow with the
number of workers, deep graphs need no recursion, and release, cancel and a client
leaving cost what they touch.

Work is counted, not timed: the Python function calls made inside one ``handle()``
(``sys.setprofile``), which is deterministic and shows any loop over every worker or
every queued task as calls."""

from __future__ import annotations

import os
import sys
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.scheduler.state import (
    AddWorkerEvent,
    CancelKeysEvent,
    ClientMsg,
    ComputeTask,
    NewTask,
    ReleaseKeysEvent,
    RemoveClientEvent,
    SchedulerState,
    TaskErredEvent,
    TaskFinishedEvent,
    UpdateGraphEvent,
)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench import sim  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def calls(fn: Callable[[], Any]) -> int:
    """How many Python and C functions ``fn()`` calls (not counting itself)."""
    n = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal n
        if event in ("call", "c_call"):
            n += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return n - 1  # the call of fn itself


def cluster(n_workers: int, nthreads: int = 1) -> SchedulerState:
    s = SchedulerState()
    s.handle(*(AddWorkerEvent(f"add-{i}", f"tcp://10.0.{i // 256}.{i % 256}:1", nthreads)
               for i in range(n_workers)))
    return s


def submit(s: SchedulerState, tasks: list[NewTask], wanted: list[Any] | None = None, client: str = "c") -> list[Any]:
    return s.handle(UpdateGraphEvent("graph", client, tasks, [t.key for t in tasks] if wanted is None else wanted))


def running(out: list[Any]) -> Iterator[ComputeTask]:
    return (i for i in out if type(i) is ComputeTask)


def chain(n: int, prefix: str = "link") -> list[NewTask]:
    return [NewTask(f"{prefix}-{i}", b"p", [f"{prefix}-{i - 1}"] if i else []) for i in range(n)]


# -- work per event, at 10 and at 1,000 workers


@pytest.mark.parametrize("graph", ["independent", "tree", "chain"])
def test_one_finished_task_costs_the_same_at_10_and_at_1000_workers(graph):
    def one_finish(n_workers: int) -> int:
        s = cluster(n_workers)
        g = sim.make_graph(graph, 6000)
        out = submit(s, [NewTask(k, b"p", [g.keys[d] for d in deps]) for k, deps in zip(g.keys, g.deps)],
                     [g.keys[i] for i in g.wanted])
        sent = deque(running(out))
        # a steady state: every worker busy (and, but for the chain, a queue behind them)
        for _ in range(50):
            ins = sent.popleft()
            sent.extend(running(s.handle(TaskFinishedEvent("warm", ins.worker, ins.key, 10, 0.01))))
        ins = sent.popleft()
        n = calls(lambda: s.handle(TaskFinishedEvent("measured", ins.worker, ins.key, 10, 0.01)))
        s.validate()
        return n

    small, large = one_finish(10), one_finish(1000)
    assert large <= small + 10, (small, large)


def test_placing_a_new_task_costs_the_same_at_10_and_at_1000_workers():
    def one_submit(n_workers: int) -> int:
        s = cluster(n_workers)
        submit(s, [NewTask(f"x-{i}", b"p") for i in range(n_workers // 2)])  # half the workers busy
        n = calls(lambda: submit(s, [NewTask("new", b"p")]))
        s.validate()
        return n

    assert one_submit(1000) <= one_submit(10) + 10


def _constrained_cluster(n_workers: int, gpus: str = "one") -> SchedulerState:
    """``n_workers`` Python workers (one of them, or every one, offers a GPU) and one
    JavaScript worker."""
    s = SchedulerState()
    s.handle(*(AddWorkerEvent(f"add-{i}", f"tcp://10.0.{i // 256}.{i % 256}:1", 1, name=f"w{i}",
                              resources={"GPU": 1} if i == 7 or gpus == "every" else {})
               for i in range(n_workers)),
             AddWorkerEvent("add-js", "tcp://10.9.9.9:1", 1, languages=("javascript",)))
    return s


@pytest.mark.parametrize("how", ["address", "name", "host", "loosely", "resources", "resources everywhere",
                                 "language", "python"])
def test_placing_a_constrained_task_costs_the_same_at_10_and_at_1000_workers(how):
    def one_submit(n_workers: int) -> int:
        s = _constrained_cluster(n_workers, "every" if how == "resources everywhere" else "one")
        submit(s, [NewTask(f"x-{i}", b"p") for i in range(n_workers // 2)])  # half the workers busy
        where = {"address": "tcp://10.0.0.5:1", "name": "w5", "host": "10.0.0.5", "loosely": "w1"}
        def task(key: str) -> NewTask:
            return NewTask(key, b"p", restrictions=[where[how]] if how in where else None,
                           loose_restrictions=how == "loosely",
                           resources={"GPU": 1} if how.startswith("resources") else None,
                           language="javascript" if how == "language" else "python")

        if how == "resources everywhere":
            # (a first one pops the entries the GPU's room index holds of the loads
            # before: a cost amortized over the events that changed them)
            submit(s, [task("warm")])
        n = calls(lambda: submit(s, [task("new")]))
        (placed,) = [ins.worker for ins in s.handle() if type(ins) is ComputeTask] or [
            s.tasks["new"].processing_on.address]
        expected = {"address": "tcp://10.0.0.5:1", "name": "tcp://10.0.0.5:1", "host": "tcp://10.0.0.5:1",
                    "resources": "tcp://10.0.0.7:1", "language": "tcp://10.9.9.9:1"}
        if how in expected:
            assert placed == expected[how]
        s.validate()
        return n

    assert one_submit(1000) <= one_submit(10) + 10


def test_a_worker_takes_queued_tasks_without_walking_those_for_other_workers():
    """Tasks queued for one worker (``workers=``) cost nothing to the others: another
    worker that has room again takes the first task it may run at once."""
    def one_finish(n_queued: int) -> int:
        s = cluster(2)
        a, b = sorted(s.workers)
        submit(s, [NewTask(f"for-a-{i}", b"p", restrictions=[a]) for i in range(n_queued)]
               + [NewTask(f"any-{i}", b"p", priority=-1) for i in range(20)])
        assert len(s.queued) >= n_queued - 3
        running_b = [ts for ts in s.workers[b].processing]
        n = calls(lambda: s.handle(TaskFinishedEvent("done", b, running_b[0].key, 10, 0.01)))
        assert any(ts.key.startswith("any-") for ts in s.workers[b].processing)
        s.validate()
        return n

    assert one_finish(4000) <= one_finish(100) + 10


def test_a_queue_of_tasks_waiting_for_a_busy_resource_costs_nothing_to_a_worker_that_frees_a_thread():
    def one_finish(n_queued: int) -> int:
        s = SchedulerState()
        s.handle(AddWorkerEvent("a", "tcp://10.0.0.1:1", 2, resources={"GPU": 1}))
        submit(s, [NewTask(f"gpu-{i}", b"p", resources={"GPU": 1}) for i in range(n_queued)]
               + [NewTask(f"any-{i}", b"p", priority=-1) for i in range(20)])
        assert len(s.queued) >= n_queued - 1  # one GPU: one GPU task at a time
        plain = sorted(ts.key for ts in s.workers["tcp://10.0.0.1:1"].processing if ts.key.startswith("any-"))
        n = calls(lambda: s.handle(TaskFinishedEvent("done", "tcp://10.0.0.1:1", plain[0], 10, 0.01)))
        s.validate()
        return n

    assert one_finish(4000) <= one_finish(100) + 10


# -- deep graphs


def test_a_failure_at_the_head_of_a_long_chain_errs_all_of_it_without_recursion():
    n = 20 * sys.getrecursionlimit()
    s = cluster(2)
    out = submit(s, chain(n), wanted=[f"link-{n - 1}"])
    (head,) = running(out)
    out = s.handle(TaskErredEvent("boom", head.worker, head.key, b"exc", b"tb", "ValueError: boom"))
    assert all(ts.state == "erred" for ts in s.tasks.values())
    (told,) = [i for i in out if isinstance(i, ClientMsg)]
    assert told.msg["key"] == f"link-{n - 1}" and told.msg["blame"] == "link-0"
    s.validate()
    # the client lets go: all of it goes, in one walk
    s.handle(ReleaseKeysEvent("release", "c", [f"link-{n - 1}"]))
    assert not s.tasks
    s.validate()


def test_a_long_chain_runs_to_the_end_and_frees_each_value_behind_itself():
    n = 5000
    s = cluster(3)
    out = submit(s, chain(n), wanted=[f"link-{n - 1}"])
    done = 0
    while True:
        sent = list(running(out))
        if not sent:
            break
        (ins,) = sent
        out = s.handle(TaskFinishedEvent(f"done-{done}", ins.worker, ins.key, 8, 0.001))
        done += 1
        # at most the value just made and the one it was made from are held
        assert sum(len(ws.has_what) for ws in s.workers.values()) <= 2
    assert done == n and s.tasks[f"link-{n - 1}"].state == "memory"
    # the rest is kept as lineage (released: to recompute the result if it is lost)
    assert s.task_counts() == {"memory": 1, "released": n - 1}
    s.validate()
    s.handle(ReleaseKeysEvent("release", "c", [f"link-{n - 1}"]))
    assert not s.tasks


def _cancel_chain_calls(n: int) -> int:
    s = cluster(1)
    tasks = chain(n)
    submit(s, tasks)
    keys = [t.key for t in tasks]
    c = calls(lambda: s.handle(CancelKeysEvent("cancel", "c", keys)))
    assert not s.tasks
    s.validate()
    return c


def test_cancelling_every_future_along_a_chain_is_linear():
    small, large = _cancel_chain_calls(2000), _cancel_chain_calls(8000)
    assert large < 5 * small, (small, large)  # 4x the tasks: 16x if it were quadratic


def _queued_release_calls(n: int, how: str) -> int:
    s = cluster(2)
    tasks = [NewTask(f"q-{i}", b"p") for i in range(n)]
    submit(s, tasks)
    assert len(s.queued) == n - 2 * 3  # 2 workers x (1 thread + 2 ahead) run, the rest wait
    if how == "release":
        c = calls(lambda: s.handle(ReleaseKeysEvent("release", "c", [t.key for t in tasks[::-1]])))
    else:
        c = calls(lambda: s.handle(RemoveClientEvent("gone", "c")))
    assert not s.queued
    s.validate()
    return c


@pytest.mark.parametrize("how", ["release", "client leaves"])
def test_releasing_a_big_queue_is_linear(how):
    small, large = _queued_release_calls(2000, how), _queued_release_calls(8000, how)
    assert large < 5 * small, (small, large)


# -- the queue


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["push", "remove", "pop", "peek"]), st.integers(0, 40)), max_size=120))
def test_the_queue_gives_its_tasks_in_priority_order_whatever_order_they_came_in(steps):
    """Tasks queued in priority order wait in a FIFO, the others in a heap; what comes
    out is always the first member by priority, and removed tasks never come out."""
    from shoal.scheduler.model import TaskQueue, TaskState

    q = TaskQueue()
    tasks = {i: TaskState(f"t-{i}", priority=(0, 0, i)) for i in range(41)}
    members: set[int] = set()
    for op, i in steps:
        if op == "push" and i not in members:
            q.push(tasks[i])
            members.add(i)
        elif op == "remove" and i in members:
            q.remove(tasks[i])
            members.discard(i)
        elif op == "peek":
            assert q.peek() is (tasks[min(members)] if members else None)
        elif op == "pop" and members:
            assert q.pop() is tasks[min(members)]
            members.discard(min(members))
        assert len(q) == len(members) and [t.key for t in q] == [f"t-{i}" for i in sorted(members)]
    for i in sorted(members):
        assert q.pop() is tasks[i]
    with pytest.raises(IndexError):
        q.pop()


# -- the simulation in bench/sim.py, small


@pytest.mark.parametrize("graph", sorted(sim.GRAPHS))
@pytest.mark.parametrize("workers", [3, 40])
def test_the_simulation_runs_every_task_and_the_state_stays_valid(graph, workers):
    g = sim.make_graph(graph, 400)
    res = sim.run_shoal(g, workers, validate_every=25)
    assert not res.error
    assert res.events == len(g.keys) + 1
    assert res.validations >= len(g.keys) // 25
    assert res.input_bytes == 100_000 * g.edges
    left = res.extra["left"]
    assert left["memory"] == len(g.wanted) and set(left) <= {"memory", "released"}  # released: lineage


# -- locality


def _pairs(n_pairs: int) -> list[NewTask]:
    """Pairs of root tasks, each pair summed, in the order a reduction runs them."""
    tasks = []
    for i in range(n_pairs):
        tasks += [NewTask(f"a-{i}", b"p"), NewTask(f"b-{i}", b"p"), NewTask(f"sum-{i}", b"p", [f"a-{i}", f"b-{i}"])]
    return tasks


def test_sibling_roots_go_to_one_worker_at_submit_and_from_the_queue():
    s = cluster(4)
    out = submit(s, _pairs(40), wanted=[f"sum-{i}" for i in range(40)])
    sent = deque(running(out))
    assert s.queued  # 4 workers x 3 slots: most pairs wait in the queue
    where: dict[str, str] = {}
    while sent:
        ins = sent.popleft()
        where[ins.key] = ins.worker
        if ins.key.startswith("sum-"):
            # both inputs are on the worker the sum runs on: nothing moves
            assert all(ins.worker in holders for holders in ins.who_has.values()), ins
        sent.extend(running(s.handle(TaskFinishedEvent(f"done-{ins.key}", ins.worker, ins.key, 1000, 0.01))))
    assert all(where[f"a-{i}"] == where[f"b-{i}"] == where[f"sum-{i}"] for i in range(40))
    s.validate()


def test_a_dependent_waits_on_the_busy_worker_holding_its_input_rather_than_move_it():
    s = cluster(2)
    (first,) = running(submit(s, [NewTask("big", b"p")]))
    s.handle(TaskFinishedEvent("done", first.worker, "big", 10**9, 0.01))
    # the holder is given more than its room, the other worker nothing
    out = submit(s, [NewTask(f"use-{i}", b"p", ["big"]) for i in range(4)])
    assert {ins.worker for ins in running(out)} == {first.worker}
    s.validate()


# -- a worker with many fetches pending


def _fetch_calls(n_inputs: int) -> tuple[int, int]:
    from shoal.worker.events import ComputeTaskEvent
    from shoal.worker.state import GatherDep, WorkerState

    w = WorkerState("tcp://me:1", nthreads=1)
    # inputs spread over 50 peers, each batch small enough that every peer gets one request
    deps = {f"in-{i}": [f"tcp://peer-{i % 50}:1"] for i in range(n_inputs)}
    ev = ComputeTaskEvent("compute", "join", b"p", deps, dict.fromkeys(deps, 10), (0,))
    out: list[Any] = []
    n = calls(lambda: out.extend(w.handle(ev)))
    gathers = [i for i in out if isinstance(i, GatherDep)]
    assert len(gathers) == w.max_gathers and all(len(g.keys) == n_inputs // 50 for g in gathers)
    w.validate()
    return n, len(gathers)


def test_batching_a_workers_fetches_is_not_quadratic_in_how_many_are_pending():
    (small, _), (large, _) = _fetch_calls(1000), _fetch_calls(4000)
    assert large < 6 * small, (small, large)  # 4x the inputs: 16x if it were quadratic


def _unrelated_event_calls(n_inputs: int) -> int:
    """A worker fetching ``n_inputs`` values from 2 peers (both busy, so more requests
    could go out but none can): one event that changes nothing of that."""
    from shoal.worker.events import ComputeTaskEvent
    from shoal.worker.state import WorkerState

    w = WorkerState("tcp://me:1", nthreads=4, gather_bytes=100)
    deps = {f"in-{i}": [f"tcp://peer-{i % 2}:1"] for i in range(n_inputs)}
    w.handle(ComputeTaskEvent("join", "join", b"p", deps, dict.fromkeys(deps, 10), (0,)))
    assert len(w.in_flight_workers) == 2 and len(w.fetching) == n_inputs - 20
    n = calls(lambda: w.handle(ComputeTaskEvent("other", "other", b"p", {}, {}, (1,))))
    w.validate()
    return n


def test_an_event_that_lets_no_fetch_start_does_not_walk_the_pending_fetches():
    assert _unrelated_event_calls(4000) <= _unrelated_event_calls(500) + 10


# -- a big graph's order on the client


def test_a_graph_too_big_for_dask_order_goes_depth_first(monkeypatch):
    from operator import add

    from shoal.client import graphs

    monkeypatch.setattr(graphs, "DASK_ORDER_MAX", 10)
    # a reduction over 16 leaves, as a dict in breadth-first order (all leaves first)
    dsk: dict[Any, Any] = {("leaf", i): i for i in range(16)}
    level = [("leaf", i) for i in range(16)]
    depth = 0
    while len(level) > 1:
        depth += 1
        nxt = [(f"sum{depth}", j) for j in range(len(level) // 2)]
        for j, key in enumerate(nxt):
            dsk[key] = (add, level[2 * j], level[2 * j + 1])
        level = nxt
    tasks, wanted = graphs.graph_to_tasks(dsk, [level[0]])
    order = [t["key"] for t in tasks]
    pos = {k: i for i, k in enumerate(order)}
    assert len(order) == len(dsk) and wanted == [level[0]]
    assert all(pos[d] < pos[t["key"]] for t in tasks for d in t["deps"])  # inputs first
    # each pair is summed right after its leaves, before any other leaf: depth first
    for j in range(8):
        assert sorted([pos[("leaf", 2 * j)], pos[("leaf", 2 * j + 1)], pos[("sum1", j)]]) == \
            list(range(pos[("sum1", j)] - 2, pos[("sum1", j)] + 1))
    # and so is each sum of sums: half of the leaves come after the first half's total
    assert pos[("sum3", 0)] < 15 or pos[("sum3", 1)] < 15


def test_a_converted_graph_is_left_to_the_oldest_generation_of_the_collector():
    """The objects a graph's conversion made (with the collector off) are not left in
    the young generations, whose next passes would walk every one of them to promote
    them; they stay collectible by a full pass."""
    import gc
    from operator import add

    from shoal.client import graphs

    dsk: dict[Any, Any] = {"x0": 0}
    for i in range(1, 3000):
        dsk[f"x{i}"] = (add, f"x{i - 1}", 1)
    assert gc.isenabled()
    gc.collect()  # (the young generations' counts start at 0: their next pass is one of the youngest)
    tasks, _ = graphs.graph_to_tasks(dsk, ["x2999"])
    made = {id(t) for t in tasks} | {id(t["payload"]) for t in tasks}
    young = {id(o) for generation in (0, 1) for o in gc.get_objects(generation=generation)}
    assert not made & young
    assert made <= {id(o) for o in gc.get_objects(generation=2)}
    assert gc.get_freeze_count() == 0


def test_a_big_graph_the_scheduler_took_in_is_left_to_the_oldest_generation_of_the_collector():
    """What the scheduler made for a big graph (with the collector off) is not left to
    the young generations: their next passes, in the events that follow, would walk
    all of it only to promote it."""
    import gc

    from shoal.scheduler.state import _BIG_GRAPH

    s = cluster(2)
    assert gc.isenabled()
    gc.collect()
    submit(s, chain(_BIG_GRAPH), wanted=[f"link-{_BIG_GRAPH - 1}"])
    assert gc.isenabled() and gc.get_freeze_count() == 0
    made = {id(ts) for ts in s.tasks.values()}
    young = {id(o) for generation in (0, 1) for o in gc.get_objects(generation=generation)}
    assert len(made) == _BIG_GRAPH and not made & young
    assert made <= {id(o) for o in gc.get_objects(generation=2)}
    s.validate()


def test_depth_first_order_stops_at_a_cycle():
    from shoal.client import graphs

    order, cyclic = graphs._depth_first({"a": ["b"], "b": ["a"], "c": ["a"]}, ["c"])
    assert sorted(order) == ["a", "b", "c"] and cyclic  # (the scheduler then refuses the cycle)
    assert graphs._depth_first({"a": [], "b": ["a"], "c": ["a", "b", "elsewhere"]}, ["c"]) == (["a", "b", "c"], False)


# -- a big graph goes to the scheduler in parts


def _chain_and_tree(n: int) -> list[dict[str, Any]]:
    """Tasks in depth-first order: ``n`` sums, each of two leaves; then a total of all."""
    tasks: list[dict[str, Any]] = []
    for i in range(n):
        tasks += [{"key": f"l{i}a", "deps": []}, {"key": f"l{i}b", "deps": []},
                  {"key": f"s{i}", "deps": [f"l{i}a", f"l{i}b"]}]
    tasks.append({"key": "total", "deps": [f"s{i}" for i in range(n)]})
    return tasks


def test_a_big_graph_is_cut_where_every_input_came_before():
    """Each part names only keys of its own or of earlier parts."""
    from shoal.client import graphs

    tasks = _chain_and_tree(10)  # 31 tasks
    parts, held = graphs.split_graph(tasks, ["total", "s3"], size=7)
    sent: set[Any] = set()
    for part, wanted in parts:
        for t in part:
            assert all(d in sent or d in {p["key"] for p in part} for d in t["deps"])
        sent |= {t["key"] for t in part}
    assert [len(p) for p, _ in parts] == [7, 7, 7, 7, 3]
    assert [t for p, _ in parts for t in p] == tasks
    # what later parts need is held (wanted) by its part; s3, wanted anyway, is not "held"
    assert [w for _, w in parts] == [["s0", "s1", "l2a"], ["s3", "s2", "l4a", "l4b"], ["s4", "s5", "s6"],
                                     ["s7", "s8", "l9a"], ["total"]]
    assert held == ["s0", "s1", "l2a", "s2", "l4a", "l4b", "s4", "s5", "s6", "s7", "s8", "l9a"]
    # small graphs, and orders that never allow a cut, stay whole
    assert graphs.split_graph(tasks, ["total"], size=40) == ([(tasks, ["total"])], [])
    backwards = tasks[::-1]
    assert graphs.split_graph(backwards, ["total"], size=7) == ([(backwards, ["total"])], [])


def test_a_big_dask_graph_is_made_into_parts_as_they_are_sent(monkeypatch):
    """Past DASK_ORDER_MAX tasks a graph's parts are made one at a time (the first
    is sent, and runs, while the others are made), depth first: each names only keys
    of its own or of earlier parts, holds what later parts need, and the last wants
    the graph's keys; a graph with a cycle is not cut (sent whole, it is refused)."""
    from operator import add

    from shoal.client import graphs

    monkeypatch.setattr(graphs, "DASK_ORDER_MAX", 10)
    dsk: dict[Any, Any] = {("leaf", i): i for i in range(16)}
    level = [("leaf", i) for i in range(16)]
    while len(level) > 1:
        nxt = [(f"sum{len(level)}", j) for j in range(len(level) // 2)]
        for j, key in enumerate(nxt):
            dsk[key] = (add, level[2 * j], level[2 * j + 1])
        level = nxt
    made: list[Any] = []
    task_of = graphs._task_of
    monkeypatch.setattr(graphs, "_task_of", lambda key, *a: made.append(key) or task_of(key, *a))
    parts = graphs.prepare(dsk, [level[0]]).parts(size=7)
    assert parts is not None
    first = next(parts)
    assert len(made) == 7 and [t["key"] for t in first[0]] == made  # the rest not made yet
    parts_list = [first, *parts]
    assert [len(p) for p, _, _ in parts_list] == [7, 7, 7, 7, 3]
    sent: set[Any] = set()
    need: dict[Any, int] = {}
    for i, (part, wanted, held) in enumerate(parts_list):
        keys = {t["key"] for t in part}
        for t in part:
            assert all(d in sent or d in keys for d in t["deps"])
        later = {d for p, _, _ in parts_list[i + 1:] for t in p for d in t["deps"]}
        assert sorted(held) == sorted(keys & later) and set(held) <= set(wanted)
        sent |= keys
    assert sent == set(dsk) and parts_list[-1][1] == [level[0]]
    values: dict[Any, Any] = {}
    for part, _, _ in parts_list:
        for t in part:
            spec = t["payload"].data
            values[t["key"]] = spec.func(spec.args[0], {d: values[d] for d in t["deps"]})
    assert values[level[0]] == sum(range(16))
    # small graphs, and cycles, are made whole (split_graph then cuts what it can)
    monkeypatch.setattr(graphs, "DASK_ORDER_MAX", 100)
    assert graphs.prepare(dsk, [level[0]]).parts(size=7) is None
    monkeypatch.setattr(graphs, "DASK_ORDER_MAX", 1)
    assert graphs.prepare({"a": (add, "b", 1), "b": (add, "a", 1), "c": (add, "a", 1)}, ["c"]).parts() is None


def test_a_big_dask_collection_computes_part_by_part(monkeypatch):
    """End to end: a collection whose graph is past DASK_ORDER_MAX goes to the scheduler
    in parts made as they are sent, with the call's options, and computes."""
    import dask.array as da

    import shoal
    from shoal.client import graphs

    monkeypatch.setattr(graphs, "DASK_ORDER_MAX", 50)
    monkeypatch.setattr(graphs, "GRAPH_CHUNK", 40)
    y = (da.ones(300, chunks=1) + 1).sum()
    with shoal.LocalCluster(n_workers=2, processes=False, dashboard_address=None) as cluster, \
            shoal.Client(cluster) as client:
        seen: list[list[Any]] = []
        state = cluster.scheduler.state
        handle = state.handle

        def spy(*events: Any) -> Any:
            seen.extend(e.tasks for e in events if type(e).__name__ == "UpdateGraphEvent")
            return handle(*events)

        monkeypatch.setattr(state, "handle", spy)
        future = client.compute(y, retries=2)
        assert future.result(timeout=60) == 600
        assert len(seen) > 2 and all(len(tasks) == 40 for tasks in seen[:-1]) and 0 < len(seen[-1]) <= 40
        assert all(t.retries == 2 for tasks in seen for t in tasks)


def test_wanted_keys_no_part_defines_go_with_the_last_part():
    from shoal.client import graphs

    tasks = [{"key": f"x{i}", "deps": ["on-cluster"] if i == 0 else []} for i in range(6)]
    parts, held = graphs.split_graph(tasks, ["x1", "on-cluster", "x5"], size=2)
    assert [w for _, w in parts] == [["x1"], [], ["x5", "on-cluster"]] and held == []


def test_a_dask_tasks_payload_is_sized_by_the_data_it_carries():
    """A dask graph's task says the bytes of the constants it carries (an array in the
    graph counts in full; a fused chain of small steps, little), without dask's own
    sizeof of each part, and runs as the node it wraps."""
    import dask.array as da
    import numpy as np

    from shoal.client import graphs

    inner = np.arange(250_000, dtype=np.float64)
    y = (da.from_array(inner, chunks=125_000) + 1).sum()
    tasks, keys = graphs.graph_to_tasks(y, graphs.flatten_keys(y.__dask_keys__(), []))
    sizes = [t["payload"].data.nbytes for t in tasks]
    assert max(sizes) >= inner.nbytes // 2  # the chunks of the array are in the graph
    small = (da.ones(8, chunks=1) + 1).sum()
    small_key = graphs.flatten_keys(small.__dask_keys__(), [])[0]
    small_tasks, _ = graphs.graph_to_tasks(small, [small_key])
    assert all(t["payload"].data.nbytes < 10_000 for t in small_tasks)
    # each payload runs its node: the graph's result, computed task by task
    values: dict[Any, Any] = {}
    for t in small_tasks:
        spec = t["payload"].data
        values[t["key"]] = spec.func(spec.args[0], {d: values[d] for d in t["deps"]})
    assert values[small_key] == 16
