"""Deployment through OpenSSH: real sshd daemons on three test hosts, keys made by the
test. The client code (``SSHCluster``, ``shoal ssh``) runs on host 0, as on a user's
machine; the scheduler goes to the first host named and groups of workers to the others,
each through an ``ssh`` session."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
from hostcluster import ClientSession, require_hosts, start_sshd

from shoal.testhosts import TestHosts
from shoal.testing import wait_for

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    require_hosts()
    base = tmp_path_factory.mktemp("ssh")
    with TestHosts(3, shm_size="256m") as th:
        keys = start_sshd(th, base)
        env = {**os.environ, "SHOAL_AUTH_DIR": str(base / "auth")}
        env.pop("SHOAL_AUTH", None)
        env.pop("SHOAL_AUTH_FILE", None)
        yield {"hosts": th, "env": env, "base": base, **keys}


def _shoal_processes(host: Any) -> list[str]:
    """The command lines of shoal processes on ``host`` (its network namespace)."""
    pids = subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True, text=True, timeout=30).stdout
    out = []
    for pid in pids.split():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "-m shoal" in cmd:
            out.append(cmd)
    return out


def _session(hosts: dict[str, Any]) -> ClientSession:
    ips = [h.ip for h in hosts["hosts"]]
    preamble = ("import json, shoal\n"
                f"IPS = {ips!r}\n"
                f"CONNECT = {{'client_keys': {hosts['key']!r}, 'known_hosts': {hosts['known_hosts']!r}}}\n"
                f"ENV = {{'SHOAL_AUTH_DIR': {str(hosts['base'] / 'remote-auth')!r}}}\n"
                # an SSHCluster of these hosts (groups of n_workers one-thread workers) and a client
                "def start(n_workers=1, **options):\n"
                "    cluster = shoal.SSHCluster(IPS, connect_options=CONNECT, env=ENV, **options,\n"
                "        worker_options={'n_workers': n_workers, 'nthreads': 1, 'memory_limit': 0},\n"
                "        scheduler_options={'port': 0, 'dashboard_address': None})\n"
                "    return cluster, shoal.Client(cluster)\n")
    return ClientSession(hosts, preamble=preamble)


def test_sshcluster_runs_tasks_scales_logs_and_closes(hosts: dict[str, Any]) -> None:
    h0, h1, h2 = hosts["hosts"]
    s = _session(hosts)
    try:
        started = s.step("""
from operator import add
cluster, c = start(n_workers=2)
info = c.scheduler_info()["workers"]
xs = c.map(lambda i: i * i, range(40))
while len(xs) > 1:
    xs = [c.submit(add, a, b) for a, b in zip(xs[::2], xs[1::2])] + ([xs[-1]] if len(xs) % 2 else [])
out = {"address": cluster.scheduler_address, "workers": sorted(info),
       "names": sorted(w["name"] for w in info.values()), "groups": dict(cluster.worker_addresses),
       "total": xs[0].result(timeout=60), "repr": repr(cluster), "secret": cluster.security.secret.decode()}
""")
        assert started["address"].startswith(f"tcp://{h0.ip}:")
        # a group of two worker processes on each worker host, named after their group
        assert [a.split("//")[1].split(":")[0] for a in started["workers"]] == [h1.ip] * 2 + [h2.ip] * 2
        assert started["names"] == ["worker-0-0", "worker-0-1", "worker-1-0", "worker-1-1"]
        assert sorted(sum(started["groups"].values(), [])) == started["workers"]
        assert started["total"] == sum(i * i for i in range(40))
        assert "SSHCluster" in started["repr"] and "4 workers" in started["repr"]
        running = {h.name: _shoal_processes(h) for h in (h0, h1, h2)}
        assert len(running["host1"]) >= 3, running  # the remote runner, the nanny process, its workers
        # the secret reached them on the sessions' stdin, never on a command line
        assert not [cmd for cmds in running.values() for cmd in cmds if started["secret"] in cmd]

        # scale up: one more group, on the worker hosts in turn (host 1 again); down:
        # the newest groups stop, and the scheduler has seen them go when scale returns
        scaled = s.step("""
cluster.scale(6)
up = sorted(c.scheduler_info()["workers"])
groups_up = sorted(cluster.worker_addresses)
cluster.scale(2)
down = sorted(c.scheduler_info()["workers"])
out = {"up": up, "groups_up": groups_up, "down": down, "groups_down": dict(cluster.worker_addresses),
       "again": c.submit(lambda: 7).result(timeout=60)}
""")
        assert len(scaled["up"]) == 6 and scaled["groups_up"] == ["worker-0", "worker-1", "worker-2"]
        assert sum(a.startswith(f"tcp://{h1.ip}:") for a in scaled["up"]) == 4
        assert scaled["down"] == sorted(scaled["groups_down"]["worker-0"]) and len(scaled["down"]) == 2
        assert scaled["again"] == 7
        assert not _shoal_processes(h2)  # worker-1's processes are gone from host 2

        # the session of a group dies (its ssh client killed, as by a broken link): its
        # workers stop on their host and leave; the next scale() replaces the group
        lost = s.step("""
