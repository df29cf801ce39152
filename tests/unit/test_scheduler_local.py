"""``local`` on ``compute-task`` (the scheduler's state, no IO): a value whose one
dependent has no other input will be read only where it is made, so its worker need
not place it in shared memory for the host; every other value is placed as before."""

from __future__ import annotations

from scheduler_harness import Sched, compute_of

from shoal.scheduler.events import NewTask


def t(key: str, *deps: str, locate: bool = False) -> NewTask:
    return NewTask(key, f"payload-{key}", list(deps), locate=locate)


def test_the_links_of_a_chain_are_local_and_the_value_a_client_waits_for_is_not():
    s = Sched()
    s.add_worker("w0")
    out = s.submit(t("a"), t("b", "a"), t("c", "b"), wanted=["c"])
    assert compute_of(out, "a").local
    assert compute_of(s.finish("w0", "a"), "b").local
    assert not compute_of(s.finish("w0", "b"), "c").local, "a client waits for it: it may fetch it"


def test_a_value_with_two_dependents_or_feeding_a_task_with_other_inputs_is_placed():
    s = Sched()
    s.add_worker("w0", nthreads=4)
    # a: two dependents; b and c: one each, which reads the other too (it may be made
    # elsewhere, and the task may run there)
    out = s.submit(t("a"), t("x", "a"), t("y", "a"), t("b"), t("c"), t("m", "b", "c"), wanted=["x", "y", "m"])
    assert not any(compute_of(out, k).local for k in ("a", "b", "c"))


def test_a_value_a_client_holds_is_not_local_even_in_a_chain():
    s = Sched()
    s.add_worker("w0")
    out = s.submit(t("a"), t("b", "a"), wanted=["a", "b"])
    assert not compute_of(out, "a").local


def test_the_input_of_a_shuffle_barrier_is_placed():
    s = Sched()
    s.add_worker("w0")
    out = s.submit(t("s0"), t("L", "s0", locate=True), t("a0", "L"), wanted=["a0"])
    # (the barrier reads where its one split is, and the assemblies map it from there)
    assert not compute_of(out, "s0").local
