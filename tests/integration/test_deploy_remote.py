"""The pieces of SSH deployment that need no sshd: ``python -m shoal.deploy.remote``
(the command a launcher runs on the far side of a pipe) and how SSHCluster turns its
options into ssh's command line. The whole path through real sshd daemons is in
tests/hosts/test_ssh.py."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import shoal
from shoal.deploy.ssh import ssh_argv

pytestmark = pytest.mark.timeout(60)


def _runner(args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "shoal.deploy.remote", *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(p: subprocess.Popen[str]) -> tuple[int, str]:
    try:
        code = p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.stderr is not None and p.stdout is not None
    err = p.stderr.read()
    for stream in (p.stdin, p.stdout, p.stderr):
        if stream is not None:
            stream.close()
    return code, err


@pytest.mark.parametrize("how", ["stdin ends", "SIGTERM", "SIGHUP"])
def test_the_runner_hands_over_its_settings_and_stops_the_process_when_its_session_ends(
        tmp_path: Path, how: str) -> None:
    secret = secrets.token_hex(32)
    p = _runner(["scheduler", "--port", "0", "--no-dashboard"])
    try:
        assert p.stdin is not None and p.stdout is not None
        p.stdin.write(json.dumps({"env": {"SHOAL_AUTH": secret, "SHOAL_AUTH_DIR": str(tmp_path)}}) + "\n")
        p.stdin.flush()
        first = p.stdout.readline()
        assert first.startswith("shoal scheduler at "), first
        address = first.split()[-1]
        # the secret came by stdin: the scheduler admits a client that proves it
        with shoal.Client(address, security=shoal.Security(secret), timeout=10) as c:
            assert c.scheduler_info()["address"] == address
        assert os.listdir(tmp_path) == [f"port-{address.rpartition(':')[2]}"]
        if how == "stdin ends":
            p.stdin.close()  # an ssh session that ends
        else:
            p.send_signal(signal.SIGTERM if how == "SIGTERM" else signal.SIGHUP)
    finally:
        code, err = _finish(p)
    # the scheduler closed as for a Ctrl-C: exit code 0, its auth file removed
    assert code == 0, err
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("line, says", [
    ("", "stdin ended before the settings line"),
    ("not json\n", "bad settings line"),
    ('{"no env": 1}\n', "bad settings line"),
    ('{"env": {"A": 1}}\n', "must map names to strings"),
])
def test_the_runner_refuses_a_bad_settings_line(line: str, says: str) -> None:
    p = _runner(["scheduler", "--port", "0"])
    assert p.stdin is not None
    p.stdin.write(line)
    p.stdin.close()
    code, err = _finish(p)
    assert code == 1 and says in err, err


def test_connect_options_become_ssh_options(tmp_path: Path) -> None:
    argv = ssh_argv("user@node-1", ["python3", "-m", "shoal.deploy.remote", "worker", "tcp://a b:1"],
                    {"username": "ann", "port": 2200, "client_keys": ["/k1", "/k2"], "known_hosts": "/kh",
                     "config": "/cfg", "options": {"Compression": "yes"}, "connect_timeout": 4})
    pairs = [f"{a} {b}" for a, b in zip(argv, argv[1:])]
    assert argv[:2] == ["ssh", "-T"]
    for expected in ("-o BatchMode=yes", "-o ConnectTimeout=4", "-l ann", "-p 2200", "-i /k1", "-i /k2",
                     "-F /cfg", "-o UserKnownHostsFile=/kh", "-o StrictHostKeyChecking=yes",
                     "-o Compression=yes"):
        assert expected in pairs, expected
    # the remote command is one word for the remote shell, quoted
    assert argv[-3:] == ["user@node-1", "--", "python3 -m shoal.deploy.remote worker 'tcp://a b:1'"]
    # known_hosts None: no host key checking at all (as asyncssh's None)
    loose = ssh_argv("h", [], {"known_hosts": None})
    assert "StrictHostKeyChecking=no" in loose and "UserKnownHostsFile=/dev/null" in loose


@pytest.mark.parametrize("kwargs, error, says", [
    ({"hosts": ["a"]}, ValueError, "at least two hosts"),
    ({"hosts": "ab"}, ValueError, "at least two hosts"),
    ({"hosts": ["a", "b"], "connect_options": {"password": "x"}}, ValueError, "keys only"),
    ({"hosts": ["a", "b"], "connect_options": {"usrname": "x"}}, TypeError, "usrname"),
    ({"hosts": ["a", "b"], "connect_options": [{}]}, ValueError, "1 entries for 2 hosts"),
    ({"hosts": ["a", "b"], "worker_options": {"n_workers": 0}}, ValueError, "n_workers"),
    ({"hosts": ["a", "b"], "worker_options": {"threads": 2}}, TypeError, "threads"),
    ({"hosts": ["a", "b"], "scheduler_options": {"prot": 1}}, TypeError, "prot"),
    ({"hosts": ["a", "b", "a"], "remote_python": ["p1", "p2", "p3"]}, ValueError, "named twice"),
])
def test_sshcluster_arguments_are_checked_before_anything_starts(kwargs: dict[str, Any], error: type,
                                                                 says: str) -> None:
    with pytest.raises(error, match=says):
        shoal.SSHCluster(**kwargs)


def test_shoal_ssh_needs_a_host() -> None:
    done = subprocess.run([sys.executable, "-m", "shoal", "ssh"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "HOST" in done.stderr
