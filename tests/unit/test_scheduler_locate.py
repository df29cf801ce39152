"""``locate`` tasks on the scheduler's state (no IO): the barrier of shoal's shuffle runs
on where its inputs are, keeps them while it is held, and runs again when one of them
is lost, so that the outputs assembled after it never miss a split."""

from __future__ import annotations

import pytest
from scheduler_harness import Sched, compute_of, computes, frees, without_user_data

from shoal.scheduler.events import NewTask, RemoveWorkerEvent


def t(key: str, *deps: str, locate: bool = False, on: str | None = None) -> NewTask:
    # (``on``: a preference, as allow_other_workers=True: the worker may go)
    return NewTask(key, f"payload-{key}", list(deps), [on] if on else None, loose_restrictions=True, locate=locate)


def shuffle(s: Sched, n: int = 2) -> list[str]:
    """Splits s0..s(n-1), a barrier L, assemblies a0..a(n-1) (wanted). Each split on
    its own worker w0..w(n-1); returns the workers."""
    workers = [f"w{i}" for i in range(n)]
    for w in workers:
        s.add_worker(w)
    tasks = [t(f"s{i}", on=workers[i]) for i in range(n)] + [t("L", *[f"s{i}" for i in range(n)], locate=True)]
    tasks += [t(f"a{j}", "L") for j in range(n)]
    s.submit(*tasks, wanted=[f"a{j}" for j in range(n)])
    for i in range(n):
        s.finish(s.on(f"s{i}"), f"s{i}", nbytes=1000)
    return workers


def test_the_barrier_is_sent_with_locate_and_where_its_inputs_are():
    s = Sched()
    for w in ("w0", "w1"):
        s.add_worker(w)
    s.submit(t("s0"), t("s1"), t("L", "s0", "s1", locate=True), wanted=["L"])
    s.finish(s.on("s0"), "s0", nbytes=10)
    out = s.finish(s.on("s1"), "s1", nbytes=20)
    inst = compute_of(out, "L")
    assert inst.locate
    assert set(inst.who_has) == {"s0", "s1"} and inst.nbytes == {"s0": 10, "s1": 20}


def test_the_splits_are_kept_while_the_barrier_is_and_freed_with_it():
    s = Sched()
    shuffle(s)
    out = s.finish(s.on("L"), "L")
    assert not frees(out), "the splits stay: the assemblies will read them"
    assert s.states()["s0"] == s.states()["s1"] == "memory"
    s.finish(s.on("a0"), "a0")
    out = s.finish(s.on("a1"), "a1")
    freed = set().union(*frees(out).values())
    assert {"L", "s0", "s1"} <= freed, "the last assembly done: barrier and splits go"
    assert s.states() == {"s0": "released", "s1": "released", "L": "released", "a0": "memory", "a1": "memory"}
    s.release("a0", "a1")
    assert not s.state.tasks and not s.state.locating


def test_a_split_lost_after_the_barrier_makes_the_barrier_run_again():
    s = Sched()
    shuffle(s)
    s.finish(s.on("L"), "L")
    lost, keep = "w1", "w0"
    running = {k: s.on(k) for k in ("a0", "a1")}
    out = s(RemoveWorkerEvent(s.sid(), lost, True))
    # s1 (its worker's only) is made again elsewhere, and the barrier waits for it
    assert s.states()["L"] == "waiting" and s.states()["s0"] == "memory"
    assert s.states()["s1"] in ("waiting", "queued", "processing")
    # an assembly running on the worker left finds the split gone and gives itself back
    for key, worker in running.items():
        if worker == keep:
            s.reschedule(keep, key)
    assert {s.states()[k] for k in ("a0", "a1")} == {"waiting"}
    out = s.finish(s.on("s1"), "s1", nbytes=1000)
    assert compute_of(out, "L").who_has == {"s0": [keep], "s1": [keep]}
    out = s.finish(s.on("L"), "L")
    assert sorted(k for _, k in computes(out)) == ["a0", "a1"]
    s.finish(s.on("a0"), "a0")
    s.finish(s.on("a1"), "a1")
    assert s.states()["a0"] == s.states()["a1"] == "memory"


def test_assemblies_waiting_in_the_queue_wait_for_the_new_barrier():
    s = Sched()
    workers = shuffle(s, 3)
    s.finish(s.on("L"), "L")
    # every worker busy: some assemblies wait in the queue
    states = {k: s.states()[k] for k in ("a0", "a1", "a2")}
    s(RemoveWorkerEvent(s.sid(), "w2", True))
    for k in ("a0", "a1", "a2"):
        assert s.states()[k] in ("waiting", "processing"), (states, s.states())
        if s.states()[k] == "waiting":
            assert s.ts("L") in s.ts(k).waiting_on
    assert s.states()["L"] == "waiting"
    assert workers


def test_a_split_lost_before_the_barrier_ran_is_just_made_again():
    s = Sched()
    for w in ("w0", "w1"):
        s.add_worker(w)
    s.submit(t("s0", on="w0"), t("s1", on="w1"), t("L", "s0", "s1", locate=True), t("a0", "L"), wanted=["a0"])
    where = s.on("s0")
    s.finish(where, "s0")
    out = s(RemoveWorkerEvent(s.sid(), where, True))
    assert "s0" in {k for _, k in computes(out)} or s.states()["s0"] in ("waiting", "queued", "processing")
    assert s.states()["L"] == "waiting"


