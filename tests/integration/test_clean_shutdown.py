"""SIGTERM and SIGINT end every shoal process cleanly: ``shoal scheduler``, ``shoal
worker`` and a process running a ``LocalCluster(processes=True)`` remove every
shared-memory segment they own before they exit, and exit promptly, also with a task
stuck in user code and with a second signal while they close.

One test per kind of segment: a result (a worker's own segment), a scattered value
(a client's transfer segment the worker keeps), a task's argument (a client's transfer
segment the scheduler adopts), a value fetched from a same-host peer (the peer's
transfer segment the fetching worker keeps), and the segments of a LocalCluster's
worker processes. Each first checks that the segment is there: a test that found
nothing to remove would prove nothing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

import shoal
from shoal.comm import shm
from shoal.testing import wait_for
from shoal_helpers import free_port, start_scheduler, start_shoal, start_worker

#: how long a process may take to exit once signalled (a clean exit takes well under a
#: second: a stuck task must not hold it up)
EXIT_DEADLINE = 10.0

#: what each test sends: one signal of each kind, and a second signal at once, which
#: finds the process closing
SIGNALS = [
    pytest.param([signal.SIGTERM], id="SIGTERM"),
    pytest.param([signal.SIGINT], id="SIGINT"),
    pytest.param([signal.SIGTERM, signal.SIGINT], id="SIGTERM-then-SIGINT"),
]

#: a value whose buffer is large enough for shared memory (64 KiB is the threshold of
#: results; 1 MiB that of transfers)
BIG = (2 << 20) // 8


def _start_stuck(client: shoal.Client, tmp_path, *args, **kwargs) -> shoal.Future:
    """Submit a task that takes ``args`` and never returns (stuck in user code, in an
    executor thread of its worker); wait until it runs."""
    marker = str(tmp_path / "stuck")

    def stuck(marker, *inputs):
        import threading

        open(marker, "w").close()
        threading.Event().wait()

    future = client.submit(stuck, marker, *args, pure=False, **kwargs)
    wait_for(lambda: os.path.exists(marker), timeout=30, what="the stuck task to run")
    return future


def _signal_and_wait(proc: subprocess.Popen, signals: list[int]) -> int:
    """Send ``signals`` to ``proc`` back to back; its exit code once it exited."""
    for sig in signals:
        proc.send_signal(sig)
    try:
        return proc.wait(EXIT_DEADLINE)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"process {proc.pid} did not exit within {EXIT_DEADLINE}s of {signals}") from None


def _assert_exited_clean(proc: subprocess.Popen, signals: list[int]) -> None:
    """``proc`` exits with 0 once sent ``signals`` (it stopped as it was asked, a
    second signal included), leaving no segment."""
    returncode = _signal_and_wait(proc, signals)
    err = proc.stderr.read() if proc.stderr is not None else ""
    assert returncode == 0, f"exit code {returncode}; stderr:\n{err}"
    assert "Traceback" not in err, err
    assert not shm.segments_of(proc.pid), (shm.segments_of(proc.pid), err)


@pytest.fixture
def own_segments():
    """The segments of this (test) process before the test: it leaves no new one."""
    before = set(shm.segments_of(os.getpid()))
    yield
    wait_for(lambda: set(shm.segments_of(os.getpid())) <= before, timeout=10,
             what="this process's transfer segments to go")


@pytest.mark.parametrize("signals", SIGNALS)
def test_worker_removes_its_results_segments(processes, tmp_path, own_segments, signals):
    """Results in the worker's segments, one released (its segment retired to the pool
    for reuse), with a task stuck in an executor thread."""
    sched, address = start_scheduler(processes)
    worker, _ = start_worker(processes, address, "--no-nanny", "--nthreads", "2")
    with shoal.Client(address) as c:
        kept = c.submit(np.full, BIG, 3.0, pure=False)
        released = c.submit(np.full, BIG, 4.0, pure=False)
        shoal.wait([kept, released], timeout=30)
        assert kept.status == released.status == "finished"
        assert len(shm.segments_of(worker.pid)) >= 2, "the results should be in shared memory"
        del released
        _start_stuck(c, tmp_path)
        _assert_exited_clean(worker, signals)
    _assert_exited_clean(sched, signals)


@pytest.mark.parametrize("signals", SIGNALS)
def test_worker_removes_scattered_values(processes, tmp_path, own_segments, signals):
    """A scattered array comes in a transfer segment of the client, which the worker
    keeps under its own name (its peers map it there)."""
    sched, address = start_scheduler(processes)
    worker, w_addr = start_worker(processes, address, "--no-nanny", "--nthreads", "1")
    with shoal.Client(address) as c:
        x = c.scatter(np.arange(BIG, dtype=np.float64), workers=[w_addr])
        assert shm.segments_of(worker.pid), "the scattered value should be kept in a segment"
        assert c.submit(np.sum, x).result(timeout=30) == np.arange(BIG, dtype=np.float64).sum()
        _start_stuck(c, tmp_path, x)
        _assert_exited_clean(worker, signals)
    _assert_exited_clean(sched, signals)


@pytest.mark.parametrize("signals", SIGNALS)
def test_scheduler_removes_adopted_arguments(processes, signals):
    """A client in a process of its own sends a large argument in a transfer segment;
    the scheduler keeps it under its own name while it knows the task. On a signal it
    gives the segment back to the client or removes it: nothing of it stays named after
    the scheduler, and nothing once the client has gone too."""
    sched, address = start_scheduler(processes)
    worker, _ = start_worker(processes, address, "--no-nanny")
    code = (
        "import sys, numpy as np, shoal\n"
        f"c = shoal.Client({address!r})\n"
        f"x = c.submit(np.sum, np.ones({BIG}), pure=False)\n"
        f"assert x.result(timeout=30) == {BIG}\n"
        "print('ready', flush=True)\n"
        "sys.stdin.read()\n"  # until the test closes stdin
        "c.close(timeout=10)\n"
    )
    client = subprocess.Popen([sys.executable, "-W", "ignore", "-c", code], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    processes.append(client)
    assert client.stdout.readline().strip() == "ready", client.stderr.read()
    assert shm.segments_of(sched.pid), "the scheduler should hold the task's argument in a segment"
    _assert_exited_clean(sched, signals)
    # told to close by the scheduler, the worker leaves too
    assert worker.wait(EXIT_DEADLINE) == 0, worker.stderr.read()
    assert not shm.segments_of(worker.pid)
    client.stdin.close()
    assert client.wait(EXIT_DEADLINE) == 0, client.stderr.read()
    assert not shm.segments_of(client.pid)


@pytest.mark.parametrize("signals", SIGNALS)
def test_worker_removes_values_fetched_from_a_peer(processes, tmp_path, own_segments, signals):
    """A value that its worker keeps in private memory (a shared-memory threshold too
    high for it) crosses to a same-host peer in a transfer segment, which the peer
    keeps as its copy; both workers leave nothing when signalled, the peer while a task
    that uses the value is stuck."""
    sched, address = start_scheduler(processes)
    private = {"SHOAL_SHM_THRESHOLD": str(1 << 40), "SHOAL_SHM_ALLOC_THRESHOLD": "0"}
    holder, h_addr = start_worker(processes, address, "--no-nanny", "--name", "holder", env=private)
    fetcher, f_addr = start_worker(processes, address, "--no-nanny", "--name", "fetcher")
    with shoal.Client(address) as c:
        x = c.submit(np.full, BIG, 5.0, pure=False, workers=[h_addr])
        shoal.wait([x], timeout=30)
        assert not shm.segments_of(holder.pid), "the holder should keep the value in private memory"
        _start_stuck(c, tmp_path, x, workers=[f_addr])
        assert shm.segments_of(fetcher.pid), "the fetched value should be kept in a transfer segment"
        _assert_exited_clean(fetcher, signals)
        _assert_exited_clean(holder, signals)
    _assert_exited_clean(sched, signals)


_CLUSTER_SCRIPT = """
import json, os, signal, sys, threading
import numpy as np
import shoal

