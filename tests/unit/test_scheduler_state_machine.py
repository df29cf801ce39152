"""A hypothesis state machine over SchedulerState: random plausible event sequences,
``validate()`` after each step, liveness and cleanliness at the end."""

from __future__ import annotations

import itertools
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from scheduler_harness import Sched, msgs, without_user_data

from shoal.scheduler.state import (
    AddWorkerEvent,
    CancelKeysEvent,
    CheckLivenessEvent,
    ClientMsg,
    CloseWorkerStream,
    ComputeTask,
    FreeKeys,
    HeartbeatEvent,
    MissingDataEvent,
    NewTask,
    ReleaseKeysEvent,
    RemoveClientEvent,
    RemoveWorkerEvent,
    RescheduleEvent,
    TaskErredEvent,
    TaskFinishedEvent,
    TaskState,
    UpdateDataEvent,
    UpdateGraphEvent,
)


class SchedulerMachine(RuleBasedStateMachine):
    """Random plausible event sequences; ``validate()`` after each; at the end, with all
    workers staying and every processing task finished, every wanted key is in memory
    or erred, and releasing everything leaves nothing behind."""

    CLIENTS = ("c1", "c2")

    def __init__(self) -> None:
        super().__init__()
        self.h = Sched(ahead=1, worker_ttl=5.0)
        self.now = 0.0
        self.worker_ids = itertools.count()
        self.key_ids = itertools.count()
        #: worker -> keys the model believes it holds (to tell the scheduler truthfully)
        self.sent: list[ComputeTask] = []

    def apply(self, *events: Any) -> list[Any]:
        out = self.h(*events)
        workers = self.h.state.workers
        for n, inst in enumerate(out):
            if isinstance(inst, ComputeTask):
                assert inst.worker in workers
                for dep, holders in inst.who_has.items():
                    assert holders, f"{inst.key} sent with no holder for {dep}"
                ts = self.h.state.tasks.get(inst.key)
                if ts is None or ts.state != "processing" or ts.processing_on.address != inst.worker:
                    # sent, then found unneeded within the same batch: it must be taken back
                    assert any(isinstance(i, FreeKeys) and i.worker == inst.worker and inst.key in i.keys
                               for i in out[n + 1:]), inst
            elif isinstance(inst, ClientMsg) and inst.msg["op"] == "key-in-memory":
                assert self.h.state.tasks[inst.msg["key"]].state == "memory"
        return out

    def pick(self, items: list[Any], i: int) -> Any:
        return sorted(items, key=repr)[i % len(items)]

    def processing(self) -> list[TaskState]:
        return [ts for ts in self.h.state.tasks.values() if ts.state == "processing"]

    @initialize(n=st.integers(1, 3))
    def start(self, n: int) -> None:
        for _ in range(n):
            self.add_worker(nthreads=1)

    @rule(nthreads=st.integers(1, 3))
    def add_worker(self, nthreads: int) -> None:
        self.apply(AddWorkerEvent(self.h.sid(), f"w{next(self.worker_ids)}", nthreads))

    @precondition(lambda self: self.h.state.workers)
    @rule(i=st.integers(0, 100), crashed=st.booleans())
    def remove_worker(self, i: int, crashed: bool) -> None:
        self.apply(RemoveWorkerEvent(self.h.sid(), self.pick(list(self.h.state.workers), i), crashed))

    @precondition(lambda self: self.h.state.workers)
    @rule(i=st.integers(0, 100))
    def heartbeat(self, i: int) -> None:
        self.apply(HeartbeatEvent(self.h.sid(), self.pick(list(self.h.state.workers), i), self.now))

    @rule(dt=st.sampled_from([0.5, 3.0, 6.0]))
    def tick(self, dt: float) -> None:
        """Time passes: workers silent for longer than the ttl go, as if they died."""
        self.now += dt
        before = set(self.h.state.workers)
        out = self.apply(CheckLivenessEvent(self.h.sid(), self.now))
        gone = {i.worker for i in out if isinstance(i, CloseWorkerStream)}
        assert gone == before - set(self.h.state.workers)

    @rule(
        client=st.sampled_from(CLIENTS),
        shape=st.lists(
            st.tuples(st.lists(st.integers(0, 100), max_size=3), st.integers(0, 9), st.integers(0, 3), st.booleans()),
            min_size=1, max_size=6),
        resubmit=st.lists(st.integers(0, 100), max_size=2),
    )
    def submit(self, client: str, shape: list[tuple[list[int], int, int, bool]], resubmit: list[int]) -> None:
        existing = sorted(self.h.state.tasks, key=repr)
        keys: list[Any] = []
        tasks: list[NewTask] = []
        for dep_idx, restrict, retries, _ in shape:
            key = f"k{next(self.key_ids)}"
            pool = existing + keys
            deps = sorted({pool[i % len(pool)] for i in dep_idx}) if pool else []
            workers = None
            if restrict == 0 and self.h.state.workers:
                workers = [self.pick(list(self.h.state.workers), dep_idx[0] if dep_idx else 0)]
            elif restrict == 1:
                workers = ["w-none"]
            # restrict 2: a task that may run only once (it errs rather than run again)
            tasks.append(NewTask(key, f"payload-{key}", deps, workers, retries if retries < 2 else 0,
                                 once="once" if restrict == 2 else ""))
            keys.append(key)
        wanted = [t.key for t, (_, _, _, w) in zip(tasks, shape, strict=True) if w] or [keys[-1]]
        if existing:
            for i in resubmit:
                k = existing[i % len(existing)]
                tasks.append(NewTask(k, f"payload-{k}", [], None, 0))
                wanted.append(k)
        self.apply(UpdateGraphEvent(self.h.sid(), client, tasks, wanted))

    @rule(client=st.sampled_from(CLIENTS), cycle=st.booleans())
    def submit_bad_graph(self, client: str, cycle: bool) -> None:
        before = self.h.states()
        k = f"bad{next(self.key_ids)}"
        tasks = [NewTask(k, "p", [k + "-b"]), NewTask(k + "-b", "p", [k] if cycle else ["ghost"])]
        out = self.apply(UpdateGraphEvent(self.h.sid(), client, tasks, [k]))
        assert [m["kind"] for _, m in msgs(out)] == ["GraphError"]
        assert self.h.states() == before

    @precondition(lambda self: self.processing())
    @rule(i=st.integers(0, 100), nbytes=st.integers(0, 1000), fetched=st.booleans(),
          duration=st.sampled_from([0.0, 0.0001, 0.01]))
    def finish(self, i: int, nbytes: int, fetched: bool = False, duration: float = 0.0) -> None:
        ts = self.pick(self.processing(), i)
        if not fetched and any(d.state != "memory" for d in ts.dependencies):
            # its worker cannot get an input that was lost meanwhile: it gives the task back
            # (unless it had fetched the input before: then it finishes)
            self.apply(RescheduleEvent(self.h.sid(), ts.processing_on.address, ts.key))
        else:
            # short tasks make the scheduler hand out more at once (adaptive look-ahead)
            self.apply(TaskFinishedEvent(self.h.sid(), ts.processing_on.address, ts.key, nbytes, duration))

    @precondition(lambda self: self.processing())
    @rule(i=st.integers(0, 100))
    def err(self, i: int) -> None:
        ts = self.pick(self.processing(), i)
        self.apply(TaskErredEvent(self.h.sid(), ts.processing_on.address, ts.key, "exc", "tb", "Boom: x"))

    @precondition(lambda self: self.processing())
    @rule(i=st.integers(0, 100))
    def reschedule(self, i: int) -> None:
        ts = self.pick(self.processing(), i)
        self.apply(RescheduleEvent(self.h.sid(), ts.processing_on.address, ts.key))

    @precondition(lambda self: self.h.state.tasks)
    @rule(client=st.sampled_from(CLIENTS), idx=st.lists(st.integers(0, 100), min_size=1, max_size=3))
    def release(self, client: str, idx: list[int]) -> None:
        keys = list(self.h.state.tasks)
        self.apply(ReleaseKeysEvent(self.h.sid(), client, [self.pick(keys, i) for i in idx]))

    @precondition(lambda self: self.h.state.tasks)
    @rule(client=st.sampled_from(CLIENTS), i=st.integers(0, 100))
    def cancel(self, client: str, i: int) -> None:
        self.apply(CancelKeysEvent(self.h.sid(), client, [self.pick(list(self.h.state.tasks), i)]))

    @precondition(lambda self: any(ts.state == "memory" for ts in self.h.state.tasks.values()))
    @rule(i=st.integers(0, 100), j=st.integers(0, 100), k=st.integers(-1, 100))
    def missing_data(self, i: int, j: int, k: int) -> None:
        # the holder itself (k < 0) or any worker, sent to fetch it or not, says so
        ts = self.pick([t for t in self.h.state.tasks.values() if t.state == "memory"], i)
        ws = self.pick(list(ts.who_has), j)
        by = ws.address if k < 0 else self.pick(sorted(self.h.state.workers), k)
        self.apply(MissingDataEvent(self.h.sid(), ts.key, ws.address, by))

    @precondition(lambda self: self.h.state.workers)
    @rule(client=st.sampled_from(CLIENTS), i=st.integers(0, 100), existing=st.booleans())
    def scatter(self, client: str, i: int, existing: bool) -> None:
        w = self.pick(list(self.h.state.workers), i)
        keys = list(self.h.state.tasks)
        key = self.pick(keys, i) if existing and keys else f"s{next(self.key_ids)}"
        self.apply(UpdateDataEvent(self.h.sid(), client, {key: [w]}, {key: 10}))

    @rule(client=st.sampled_from(CLIENTS))
    def remove_client(self, client: str) -> None:
        self.apply(RemoveClientEvent(self.h.sid(), client))

    @rule()
    def unknown_keys(self) -> None:
        before = self.h.states()
        w = next(iter(self.h.state.workers), "w-none")
        self.apply(TaskErredEvent(self.h.sid(), w, "ghost"), ReleaseKeysEvent(self.h.sid(), "c1", ["ghost"]),
                   MissingDataEvent(self.h.sid(), "ghost", w), RescheduleEvent(self.h.sid(), w, "ghost"))
        assert self.h.states() == before

    @invariant()
    def valid(self) -> None:
        self.h.state.validate()
        assert self.h.state.payload_deserializations == 0

    def teardown(self) -> None:
        state = self.h.state
        if not state.workers:
            self.add_worker(nthreads=2)
        for _ in range(10_000):
            todo = self.processing()
            if not todo:
                break
            self.finish(0, 1)
        else:
            raise AssertionError("the graph never finished")
        stuck = {k: ts.state for k, ts in state.tasks.items() if ts.state in ("waiting", "queued", "processing")}
        assert not stuck, f"nothing runs but tasks still wait: {stuck}"
        for ts in state.tasks.values():
            if ts.who_wants:
                assert ts.state in ("memory", "erred"), ts
        for client in self.CLIENTS:
            self.apply(RemoveClientEvent(self.h.sid(), client))
        assert state.tasks == {}, f"left behind: {state.tasks}"
        assert all(not ws.has_what and ws.nbytes == 0 and not ws.processing for ws in state.workers.values())
        # the log replays the run: a fresh state fed the logged events (user data
        # dropped) returns the same instructions and ends the same
        fresh, replayed = self.h.replay()
        assert without_user_data(replayed) == without_user_data(self.h.instructions)
        assert fresh.tasks == {} and sorted(fresh.workers) == sorted(state.workers)
        assert fresh.story() == [] and list(fresh.log.transitions) == list(state.log.transitions)


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
