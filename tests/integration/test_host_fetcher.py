"""A worker asked for a value it is fetching itself answers once it has it: the
scheduler names the first worker of a host that fetches a large value from another host
to that host's later readers (docs/protocol.md §7.2, §8.1), and they ask it first.
Across real hosts in tests/hosts/test_three_hosts.py; here, in one process, the waiting
itself: the holder's answer to the fetcher is held back until the test lets it go."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest

import shoal
from shoal import config
from shoal.comm import connect
from shoal.testing import wait_for
from shoal.worker.server import Worker

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """``get-data`` from the worker at ``held["address"]`` waits until ``held["go"]``."""
    out: dict[str, Any] = {"address": None, "go": threading.Event()}
    get_data = Worker.get_data

    def holding(self: Worker, comm: Any, keys: list[Any], host_fetch: bool = False) -> Any:
        if self.address != out["address"] or out["go"].is_set():
            return get_data(self, comm, keys, host_fetch)

        async def later() -> Any:
            await asyncio.get_running_loop().run_in_executor(None, out["go"].wait, 30)
            answer = get_data(self, comm, keys, host_fetch)
            return await answer if asyncio.iscoroutine(answer) else answer

        return later()

    monkeypatch.setattr(Worker, "get_data", holding)
    answered.clear()
    yield out
    out["go"].set()
    answered.set()


def ask(address: str, key: Any, host_fetch: bool = True) -> dict[str, Any]:
    """A peer's ``get-data`` for ``key``, answered (as a worker of the same host asks,
    or with ``host_fetch=False`` as a client does)."""

    async def main() -> dict[str, Any]:
        comm = await connect(address)
        try:
            await comm.write({"op": "get-data", "reply": True, "keys": [key], "host_fetch": host_fetch})
            return dict(await comm.read())
        finally:
            await comm.close()

    return asyncio.run(main())


answered = threading.Event()


def total(xs: list[int]) -> int:
    answered.wait(30)  # holds the fetched value here until the asker has its answer
    return sum(xs)


def _fetching(fetcher: Worker, key: Any) -> bool:
    assert fetcher.state is not None
    t = fetcher.state.tasks.get(key)
    return t is not None and t.state == "flight"


@contextlib.contextmanager
def fetch_under_way(held: dict[str, Any]) -> Iterator[tuple[Worker, Any, Any]]:
    """Two in-process workers: a list scattered to the holder, and a task on the
    fetcher that needs it, whose fetch is under way (the holder's answer held back);
    yields ``(fetcher, the list's future, the task's)``."""
    with shoal.LocalCluster(n_workers=2, processes=False, dashboard_address=None) as cluster, \
            shoal.Client(cluster) as c:
        holder, fetcher = cluster.workers.values()
        held["address"] = holder.address
        [x] = c.scatter([list(range(100))], workers=[holder.address])
        y = c.submit(total, x, workers=[fetcher.address])
        wait_for(lambda: _fetching(fetcher, x.key), 10, "the fetch to be under way")
        yield fetcher, x, y


def test_a_worker_answers_for_a_value_it_is_fetching_once_it_has_it(held: dict[str, Any]) -> None:
    with fetch_under_way(held) as (fetcher, x, y):
        answer: dict[str, Any] = {}
        asking = threading.Thread(target=lambda: answer.update(ask(fetcher.address, x.key)))
        asking.start()
        # the request waits for the fetch; once the holder answers, so does the fetcher
        wait_for(lambda: fetcher._awaited, 10, "the request to wait")
        assert not answer
        held["go"].set()
        asking.join(30)
        answered.set()
        assert answer["status"] == "OK" and answer["result"]["data"] == {x.key: list(range(100))}
        assert y.result(timeout=30) == 4950


def test_without_the_value_in_time_it_answers_with_what_it_has(held: dict[str, Any]) -> None:
    with config.set(host_fetch_wait=0.2), fetch_under_way(held) as (fetcher, x, y):
        # the asker gets no value (it would fetch from another holder) and nothing breaks
        assert ask(fetcher.address, x.key) == {"status": "OK", "result": {"data": {}}}
        answered.set()
        held["go"].set()
        assert y.result(timeout=30) == 4950


def test_a_worker_asked_before_it_hears_of_the_value_waits_for_its_task(held: dict[str, Any]) -> None:
    # the scheduler's compute-task to the fetcher can come after its peer's request
    with shoal.LocalCluster(n_workers=2, processes=False, dashboard_address=None) as cluster, \
            shoal.Client(cluster) as c:
        holder, fetcher = cluster.workers.values()
        held["address"] = holder.address
        [x] = c.scatter([list(range(100))], workers=[holder.address])
        answer: dict[str, Any] = {}
        asking = threading.Thread(target=lambda: answer.update(ask(fetcher.address, x.key)))
        asking.start()
        wait_for(lambda: fetcher._awaited, 10, "the request to wait")
        y = c.submit(total, x, workers=[fetcher.address])
        wait_for(lambda: _fetching(fetcher, x.key), 10, "the fetch to be under way")
        assert not answer  # heard of now, and being fetched: the request waits on
        held["go"].set()
        asking.join(30)
        answered.set()
        assert answer["status"] == "OK" and answer["result"]["data"] == {x.key: list(range(100))}
        assert y.result(timeout=30) == 4950


def test_a_value_it_never_hears_of_is_answered_without_after_the_grace() -> None:
    with config.set(host_fetch_grace=0.2), \
            shoal.LocalCluster(n_workers=1, processes=False, dashboard_address=None) as cluster:
        (worker,) = cluster.workers.values()
        assert ask(worker.address, "nobody-has-this") == {"status": "OK", "result": {"data": {}}}
        assert not worker._awaited


def test_a_request_that_is_no_host_fetch_is_answered_at_once() -> None:
    # a client's get-data (no host_fetch) for a key the worker does not know: were it
    # to wait for the grace, the test's timeout would end it first
    with config.set(host_fetch_grace=3600, host_fetch_wait=3600), \
            shoal.LocalCluster(n_workers=1, processes=False, dashboard_address=None) as cluster:
        (worker,) = cluster.workers.values()
        assert ask(worker.address, "nobody", host_fetch=False) == {"status": "OK", "result": {"data": {}}}
        assert not worker._awaited


def test_a_value_it_forgot_is_answered_without_at_once() -> None:
    # a peer of its host whose holders are out of date asks for a value this worker
    # has released: nothing is coming, so no grace (an hour here: the test's timeout
    # would end a wait first)
    with config.set(host_fetch_grace=3600, host_fetch_wait=3600), \
            shoal.LocalCluster(n_workers=1, processes=False, dashboard_address=None) as cluster, \
            shoal.Client(cluster) as c:
        (worker,) = cluster.workers.values()
        assert worker.state is not None
        f = c.submit(sum, [1, 2], key="forgotten")
        assert f.result(timeout=30) == 3
        del f
        wait_for(lambda: "forgotten" not in worker.state.tasks, 10, "the worker to release it")
        assert "forgotten" in worker.state.released
        assert ask(worker.address, "forgotten") == {"status": "OK", "result": {"data": {}}}
        assert not worker._awaited
