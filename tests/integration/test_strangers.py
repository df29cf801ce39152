"""Connections that never prove the secret cannot keep anyone out (issue 35).

Real processes and sockets: a ``shoal scheduler`` and two ``shoal worker``s, each with
its nanny (three listeners of three kinds), authentication on, over tcp:// and tls://.
The flooding side is ``flooder.py``, a process of its own: silent connections (connect,
send nothing) and slow ones (dribble a byte of a handshake now and then: the shoal
``handshake`` over tcp, a TLS ClientHello over tls), opened again as fast as the
listener closes them.

- A graph whose tasks cross between the workers (new worker-to-worker connections),
  a second client, a new connection to a nanny: all done, with results checked against
  plain Python, while 2,000 such connections at a time flood the scheduler, a worker
  and its nanny. The listeners evict the oldest strangers to make room (logged).
- The same with the stranger limits lifted and 1,024 descriptors at most in every
  shoal process: the descriptor reserve evicts strangers instead.
- 5 of 5 new local clients connect while 500 half-open connections are held (before
  issue 35: 0 of 5, the newcomers were refused for as long as they were held).
- A listener out of descriptors closes strangers first, tells a connection it cannot
  take why (a clear error), and accepts again as soon as descriptors are back; a process
  that listens raises its soft descriptor limit to the hard one.
"""

from __future__ import annotations

import asyncio
import json
import operator
import os
import re
import resource
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

import shoal
from shoal.comm import connect
from shoal.comm.security import Security
from shoal.errors import HandshakeError
from shoal.protocol import PROTOCOL_VERSION
from shoal.rpc import rpc
from shoal.testing import wait_for
from shoal_helpers import auth_files, free_port, read_line, stop_processes

