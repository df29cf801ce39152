"""Pausing for memory, on the state machines alone (no IO): a paused worker starts no
task and no fetch; the scheduler places nothing on a paused worker. And the parsing of
memory limits (shoal.worker.memory)."""

from __future__ import annotations

import pytest

from scheduler_harness import Sched, computes, task
from shoal.scheduler.state import WorkerMemoryEvent
from shoal.worker import memory
from shoal.worker.state import MemoryTightEvent, PauseEvent, UnpauseEvent
from worker_harness import Wk, executes, gathers, rejoins


def test_a_paused_worker_starts_no_task_until_it_goes_on() -> None:
    w = Wk(nthreads=1, queued=0)
    assert executes(w.compute("a")) == ["a"]
    w(PauseEvent(w.sid()))
    assert executes(w.compute("b")) == []
    assert executes(w.success("a")) == []  # a thread is free: still nothing starts
    assert w.states() == {"a": "memory", "b": "ready"}
    assert executes(w(UnpauseEvent(w.sid()))) == ["b"]


def test_while_memory_is_tight_no_task_is_handed_ahead() -> None:
    w = Wk(nthreads=1, queued=1)
    out = w(w.compute_event("a"), w.compute_event("b"), w.compute_event("c"), w.compute_event("d"))
    assert executes(out) == ["a", "b"]  # b waits in the pool, ahead
    w(MemoryTightEvent(w.sid(), True))
    # a's result is stored (and spilled) before another task is handed over: b runs,
    # nothing waits behind it
    assert executes(w.success("a")) == []
    assert executes(w.success("b")) == ["c"]
    assert executes(w(MemoryTightEvent(w.sid(), False))) == ["d"]  # ahead again
    w.success("c")
    assert w.states() == {"a": "memory", "b": "memory", "c": "memory", "d": "executing"}


def test_memory_tight_from_the_start_hands_one_task_per_thread() -> None:
    w = Wk(nthreads=2, queued=2)
    w(MemoryTightEvent(w.sid(), True))
    out = w(*[w.compute_event(k) for k in "abcde"])
    assert executes(out) == ["a", "b"]
    assert executes(w(MemoryTightEvent(w.sid(), False))) == ["c", "d"]


def test_a_paused_worker_begins_no_fetch() -> None:
    w = Wk(nthreads=1)
    w(PauseEvent(w.sid()))
    out = w.compute("b", deps={"x": ["tcp://peer:1"]})
    assert gathers(out) == []
    assert w.states()["x"] == "fetch"
    assert [peer for peer, _, _ in gathers(w(UnpauseEvent(w.sid())))] == ["tcp://peer:1"]


def test_a_seceded_task_may_rejoin_while_paused() -> None:
    w = Wk(nthreads=1, queued=0)
    w.compute("a")
    w.secede("a")
    w(PauseEvent(w.sid()))
    assert rejoins(w.rejoin("a")) == ["a"]  # it runs already: it gets its slot back


def _memory(s: Sched, worker: str, paused: bool) -> list:
    return s(WorkerMemoryEvent(s.sid(), worker, {"limit": 100, "process": 90 if paused else 10}, paused))


def test_the_scheduler_places_nothing_on_a_paused_worker() -> None:
    s = Sched()
    s.add_worker("tcp://a:1")
    s.add_worker("tcp://b:1")
    _memory(s, "tcp://a:1", paused=True)
    out = s.submit(*(task(f"t{i}") for i in range(3)))
    assert {w for w, _ in computes(out)} == {"tcp://b:1"}
    assert s.state.workers["tcp://a:1"].memory["process"] == 90


def test_tasks_queued_for_a_paused_cluster_go_out_when_a_worker_goes_on() -> None:
    s = Sched()
    s.add_worker("tcp://a:1")
    _memory(s, "tcp://a:1", paused=True)
    assert computes(s.submit(task("t"))) == []
    assert s.ts("t").state == "queued"
    assert computes(_memory(s, "tcp://a:1", paused=False)) == [("tcp://a:1", "t")]


@pytest.mark.parametrize("text, expected", [
    ("4GiB", 4 * 2**30), ("500 MB", 500_000_000), ("1e6", 1_000_000), ("100", 100), ("2 kib", 2048),
])
def test_sizes_parse(text: str, expected: int) -> None:
    assert memory.parse_bytes(text) == expected
    assert memory.parse_memory_limit(text) == min(expected, memory.system_memory())


@pytest.mark.parametrize("none", [0, None, "0", "none", 0.0])
def test_no_limit(none: object) -> None:
    assert memory.parse_memory_limit(none) is None


def test_auto_and_fractions_come_from_the_hosts_memory() -> None:
    total = memory.system_memory()
    assert memory.parse_memory_limit("auto", n_workers=4) == total // 4
    assert memory.parse_memory_limit(0.5) == int(total * 0.5)
    assert memory.parse_memory_limit(10 * total) == total  # capped


@pytest.mark.parametrize("bad, error", [
    ("lots", ValueError), ("-4GB", ValueError), (-1, ValueError), (float("nan"), ValueError), ("4 parsecs", ValueError), ("inf", ValueError), ("nan", ValueError),
    (float("inf"), ValueError),
    ([1], TypeError), (True, TypeError),
])
def test_bad_limits_are_clear_errors(bad: object, error: type) -> None:
    with pytest.raises(error):
        memory.parse_memory_limit(bad)


def test_thresholds_follow_the_settings() -> None:
    from shoal import config

    with config.set(memory_pause=0.0):
        t = memory.Thresholds.from_config(1000)
    assert (t.target, t.spill, t.pause, t.terminate) == (600, 700, None, 950)


class FullDiskStore:
    """A store whose disk refuses every value (as :class:`WorkerStore` on a full disk)."""

    def __init__(self, managed: int) -> None:
        self.managed = managed
        self.shm_owned = 0
        self.disk_full = True
        self.tries = 0

    def evict(self) -> int:
        self.tries += 1
        return 0


def test_a_full_disk_pauses_only_while_memory_is_past_the_target() -> None:
    from shoal.worker.monitor import MemoryMonitor

    limit = 1000
    t = memory.Thresholds(limit, target=600, spill=700, pause=800, terminate=950)
    store = FullDiskStore(managed=650)  # past the target, below spill
    pauses: list[bool] = []
    m = MemoryMonitor(store, t, own_process=False, pause=pauses.append)
    m.check()
    # the disk is tried again (the store rate-limits it), and refused: paused
    assert store.tries == 1 and pauses == [True]
    m.check()
    assert store.tries == 2 and pauses == [True]
    # values released: memory falls below the target, the disk still full: goes on
    store.managed = 500
    m.check()
    assert pauses == [True, False]
    m.check()
    assert pauses == [True, False] and store.tries == 2  # nothing to spill, nothing to pause for


def test_a_full_disk_with_memory_below_the_target_does_not_pause() -> None:
    from shoal.worker.monitor import MemoryMonitor

    t = memory.Thresholds(1000, target=600, spill=700, pause=800, terminate=950)
    pauses: list[bool] = []
    m = MemoryMonitor(FullDiskStore(managed=100), t, own_process=False, pause=pauses.append)
    m.check()
    assert pauses == []
