"""The scheduler's state across hosts (no IO): which segment each host is handed, and
which worker of a host fetches a value from another host first, so that the value
crosses to a host once however many of its workers read it."""

from __future__ import annotations

from scheduler_harness import Sched, compute_of, task
from shoal.scheduler.state import AddWorkerEvent


def test_each_host_is_handed_a_segment_of_its_own_host(s: Sched) -> None:
    from shoal.scheduler.state import ReplicaAddedEvent, TaskFinishedEvent

    for address, host in (("a1", "A"), ("a2", "A"), ("b1", "B"), ("b2", "B"), ("b3", "B")):
        s(AddWorkerEvent(s.sid(), address, 1, host))
    made, kept, also = ["seg-a1"], ["seg-b1"], ["seg-b2"]
    s.submit(task("x", workers=["a1"]), wanted=["x"])
    s(TaskFinishedEvent(s.sid(), "a1", "x", 1 << 25, shm=made))
    # b1 read x over tcp and keeps it in a segment of host B
    s.submit(task("r1", "x", workers=["b1"]))
    assert s(ReplicaAddedEvent(s.sid(), "b1", "x", kept)) == []
    assert {ws.address for ws in s.ts("x").who_has} == {"a1", "b1"}
    out = s.submit(task("r2", "x", workers=["b2"]), task("r3", "x", workers=["a2"]))
    assert compute_of(out, "r2").shm == {"x": kept} and compute_of(out, "r3").shm == {"x": made}
    # a second copy on host B: the first one is handed out while its owner holds it...
    s(ReplicaAddedEvent(s.sid(), "b2", "x", also))
    out = s.submit(task("r4", "x", workers=["b3"]))
    assert compute_of(out, "r4").shm == {"x": kept}
    # ...then the next one
    s.remove_worker("b1")
    assert s.ts("x").shm == {"a1": made, "b2": also}
    out = s.submit(task("r5", "x", workers=["b3"]))
    assert compute_of(out, "r5").shm == {"x": also}


def test_a_hosts_later_readers_ask_its_fetcher_first_so_a_value_crosses_once(s: Sched) -> None:
    from shoal.scheduler.state import ReplicaAddedEvent, RemoveWorkerEvent, TaskFinishedEvent

    for address, host in (("a1", "A"), ("a2", "A"), ("b1", "B"), ("b2", "B"), ("b3", "B"), ("c1", "C")):
        s(AddWorkerEvent(s.sid(), address, 1, host))
    s.submit(task("x", workers=["a1"]), wanted=["x"])
    s(TaskFinishedEvent(s.sid(), "a1", "x", 1 << 25, shm=["seg-a1"]))
    # two readers on host B at once: the first fetches from a1, the second asks it first
    out = s.submit(task("r1", "x", workers=["b1"]), task("r2", "x", workers=["b2"]))
    assert compute_of(out, "r1").who_has == {"x": ["a1"]}
    assert compute_of(out, "r2").who_has == {"x": ["b1", "a1"]}
    # host A holds it: a reader there asks the holder of its host; host C has a fetcher of its own
    out = s.submit(task("r3", "x", workers=["a2"]), task("r4", "x", workers=["c1"]))
    assert compute_of(out, "r3").who_has == {"x": ["a1"]} and compute_of(out, "r4").who_has == {"x": ["a1"]}
    # the fetcher left before it had the value: the next reader of host B fetches it itself
    s(RemoveWorkerEvent(s.sid(), "b1"))
    out = s.submit(task("r5", "x", workers=["b3"]))
    assert compute_of(out, "r5").who_has == {"x": ["a1"]}
    # once host B holds it, its holder is asked first (and its segment handed out)
    s(ReplicaAddedEvent(s.sid(), "b3", "x", ["seg-b3"]))
    out = s.submit(task("r6", "x", workers=["b2"]))
    assert compute_of(out, "r6").who_has == {"x": ["b3", "a1"]} and compute_of(out, "r6").shm == {"x": ["seg-b3"]}
    s.state.validate()


def test_the_scheduler_and_the_workers_agree_on_what_is_kept_for_a_host() -> None:
    from shoal.comm.shm_family import TRANSFER_MIN_BYTES
    from shoal.scheduler.transitions import HOST_COPY_MIN_BYTES

    assert HOST_COPY_MIN_BYTES == TRANSFER_MIN_BYTES


def test_small_values_have_no_fetcher(s: Sched) -> None:
    from shoal.scheduler.state import TaskFinishedEvent

    for address, host in (("a1", "A"), ("b1", "B"), ("b2", "B")):
        s(AddWorkerEvent(s.sid(), address, 1, host))
    s.submit(task("x", workers=["a1"]), wanted=["x"])
    s(TaskFinishedEvent(s.sid(), "a1", "x", 1000))  # not kept for a host: crossing again is cheap
    out = s.submit(task("r1", "x", workers=["b1"]), task("r2", "x", workers=["b2"]))
    assert compute_of(out, "r1").who_has == compute_of(out, "r2").who_has == {"x": ["a1"]}