_FLOODER = os.path.join(os.path.dirname(__file__), "flooder.py")
#: a shoal command whose log goes to stderr from INFO on
_RUN = (
    "import logging, sys\n"
    "logging.basicConfig(level=logging.INFO, format='%(levelname)s %(name)s %(message)s')\n"
    "from shoal.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)
_EVICTED = re.compile(r"to make room for one from|still in their handshake, the oldest first")


@pytest.fixture(scope="module")
def tls() -> Security:
    return Security.temporary()


def _security(scheme: str, tls: Security) -> Security:
    return tls if scheme == "tls" else Security.new()


class Cluster:
    """Shoal processes started by the test (their stderr in files, read after), with a
    secret (and certificates over tls) given in their environment."""

    def __init__(self, tmp: Any, sec: Security, env: dict[str, str] | None = None,
                 descriptors: int | tuple[int, int] = 0):
        self.tmp = tmp
        self.sec = sec
        self.env = {**os.environ, **sec.to_env(), **(env or {})}
        self.descriptors = descriptors
        self.procs: list[subprocess.Popen] = []
        self.logs: dict[str, str] = {}
        self.auth_before = auth_files()

    def start(self, name: str, *args: str) -> str:
        """Start ``shoal ARGS`` as ``name``; returns the address its first line names."""
        path = str(self.tmp / f"{name}.log")
        self.logs[name] = path
        limit = self.descriptors

        def limited() -> None:
            if limit:
                resource.setrlimit(resource.RLIMIT_NOFILE, limit if isinstance(limit, tuple) else (limit, limit))

        with open(path, "wb") as err:
            p = subprocess.Popen([sys.executable, "-c", _RUN, *args], stdout=subprocess.PIPE, stderr=err,
                                 env=self.env, preexec_fn=limited)
        self.procs.append(p)
        line = read_line(p, time.monotonic() + 60)
        assert line.startswith("shoal "), (name, line)
        return line.split()[-1]

    def log(self, name: str) -> str:
        with open(self.logs[name], errors="replace") as f:
            return f.read()

    def close(self) -> None:
        stop_processes(self.procs, self.auth_before)


@pytest.fixture
def make_cluster(tmp_path: Any) -> Iterator[Any]:
    made: list[Cluster] = []

    def make(sec: Security, **kwargs: Any) -> Cluster:
        made.append(Cluster(tmp_path, sec, **kwargs))
        return made[-1]

    yield make
    for cluster in made:
        cluster.close()


class Flood:
    """``flooder.py`` against ``targets`` (addresses): started, and once every target has
    had ``count`` connections, ``ready`` holds its counts; :meth:`stop` ends it and
    returns the final counts."""

    def __init__(self, targets: list[str], count: int, reconnect: bool = True, slow: float = 0.5):
        spec = {"targets": [[*_host_port(a), a.startswith("tls://")] for a in targets], "count": count,
                "slow": slow, "reconnect": reconnect, "interval": 0.2, "protocol": PROTOCOL_VERSION}
        self.proc = subprocess.Popen([sys.executable, _FLOODER, json.dumps(spec)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE)
        try:
            line = read_line(self.proc, time.monotonic() + 120)
            assert line.startswith("ready "), line
        except BaseException:
            self.stop()
            raise
        self.ready: list[dict[str, int]] = json.loads(line.split(" ", 1)[1])

    def stop(self) -> list[dict[str, int]]:
        proc = self.proc
        try:
            out, _ = proc.communicate(b"", timeout=60)  # its stdin closes: it stops
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        done = [line for line in out.decode().splitlines() if line.startswith("done ")]
        assert proc.returncode == 0 and done, (proc.returncode, out)
        return json.loads(done[0].split(" ", 1)[1])


def _host_port(address: str) -> tuple[str, int]:
    host, port = address.split("://", 1)[1].rsplit(":", 1)
    return host.strip("[]"), int(port)


async def _nanny_identity(address: str, sec: Security) -> Any:
    async with rpc(address, security=sec) as r:
        return await r.identity()


def _work(c: shoal.Client, a: str, b: str, n: int) -> None:
    """A graph whose values cross from worker a to b and back, checked against plain
    Python; its fetches open connections between the workers, its results come to the
    client from both. (Functions of the standard library: the ``shoal worker``
    processes do not import the tests' modules.)"""
    xs = [c.submit(operator.add, i, 1, workers=[a], pure=False) for i in range(n)]
    ys = [c.submit(operator.add, x, i, workers=[b], pure=False) for i, x in enumerate(xs)]
    s = c.submit(sum, ys, workers=[a], pure=False)
    assert s.result(timeout=120) == sum(i + 1 + i for i in range(n))
    assert c.gather(xs) == [i + 1 for i in range(n)]
    assert c.gather(ys) == [2 * i + 1 for i in range(n)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("limits", ["handshakes", "descriptors"])
@pytest.mark.parametrize("scheme", ["tcp", "tls"])
def test_a_graph_runs_while_2000_strangers_flood_scheduler_worker_and_nanny(
        make_cluster: Any, tls: Security, scheme: str, limits: str) -> None:
    sec = _security(scheme, tls)
    if limits == "handshakes":
        cluster = make_cluster(sec)
    else:
        # no stranger limit would stop them: the descriptors run low first (each process
        # may have 1,024, as on a default Linux), and the reserve evicts strangers
        cluster = make_cluster(sec, env={"SHOAL_MAX_HANDSHAKING": "100000",
                                         "SHOAL_MAX_HANDSHAKING_PER_HOST": "100000"}, descriptors=1024)
    address = cluster.start("scheduler", "scheduler", "--host", "127.0.0.1", "--port", str(free_port()))
    assert address.startswith(f"{scheme}://")
    a = cluster.start("a", "worker", address, "--nthreads", "2", "--name", "a", "--host", "127.0.0.1")
    b = cluster.start("b", "worker", address, "--nthreads", "2", "--name", "b", "--host", "127.0.0.1")
    with shoal.Client(address, security=sec, timeout=60) as c:
        c.wait_for_workers(2, timeout=60)
        nanny = c.scheduler_info()["workers"][a]["nanny"]
        assert nanny.startswith(f"{scheme}://")
        assert c.submit(operator.neg, 1, workers=[a]).result(timeout=60) == -1  # connected before the flood
        targets = [address, a, nanny]
        flood = Flood(targets, count=2000)
        try:
            # while they flood: the established client goes on, new connections get in
            _work(c, a, b, 30)
            with shoal.Client(address, security=sec, timeout=60) as c2:
                assert c2.submit(sum, list(range(100)), workers=[a]).result(timeout=60) == 4950
            assert asyncio.run(_nanny_identity(nanny, sec))["address"] == nanny
            _work(c, b, a, 10)
        finally:
            counts = flood.stop()
        for target, before, after in zip(targets, flood.ready, counts):
            assert before["opened"] >= 2000, (target, before)
            # it went on flooding while the graph ran, and the listener closed them
            assert after["opened"] > before["opened"] and after["closed"] > 0, (target, before, after)
        # and everyone serves on after it
        _work(c, a, b, 5)
    assert all(p.poll() is None for p in cluster.procs), [p.poll() for p in cluster.procs]
    for name in ("scheduler", "a"):  # (a's log holds its nanny's and its worker's)
        log = cluster.log(name)
        assert _EVICTED.search(log), log[-5000:]
    for name in ("scheduler", "a", "b"):
        log = cluster.log(name)
        assert "Traceback" not in log, log[-5000:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("scheme", ["tcp", "tls"])
def test_5_of_5_new_clients_connect_while_500_half_open_connections_are_held(
        make_cluster: Any, tls: Security, scheme: str) -> None:
    sec = _security(scheme, tls)
    cluster = make_cluster(sec)
    address = cluster.start("scheduler", "scheduler", "--host", "127.0.0.1", "--port", str(free_port()))
    flood = Flood([address], count=500, reconnect=False, slow=0.0)  # opened once each, never a byte
    try:
        connected = 0
        for i in range(5):
            with shoal.Client(address, security=sec, timeout=30) as c:
                assert c.scheduler_info()["address"] == address
                connected += 1
    finally:
        (counts,) = flood.stop()
    assert connected == 5
    assert counts["opened"] == 500 and counts["closed"] > 0  # the oldest made room
    assert "max-handshaking-per-host" in cluster.log("scheduler")


def _descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _lowest_free_fd(pid: int) -> int:
    used = {int(fd) for fd in os.listdir(f"/proc/{pid}/fd")}
    return next(n for n in range(len(used) + 1) if n not in used)


async def _connect(address: str, sec: Security) -> None:
    comm = await connect(address, security=sec, timeout=30)
    await comm.close()


@pytest.mark.timeout(120)
def test_out_of_descriptors_strangers_go_first_then_a_clear_refusal_then_it_accepts_again(
        make_cluster: Any) -> None:
    sec = Security.new()
    cluster = make_cluster(sec)
    address = cluster.start("scheduler", "scheduler", "--host", "127.0.0.1", "--port", str(free_port()))
    pid = cluster.procs[0].pid
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    baseline = _descriptors(pid)
    # strangers hold descriptors; then the scheduler may open no more
    flood = Flood([address], count=20, reconnect=False, slow=0.0)
    try:
        wait_for(lambda: _descriptors(pid) >= baseline + 20, timeout=30, what="the strangers' descriptors")
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (_lowest_free_fd(pid), hard))
        try:
            asyncio.run(_connect(address, sec))  # in: strangers were closed for it
        finally:
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
    finally:
        (counts,) = flood.stop()
    assert counts["closed"] > 0, counts
    # no stranger left to close: the newcomer is told why, at once
    wait_for(lambda: _descriptors(pid) <= baseline, timeout=30, what="the connections to close")
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (_lowest_free_fd(pid), hard))
    try:
        with pytest.raises(HandshakeError, match="refused the connection: this process is out of file descriptors"):
            asyncio.run(_connect(address, sec))
    finally:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
    # descriptors back: accepting goes on (no pause left behind)
    asyncio.run(_connect(address, sec))
    with shoal.Client(address, security=sec, timeout=30) as c:
        assert c.scheduler_info()["address"] == address
    log = cluster.log("scheduler")
    assert "connection(s) still in their handshake, the oldest first" in log, log[-5000:]
    assert "no connection in its handshake to close" in log, log[-5000:]
    assert "Traceback" not in log, log[-5000:]


@pytest.mark.timeout(60)
def test_a_process_that_listens_raises_its_descriptor_limit_to_the_hard_limit(make_cluster: Any) -> None:
    cluster = make_cluster(Security.new(), descriptors=(256, 4096))
    cluster.start("scheduler", "scheduler", "--host", "127.0.0.1", "--port", str(free_port()))
    assert resource.prlimit(cluster.procs[0].pid, resource.RLIMIT_NOFILE) == (4096, 4096)
