"""Resource exhaustion on a real cluster of processes (issue 11).

- ``/dev/shm`` full: the scheduler and the workers run in a private mount namespace
  whose ``/dev/shm`` is a small tmpfs of its own (the machine's is never touched), which
  the test fills. A full ``/dev/shm`` means "no shared memory for this connection or this
  value", said once per process; connections work over tcp and nothing is left behind.
- Out of descriptors: a worker process's soft ``RLIMIT_NOFILE`` is lowered to what it
  has open. A fetch that fails for it is tried a bounded number of times with a pause
  that doubles (counted in the worker's log), then the task errs with the fetch's error;
  with descriptors back, the same worker serves again.

- A handshake that fails for any reason (a bug included) or is cancelled closes its
  connection: no half-open connection, no descriptor left (in-process, real sockets).

The cluster tests need root and util-linux (``unshare``, ``nsenter``); they are
skipped otherwise.
"""

from __future__ import annotations

import asyncio
import os
import re
import resource
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shoal
from shoal.comm import connect, shm
from shoal.comm.security import Security
from shoal.rpc import Server
from shoal.testing import wait_for
from shoal_helpers import (
    LoopThread,
    auth_files,
    handshake_bytes,
    log_waiter,
    raw_connect,
    recv_until_closed,
    secret_of,
    start_scheduler,
    start_worker,
    stop_processes,
)

#: a shoal command (``scheduler ...``, ``worker ...``) whose log goes to stderr from INFO on
_RUN = (
    "import logging, sys\n"
    "logging.basicConfig(level=logging.INFO, format='%(levelname)s %(name)s %(message)s')\n"
    "from shoal.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)
_PROBE_WARNING = "cannot create a shared-memory probe"
_SHM_FULL = "shared memory is full"


def _namespaces_work() -> str | None:
    """Why a private mount namespace cannot be made here, or None if it can."""
    if os.geteuid() != 0:
        return "needs root (a private mount namespace with a tmpfs on /dev/shm)"
    for tool in ("unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"needs {tool} (util-linux)"
    try:
        p = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs -o size=1m tmpfs /dev/shm"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare does not work here: {exc}"
    return None if p.returncode == 0 else f"unshare does not work here: {p.stderr.decode(errors='replace')}"


pytestmark = pytest.mark.timeout(60)
_WHY_NOT = _namespaces_work()
#: tests that run a cluster in a mount namespace of their own
needs_namespace = pytest.mark.skipif(_WHY_NOT is not None, reason=_WHY_NOT or "")


class Namespace:
    """A private mount namespace whose ``/dev/shm`` is a tmpfs of ``size`` bytes, kept
    alive by a holder process; processes join it with ``nsenter``. The test sees that
    ``/dev/shm`` at ``/proc/<holder>/root/dev/shm``."""

    def __init__(self, size: int) -> None:
        self.holder = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c",
             f"mount -t tmpfs -o size={size} tmpfs /dev/shm && echo ready && exec sleep 600"],
            stdout=subprocess.PIPE, text=True,
        )
        assert self.holder.stdout is not None
        line = self.holder.stdout.readline().strip()
        if line != "ready":
            self.close()
            raise RuntimeError(f"the namespace did not come up: {line!r}")
        self.shm = f"/proc/{self.holder.pid}/root/dev/shm"

    def popen(self, args: list[str], **kwargs: Any) -> subprocess.Popen:
        return subprocess.Popen(["nsenter", "-t", str(self.holder.pid), "-m", *args], **kwargs)

    def fill(self) -> None:
        """Take every free byte of its /dev/shm: any write there fails with ENOSPC."""
        fd = os.open(os.path.join(self.shm, "filler"), os.O_CREAT | os.O_WRONLY, 0o600)
        try:
            st = os.statvfs(self.shm)
            os.posix_fallocate(fd, 0, st.f_bavail * st.f_frsize)
        finally:
            os.close(fd)
        assert os.statvfs(self.shm).f_bavail == 0

    def shoal_files(self) -> list[str]:
        return sorted(n for n in os.listdir(self.shm) if n.startswith("shoal-"))

    def close(self) -> None:
        # the tmpfs (and whatever is in it) goes with the last process of the namespace
        self.holder.kill()
        self.holder.wait()
        if self.holder.stdout is not None:
            self.holder.stdout.close()