def test_replay_gives_the_same_instructions():
    s = Sched()
    shuffle(s)
    s.finish(s.on("L"), "L")
    s(RemoveWorkerEvent(s.sid(), "w1", True))
    fresh, out = s.replay()
    assert without_user_data(out) == without_user_data(s.instructions)


def test_both_splits_lost_at_once_relocate_once():
    s = Sched()
    for w in ("w0", "w1"):
        s.add_worker(w)
    s.submit(t("s0", on="w1"), t("s1", on="w1"), t("L", "s0", "s1", locate=True), t("a0", "L"), t("a1", "L"),
             wanted=["a0", "a1"])
    s.finish("w1", "s0")
    s.finish("w1", "s1")
    s.finish(s.on("L"), "L")
    s.add_worker("w2")
    s(RemoveWorkerEvent(s.sid(), "w1", True))
    assert s.states()["L"] == "waiting"
    assert {k for k in ("s0", "s1") if s.states()[k] == "processing"} == {"s0", "s1"}
    for k in ("s0", "s1"):
        s.finish(s.on(k), k)
    out = s.finish(s.on("L"), "L")
    assert sorted(k for _, k in computes(out) if k.startswith("a")) == ["a0", "a1"] or \
        {s.states()["a0"], s.states()["a1"]} <= {"processing", "memory"}


def test_the_outputs_go_where_there_is_room_not_to_the_barriers_holder():
    s = Sched()
    workers = shuffle(s, n=2)
    out = s.finish(s.on("L"), "L")
    # (the barrier's value is where the splits are, all over the cluster)
    assert sorted(s.on(k) for k in ("a0", "a1")) == workers
    assert len(computes(out)) == 2


def test_more_outputs_than_room_wait_in_the_queue_for_whichever_worker_is_free():
    s = Sched()
    for w in ("w0", "w1"):
        s.add_worker(w)
    n = 12
    tasks = [t(f"s{i}", on=f"w{i % 2}") for i in range(2)] + [t("L", "s0", "s1", locate=True)]
    tasks += [t(f"a{j}", "L") for j in range(n)]
    s.submit(*tasks, wanted=[f"a{j}" for j in range(n)])
    for i in range(2):
        s.finish(s.on(f"s{i}"), f"s{i}", nbytes=1000)
    s.finish(s.on("L"), "L")
    sent = [s.on(f"a{j}") for j in range(n) if s.states()[f"a{j}"] == "processing"]
    assert sent.count("w0") == sent.count("w1"), sent


def merge_of_two_shuffles(s: Sched, n: int = 2, projected: bool = False) -> None:
    """Two shuffles of two partitions into ``n`` (splits l0, l1 and r0, r1; barriers
    LL, LR; outputs la0.. and ra0..) and a merge of each pair of outputs (m0..), on
    workers w0 and w1; every split made, no barrier run yet. ``projected``: a task of
    one input after each output (pl0.., pr0..), which the merges join, as dask's
    planner drops the column of output numbers."""
    for w in ("w0", "w1"):
        s.add_worker(w)
    tasks = []
    for side in ("l", "r"):
        tasks += [t(f"{side}{i}", on=f"w{i}") for i in range(2)]
        tasks += [t(f"L{side.upper()}", f"{side}0", f"{side}1", locate=True)]
        tasks += [t(f"{side}a{j}", f"L{side.upper()}") for j in range(n)]
        if projected:
            tasks += [t(f"p{side}{j}", f"{side}a{j}") for j in range(n)]
    above = "p{}{}" if projected else "{}a{}"
    tasks += [t(f"m{j}", above.format("l", j), above.format("r", j)) for j in range(n)]
    s.submit(*tasks, wanted=[f"m{j}" for j in range(n)])
    for key in ("l0", "l1", "r0", "r1"):
        s.finish(s.on(key), key, nbytes=1000)


def test_the_outputs_of_a_merge_go_where_their_other_side_was_assembled():
    """Output j of both sides of a merge is assembled on one worker (the merge of the
    pair then moves nothing), even when that worker is the busier one."""
    s = Sched()
    merge_of_two_shuffles(s)
    s.finish(s.on("LR"), "LR")
    right = {j: s.on(f"ra{j}") for j in range(2)}
    assert sorted(right.values()) == ["w0", "w1"]
    s.finish(right[0], "ra0", nbytes=500)
    s.finish(right[1], "ra1", nbytes=500)
    # the worker that holds ra0 is now the busier one
    s.submit(t("busy", on=right[0]), wanted=["busy"])
    assert s.on("busy") == right[0]
    s.finish(s.on("LL"), "LL")
    assert {j: s.on(f"la{j}") for j in range(2)} == right
    for j in range(2):
        s.finish(right[j], f"la{j}", nbytes=2000)
        assert s.on(f"m{j}") == right[j]


