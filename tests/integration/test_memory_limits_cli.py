"""``shoal worker`` and its nanny, as real processes: ``--memory-limit`` (parsed once,
by the nanny, errors in one line), ``--local-directory``, ``--no-nanny``, a killed
worker started again, a nanny that gives up, ``client.restart()`` of a cluster made
with the command line (no cluster object), and how the nanny and its worker end on
signals (nothing left in /dev/shm or the local directory).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest

import shoal
from shoal.comm import connect, security, shm
from shoal.rpc import send_recv
from shoal.testing import wait_for
from shoal.worker.memory import parse_memory_limit
from shoal_helpers import start_scheduler, start_shoal, start_worker


# what the tasks run: importable by the worker processes (this module is not), or by
# value (a lambda)
kill_self = lambda: os.kill(os.getpid(), signal.SIGKILL)  # noqa: E731
inc = lambda x: x + 1  # noqa: E731


def _workers(c: shoal.Client) -> dict[str, dict]:
    return c.scheduler_info()["workers"]


def _dirs(path) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.startswith("shoal-worker-"))


def _line(stream, prefix: str) -> str:
    """The next line of ``stream`` that starts with ``prefix`` (the test's timeout bounds it)."""
    while True:
        line = stream.readline()
        assert line, f"the stream ended before a line starting with {prefix!r}"
        if line.startswith(prefix):
            return line.rstrip("\n")


@pytest.mark.parametrize("text, error", [
    ("lots", "not a size: 'lots'"), ("-1GB", "not a size"), ("12XB", "not a size"), ("inf", "must be a finite size"), ("nan", "must be a finite size"),
])
def test_a_bad_memory_limit_is_one_clear_line(text, error):
    p = subprocess.run([sys.executable, "-m", "shoal", "worker", "tcp://127.0.0.1:1", f"--memory-limit={text}"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    last = p.stderr.splitlines()[-1]
    assert last.startswith(f"shoal worker: error: argument --memory-limit: bad --memory-limit {text!r}: "), last
    assert error in last and "Traceback" not in p.stderr


@pytest.mark.timeout(90)
def test_memory_limits_reach_the_workers(processes, tmp_path):
    sched, address = start_scheduler(processes)
    start_worker(processes, address, "--name", "small", "--memory-limit", "300MB")
    group = start_shoal_worker_group(processes, address)
    start_worker(processes, address, "--name", "unlimited", "--memory-limit", "0", "--no-nanny")
    with shoal.Client(address) as c:
        wait_for(lambda: len(_workers(c)) == 4 and all(w["process"] for w in
                                                      (v["memory"] for v in _workers(c).values())),
                 timeout=30, what="four workers and their memory reports")
        limits = {w["name"]: w["memory_limit"] for w in _workers(c).values()}
        assert limits == {"small": 300_000_000, "auto-0": parse_memory_limit("auto", 2),
                          "auto-1": parse_memory_limit("auto", 2), "unlimited": 0}
        nannies = {w["name"]: w["nanny"] for w in _workers(c).values()}
        assert nannies["unlimited"] == "" and len({nannies[n] for n in ("small", "auto-0", "auto-1")}) == 3
        # the two nannies of --nworkers share one process, the parent of both workers
        assert len({w["pid"] for w in _workers(c).values()} | {group.pid}) == 5


def start_shoal_worker_group(processes, address: str) -> subprocess.Popen:
    """``shoal worker --nworkers 2 --name auto`` (two nannies in one process), once both joined."""
    group = start_shoal(processes, "worker", address, "--nworkers", "2", "--name", "auto")
    for _ in range(2):
        assert group.stdout.readline().startswith("shoal worker at tcp://")
    return group


@pytest.mark.timeout(90)
def test_a_killed_worker_is_restarted_by_its_nanny(processes, tmp_path):
    sched, address = start_scheduler(processes)
    nanny, first = start_worker(processes, address, env={"SHOAL_LOCAL_DIRECTORY": str(tmp_path)})
    with shoal.Client(address) as c:
        [info] = _workers(c).values()
        victim = info["pid"]
        assert victim != nanny.pid and info["nanny"]
        [work_dir] = _dirs(tmp_path)
        x = c.submit(np.full, (2 << 20) // 8, 3.0, pure=False)
        assert x.result(timeout=30).sum() == 3.0 * ((2 << 20) // 8)
        assert shm.segments_of(victim), "the value should be in a shared-memory segment"
        os.kill(victim, signal.SIGKILL)
        assert _line(nanny.stderr, "shoal worker:") == (
            f"shoal worker: worker pid {victim} exited with code -9; starting it again")
        wait_for(lambda: [w["pid"] for w in _workers(c).values()] not in ([], [victim]), timeout=30,
                 what="the new worker to join")
        assert first not in _workers(c)
        assert not shm.segments_of(victim)
        wait_for(lambda: len(_dirs(tmp_path)) == 1 and _dirs(tmp_path) != [work_dir], timeout=10,
                 what="the dead worker's directory to go")
        # the value it held is computed again
        assert x.result(timeout=30).sum() == 3.0 * ((2 << 20) // 8)
    nanny.terminate()
    assert nanny.wait(20) == 0
    assert not _dirs(tmp_path)


@pytest.mark.timeout(90)
def test_a_nanny_gives_up_after_repeated_crashes(processes):
    sched, address = start_scheduler(processes)
    nanny, _ = start_worker(processes, address, "--name", "fragile", env={"SHOAL_NANNY_MAX_RESTARTS": "1"})
    with shoal.Client(address) as c:
        f = c.submit(kill_self, pure=False)  # kills the worker, and its successor
        assert nanny.wait(60) == 1
        assert f.status == "pending"  # (it waits for a worker)
        err = nanny.stderr.read()
        assert "shoal worker: worker fragile died 2 times within 60s (nanny-max-restarts is 1): " \
               "not starting it again" in err, err
        assert "Traceback" not in err
        wait_for(lambda: not _workers(c), timeout=20, what="the scheduler to see it gone")


@pytest.mark.timeout(120)
def test_client_restart_of_a_command_line_cluster(processes):
    sched, address = start_scheduler(processes)
    start_shoal_worker_group(processes, address)
    with shoal.Client(address) as c:
        wait_for(lambda: len(_workers(c)) == 2, timeout=30, what="two workers")
        before = {w["name"]: w["pid"] for w in _workers(c).values()}
        x = c.submit(inc, 1)
        assert x.result(timeout=30) == 2
        c.restart(timeout=60)
        assert x.status == "cancelled"
        after = {w["name"]: w["pid"] for w in _workers(c).values()}
        assert sorted(after) == sorted(before) and set(after.values()).isdisjoint(before.values())
        assert c.submit(inc, 1).result(timeout=30) == 2  # the same key, computed afresh
        # a worker without a nanny: restart() says so, and cancels nothing
        start_worker(processes, address, "--no-nanny", "--name", "alone")
        wait_for(lambda: len(_workers(c)) == 3, timeout=30, what="the third worker")
        kept = c.submit(inc, 5)
        assert kept.result(timeout=30) == 6
        with pytest.raises(RuntimeError, match="supervisor.*--no-nanny"):
            c.restart(timeout=60)
        assert kept.status == "finished" and kept.result() == 6


@pytest.mark.timeout(60)
def test_no_nanny_runs_the_worker_in_the_process(processes):
    sched, address = start_scheduler(processes)
    worker, waddr = start_worker(processes, address, "--no-nanny", "--memory-limit", "1GiB")
    with shoal.Client(address) as c:
        info = _workers(c)[waddr]
        assert info["pid"] == worker.pid and info["nanny"] == ""
        assert c.submit(inc, 1).result(timeout=30) == 2
    worker.terminate()
    assert worker.wait(20) == 0


@pytest.mark.timeout(90)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_the_worker_ends_with_its_nanny(processes, tmp_path, sig):
    """SIGTERM: the nanny stops its worker in order; SIGKILL: the kernel tells the worker
    (PR_SET_PDEATHSIG), which closes by itself. Either way its segments and its
    directory go."""
    sched, address = start_scheduler(processes)
    nanny, waddr = start_worker(processes, address, "--local-directory", str(tmp_path))
    with shoal.Client(address) as c:
        child = _workers(c)[waddr]["pid"]
        x = c.submit(np.full, (2 << 20) // 8, 1.0, pure=False)
        x.result(timeout=30)
        assert shm.segments_of(child) and _dirs(tmp_path)
        os.kill(nanny.pid, sig)
        assert nanny.wait(20) == (0 if sig == signal.SIGTERM else -signal.SIGKILL)
        wait_for(lambda: shm.process_gone(child), timeout=20, what="the worker process to end")
        wait_for(lambda: not _workers(c), timeout=20, what="the scheduler to see it go")
    assert not shm.segments_of(child)
    assert not _dirs(tmp_path)


async def _ask(address: str, op: str, sec: security.Security | None) -> dict:
    comm = await connect(address, deserialize=False, security=sec)
    try:
        return await send_recv(comm, op)
    finally:
        comm.abort()


@pytest.mark.timeout(60)
def test_a_nanny_answers_identity_and_closes_when_asked(processes, tmp_path):
    import asyncio

    sched, address = start_scheduler(processes)
    nanny, waddr = start_worker(processes, address, "--name", "kept", "--memory-limit", "2GB",
                                "--local-directory", str(tmp_path))
    sec = security.for_address(address)  # the cluster's secret, from the scheduler's auth file
    with shoal.Client(address) as c:
        info = _workers(c)[waddr]
        ident = asyncio.run(_ask(info["nanny"], "identity", sec))
        assert ident == {"type": "Nanny", "address": info["nanny"], "name": "kept", "pid": nanny.pid,
                         "worker_pid": info["pid"], "memory_limit": 2_000_000_000, "restarts": 0,
                         "status": "running"}
        # a stranger is refused
        with pytest.raises(shoal.AuthenticationError):
            asyncio.run(_ask(info["nanny"], "identity", security.Security.new()))
        assert asyncio.run(_ask(info["nanny"], "nanny-close", sec)) is None
        assert nanny.wait(20) == 0
        wait_for(lambda: not _workers(c), timeout=20, what="the worker to leave")
    assert shm.process_gone(info["pid"]) and not _dirs(tmp_path)