class Cluster:
    """A scheduler and two workers (``w0``, ``w1``) as processes in ``ns``, logging
    from INFO on into files; ``a``/``b`` are the workers' addresses and ``pids`` maps
    ``"scheduler"``, ``"a"``, ``"b"`` to process ids."""

    def __init__(self, ns: Namespace, logs: Path, procs: list[subprocess.Popen], env: dict[str, str]) -> None:
        self.logs = logs
        root = os.path.dirname(os.path.dirname(shoal.__file__))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
               **env}
        sched = self._start(ns, procs, env, "scheduler", "scheduler", "--host", "127.0.0.1",
                            "--port", str(_free_port()))
        assert sched.stdout is not None
        line = sched.stdout.readline()
        assert line.startswith("shoal scheduler at "), line
        self.address = line.split()[-1]
        workers = [self._start(ns, procs, env, f"w{i}", "worker", self.address, "--no-nanny", "--name", f"w{i}") for i in range(2)]
        for w in workers:
            assert w.stdout is not None
            assert w.stdout.readline().startswith("shoal worker at ")
        self.pids = {"scheduler": sched.pid, "a": workers[0].pid, "b": workers[1].pid}
        self.a = self.b = ""

    def _start(self, ns: Namespace, procs: list[subprocess.Popen], env: dict[str, str], name: str,
               *args: str) -> subprocess.Popen:
        with open(self.logs / f"{name}.log", "w") as log:
            p = ns.popen([sys.executable, "-c", _RUN, *args], stdout=subprocess.PIPE, stderr=log,
                         text=True, env=env)
        procs.append(p)
        return p

    def connect(self, client: shoal.Client) -> None:
        workers = {w["name"]: addr for addr, w in client.scheduler_info()["workers"].items()}
        self.a, self.b = workers["w0"], workers["w1"]

    def log(self, who: str) -> str:
        name = {"scheduler": "scheduler", "a": "w0", "b": "w1"}[who]
        return (self.logs / f"{name}.log").read_text()

    def descriptors(self) -> dict[str, int]:
        return {who: len(os.listdir(f"/proc/{pid}/fd")) for who, pid in self.pids.items()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Any]:
    """``start(shm_bytes, **env)`` -> (namespace, cluster); all of it is stopped (the
    processes first, then the namespace with its tmpfs) whatever the test did."""
    procs: list[subprocess.Popen] = []
    spaces: list[Namespace] = []
    before = auth_files()

    def make(shm_bytes: int, fill: bool = False, **env: str) -> tuple[Namespace, Cluster]:
        ns = Namespace(shm_bytes)
        spaces.append(ns)
        if fill:
            ns.fill()
        return ns, Cluster(ns, tmp_path, procs, env)

    try:
        yield make
    finally:
        try:
            stop_processes(procs, before)
        finally:
            for ns in spaces:
                ns.close()


def _count(text: str, needle: str) -> int:
    return sum(needle in line for line in text.splitlines())


# ------------------------------------------------------------------- /dev/shm is full


