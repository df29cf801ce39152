"""The command line: a scheduler and two workers as real processes."""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

import shoal
from shoal import cli
from shoal.deploy.processes import format_resources
from shoal.testing import wait_for
from shoal_helpers import free_port, start_scheduler, start_shoal


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
    p = subprocess.run([sys.executable, "-m", "shoal", "worker", f"tcp://127.0.0.1:{port}", "--death-timeout", "0.5"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1
    # one line while it waits, one when it gives up; no traceback
    assert p.stderr.splitlines() == [
        f"shoal worker: waiting for the scheduler at tcp://127.0.0.1:{port} (up to 0.5s, --death-timeout)",
        f"shoal worker: no scheduler at tcp://127.0.0.1:{port} within 0.5s (--death-timeout); exiting",
    ]
    assert p.stdout == ""
    # without waiting: one attempt (the connect timeout), then one line
    p = subprocess.run([sys.executable, "-m", "shoal", "worker", f"tcp://127.0.0.1:{port}", "--death-timeout", "0"],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "SHOAL_CONNECT_TIMEOUT": "0.5"})
    assert p.returncode == 1
    [line] = p.stderr.splitlines()
    assert line.startswith("shoal worker: CommConnectError: could not connect to tcp://127.0.0.1:")


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
    worker = start_shoal(processes, "worker", address, "--no-nanny", "--death-timeout", "0.5")
    assert worker.stdout.readline().startswith("shoal worker at ")
    c = shoal.Client(address)
    try:
        x = c.submit(np.full, (4 << 20) // 8, 3.0, pure=False)  # importable by the worker
        shoal.wait([x], timeout=30)
        assert x.status == "finished"
        assert shm.segments_of(worker.pid), "the value should be in a shared-memory segment"
        os.kill(sched.pid, signal.SIGKILL)  # nobody left who could sweep the worker's segments
        assert sched.wait(10) == -signal.SIGKILL
        # the worker notices, closes, waits for a scheduler in vain and exits on its own,
        # its segments unlinked
        assert worker.wait(30) == 1
        assert not shm.segments_of(worker.pid)
        err = worker.stderr.read()
        assert f"shoal worker: lost the scheduler at {address}; waiting up to 0.5s" in err
        assert f"shoal worker: no scheduler at {address} within 0.5s (--death-timeout); exiting" in err
        assert "Traceback" not in err
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
    worker = start_shoal(processes, "worker", address, "--nthreads", "1", "--death-timeout", "0")
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
        assert worker.wait(30) == 1  # its scheduler is gone (--death-timeout 0: it does not wait)
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


# ------------------------------------------------- options, waiting and reconnecting


def _walk(parser: argparse.ArgumentParser, path: str = "shoal") -> Iterator[tuple[str, argparse.Action]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield path, action
            for name, sub in action.choices.items():
                yield from _walk(sub, f"{path} {name}")
        else:
            yield path, action


def test_every_option_of_every_command_has_help():
    seen = 0
    for path, action in _walk(cli.parser()):
        if isinstance(action, argparse._HelpAction):
            continue
        what = f"{path} {'/'.join(action.option_strings) or action.dest}"
        assert action.help and action.help != argparse.SUPPRESS and len(action.help) > 10, f"{what} has no help"
        seen += 1
    assert seen > 20
    # and the help itself renders, for every command
    for command in ("", "demo", "selfcheck", "scheduler", "worker"):
        p = subprocess.run([sys.executable, "-m", "shoal", *command.split(), "--help"],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 0 and p.stdout.startswith("usage: shoal"), p.stderr


def test_version():
    p = subprocess.run([sys.executable, "-m", "shoal", "--version"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0
    assert p.stdout.strip() == f"shoal {shoal.__version__}"


def test_default_ports_are_not_dasks():
    assert cli.DEFAULT_SCHEDULER_PORT not in (8786, 8787)
    p = subprocess.run([sys.executable, "-m", "shoal", "scheduler", "--help"], capture_output=True, text=True,
                       timeout=60)
    assert f"(default: {cli.DEFAULT_SCHEDULER_PORT})" in " ".join(p.stdout.split())
    assert cli.parser().parse_args(["scheduler"]).port == cli.DEFAULT_SCHEDULER_PORT


@pytest.mark.parametrize("text, parsed", [
    ("GPU=2,MEM=10e9", {"GPU": 2.0, "MEM": 1e10}),
    ("GPU=2 MEM=1", {"GPU": 2.0, "MEM": 1.0}),
    (" GPU=0.5, ", {"GPU": 0.5}),
    ("", {}),
])
def test_resources_syntax(text, parsed):
    assert cli.parse_resources(text) == parsed
    assert cli.parse_resources(format_resources(parsed)) == parsed


@pytest.mark.parametrize("text, error", [
    ("GPU", "'GPU' is not NAME=AMOUNT"), ("=2", "'=2' is not NAME=AMOUNT"), ("GPU=", "'GPU=' is not NAME=AMOUNT"),
    ("GPU=two", "GPU: 'two' is not a number"), ("GPU=-1", "finite number >= 0"), ("GPU=inf", "finite number >= 0"),
    ("GPU=1,GPU=2", "GPU is given twice"),
])
def test_bad_resources_are_a_clear_usage_error(text, error):
    with pytest.raises(ValueError, match=re.escape(error)):
        cli.parse_resources(text)
    p = subprocess.run([sys.executable, "-m", "shoal", "worker", "tcp://127.0.0.1:1", "--resources", text],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    last = p.stderr.splitlines()[-1]
    assert last.startswith(f"shoal worker: error: argument --resources: bad --resources {text!r}: ") and error in last
    assert "Traceback" not in p.stderr


def test_nworkers_nthreads_resources_and_names(processes):
    sched, address = start_scheduler(processes)
    group = start_shoal(processes, "worker", address, "--nworkers", "2", "--nthreads", "2",
                        "--resources", "GPU=2,MEM=10e9", "--name", "gpu")
    lines = [group.stdout.readline() for _ in range(2)]
    assert all(line.startswith("shoal worker at tcp://127.0.0.1:") for line in lines), lines
    with shoal.Client(address) as c:
        wait_for(lambda: len(c.scheduler_info()["workers"]) == 2, what="both workers")
        info = c.scheduler_info()["workers"]
        assert sorted(w["name"] for w in info.values()) == ["gpu-0", "gpu-1"]
        assert all(w["nthreads"] == 2 for w in info.values())
        assert len({w["pid"] for w in info.values()} | {group.pid}) == 3  # a process each
        # tasks that need the whole of what one worker offers run, one per worker at a time
        futures = [c.submit(abs, -i, resources={"GPU": 2, "MEM": 10e9}, pure=False) for i in range(4)]
        assert c.gather(futures) == [0, 1, 2, 3]
    group.terminate()  # passed on to both workers, which close
    assert group.wait(20) == 0


def _line(stream, prefix: str) -> str:
    """The next line of ``stream`` that starts with ``prefix`` (the test's timeout bounds it)."""
    while True:
        line = stream.readline()
        assert line, f"the stream ended before a line starting with {prefix!r}"
        if line.startswith(prefix):
            return line.rstrip("\n")


@pytest.mark.timeout(90)
def test_a_worker_waits_for_its_scheduler_and_rejoins_it_when_it_comes_back(processes):
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    worker = start_shoal(processes, "worker", address, "--name", "patient", "--death-timeout", "30")
    assert _line(worker.stderr, "shoal worker:") == (
        f"shoal worker: waiting for the scheduler at {address} (up to 30s, --death-timeout)")
    sched = start_shoal(processes, "scheduler", "--port", str(port))
    assert sched.stdout.readline().strip() == f"shoal scheduler at {address}"
    assert worker.stdout.readline().startswith("shoal worker at tcp://127.0.0.1:")
    with shoal.Client(address) as c:
        wait_for(lambda: [w["name"] for w in c.scheduler_info()["workers"].values()] == ["patient"],
                 what="the worker to join")
        assert c.submit(abs, -1).result(timeout=30) == 1
    # the scheduler dies (its secret stays in its auth file); another one comes up at
    # the same address, with a new secret: the worker joins it
    os.kill(sched.pid, signal.SIGKILL)
    assert sched.wait(10) == -signal.SIGKILL
    assert _line(worker.stderr, "shoal worker:") == (
        f"shoal worker: lost the scheduler at {address}; waiting up to 30s for it to come back")
    again = start_shoal(processes, "scheduler", "--port", str(port))
    assert again.stdout.readline().strip() == f"shoal scheduler at {address}"
    rejoined = _line(worker.stderr, "shoal worker:")
    assert rejoined.startswith(f"shoal worker: reconnected to the scheduler at {address} (this worker is now at ")
    with shoal.Client(address) as c:
        wait_for(lambda: [w["name"] for w in c.scheduler_info()["workers"].values()] == ["patient"],
                 what="the worker to join again")
        assert c.submit(abs, -2).result(timeout=30) == 2
    # a scheduler that shuts down tells its workers to close: no waiting for it then
    again.terminate()
    assert again.wait(20) == 0
    assert worker.wait(20) == 0
    assert "Traceback" not in worker.stderr.read()


def test_a_signal_while_waiting_for_the_scheduler_stops_the_worker(processes):
    port = free_port()
    worker = start_shoal(processes, "worker", f"tcp://127.0.0.1:{port}", "--death-timeout", "60")
    assert _line(worker.stderr, "shoal worker:").startswith("shoal worker: waiting for the scheduler")
    worker.terminate()
    assert worker.wait(20) == 0
