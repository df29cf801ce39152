"""Payload languages (protocol §4.6, §7.1): a task runs only on a worker that declared
its language; one that no worker can run waits, queued, until such a worker joins."""

from __future__ import annotations


from scheduler_harness import Sched, computes, task


def test_tasks_go_only_to_workers_of_their_language(s: Sched) -> None:
    s.add_worker("py", nthreads=4)
    s.add_worker("js", nthreads=4, languages=("js",))
    out = s.submit(task("make"), task("scale", "make", language="js"), task("more"), wanted=["scale", "more"])
    assert sorted(computes(out)) == [("py", "make"), ("py", "more")]
    out = s.finish("py", "make")
    assert computes(out) == [("js", "scale")]
    s.finish("js", "scale")
    # and back: a Python task on the JS task's result runs on the Python worker
    out = s.submit(task("check", "scale"))
    assert computes(out) == [("py", "check")]


def test_a_task_no_worker_can_run_waits_until_one_joins(s: Sched) -> None:
    s.add_worker("py")
    out = s.submit(task("scale", language="js"))
    assert computes(out) == [] and s.ts("scale").state == "queued"
    out = s.add_worker("js", languages=("js",))
    assert computes(out) == [("js", "scale")]


def test_a_worker_of_many_languages_runs_each(s: Sched) -> None:
    s.add_worker("both", nthreads=2, languages=("js", "python"))
    out = s.submit(task("a"), task("b", language="js"))
    assert sorted(computes(out)) == [("both", "a"), ("both", "b")]


def test_python_tasks_wait_when_only_foreign_workers_remain(s: Sched) -> None:
    s.add_worker("js", nthreads=2, languages=("js",))
    out = s.submit(task("a"))
    assert computes(out) == [] and s.ts("a").state == "queued"
    out = s.add_worker("py")
    assert computes(out) == [("py", "a")]


def test_losing_the_only_worker_of_a_language_requeues_its_tasks(s: Sched) -> None:
    s.add_worker("py")
    s.add_worker("js1", languages=("js",))
    s.submit(task("x", language="js"))
    assert s.ts("x").processing_on.address == "js1"
    out = s.remove_worker("js1")
    assert computes(out) == [] and s.ts("x").state == "queued"  # never on the Python worker
    assert s.state.non_python_workers == 0
    out = s.add_worker("js2", languages=("js",))
    assert computes(out) == [("js2", "x")]


def test_workers_named_by_a_task_must_still_run_its_language(s: Sched) -> None:
    s.add_worker("py")
    s.add_worker("js", languages=("js",))
    out = s.submit(task("x", workers=["py"], language="js"))
    assert computes(out) == [] and s.ts("x").state == "queued"


def test_a_worker_of_another_language_does_not_look_through_a_queue_it_cannot_run(s: Sched, monkeypatch) -> None:
    # (each look was O(queue) per event: 5,000 Python tasks beside an idle JS worker ran
    # at 140 tasks/s instead of 3,000)
    s.add_worker("py")
    s.add_worker("js", languages=("js",))
    s.submit(*[task(f"t{i}") for i in range(50)])
    assert sum(t.state == "queued" for t in s.state.tasks.values()) > 40
    looks: list[str] = []
    original, validate = type(s.state)._may_run, type(s.state).validate
    validating = [False]

    def may_run(self, ts, ws):
        if not validating[0]:  # (the harness's validate() looks at every pair)
            looks.append(ws.address)
        return original(self, ts, ws)

    def validated(self):
        validating[0] = True
        try:
            validate(self)
        finally:
            validating[0] = False

    monkeypatch.setattr(type(s.state), "_may_run", may_run)
    monkeypatch.setattr(type(s.state), "validate", validated)
    placed = 0
    for _ in range(10):
        key = next(t.key for t in s.state.tasks.values() if t.state == "processing")
        placed += len(computes(s.finish("py", key)))
    # one look per task placed (choosing among the workers), none per task in the queue
    assert placed >= 10 and looks.count("js") <= placed
    queued = sum(t.state == "queued" for t in s.state.tasks.values())
    assert queued > 20 and s.state.queued_languages == {"python": queued}