@needs_namespace
def test_a_cluster_started_with_dev_shm_full_works_over_tcp(start: Any) -> None:
    ns, cluster = start(1 << 20, fill=True)
    with shoal.Client(cluster.address, timeout=20) as c:
        cluster.connect(c)
        assert sum(c.gather(c.map(abs, range(-50, 50)))) == 2 * sum(range(51)) - 50

        def round_trip() -> None:
            # a big value made on one worker, used on the other: over tcp, correct
            x = c.submit(np.full, (8 << 20) // 8, 2.0, workers=[cluster.a], pure=False)
            y = c.submit(np.sum, x, workers=[cluster.b], pure=False)
            assert y.result(timeout=30) == 2.0 * (1 << 20)
            assert np.array_equal(x.result(timeout=30), np.full(1 << 20, 2.0))

        before_stats = c.transfer_stats()[cluster.a]
        round_trip()
        stats = c.transfer_stats()[cluster.a]
        assert stats["tcp"] - before_stats["tcp"] >= 8 << 20 and stats["shm"] == before_stats["shm"] == 0
        assert ns.shoal_files() == []  # no probe, no segment: nothing fits
        # the connections exist now; more of the same work opens no more descriptors
        fds = cluster.descriptors()
        round_trip()
        assert sum(c.gather(c.map(abs, range(-50, 50)))) == 2 * sum(range(51)) - 50
        wait_for(lambda: all(n <= fds[who] for who, n in cluster.descriptors().items()), timeout=10,
                 what=f"descriptors back to {fds} (now {cluster.descriptors()})")
        assert ns.shoal_files() == []
    for who in ("scheduler", "a", "b"):
        log = cluster.log(who)
        assert _count(log, _PROBE_WARNING) == 1, log  # said once, however many connections
        assert "Traceback" not in log and "ERROR" not in log, log
        assert "refused connection" not in log, log


@needs_namespace
def test_dev_shm_full_mid_run_keeps_a_big_result_in_private_memory(start: Any) -> None:
    ns, cluster = start(16 << 20)
    n = (4 << 20) // 8
    with shoal.Client(cluster.address, timeout=20) as c:
        cluster.connect(c)
        # connections made while shared memory has room: same-host between the workers
        small = c.submit(bytes, 100, workers=[cluster.a], pure=False)
        assert c.submit(len, small, workers=[cluster.b], pure=False).result(timeout=30) == 100
        ns.fill()
        for value in (3.0, 4.0):
            big = c.submit(np.full, n, value, workers=[cluster.a], pure=False)
            total = c.submit(np.sum, big, workers=[cluster.b], pure=False)
            assert total.result(timeout=30) == value * n
            assert np.array_equal(big.result(timeout=30), np.full(n, value))
        assert [f for f in ns.shoal_files() if "probe" in f] == []
    log = cluster.log("a")
    assert _count(log, _SHM_FULL) == 1, log  # two big results, one warning
    assert "Traceback" not in log and "ERROR" not in log, log


# ------------------------------------------------------------------ out of descriptors


def _lowest_free_fd(pid: int) -> int:
    used = {int(fd) for fd in os.listdir(f"/proc/{pid}/fd")}
    return next(n for n in range(len(used) + 1) if n not in used)


def _block_new_descriptors(pid: int) -> int:
    """Lower ``pid``'s soft descriptor limit so that it cannot open one more; returns
    the soft limit to restore."""
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (_lowest_free_fd(pid), hard))
    return soft


def _restore_descriptors(pid: int, soft: int) -> None:
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, resource.prlimit(pid, resource.RLIMIT_NOFILE)[1]))


@needs_namespace
@pytest.mark.parametrize(("starved", "error", "says"), [
    ("b", shoal.CommConnectError, "this process is out of file descriptors"),
    # the peer accepts with a descriptor kept for this, says why it refuses, and closes
    ("a", shoal.HandshakeError, "refused the connection: this process is out of file descriptors"),
], ids=["fetching-worker", "peer"])
def test_fetches_without_descriptors_are_bounded_then_the_task_errs_and_the_worker_recovers(
        start: Any, starved: str, error: type[Exception], says: str) -> None:
    """Worker b needs a value of worker a while b (or a) cannot open a descriptor: b's
    fetch is tried ``gather-attempts`` times with a doubling pause, handed back to the
    scheduler, tried again, and after ``gather-peer-failures`` such rounds the task errs
    with the fetch's error, naming it. With descriptors back, b fetches from a again."""
    attempts, rounds = 4, 3
    ns, cluster = start(16 << 20, SHOAL_GATHER_ATTEMPTS=str(attempts), SHOAL_GATHER_RETRY_DELAY="0.01",
                        SHOAL_GATHER_PEER_FAILURES=str(rounds))
    with shoal.Client(cluster.address, timeout=20) as c:
        cluster.connect(c)
        x = c.submit(bytes, 100, workers=[cluster.a], pure=False)
        x.result(timeout=30)
        fds = cluster.descriptors()
        pid = cluster.pids[starved]
        soft = _block_new_descriptors(pid)
        try:
            y = c.submit(len, x, workers=[cluster.b], pure=False)
            with pytest.raises(error, match=f"could not fetch .* from {re.escape(cluster.a)} "
                                            f"\\({attempts} attempt\\(s\\)\\).*{says}"):
                y.result(timeout=30)
            assert cluster.descriptors()[starved] == fds[starved]  # nothing leaked
        finally:
            _restore_descriptors(pid, soft)
        log = cluster.log("b")
        tried = re.findall(rf"fetching 1 keys from {re.escape(cluster.a)} failed \(attempt (\d) of {attempts}"
                           r"(?:; again in ([\d.]+)s)?\)", log)
        assert [int(n) for n, _ in tried] == list(range(1, attempts + 1)) * rounds, log
        # the pause doubles within each round; the last attempt of a round waits no more
        assert [p for _, p in tried[:attempts]] == ["0.01", "0.02", "0.04", ""], log
        # descriptors back: the same worker fetches from the same peer again
        z = c.submit(len, x, workers=[cluster.b], pure=False)
        assert z.result(timeout=30) == 100
        assert sum(c.gather(c.map(abs, range(-5, 5), workers=[cluster.b]))) == 25
    assert [f for f in ns.shoal_files() if "probe" in f] == []
    for who in ("scheduler", "a", "b"):
        log = cluster.log(who)
        assert "Traceback" not in log and "ERROR" not in log, log