def test_an_output_goes_where_its_other_side_is_still_being_assembled():
    s = Sched()
    merge_of_two_shuffles(s)
    s.finish(s.on("LR"), "LR")
    right = {j: s.on(f"ra{j}") for j in range(2)}
    s.finish(s.on("LL"), "LL")  # the right side's outputs are still running
    assert {j: s.on(f"la{j}") for j in range(2)} == right


def test_outputs_wait_at_their_other_side_past_the_room_of_its_worker():
    """Forty outputs a side on two one-thread workers: the left outputs are sent to the
    workers holding their right outputs, past their room (as a task with a large input
    waits at its holder), never to the other; the rest wait in the queue."""
    s = Sched()
    n = 40
    merge_of_two_shuffles(s, n)
    s.finish(s.on("LR"), "LR")
    held: dict[int, str] = {}
    while len(held) < n:  # the right side's outputs, as workers free threads
        j = next(j for j in range(n) if j not in held and s.states()[f"ra{j}"] == "processing")
        held[j] = s.on(f"ra{j}")
        s.finish(held[j], f"ra{j}", nbytes=4 << 20)
    room = 1 + s.state._ahead_now  # a one-thread worker's room
    s.finish(s.on("LL"), "LL")
    sent = {j: s.on(f"la{j}") for j in range(n) if s.states()[f"la{j}"] == "processing"}
    assert all(sent[j] == held[j] for j in sent), "no output away from its other side"
    # more than a holder takes past its room (2x): they wait there (up to 4x), the rest in the queue
    assert max(list(sent.values()).count(w) for w in ("w0", "w1")) > 2 * room
    assert all(s.states()[f"la{j}"] == "queued" for j in range(n) if j not in sent)


@pytest.mark.parametrize("projected", [False, True])
def test_a_queued_output_takes_its_queued_other_side_along(projected):
    """Both sides' outputs waiting in the queue (more than the workers' room): the
    worker that takes output j of one side from it takes output j of the other too,
    also when a task of one input follows each (dask's planner drops the column of
    output numbers so) and the merge joins those."""
    s = Sched()
    n = 40
    merge_of_two_shuffles(s, n, projected)
    s.finish(s.on("LR"), "LR")
    s.finish(s.on("LL"), "LL")
    where: dict[str, str] = {}
    for _ in range(8 * n):  # workers finish what they run, and take more from the queue
        running = sorted(k for k, st in s.states().items() if st == "processing")
        if not running:
            break
        for key in running:
            if key[1] == "a":
                where.setdefault(key, s.on(key))
        s.finish(s.on(running[0]), running[0], nbytes=4 << 20)
    assert len(where) == 2 * n
    apart = [j for j in range(n) if where[f"la{j}"] != where[f"ra{j}"]]
    assert len(apart) <= n // 10, apart


def test_an_output_finds_its_other_side_through_the_task_after_it():
    """Output j of the right side done, and the task after it (one input) done on the
    same worker: output j of the left side goes there."""
    s = Sched()
    merge_of_two_shuffles(s, projected=True)
    s.finish(s.on("LR"), "LR")
    right = {j: s.on(f"ra{j}") for j in range(2)}
    for j in range(2):
        s.finish(right[j], f"ra{j}", nbytes=500)
        assert s.on(f"pr{j}") == right[j]
        s.finish(right[j], f"pr{j}", nbytes=500)
    s.submit(t("busy", on=right[0]), wanted=["busy"])
    s.finish(s.on("LL"), "LL")
    assert {j: s.on(f"la{j}") for j in range(2)} == right


def test_a_split_lost_while_the_barrier_runs_makes_it_run_again():
    """The barrier's value is where its inputs were when it was sent: if the last
    holder of one goes while it runs, its worker is told to drop it and it runs again
    once the split is made again, on where the splits are then; what the first run
    reports is not taken."""
    s = Sched()
    for w in ("w0", "w1", "w2"):
        s.add_worker(w)
    tasks = [t("s0", on="w0"), t("s1", on="w1"), t("L", "s0", "s1", locate=True)]
    tasks += [t(f"a{j}", "L") for j in range(2)]
    s.submit(*tasks, wanted=["a0", "a1"])
    s.finish("w0", "s0", nbytes=1000)
    s.finish("w1", "s1", nbytes=1000)
    first = s.on("L")
    lost = "w1" if first != "w1" else "w0"
    key = "s1" if lost == "w1" else "s0"
    out = s(RemoveWorkerEvent(s.sid(), lost, True))
    assert s.states()["L"] == "waiting" and s.ts(key) in s.ts("L").waiting_on
    assert "L" in set().union(*frees(out).values()), "its worker drops the run that names the lost holder"
    assert {s.states()[k] for k in ("a0", "a1")} == {"waiting"}
    s.finish(first, "L")  # the first run's report, late: not taken
    assert s.states()["L"] == "waiting"
    out = s.finish(s.on(key), key, nbytes=1000)
    inst = compute_of(out, "L")
    assert lost not in {w for holders in inst.who_has.values() for w in holders}
    s.finish(s.on("L"), "L")
    assert {s.states()[k] for k in ("a0", "a1")} == {"processing"}