# Ctrl-C as at a terminal, even when the test runs in the background (a shell starts
# a background job with SIGINT ignored, and Python then leaves it ignored)
signal.signal(signal.SIGINT, signal.default_int_handler)
marker, big = sys.argv[1], int(sys.argv[2])

def stuck(x):
    open(marker, "w").close()
    threading.Event().wait()

with shoal.LocalCluster(n_workers=2, threads_per_worker=2) as cluster, shoal.Client(cluster) as c:
    workers = c.scheduler_info()["workers"]
    first, second = sorted(workers)
    result = c.submit(np.full, big, 1.0, pure=False, workers=[first])
    scattered = c.scatter(np.ones(big), workers=[second])
    shoal.wait([result], timeout=30)
    task = c.submit(stuck, scattered, pure=False, workers=[second])
    print(json.dumps(sorted(w["pid"] for w in workers.values())), flush=True)
    sys.stdin.read()  # until the test signals this process
"""


@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT-to-group", "second-SIGTERM-while-closing"])
def test_local_cluster_process_leaves_nothing(processes, tmp_path, how):
    """A script with a ``LocalCluster(processes=True)``, its workers holding a result,
    a scattered value and a stuck task, ends on SIGTERM (exit code 143) or on Ctrl-C
    (SIGINT to its process group; Python's exit by SIGINT) with its workers stopped and
    no segment of any of them left. A second SIGTERM while it waits for a worker that
    does not stop (SIGSTOP) makes it kill them and leave at once, as clean."""
    marker = tmp_path / "stuck"
    # a session of its own: a Ctrl-C at a terminal goes to its whole process group
    script = subprocess.Popen([sys.executable, "-X", "faulthandler", "-c", _CLUSTER_SCRIPT, str(marker), str(BIG)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True)
    processes.append(script)
    line = script.stdout.readline()
    assert line.startswith("["), (line, script.poll(), script.poll() is not None and script.stderr.read())
    workers = json.loads(line)
    wait_for(marker.exists, timeout=30, what="the stuck task to run")
    assert len(workers) == 2 and all(shm.segments_of(pid) for pid in workers), [
        shm.segments_of(pid) for pid in workers]
    expected = 128 + signal.SIGTERM
    if how == "SIGINT-to-group":
        os.killpg(script.pid, signal.SIGINT)
        expected = -signal.SIGINT
    elif how == "SIGTERM":
        script.send_signal(signal.SIGTERM)
    else:
        stopped, other = workers
        os.kill(stopped, signal.SIGSTOP)  # the cluster's close waits for it (5 s)...
        script.send_signal(signal.SIGTERM)
        # ... once the other worker has gone, the close is under way
        wait_for(lambda: shm.process_gone(other), timeout=EXIT_DEADLINE, what="the other worker to exit")
        script.send_signal(signal.SIGTERM)
    try:
        returncode = script.wait(EXIT_DEADLINE)
    except subprocess.TimeoutExpired:
        # what it was doing: its threads' stacks (faulthandler on SIGABRT), then its words
        os.kill(script.pid, signal.SIGABRT)
        _, err = script.communicate(timeout=30)
        raise AssertionError(f"the cluster's process did not exit within {EXIT_DEADLINE}s:\n{err[-6000:]}") from None
    err = script.stderr.read()
    assert returncode == expected, err
    assert ("workers were killed" in err) == (how == "second-SIGTERM-while-closing"), err
    # the cluster stopped (or killed) and reaped its workers
    for pid in workers:
        assert shm.process_gone(pid)
    for pid in [script.pid, *workers]:
        assert not shm.segments_of(pid), (pid, shm.segments_of(pid), err)


#: installed (by PYTHONPATH) in the processes of the test below: at the interpreter's
#: exit, after ``main`` returned and just before CPython puts back the default action of
#: the signals it handled, a process writes what a SIGINT and a SIGTERM would do to it
_RECORD_AT_EXIT = """
import atexit, json, os, signal

def _record():
    names = {signal.SIG_IGN: "ignore", signal.SIG_DFL: "default"}
    found = {s.name: names.get(signal.getsignal(s), "handler") for s in (signal.SIGINT, signal.SIGTERM)}
    with open(os.path.join(os.environ["SHOAL_TEST_AT_EXIT"], f"{os.getpid()}.json"), "w") as f:
        json.dump(found, f)

atexit.register(_record)
"""


@pytest.mark.parametrize("command", ["scheduler", "worker", "worker-group"])
def test_a_late_second_signal_cannot_kill_a_process_that_has_cleaned_up(processes, tmp_path, command):
    """A process that closed on SIGTERM and removed what it owns ignores the signals
    that come while the interpreter finalizes: CPython restores their default action
    then, and a second signal a few milliseconds after the first would kill the process
    (exit code -2 rather than the 0 of a process that stopped as it was asked). Checked
    where it matters, at the interpreter's exit: the ``worker`` is its nanny's process
    and ``worker-group`` the parent of ``--nworkers 2 --no-nanny`` (a worker process
    itself leaves by ``os._exit``, with no finalization)."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(_RECORD_AT_EXIT)
    records = tmp_path / "records"
    records.mkdir()
    env = {"PYTHONPATH": os.pathsep.join([str(hooks), os.environ.get("PYTHONPATH", "")]),
           "SHOAL_TEST_AT_EXIT": str(records)}
    if command == "scheduler":
        proc = start_shoal(processes, "scheduler", "--host", "127.0.0.1", "--port", str(free_port()), env=env)
        assert proc.stdout.readline().startswith("shoal scheduler at "), proc.poll()
    else:
        _, address = start_scheduler(processes)
        extra = ["--nworkers", "2", "--no-nanny"] if command == "worker-group" else []
        proc = start_shoal(processes, "worker", address, *extra, env=env)
        for _ in range(2 if extra else 1):
            assert proc.stdout.readline().startswith("shoal worker at "), proc.poll()
    returncode = _signal_and_wait(proc, [signal.SIGTERM])
    assert returncode == 0, proc.stderr.read()
    recorded = json.loads((records / f"{proc.pid}.json").read_text())
    assert recorded == {"SIGINT": "ignore", "SIGTERM": "ignore"}, recorded