import os, signal
from shoal.testing import wait_for
gone = list(cluster.worker_addresses["worker-0"])
os.kill(cluster.workers["worker-0"].proc.pid, signal.SIGKILL)
wait_for(lambda: not set(gone) & set(c.scheduler_info()["workers"]), timeout=60, what="its workers to leave")
cluster.scale(2)
out = {"workers": sorted(c.scheduler_info()["workers"]), "groups": sorted(cluster.workers),
       "again": c.submit(lambda: 8).result(timeout=60)}
""")
        wait_for(lambda: not _shoal_processes(h1), timeout=60, what="host 1's processes to end")
        assert lost["groups"] == ["worker-3"] and lost["again"] == 8
        assert [a.split("//")[1].split(":")[0] for a in lost["workers"]] == [h2.ip] * 2

        logs = s.step("""
logs = cluster.get_logs()
out = {k: v for k, v in logs.items()}
c.close()
cluster.close()
out["status"] = cluster.status
""")
        assert logs.pop("status") == "closed"
        assert set(logs) == {"Scheduler", "worker-0", "worker-1", "worker-2", "worker-3"}
        assert "shoal scheduler at " + started["address"] in logs["Scheduler"]
        assert logs["worker-1"].count("shoal worker at ") == 2
        # closed: nothing of shoal is left on any host
        for h in (h0, h1, h2):
            assert not _shoal_processes(h), _shoal_processes(h)
    finally:
        s.step("if 'cluster' in globals(): cluster.close()")
        s.close()


def test_a_host_that_cannot_be_reached_is_a_clear_error(hosts: dict[str, Any]) -> None:
    h0, h1, h2 = hosts["hosts"]
    s = _session(hosts)
    try:
        out = s.step("""
errors = {}
# host 2's sshd does not listen on port 2222: ssh's connection is refused
opts = [CONNECT, CONNECT, dict(CONNECT, port=2222)]
try:
    shoal.SSHCluster(IPS, connect_options=opts, env=ENV, scheduler_options={"port": 0, "dashboard_address": None})
except shoal.DeployError as exc:
    errors["refused"] = str(exc)
# a key the hosts do not know: no login (and no password prompt: batch mode)
import subprocess, tempfile
other = tempfile.mkdtemp() + "/other"
subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", other], check=True)
try:
    shoal.SSHCluster(IPS[:2], connect_options=dict(CONNECT, client_keys=other), env=ENV,
                     scheduler_options={"port": 0, "dashboard_address": None})
except shoal.DeployError as exc:
    errors["denied"] = str(exc)
try:
    shoal.SSHCluster(IPS[:1])
except ValueError as exc:
    errors["one host"] = str(exc)
try:
    shoal.SSHCluster(IPS, connect_options=dict(CONNECT, password="x"))
except ValueError as exc:
    errors["password"] = str(exc)
try:
    shoal.SSHCluster(IPS, worker_options={"n_wrokers": 2})
except TypeError as exc:
    errors["typo"] = str(exc)
out = errors
""")
        assert h2.ip in out["refused"] and "refused" in out["refused"].lower(), out["refused"]
        assert "255" in out["refused"]
        assert h0.ip in out["denied"] and "permission denied" in out["denied"].lower(), out["denied"]
        assert "two hosts" in out["one host"]
        assert "keys only" in out["password"]
        assert "n_wrokers" in out["typo"]
        # what did start (the schedulers) was stopped again
        for h in (h0, h1, h2):
            assert not _shoal_processes(h), _shoal_processes(h)
    finally:
        s.close()


@pytest.mark.parametrize("tls", [False, True])
def test_shoal_ssh_on_the_command_line(hosts: dict[str, Any], tls: bool) -> None:
    h0, h1, h2 = hosts["hosts"]
    env = dict(hosts["env"], SHOAL_AUTH_DIR=str(hosts["base"] / "cli-auth"))
    flags: list[str] = []
    if tls:
        from shoal import Security

        sec = Security.temporary()
        flags = ["--tls-ca-file", str(sec.ca_file), "--tls-cert", str(sec.cert), "--tls-key", str(sec.key)]
        # the client on this machine: the secret from the auth file, the TLS files from here
        env.update(SHOAL_TLS_CA_FILE=str(sec.ca_file), SHOAL_TLS_CERT=str(sec.cert), SHOAL_TLS_KEY=str(sec.key))
    p = h0.popen([sys.executable, "-m", "shoal", "ssh", h0.ip, h1.ip, h2.ip, "--nworkers", "1",
                  "--ssh-key", hosts["key"], "--known-hosts", hosts["known_hosts"], "--scheduler-port", "0",
                  "--no-dashboard", *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert p.stdout is not None and p.stderr is not None
    first = p.stdout.readline()
    assert first.startswith("shoal scheduler at "), (first, p.poll())
    address = first.split()[-1]
    assert address.startswith("tls://" if tls else "tcp://"), address
    lines = [p.stdout.readline().strip() for _ in range(2)]
    assert [line.split()[0:3] for line in lines] == [["shoal", "worker", "at"]] * 2, lines
    # a client on this machine finds the secret in the auth file the command wrote
    s = ClientSession({"hosts": hosts["hosts"], "env": env},
                      preamble=f"import json, shoal\nc = shoal.Client({address!r})\nc.wait_for_workers(2, timeout=60)\n")
    try:
        out = s.step("out = {'hosts': sorted(a.split('//')[1].split(':')[0] "
                     "for a in c.scheduler_info()['workers']), 'v': c.submit(lambda: 6 * 7).result(timeout=60)}")
    finally:
        s.close()
    assert out == {"hosts": [h1.ip, h2.ip], "v": 42}
    p.send_signal(signal.SIGINT)  # as a Ctrl-C: everything it started stops
    assert p.wait(timeout=60) == 0, p.stderr.read()
    for h in (h0, h1, h2):
        assert not _shoal_processes(h), _shoal_processes(h)
    assert not os.listdir(hosts["base"] / "cli-auth")


def test_sshcluster_with_tls_sends_the_files_to_the_hosts_and_removes_them(hosts: dict[str, Any]) -> None:
    h0, h1, h2 = hosts["hosts"]
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "shoal-tls-*")))
    s = _session(hosts)
    try:
        out = s.step("""
