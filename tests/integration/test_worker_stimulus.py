"""Stories meet across machines: a worker files what the scheduler sent under the
scheduler's ``stimulus_id``, and its reports carry the id of the stimulus that caused
them (docs/protocol.md §6)."""

from __future__ import annotations

from typing import Any

import pytest

import shoal
from shoal.protocol.messages import Msg, TaskFinishedMsg, to_wire
from shoal.scheduler.server import Scheduler
from shoal.testing import wait_for

pytestmark = pytest.mark.timeout(60)


def inc(x: int) -> int:
    return x + 1


def test_stimulus_ids_travel_both_ways(monkeypatch: pytest.MonkeyPatch) -> None:
    told: dict[tuple[str, Any], str] = {}  # (op, key) -> the stimulus_id the scheduler sent
    reports: list[Msg] = []
    send_worker, worker_msg = Scheduler._send_worker, Scheduler._worker_msg

    def send(self: Scheduler, address: str, msg: Msg | dict[str, Any], lazy: bool = False) -> None:
        if isinstance(msg, Msg):
            msg = to_wire(msg)  # (to a worker of this process a task goes as a struct)
        if msg.get("op") in ("compute-task", "free-keys"):
            # whatever the scheduler says, or (a scheduler that says nothing) an id of ours
            msg = {**msg, "stimulus_id": msg.get("stimulus_id") or f"scheduler-{msg['op']}-{len(told)}"}
            for key in msg.get("keys", [msg.get("key")]):
                told[(msg["op"], key)] = msg["stimulus_id"]
        send_worker(self, address, msg, lazy)

    def received(self: Scheduler, address: str, msg: Msg) -> None:
        reports.append(msg)
        worker_msg(self, address, msg)

    monkeypatch.setattr(Scheduler, "_send_worker", send)
    monkeypatch.setattr(Scheduler, "_worker_msg", received)
    with shoal.LocalCluster(n_workers=1, processes=False) as cluster, shoal.Client(cluster) as c:
        (worker,) = cluster.workers.values()
        state = worker.state
        assert state is not None
        f = c.submit(inc, 1, key="k")
        assert f.result(timeout=30) == 2
        del f
        wait_for(lambda: ("free-keys", "k") in told and "k" not in state.tasks, 10, "k to be freed")
        story = [(t.start, t.finish, t.stimulus_id) for t in state.story("k")]
    (finished,) = [m for m in reports if isinstance(m, TaskFinishedMsg) and m.key == "k"]
    computed, freed = told[("compute-task", "k")], told[("free-keys", "k")]
    assert finished.stimulus_id.startswith("task-finished-k-")
    assert story == [
        ("released", "ready", computed), ("ready", "executing", computed),
        ("executing", "memory", finished.stimulus_id), ("memory", "released", freed),
    ]