# -------------------------------------------------------- handshakes that go wrong


def _my_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_handshake_that_fails_unexpectedly_closes_that_connection_only(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> Any:
        raise RuntimeError("a bug in making the probe")

    with LoopThread(name="handshake-server") as thread, log_waiter() as logs:
        server = Server({"echo": lambda comm, x=None: x}, name="server")
        thread.run(server.listen("tcp://127.0.0.1:0"))
        try:
            address = server.address
            host, port = address.removeprefix("tcp://").rsplit(":", 1)
            before = _my_descriptors()
            monkeypatch.setattr(shm, "probe", broken)
            with socket.create_connection((host, int(port)), timeout=10) as sock:
                sock.sendall(handshake_bytes(nonce=os.urandom(32), auth=secret_of(address) is not None))
                recv_until_closed(sock)  # its step 1, then the connection is closed
            record = logs.wait_for(lambda r: "the handshake with" in r.getMessage())
            assert record.levelname == "ERROR" and "closing the connection" in record.getMessage()
            monkeypatch.undo()
            wait_for(lambda: _my_descriptors() <= before, what="the server's end of it to be closed")
            raw_connect(address).close()  # everyone else is served
        finally:
            thread.run(server.close())


async def test_a_connect_cancelled_in_its_handshake_leaves_no_descriptor() -> None:
    with socket.socket() as silent:  # takes connections (the kernel does) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        address = f"tcp://127.0.0.1:{silent.getsockname()[1]}"
        before = _my_descriptors()
        for _ in range(5):
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(connect(address, timeout=10, security=Security.disabled()), 0.2)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while _my_descriptors() > before:  # transports close on the loop's next turns
            assert loop.time() < deadline, f"{_my_descriptors() - before} descriptor(s) left open"
            await asyncio.sleep(0.01)


# ---------------------------------------------------------------- address space


def _vm_size(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmSize for {pid}")


def ones(n: int) -> Any:
    return np.ones(n, dtype=np.uint8)


def test_a_worker_short_of_address_space_errs_the_task_that_hit_it_and_carries_on(processes: list[Any]) -> None:
    """Under an address-space limit (``RLIMIT_AS``, lowered on the running worker), a
    result that fits in private memory but whose shared-memory segment cannot be mapped
    (``mmap``: ENOMEM) stays private and is fetched correctly, with its segment gone; a
    task that cannot allocate its result fails with ``MemoryError``; the one-thread
    worker then runs the next tasks. Nothing is left in /dev/shm."""
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join([here, os.path.dirname(here), os.environ.get("PYTHONPATH", "")])
    _, address = start_scheduler(processes)
    worker, _ = start_worker(processes, address, "--no-nanny", "--nthreads", "1", env={"PYTHONPATH": path})
    with shoal.Client(address, timeout=30) as c:
        assert c.submit(ones, 10, pure=False).result(timeout=30).sum() == 10  # numpy loaded, threads up
        soft, hard = resource.prlimit(worker.pid, resource.RLIMIT_AS)
        # room for a 96 MB result, not for a second mapping of it
        resource.prlimit(worker.pid, resource.RLIMIT_AS, (_vm_size(worker.pid) + (150 << 20), hard))
        try:
            big = c.submit(ones, 96 << 20, pure=False)
            assert int(big.result(timeout=60).sum()) == 96 << 20
            huge = c.submit(ones, 1 << 32, pure=False)
            with pytest.raises(MemoryError):
                huge.result(timeout=60)
            assert c.submit(ones, 1000, pure=False).result(timeout=30).sum() == 1000
            del big, huge
        finally:
            resource.prlimit(worker.pid, resource.RLIMIT_AS, (soft, hard))
        assert sum(c.gather(c.map(abs, range(-5, 5)))) == 25
        assert all(os.path.getsize(os.path.join(shm.SHM_DIR, n)) < (96 << 20) for n in shm.segments_of(worker.pid))
    assert worker.poll() is None
    worker.terminate()
    log = worker.communicate(timeout=30)[1]
    assert "a result stays in this worker's private memory: ShmUnavailable: cannot map segment" in log, log
    assert "Cannot allocate memory" in log and "Traceback" not in log, log
    assert shm.segments_of(worker.pid) == []
