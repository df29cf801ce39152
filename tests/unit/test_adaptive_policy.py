"""Adaptive scaling's policy (:mod:`shoal.deploy.adaptive`) on a scheduler state built
by hand: how many workers the load asks for, which workers may go, in which order."""

from __future__ import annotations

import pytest

from shoal.deploy.adaptive import desired_workers, parse_seconds, retirable, retirement_order
from shoal.scheduler.adaptive import plan
from shoal.scheduler.state import AddWorkerEvent, NewTask, SchedulerState, TaskFinishedEvent, UpdateGraphEvent


def _state_with(workers: int, threads: int = 1) -> SchedulerState:
    state = SchedulerState()
    state.handle(*(AddWorkerEvent(f"add-{i}", f"tcp://w{i}:1", threads, name=f"worker-{i}") for i in range(workers)))
    return state


def test_desired_workers_follows_the_runnable_tasks() -> None:
    state = _state_with(1)
    assert desired_workers(state, 1, target_duration=5.0) == 0
    state.handle(UpdateGraphEvent("graph", "c", [NewTask(f"t{i}", "payload") for i in range(20)], [f"t{i}" for i in range(20)]))
    # 20 tasks of unknown duration (0.5 s each): 10 s of work, 2 threads for 5 s
    assert desired_workers(state, 1, target_duration=5.0) == 2
    assert desired_workers(state, 2, target_duration=5.0) == 1
    # never more threads than tasks, at least one while any is runnable
    assert desired_workers(state, 1, target_duration=0.001) == 20
    assert desired_workers(state, 1, target_duration=1e6) == 1
    # a task that waits for a dependency is not runnable yet
    state.handle(UpdateGraphEvent("graph-2", "c", [NewTask("d", "payload", dependencies=["t0"])], ["d"]))
    assert desired_workers(state, 1, target_duration=0.001) == 20
    state.validate()


def test_retirable_and_retirement_order() -> None:
    state = _state_with(3)
    w0, w1, w2 = (state.workers[f"tcp://w{i}:1"] for i in range(3))
    state.handle(UpdateGraphEvent("graph", "c", [NewTask("x", "payload", restrictions=[w1.address])], ["x"]))
    assert not retirable(w1)  # it computes x
    state.handle(TaskFinishedEvent("done", w1.address, "x", 100, 0.01))
    assert retirable(w0) and retirable(w2) and not retirable(w1)  # the only copy of a wanted value
    # a copy elsewhere makes it safe, unless that one goes at the same time
    state.tasks["x"].add_holder(w2)
    w2.has_what.add(state.tasks["x"])
    assert retirable(w1) and not retirable(w1, going=[w2])
    addresses = {"worker-0": w0.address, "worker-1": w1.address, "worker-2": w2.address, "worker-3": ""}
    # not joined yet, then the empty newest first, the holders last
    assert retirement_order(state, addresses) == ["worker-3", "worker-0", "worker-2", "worker-1"]
    # a value nobody needs any more keeps no worker
    state.tasks["x"].drop_holder(w2)
    w2.has_what.discard(state.tasks["x"])
    state.validate()
    assert not retirable(w1)
    state.tasks["x"].who_wants = ()
    assert retirable(w1)


def test_the_plan_lists_the_workers_that_may_go_together_best_first() -> None:
    state = _state_with(3)
    w0, w1, w2 = (state.workers[f"tcp://w{i}:1"] for i in range(3))
    state.handle(UpdateGraphEvent("graph", "c", [NewTask("x", "payload", restrictions=[w1.address])], ["x"]))
    state.handle(TaskFinishedEvent("done", w1.address, "x", 100, 0.01))
    # x is on w1 and w2: either may go, not both
    state.tasks["x"].add_holder(w2)
    w2.has_what.add(state.tasks["x"])
    addresses = {"worker-0": w0.address, "worker-1": w1.address, "worker-2": w2.address, "worker-3": ""}
    desired, names = plan(state, addresses, 1, 5.0)
    assert desired == 0  # nothing runnable
    # the one still starting is not retired by the plan (it has not joined); of w1 and
    # w2, the first in the order goes and the other must stay
    assert names == ["worker-0", "worker-2"]
    assert all(retirable(state.workers[addresses[n]], [state.workers[addresses[m]] for m in names[:i]])
               for i, n in enumerate(names))


@pytest.mark.parametrize("text, seconds", [(1, 1.0), (0.25, 0.25), ("1s", 1.0), ("100ms", 0.1), ("2 minutes", 120.0),
                                           ("1.5", 1.5), ("500us", 5e-4)])
def test_durations_in_dask_notation(text: object, seconds: float) -> None:
    assert parse_seconds(text, "interval") == pytest.approx(seconds)  # type: ignore[arg-type]
