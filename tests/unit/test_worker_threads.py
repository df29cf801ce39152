"""shoal.worker.threads: the task thread pool that a running task may leave
(``secede``) and come back to (``rejoin``). Threads and events, no event loop; every
wait has a deadline."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from shoal.testing import wait_for
from shoal.worker.threads import TaskThreads

DEADLINE = 10.0


@pytest.fixture
def pool() -> Iterator[TaskThreads]:
    p = TaskThreads(1, name="test-task")
    yield p
    p.shutdown()


def test_a_one_thread_pool_runs_in_order_and_one_at_a_time(pool: TaskThreads) -> None:
    order: list[int] = []
    running = threading.Semaphore(1)
    done = threading.Event()

    def job(i: int) -> None:
        assert running.acquire(blocking=False), "two jobs at once"
        order.append(i)
        running.release()
        if i == 4:
            done.set()

    for i in range(5):
        pool.submit(lambda i=i: job(i))
    assert done.wait(DEADLINE)
    assert order == [0, 1, 2, 3, 4]


def test_a_seceded_thread_is_replaced_and_rejoin_retires_one(pool: TaskThreads) -> None:
    seceded = threading.Event()
    other_ran = threading.Event()
    rejoined = threading.Event()
    finish = threading.Event()

    def waits() -> None:
        assert pool.in_pool() and not pool.seceded()
        assert pool.secede() is True
        assert pool.seceded() and pool.secede() is False  # once is enough
        seceded.set()
        assert other_ran.wait(DEADLINE)  # the pool ran another job meanwhile
        assert pool.rejoin() is True and not pool.seceded()
        rejoined.set()
        assert finish.wait(DEADLINE)

    pool.submit(waits)
    assert seceded.wait(DEADLINE)
    pool.submit(other_ran.set)
    assert rejoined.wait(DEADLINE)
    # back to one pool thread: the thread that took the job's place retired
    wait_for(lambda: len(pool.threads) == 1, DEADLINE, "the extra thread to retire")
    after = threading.Event()
    pool.submit(after.set)  # queued behind the rejoined job, on the one thread
    assert not after.wait(0.05)
    finish.set()
    assert after.wait(DEADLINE)


def test_a_seceded_thread_that_does_not_rejoin_ends_with_its_job(pool: TaskThreads) -> None:
    done = threading.Event()

    def job() -> None:
        pool.secede()
        done.set()

    pool.submit(job)
    assert done.wait(DEADLINE)
    wait_for(lambda: len(pool.threads) == 1, DEADLINE, "the seceded thread to end")
    again = threading.Event()
    pool.submit(again.set)
    assert again.wait(DEADLINE)


def test_secede_outside_the_pool_raises_and_rejoin_does_nothing(pool: TaskThreads) -> None:
    with pytest.raises(RuntimeError, match="not a task thread"):
        pool.secede()
    assert pool.rejoin() is False


def test_shutdown_drops_what_has_not_started_and_refuses_more() -> None:
    pool = TaskThreads(1)
    assert not pool.threads  # no thread before the first job
    started, release = threading.Event(), threading.Event()
    ran: list[int] = []

    def blocker() -> None:
        started.set()
        assert release.wait(DEADLINE)

    pool.submit(blocker)
    assert started.wait(DEADLINE)
    pool.submit(lambda: ran.append(1))
    pool.shutdown()
    release.set()
    wait_for(lambda: not pool.threads, DEADLINE, "the pool's threads to end")
    assert ran == []
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(lambda: None)


def test_an_exception_in_a_job_is_logged_and_the_thread_goes_on(pool: TaskThreads,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    done = threading.Event()

    def boom() -> None:
        raise ZeroDivisionError("boom")

    pool.submit(boom)
    pool.submit(done.set)
    assert done.wait(DEADLINE)
    assert "ZeroDivisionError: boom" in caplog.text
