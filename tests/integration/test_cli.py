"""The command line: a scheduler and two workers as real processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

import shoal
from shoal_helpers import free_port, start_shoal


def test_scheduler_and_two_workers(processes):
    port = free_port()
    sched = start_shoal(processes, "scheduler", "--host", "127.0.0.1", "--port", str(port))
    line = sched.stdout.readline()
    assert line.strip() == f"shoal scheduler at tcp://127.0.0.1:{port}"
    address = line.split()[-1]
    workers = [start_shoal(processes, "worker", address, "--nthreads", "2", "--name", f"w{i}") for i in range(2)]
    for w in workers:
        assert w.stdout.readline().startswith("shoal worker at tcp://127.0.0.1:")
    with shoal.Client(address) as c:
        info = c.scheduler_info()
        assert len(info["workers"]) == 2
        assert sorted(w["name"] for w in info["workers"].values()) == ["w0", "w1"]
        assert all(w["nthreads"] == 2 for w in info["workers"].values())
        assert sum(c.gather(c.map(abs, range(-50, 50)))) == 2 * sum(range(51)) - 50
    # the secret the scheduler made is in a file only its user reads, found by the
    # workers and the client above without being told
    auth_line = sched.stdout.readline().split()
    assert auth_line[:4] == ["shoal", "scheduler", "auth", "file"]
    auth_file = auth_line[-1]
    assert os.stat(auth_file).st_mode & 0o777 == 0o600
    # a process without it (another user's view: another auth directory) is refused
    elsewhere = {**os.environ, "SHOAL_AUTH_DIR": os.path.join(os.path.dirname(auth_file), "elsewhere"),
                 "SHOAL_CONNECT_TIMEOUT": "2"}
    stranger = subprocess.run([sys.executable, "-m", "shoal", "worker", address], capture_output=True,
                              text=True, timeout=60, env=elsewhere)
    assert stranger.returncode != 0 and "AuthenticationError" in stranger.stderr
    assert "requires authentication" in stranger.stderr
    # workers stop on SIGTERM, the scheduler too, and it removes its auth file
    for p in [*workers, sched]:
        p.terminate()
    for p in [*workers, sched]:
        assert p.wait(10) == 0
    assert not os.path.exists(auth_file)


def test_no_auth_works_between_no_auth_ends_and_warns(processes):
    port = free_port()
    sched = start_shoal(processes, "scheduler", "--port", str(port), "--no-auth")
    address = sched.stdout.readline().split()[-1]
    warning = sched.stderr.readline()
    assert "WARNING" in warning and "--no-auth" in warning
    worker = start_shoal(processes, "worker", address, "--no-auth")
    assert worker.stdout.readline().startswith("shoal worker at ")
    with shoal.Client(address, security=shoal.Security(auth=False)) as c:
        assert c.submit(abs, -3).result(timeout=30) == 3
    # an end with a secret does not talk to one without
    with pytest.raises(shoal.AuthenticationError, match="the peer has no secret"):
        shoal.Client(address, security=shoal.Security.new(), timeout=5)


def test_worker_without_scheduler_fails_clearly(processes):
    port = free_port()
    p = subprocess.run([sys.executable, "-m", "shoal", "worker", f"tcp://127.0.0.1:{port}"],
                       capture_output=True, text=True, timeout=60,
                       env={**__import__("os").environ, "SHOAL_CONNECT_TIMEOUT": "0.5"})
    assert p.returncode != 0
    assert "could not connect" in p.stderr


def test_selfcheck_runs():
    p = subprocess.run([sys.executable, "-m", "shoal", "selfcheck", "--size-mb", "4"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "tcp" in p.stdout and "inproc" in p.stdout


def test_demo_runs_and_checks_its_results():
    p = subprocess.run([sys.executable, "-m", "shoal", "demo", "--n", "400", "--block", "100",
                        "--chunks", "4", "--chunk-size", "10000", "--arg-mb", "4"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("matches numpy") == 2
    assert p.stdout.count("a 4 MB array passed to a task as its argument: column sums agree with numpy") == 2
    counted = re.findall(r"([\d,]+) of 40,000 within", p.stdout)
    assert len(counted) == 2 and all(39_900 < int(c.replace(",", "")) <= 40_000 for c in counted)
    assert "by reference" in p.stdout and "over tcp" in p.stdout


def test_worker_that_loses_its_scheduler_exits_and_releases_shared_memory(processes):
    import os
    import signal

    import numpy as np

    from shoal.comm import shm

    sched = start_shoal(processes, "scheduler", "--host", "127.0.0.1", "--port", str(free_port()))
    address = sched.stdout.readline().split()[-1]
    worker = start_shoal(processes, "worker", address)
    assert worker.stdout.readline().startswith("shoal worker at ")
    c = shoal.Client(address)
    try:
        x = c.submit(np.full, (4 << 20) // 8, 3.0, pure=False)  # importable by the worker
        shoal.wait([x], timeout=30)
        assert x.status == "finished"
        assert shm.segments_of(worker.pid), "the value should be in a shared-memory segment"
        os.kill(sched.pid, signal.SIGKILL)  # nobody left who could sweep the worker's segments
        assert sched.wait(10) == -signal.SIGKILL
        # the worker notices, closes and exits cleanly on its own, its segments unlinked
        assert worker.wait(30) == 0
        assert not shm.segments_of(worker.pid)
        # the client sees its connection go: a value no one can serve is a clear error,
        # new work is refused; nothing hangs
        from shoal.errors import LostDataError

        with pytest.raises(LostDataError, match="connection to the scheduler"):
            x.result(timeout=30)
        with pytest.raises(RuntimeError, match="lost its connection"):
            c.submit(np.full, 8, 1.0, pure=False)
    finally:
        c.close(timeout=10)


@pytest.mark.filterwarnings("ignore:a task of .* MB of arguments:UserWarning")
def test_arguments_from_a_client_in_another_process_are_handed_over_in_shared_memory(processes):
    import os
    import signal

    import numpy as np

    from shoal.comm import shm
    from shoal.testing import wait_for

    def seen(a):
        """What the task sees of its argument: the first value, whether it may write to
        it, and the shared-memory files there are while it runs."""
        import os

        return float(a[0]), bool(a.flags.writeable), sorted(os.listdir("/dev/shm"))

    sched = start_shoal(processes, "scheduler", "--host", "127.0.0.1", "--port", str(free_port()))
    address = sched.stdout.readline().split()[-1]
    worker = start_shoal(processes, "worker", address, "--nthreads", "1")
    assert worker.stdout.readline().startswith("shoal worker at ")
    mine = set(shm.segments_of(os.getpid()))
    c = shoal.Client(address)
    try:
        w_addr = next(iter(c.scheduler_info()["workers"]))
        a = np.full((4 << 20) // 8, 2.0)
        x = c.submit(seen, a, pure=False)
        first, writeable, files = x.result(timeout=30)
        assert (first, writeable) == (2.0, True)
        # the scheduler took the client's transfer segment over (it may send the task
        # again); the client keeps nothing of it
        assert any(f.startswith(f"shoal-{sched.pid}-") for f in files), files
        assert set(shm.segments_of(os.getpid())) <= mine
        assert c.transfer_stats()[w_addr]["shm"] >= a.nbytes
        [held] = [f for f in files if f.startswith(f"shoal-{sched.pid}-")]
        inode = os.stat(os.path.join(shm.SHM_DIR, held)).st_ino
        del x
        wait_for(lambda: not shm.segments_of(sched.pid), what="the released task's argument to go")
        # it went back to this process, whose next argument of that size reuses it
        [returned] = [n for n in shm.segments_of(os.getpid()) if n not in mine]
        assert os.stat(os.path.join(shm.SHM_DIR, returned)).st_ino == inode
        # a scheduler killed while it holds an argument: its worker removes what it left
        y = c.submit(seen, a, pure=False)
        y.result(timeout=30)
        [held] = shm.segments_of(sched.pid)
        assert os.stat(os.path.join(shm.SHM_DIR, held)).st_ino == inode
        os.kill(sched.pid, signal.SIGKILL)
        assert sched.wait(10) == -signal.SIGKILL
        assert worker.wait(30) == 0
        assert not shm.segments_of(sched.pid)
    finally:
        c.close(timeout=10)
    assert set(shm.segments_of(os.getpid())) <= mine  # nothing of ours is left behind


@pytest.mark.filterwarnings("ignore:a task of .* MB of arguments:UserWarning")
def test_a_client_killed_after_large_arguments_leaves_no_files(processes):
    """Its transfer segments were taken over by the scheduler, which gives them back
    to the client; with the client killed, the scheduler removes what is named after it."""
    import os
    import signal

    from shoal.comm import shm
    from shoal.testing import wait_for

    sched = start_shoal(processes, "scheduler", "--host", "127.0.0.1", "--port", str(free_port()))
    address = sched.stdout.readline().split()[-1]
    worker = start_shoal(processes, "worker", address, "--nthreads", "1")
    assert worker.stdout.readline().startswith("shoal worker at ")
    code = (
        "import sys, numpy as np, shoal\n"
        f"c = shoal.Client({address!r})\n"
        "for i in range(3):\n"
        "    assert c.submit(np.sum, np.ones(1 << 18), pure=False).result(timeout=30) == 1 << 18\n"
        "print('done', flush=True)\n"
        "sys.stdin.read()\n"  # waits to be killed
    )
    client = subprocess.Popen([sys.executable, "-W", "ignore", "-c", code], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    processes.append(client)
    assert client.stdout.readline().strip() == "done", client.stderr.read()
    os.kill(client.pid, signal.SIGKILL)
    client.wait(10)
    client.stdin.close()
    wait_for(lambda: not shm.segments_of(client.pid), timeout=20, what="the killed client's files to go")
    wait_for(lambda: not shm.segments_of(sched.pid), timeout=20, what="its tasks' arguments to go")
    assert sched.poll() is None and worker.poll() is None