import glob, os, tempfile
sec = shoal.Security.temporary()
cluster, c = start(security=sec)
c.wait_for_workers(2, timeout=60)
key = open(sec.key).read()
out = {"address": cluster.scheduler_address, "workers": sorted(c.scheduler_info()["workers"]),
       "total": c.submit(sum, range(10)).result(timeout=60),
       "dirs": {d: [os.stat(d).st_mode & 0o777] + [os.stat(os.path.join(d, f)).st_mode & 0o777
                                                   for f in sorted(os.listdir(d))]
                for d in glob.glob(os.path.join(tempfile.gettempdir(), "shoal-tls-*"))},
       "key_line": key.splitlines()[1], "own": os.path.dirname(sec.key)}
""")
        running = [cmd for h in (h0, h1, h2) for cmd in _shoal_processes(h)]
        s.step("c.close()\ncluster.close()\nout = cluster.status")
    finally:
        s.step("if 'cluster' in globals(): cluster.close()")
        s.close()
    assert out["address"].startswith(f"tls://{h0.ip}:")
    assert [a.split("//")[0] for a in out["workers"]] == ["tls:", "tls:"]
    assert out["total"] == 45
    # the files went on the sessions' stdin, each process's host wrote them to a
    # private directory (one per process started), removed when it ended
    made = {d: modes for d, modes in out["dirs"].items() if d not in before and d != out["own"]}
    # the scheduler's and each worker group's: the directory 700, its CA, cert and key 600
    assert sorted(made.values()) == [[0o700, 0o600, 0o600, 0o600]] * 3, made
    assert not [cmd for cmd in running if out["key_line"] in cmd]
    assert not set(glob.glob(os.path.join(tempfile.gettempdir(), "shoal-tls-*"))) - before - {out["own"]}
    for h in (h0, h1, h2):
        assert not _shoal_processes(h), _shoal_processes(h)


def test_sshcluster_adapts_to_the_load(hosts: dict[str, Any]) -> None:
    """The policy runs in the client's process and reads the remote scheduler's state
    through its ``adaptive-plan`` op: groups start while tasks wait, and the idle ones
    stop once their values are safe (nothing needed is lost)."""
    s = _session(hosts)
    try:
        out = s.step("""
import time
from shoal.testing import wait_for
cluster, c = start()
started = len(cluster.workers)
adaptive = cluster.adapt(minimum=1, maximum=4, interval=0.2, wait_count=2, target_duration=0.5)
futures = c.map(lambda i: (time.sleep(0.2), i)[1], range(40))
wait_for(lambda: len(c.scheduler_info()["workers"]) == 4, timeout=90, what="four workers")
busiest = len(cluster.workers)
kept = c.submit(lambda: "kept", pure=False)
total = sum(c.gather(futures))
kept.result(timeout=60)
del futures
# idle: the groups go down to the one holding the value still wanted (or the minimum)
wait_for(lambda: len(cluster.workers) == 1 and len(c.scheduler_info()["workers"]) == 1, timeout=90,
         what="one group left, and the scheduler to have seen the others go")
out = {"started": started, "busiest": busiest, "total": total, "kept": kept.result(timeout=60),
       "left": len(c.scheduler_info()["workers"]), "repr": repr(adaptive)}
adaptive.stop()
c.close()
cluster.close()
""")
    finally:
        s.step("if 'cluster' in globals(): cluster.close()")
        s.close()
    assert out["started"] == 2 and out["busiest"] == 4
    assert out["total"] == sum(range(40)) and out["kept"] == "kept"
    assert out["left"] == 1 and "Adaptive minimum=1 maximum=4" in out["repr"]
