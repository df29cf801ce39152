"""The scheduler's side of rebalance/replicate, without IO: the plan of moves, and
dropping copies through the state machine (never the last one)."""

from __future__ import annotations

import random

from scheduler_harness import Sched, frees, task
from shoal.scheduler.ops import rebalance_moves
from shoal.scheduler.state import RemoveReplicasEvent


def test_moves_even_out_equal_values() -> None:
    moves = rebalance_moves({"a": 10, "b": 0}, {"a": {i: 1 for i in range(10)}}, {i: {"a"} for i in range(10)})
    assert len(moves) == 5 and all(s == "a" and r == "b" for _, s, r in moves)


def test_a_value_too_large_to_help_stays() -> None:
    assert rebalance_moves({"a": 10, "b": 0}, {"a": {"x": 10}}, {"x": {"a"}}) == []


def test_a_key_the_recipient_holds_is_not_moved_there() -> None:
    assert rebalance_moves({"a": 4, "b": 0}, {"a": {"x": 2}}, {"x": {"a", "b"}}) == []


def test_moves_always_lower_the_spread_and_each_key_moves_once() -> None:
    rng = random.Random(7)
    workers = [f"w{i}" for i in range(6)]
    holdings: dict[str, dict[int, int]] = {w: {} for w in workers}
    holders: dict[int, set[str]] = {}
    for k in range(300):
        w = rng.choice(workers[:2])
        holdings[w][k] = rng.randint(1, 100)
        holders[k] = {w}
    loads = {w: sum(keys.values()) for w, keys in holdings.items()}
    moves = rebalance_moves(loads, holdings, holders)
    assert len({k for k, _, _ in moves}) == len(moves)
    after = dict(loads)
    for key, sender, recipient in moves:
        assert holders[key] == {sender}
        after[sender] -= holdings[sender][key]
        after[recipient] += holdings[sender][key]
    assert max(after.values()) - min(after.values()) < max(loads.values()) - min(loads.values())
    assert sum(v * v for v in after.values()) < sum(v * v for v in loads.values())


def test_remove_replicas_never_drops_the_last_copy() -> None:
    h = Sched()
    h.add_worker("a")
    h.add_worker("b")
    h.scatter({"x": ["a", "b"], "y": ["a"]}, {"x": 10, "y": 5})
    out = h(RemoveReplicasEvent(h.sid(), {"x": ["a", "b"], "y": ["a"], "unknown": ["a"]}))
    assert frees(out) == {"a": {"x"}}
    assert {ws.address for ws in h.ts("x").who_has} == {"b"}
    assert {ws.address for ws in h.ts("y").who_has} == {"a"}
    assert h.state.workers["a"].nbytes == 5 and h.state.workers["b"].nbytes == 10


def test_remove_replicas_keeps_a_copy_a_running_task_there_reads() -> None:
    h = Sched()
    h.add_worker("a")
    h.add_worker("b")
    h.scatter({"x": ["a", "b"]})
    h.submit(task("y", "x", workers=["a"]))
    assert h.on("y") == "a"
    assert frees(h(RemoveReplicasEvent(h.sid(), {"x": ["a"]}))) == {}
    assert frees(h(RemoveReplicasEvent(h.sid(), {"x": ["b"]}))) == {"b": {"x"}}
    fresh, _ = h.replay()
    assert {ws.address for ws in fresh.tasks["x"].who_has} == {"a"}
