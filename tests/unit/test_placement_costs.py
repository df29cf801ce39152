"""Placement by what moving a value costs, on the scheduler's state (no IO): a task
waits for the holder of its inputs, past the holder's room, when the tasks ahead of it
there end sooner than its inputs would move (a shuffle's cheap splits of one large
partition); not when the holder is busy with long tasks, nor while the cost of its
kind of task is unknown."""

from __future__ import annotations

from scheduler_harness import Sched, computes, task

from shoal.scheduler.events import TaskFinishedEvent
from shoal.scheduler.transitions import DURATIONS_KEPT

BIG = 64 << 20  # bytes: 0.3 s to move at the reckoned rate


def finish(s: Sched, worker: str, key: str, nbytes: int = 1, duration: float = 0.0) -> list:
    return s(TaskFinishedEvent(s.sid(), worker, key, nbytes, duration))


def two_workers() -> Sched:
    s = Sched()
    s.add_worker("w1")
    s.add_worker("w2")
    return s


def learn(s: Sched, prefix: str, duration: float) -> None:
    """Run one task of ``prefix`` (on whichever worker) that took ``duration``."""
    key = f"{prefix}-999"  # (a key's prefix: its words before the number)
    (where, _), = computes(s.submit(task(key)))
    finish(s, where, key, duration=duration)
    s.release(key)


def fan_out(s: Sched, n: int) -> dict[str, list[str]]:
    """A large value and ``n`` splits of it: where each split goes."""
    (where, _), = computes(s.submit(task("part-1"), wanted=[]))
    s.submit(*[task(f"split-{i}", "part-1") for i in range(n)])
    out = finish(s, where, "part-1", nbytes=BIG, duration=0.5)
    placed: dict[str, list[str]] = {}
    for worker, key in computes(out):
        placed.setdefault(worker, []).append(key)
    placed["holder"] = [where]
    return placed


def test_cheap_splits_of_a_large_value_all_go_to_its_holder():
    s = two_workers()
    learn(s, "split", 1e-4)
    placed = fan_out(s, 32)
    holder = placed.pop("holder")[0]
    assert set(placed) == {holder} and len(placed[holder]) == 32, placed
    assert s.ts("split-0").processing_on.address == holder


def test_while_a_kind_of_task_has_never_run_the_holder_takes_only_its_room():
    s = two_workers()
    placed = fan_out(s, 32)
    holder = placed.pop("holder")[0]
    other = "w2" if holder == "w1" else "w1"
    assert placed.get(other), "with no cost known, the other worker takes some (the room rule)"


def overfill(s: Sched) -> int:
    """How many tasks a holder of one thread takes by the room rule alone."""
    return 2 * (1 + s.state._ahead_now)


def test_a_fan_out_past_the_room_rule_stays_with_its_holder_only_while_its_tasks_are_cheap():
    s = two_workers()
    learn(s, "split", 1e-4)
    n = 3 * overfill(s)
    placed = fan_out(s, n)
    holder = placed.pop("holder")[0]
    assert set(placed) == {holder} and len(placed[holder]) == n

    s = two_workers()
    learn(s, "split", 10.0)  # each as long as moving the value 30 times
    n = 8 * overfill(s)
    placed = fan_out(s, n)
    holder = placed.pop("holder")[0]
    other = "w2" if holder == "w1" else "w1"
    room = 1 + s.state._ahead_now
    assert len(placed[other]) == room, "the other worker takes what it has room for"
    # and no worker has room: the next wait at the holder of their large input, not
    # in the queue for whichever worker frees a thread first; past four times its
    # room, in the queue (which balances the load)
    assert len(placed[holder]) == 4 * room
    queued = [i for i in range(n) if s.ts(f"split-{i}").state == "queued"]
    assert len(queued) == n - 5 * room


def test_with_no_room_anywhere_a_task_of_a_small_input_waits_in_the_queue():
    s = two_workers()
    learn(s, "split", 10.0)
    n = 3 * overfill(s)
    (where, _), = computes(s.submit(task("part-1"), wanted=[]))
    s.submit(*[task(f"split-{i}", "part-1") for i in range(n)])
    finish(s, where, "part-1", nbytes=1000, duration=0.5)
    assert {s.ts(f"split-{i}").state for i in range(n)} == {"processing", "queued"}


def test_a_small_input_does_not_make_a_task_wait():
    s = two_workers()
    learn(s, "split", 0.01)
    (where, _), = computes(s.submit(task("part-1"), wanted=[]))
    s.submit(*[task(f"split-{i}", "part-1") for i in range(32)])
    out = finish(s, where, "part-1", nbytes=1000, duration=0.5)  # cheap to move: 1 ms
    assert len({w for w, _ in computes(out)}) == 2


def test_durations_outlive_their_graph_and_are_bounded():
    s = two_workers()
    learn(s, "split", 1e-4)
    assert "split" not in s.state.groups and s.state.durations["split"] == 1e-4
    s.submit(task("split-9"))
    assert s.state.groups["split"].duration == 1e-4
    for i in range(DURATIONS_KEPT + 5):
        s.state.durations[f"p{i}"] = 1.0
    learn(s, "other", 0.5)
    assert len(s.state.durations) <= DURATIONS_KEPT + 6  # (trimmed by one per group that goes)
