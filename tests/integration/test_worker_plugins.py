"""Worker plugins, written as a dask.distributed user writes them: a ``WorkerPlugin``
subclass registered with ``client.register_plugin``; every worker gets a copy of its
own (and workers that join later do too), ``setup`` runs there, ``transition`` hears
each change of a key's state, ``teardown`` runs when the worker closes or the plugin is
removed; what a plugin raises is logged and the worker goes on."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest

import shoal
from shoal import WorkerPlugin
from shoal.scheduler.server import Scheduler
from shoal.worker.server import Worker

pytestmark = pytest.mark.timeout(60)


def inc(x: int) -> int:
    return x + 1


class Recorder(WorkerPlugin):
    name = "recorder"

    def __init__(self) -> None:
        self.worker: Any = None
        self.transitions: list[tuple[Any, str, str]] = []
        self.torn_down = False

    def setup(self, worker: Any) -> None:
        self.worker = worker

    def transition(self, key: Any, start: str, finish: str, **kwargs: Any) -> None:
        assert kwargs["stimulus_id"]
        self.transitions.append((key, start, finish))

    def teardown(self, worker: Any) -> None:
        self.torn_down = True


class FailsEverywhere(WorkerPlugin):
    name = "fails"

    def setup(self, worker: Any) -> None:
        worker.fails_setup_ran = True

    def transition(self, key: Any, start: str, finish: str, **kwargs: Any) -> None:
        raise RuntimeError("a broken plugin")


class SetupFails(WorkerPlugin):
    name = "setup-fails"

    def setup(self, worker: Any) -> None:
        raise ZeroDivisionError("setup failed")


class AsyncSetup(WorkerPlugin):
    name = "async-setup"

    async def setup(self, worker: Any) -> None:
        worker.async_setup_ran = True


class Counting(WorkerPlugin):
    """Counts its setups in the worker (each worker has its own copy of the plugin)."""

    name = "counting"

    def setup(self, worker: Any) -> None:
        worker.counting_setups = getattr(worker, "counting_setups", 0) + 1


def recorded(dask_worker: Any) -> list[tuple[Any, str, str]]:
    plugin = dask_worker.plugins["recorder"]
    assert plugin.worker is dask_worker
    return [t for t in plugin.transitions if t[0] == "plugged-x"]


def attribute(name: str, dask_worker: Any) -> Any:
    return getattr(dask_worker, name, None)


def test_register_plugin_sets_up_every_worker_and_hears_transitions(client: shoal.Client) -> None:
    replies = client.register_plugin(Recorder())
    assert sorted(replies) == sorted(client.scheduler_info()["workers"])
    assert client.submit(inc, 1, key="plugged-x").result(timeout=30) == 2
    stories = client.run(recorded)
    ran = [s for s in stories.values() if s]
    assert len(ran) == 1, stories  # the worker that ran it
    assert ran[0][:3] == [("plugged-x", "released", "ready"), ("plugged-x", "ready", "executing"),
                          ("plugged-x", "executing", "memory")]
    client.unregister_worker_plugin("recorder")
    assert all(p is None for p in client.run(lambda dask_worker: dask_worker.plugins.get("recorder")).values())


def test_a_plugin_that_raises_is_logged_and_tasks_go_on(client: shoal.Client) -> None:
    client.register_plugin(FailsEverywhere())
    try:
        assert client.submit(inc, 41, pure=False).result(timeout=30) == 42
        assert all(client.run(attribute, "fails_setup_ran").values())
    finally:
        client.unregister_worker_plugin("fails")


def test_a_setup_that_raises_fails_register_plugin(client: shoal.Client) -> None:
    with pytest.raises(ZeroDivisionError, match="setup failed"):
        client.register_plugin(SetupFails())
    client.unregister_worker_plugin("setup-fails")
    assert client.submit(inc, 1, pure=False).result(timeout=30) == 2


def test_async_setup_and_idempotent_registration(client: shoal.Client) -> None:
    client.register_plugin(AsyncSetup())
    assert all(client.run(attribute, "async_setup_ran").values())
    client.register_plugin(Counting(), idempotent=True)
    assert client.register_plugin(Counting(), idempotent=True) == {}  # kept: not sent again
    assert set(client.run(attribute, "counting_setups").values()) == {1}
    client.unregister_worker_plugin("counting")
    client.unregister_worker_plugin("async-setup")


def test_a_plugin_that_cannot_be_pickled_fails_at_register(client: shoal.Client) -> None:
    plugin = Recorder()
    plugin.lock = threading.Lock()  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match="recorder.*cannot be pickled"):
        client.register_plugin(plugin)
    with pytest.raises(ValueError, match="does not exist"):
        client.unregister_worker_plugin("recorder")


async def test_workers_that_join_later_get_the_plugin_and_tear_it_down(caplog: pytest.LogCaptureFixture) -> None:
    scheduler = Scheduler()
    await scheduler.start("inproc://")
    first = Worker(scheduler.address, name="first")
    await first.start()
    later = Worker(scheduler.address, name="later")
    try:
        async with shoal.Client(scheduler.address, asynchronous=True) as client:
            await client.register_plugin(Recorder())
            await later.start()
            assert await client.submit(inc, 1, key="plugged-x", workers=[later.address]) == 2
            plugin = later.plugins["recorder"]
            assert plugin.worker is later and plugin is not first.plugins["recorder"]  # a copy each
            assert ("plugged-x", "executing", "memory") in plugin.transitions
            # a plugin added on the worker itself; one of the same name replaces it
            mine = Recorder()
            await later.add_plugin(mine)
            assert later.plugins["recorder"] is mine and plugin.torn_down
    finally:
        await later.close()
        await first.close()
        await scheduler.close()
    assert mine.torn_down  # the worker closed


async def test_a_plugin_error_on_the_worker_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    scheduler = Scheduler()
    await scheduler.start("inproc://")
    worker = Worker(scheduler.address)
    await worker.start()
    try:
        with caplog.at_level(logging.ERROR, logger="shoal.worker"):
            await worker.add_plugin(FailsEverywhere())
            await worker.add_plugin(SetupFails())  # logged, not raised
            async with shoal.Client(scheduler.address, asynchronous=True) as client:
                assert await client.submit(inc, 1) == 2
        assert "a broken plugin" in caplog.text and "setup failed" in caplog.text
        assert worker.status == "running"
    finally:
        await worker.close()
        await scheduler.close()


def test_a_worker_process_that_joins_later_gets_the_plugin() -> None:
    # the plugin travels pickled over tcp: from the client to the scheduler (kept
    # opaque), and from there to the new worker process when it registers
    with shoal.LocalCluster(n_workers=1, processes=True) as cluster, shoal.Client(cluster) as client:
        client.register_plugin(Counting())
        cluster.scale(2)
        cluster.wait_for_workers(2, timeout=30)
        assert list(client.run(attribute, "counting_setups").values()) == [1, 1]
