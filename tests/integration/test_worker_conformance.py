"""What every worker implementation must do, written once and run against each: shoal's
own worker (a process), the worker written from docs/protocol.md in Python
(foreign_worker, threads of this process), and the JavaScript worker (workers/js, a
node process). The next language plugs in one more :class:`Impl`.

Each runs beside one Python worker of a real cluster (tcp, authenticated), which is the
peer it fetches from and serves. Tasks are the same four functions in each language:
``add``, ``total`` (an array's sum), ``scale`` (a new array, times k) and ``fail``
(raises with the given message); for the JavaScript worker they live in
``js_modules/conformance.js``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from typing import Any

import pytest

import shoal
from foreign_wire import Connection
from foreign_worker import ForeignWorker
from shoal.testing import wait_for

np = pytest.importorskip("numpy")

pytestmark = pytest.mark.timeout(120)

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
JS_WORKER = os.path.join(REPO, "workers", "js", "bin", "shoal-worker.js")
JS_MODULES = os.path.join(HERE, "js_modules")


# the task functions, in Python (the Python workers import them from this module)

def add(a, b):
    return a + b


def total(arr):
    return float(arr.sum())


def scale(arr, k):
    return arr * k


def fail(message):
    raise ValueError(message)


def make(n):
    return np.arange(n, dtype=np.float64)


# ------------------------------------------------------------------ implementations


class Impl:
    """How to start one worker implementation and name its task functions."""

    name = ""
    language = "python"

    def fn(self, name: str) -> Any:
        return globals()[name]

    def start(self, cluster: Any) -> Any:
        raise NotImplementedError

    def stop(self, handle: Any) -> None:
        raise NotImplementedError

    def exited(self, handle: Any) -> bool:
        """Whether it is gone (after its scheduler closed)."""
        raise NotImplementedError


class ProcessImpl(Impl):
    def command(self, address: str) -> list[str]:
        raise NotImplementedError

    def start(self, cluster: Any) -> Any:
        env = {**os.environ, **cluster.security.to_env()}
        # (a Python worker imports the task functions from this module)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p)
        return subprocess.Popen(self.command(cluster.scheduler_address), env=env, stdin=subprocess.DEVNULL,
                                start_new_session=True)

    def stop(self, handle: Any) -> None:
        if handle.poll() is None:
            handle.send_signal(signal.SIGTERM)
            try:
                handle.wait(15)
            except subprocess.TimeoutExpired:
                handle.kill()
                handle.wait()

    def exited(self, handle: Any) -> bool:
        return handle.poll() is not None


class ShoalWorker(ProcessImpl):
    name = "shoal"

    def command(self, address: str) -> list[str]:
        return [sys.executable, "-m", "shoal", "worker", address, "--no-nanny", "--nthreads", "1",
                "--host", "127.0.0.1", "--name", "under-test", "--memory-limit", "0"]


class DocWorker(Impl):
    name = "doc-python"

    def start(self, cluster: Any) -> Any:
        fw = ForeignWorker(cluster.scheduler_address, name="under-test", secret=cluster.security.secret)
        try:
            fw.start()
        except BaseException:
            fw.stop()
            raise
        return fw

    def stop(self, handle: Any) -> None:
        handle.stop()

    def exited(self, handle: Any) -> bool:
        return handle.stream_ended.is_set()


class JsWorker(ProcessImpl):
    name = "js"
    language = "js"

    def fn(self, name: str) -> Any:
        return shoal.foreign("js", "conformance", name)

    def command(self, address: str) -> list[str]:
        return ["node", JS_WORKER, address, "--nthreads", "1", "--path", JS_MODULES, "--name", "under-test"]

    def start(self, cluster: Any) -> Any:
        if shutil.which("node") is None:
            pytest.fail("node is not installed: the JavaScript worker needs Node >= 20 (apt-get install nodejs)")
        if not os.path.isdir(os.path.join(REPO, "workers", "js", "node_modules")):
            pytest.fail("the JavaScript worker's packages are not installed: run `cd workers/js && npm ci`")
        return super().start(cluster)


IMPLS = [ShoalWorker(), DocWorker(), JsWorker()]


class Running:
    """A cluster of one Python worker (the peer), a client, and the worker under test."""

    def __init__(self, impl: Impl, cluster: Any, client: Any, handle: Any, address: str, peer: str):
        self.impl, self.cluster, self.client, self.handle = impl, cluster, client, handle
        self.address, self.peer = address, peer

    def submit(self, name: str, *args: Any, here: bool = True) -> Any:
        return self.client.submit(self.impl.fn(name), *args, workers=[self.address] if here else [self.peer],
                                  pure=False)

    def on_peer(self, fn: Any, *args: Any) -> Any:
        return self.client.submit(fn, *args, workers=[self.peer], pure=False)

    def get_data(self, keys: list[Any]) -> dict[str, Any]:
        with Connection(self.address, "conformance", secret=self.cluster.security.secret,
                        reads="neutral" if self.impl.language != "python" else None) as conn:
            return conn.call("get-data", keys=keys)


def _start(impl: Impl) -> Any:
    cluster = shoal.LocalCluster(n_workers=1, processes=True, memory_limit=0)
    client = handle = None
    try:
        client = shoal.Client(cluster)
        (peer,) = client.scheduler_info()["workers"]
        handle = impl.start(cluster)
        wait_for(lambda: len(client.scheduler_info()["workers"]) == 2, timeout=60,
                 what=f"the {impl.name} worker to join")
        (address,) = set(client.scheduler_info()["workers"]) - {peer}
        return Running(impl, cluster, client, handle, address, peer)
    except BaseException:
        _stop(impl, cluster, client, handle)
        raise


def _stop(impl: Impl, cluster: Any, client: Any, handle: Any) -> None:
    try:
        if handle is not None:
            impl.stop(handle)
    finally:
        if client is not None:
            client.close()
        cluster.close()


@pytest.fixture(scope="module", params=IMPLS, ids=[i.name for i in IMPLS])
def w(request: pytest.FixtureRequest) -> Any:
    running = _start(request.param)
    try:
        yield running
    finally:
        _stop(running.impl, running.cluster, running.client, running.handle)


# ------------------------------------------------------------------------- the suite


def test_it_registers_with_its_name_threads_and_languages(w: Running) -> None:
    info = w.client.scheduler_info()["workers"][w.address]
    assert info["name"] == "under-test"
    assert info["nthreads"] == 1
    assert info.get("languages", ["python"]) == [w.impl.language]


def test_it_runs_a_task_and_serves_the_value_to_the_client(w: Running) -> None:
    assert w.submit("add", 1, 2).result(timeout=30) == 3
    assert w.submit("add", "sh", "oal").result(timeout=30) == "shoal"


def test_it_fetches_an_input_from_a_python_peer(w: Running) -> None:
    x = w.on_peer(make, 1000)
    assert w.submit("total", x).result(timeout=30) == float(np.arange(1000).sum())


def test_its_value_feeds_a_python_task_on_the_peer(w: Running) -> None:
    x = w.on_peer(make, 1 << 18)  # 2 MiB
    y = w.submit("scale", x, 3.0)
    got = w.client.submit(total, y, workers=[w.peer], pure=False).result(timeout=30)
    assert got == float(np.arange(1 << 18).sum() * 3)
    back = y.result(timeout=30)
    assert back.dtype == np.float64 and back.shape == (1 << 18,) and (back == np.arange(1 << 18) * 3.0).all()


def test_a_task_that_raises_errs_with_its_message_and_the_worker_goes_on(w: Running) -> None:
    bad = w.submit("fail", "conformance says no")
    with pytest.raises(Exception, match="conformance says no"):
        bad.result(timeout=30)
    assert w.submit("add", 2, 2).result(timeout=30) == 4


def test_a_released_value_is_dropped(w: Running) -> None:
    f = w.submit("add", 40, 2)
    assert f.result(timeout=30) == 42
    key = f.key
    assert key in w.get_data([key])["result"]["data"]
    del f
    wait_for(lambda: key not in w.get_data([key])["result"]["data"], timeout=30, what="the worker to drop the key")


def test_a_connection_that_sends_garbage_is_cut_off_and_the_worker_goes_on(w: Running) -> None:
    host, port = w.address.removeprefix("tcp://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.settimeout(30)
        sock.sendall(b"\xff" * 64)  # no handshake: a frame count no message has
        while True:  # what it sent before it noticed (its handshake), then the end
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
    assert w.submit("add", 5, 6).result(timeout=30) == 11


@pytest.mark.parametrize("impl", IMPLS, ids=[i.name for i in IMPLS])
def test_it_leaves_when_its_scheduler_closes(impl: Impl) -> None:
    running = _start(impl)
    try:
        assert running.submit("add", 1, 1).result(timeout=30) == 2
        running.client.close()
        running.cluster.close()
        wait_for(lambda: impl.exited(running.handle), timeout=30, what=f"the {impl.name} worker to leave")
    finally:
        _stop(impl, running.cluster, running.client, running.handle)


def test_scatter_and_run_go_only_to_workers_that_serve_them(w: Running) -> None:
    served = w.client.scheduler_info()["workers"][w.address].get("ops")
    if served is None:  # it serves every optional op (shoal's own worker)
        served = ["run", "update-data"]
    ran = set(w.client.run(os.getpid))
    assert ran == ({w.peer, w.address} if "run" in served else {w.peer})
    places = set()
    for _ in range(4):  # round robin reaches every worker that serves update-data
        (f,) = w.client.scatter([np.arange(3)], hash=False)
        places.update(w.client.who_has([f])[f.key])
    assert places == ({w.peer, w.address} if "update-data" in served else {w.peer})
