"""Clusters on test hosts (network namespaces with a /dev/shm each, :mod:`shoal.testhosts`):
the scheduler on host 0, where the client code runs too, and ``shoal worker --nworkers
2`` on each other host, all started with the CLI and a shared secret."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shoal.testhosts import TestHosts, available

PORT = 8686

#: the client side of :class:`ClientSession`: runs each JSON line of code it reads in
#: one namespace and answers with the JSON of ``out`` (or the error's text)
_REPL = r"""
import json, sys, traceback
ns = {"json": json}
exec(sys.argv[1], ns)
print("READY", flush=True)
for line in sys.stdin:
    ns["out"] = None
    try:
        exec(json.loads(line), ns)
        reply = {"out": ns["out"]}
    except BaseException:
        reply = {"error": traceback.format_exc()}
    print("OUT" + json.dumps(reply), flush=True)
"""


def require_hosts() -> None:
    why = available()
    if why is not None:
        if os.environ.get("SHOAL_REQUIRE_HOSTS"):
            pytest.fail(why)
        pytest.skip(why)


#: where the processes of a test host started with ``scratch=True`` see their host's
#: own scratch directory (its TMPDIR and its workers' local directory)
SCRATCH = "scratch"


def _on_own_scratch(own: Path, seen_at: Path, argv: list[str]) -> list[str]:
    """``argv`` run with directory ``own`` mounted on ``seen_at`` (in the host's private
    mount namespace: the other hosts still see their own there), like a disk of its own."""
    return ["sh", "-c", 'mount --bind "$0" "$1" && shift && exec "$@"', str(own), str(seen_at), *argv]


@contextlib.contextmanager
def host_cluster(base: Path, n_hosts: int = 3, env: dict[str, str] | None = None,
                 shm_size: str = "256m", scratch: bool = False) -> Iterator[dict[str, Any]]:
    """A cluster on ``n_hosts`` test hosts; yields ``{"hosts", "address", "env",
    "workers": {host name: [worker address, ...]}}``. ``env`` is added to every
    process's environment (settings such as ``SHOAL_WORKER_TTL``). With ``scratch``,
    each host's workers have a scratch directory of their host's own, seen by all at
    the same path ``base/SCRATCH`` (their TMPDIR and local directory), as if each host
    had its own disk; ``"scratch"`` then maps each host's name to its directory."""
    require_hosts()
    secret = base / "secret"
    secret.write_text(secrets.token_hex(32))
    secret.chmod(0o600)
    env = {**os.environ, "SHOAL_AUTH_FILE": str(secret), "SHOAL_AUTH_DIR": str(base / "auth"), **(env or {})}
    with TestHosts(n_hosts, shm_size=shm_size) as hosts:
        h0 = hosts[0]
        address = f"tcp://{h0.ip}:{PORT}"
        s = h0.popen([sys.executable, "-m", "shoal", "scheduler", "--host", h0.ip, "--port", str(PORT),
                      "--no-dashboard", "--auth-file", str(secret)], stdout=subprocess.PIPE, text=True, env=env)
        assert s.stdout is not None and s.stdout.readline().startswith("shoal scheduler at "), s.poll()
        workers: dict[str, list[str]] = {}
        scratches: dict[str, str] = {}
        seen_at = base / SCRATCH
        for h in hosts[1:]:
            argv = [sys.executable, "-m", "shoal", "worker", address, "--host", h.ip, "--nworkers", "2",
                    "--memory-limit", "0", "--auth-file", str(secret)]
            worker_env = env
            if scratch:
                seen_at.mkdir(exist_ok=True)
                own = base / f"{SCRATCH}-{h.name}"
                own.mkdir()
                scratches[h.name] = str(own)
                argv = _on_own_scratch(own, seen_at, argv)
                worker_env = {**env, "TMPDIR": str(seen_at), "SHOAL_LOCAL_DIRECTORY": str(seen_at)}
            w = h.popen(argv, stdout=subprocess.PIPE, text=True, env=worker_env)
            assert w.stdout is not None
            workers[h.name] = sorted(w.stdout.readline().split()[-1] for _ in range(2))
        yield {"hosts": hosts, "address": address, "env": env, "workers": workers, "scratch": scratches}
    assert not os.path.exists(str(base / "auth")) or not os.listdir(base / "auth")


def _preamble(cluster: dict[str, Any]) -> str:
    n = sum(len(ws) for ws in cluster["workers"].values())
    return ("import json, shoal\n"
            f"W = {cluster['workers']!r}\n"
            f"c = shoal.Client({cluster['address']!r})\n"
            f"c.wait_for_workers({n}, timeout=60)\n")


def on_client_host(cluster: dict[str, Any], body: str) -> Any:
    """Run ``body`` (Python, with ``c`` a Client of the cluster and ``W`` the workers by
    host) on host 0; it sets ``out``, returned here from JSON."""
    script = _preamble(cluster) + "out = None\n" + body + "\nc.close()\nprint('OUT' + json.dumps(out))\n"
    done = cluster["hosts"][0].run([sys.executable, "-c", script], env=cluster["env"], timeout=150)
    lines = [line for line in done.stdout.splitlines() if line.startswith("OUT")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    return json.loads(lines[-1][3:])


class ClientSession:
    """A client process on host 0 that runs code step by step (between steps the test
    changes the network): ``step(code)`` runs ``code`` there, with ``c`` and ``W`` as in
    :func:`on_client_host` and the names of earlier steps, and returns its ``out``."""

    def __init__(self, cluster: dict[str, Any], preamble: str | None = None):
        self.process = cluster["hosts"][0].popen(
            [sys.executable, "-c", _REPL, _preamble(cluster) if preamble is None else preamble], env=cluster["env"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._line() == "READY"

    def _line(self) -> str:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        assert line, f"the client process ended (exit code {self.process.wait(timeout=10)})"
        return line.strip()

    def step(self, code: str) -> Any:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(code) + "\n")
        self.process.stdin.flush()
        line = self._line()
        while not line.startswith("OUT"):
            line = self._line()
        reply = json.loads(line[3:])
        assert "error" not in reply, reply["error"]
        return reply["out"]

    def close(self) -> None:
        self.step("if 'c' in globals(): c.close()")
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=30)


#: an sshd of a test host: root logs in with the test's key only
_SSHD_CONFIG = """\
ListenAddress {ip}
Port 22
HostKey {dir}/host_key
AuthorizedKeysFile {dir}/authorized_keys
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PidFile none
PrintMotd no
"""


def start_sshd(hosts: TestHosts, base: Path) -> dict[str, str]:
    """An sshd (Debian's openssh-server) on every test host, with keys made here; returns
    ``{"key": the client's private key, "known_hosts": a file of the hosts' keys}``.
    The daemons (and their logins) stop with the hosts."""
    sshd = "/usr/sbin/sshd"
    if not os.path.exists(sshd) or shutil.which("ssh") is None or shutil.which("ssh-keygen") is None:
        pytest.fail("the ssh tests need sshd and ssh (Debian's openssh-server and openssh-client)")
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation directory
    keys = base / "ssh"
    keys.mkdir(mode=0o700)
    for name in ("host_key", "id"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / name)], check=True,
                       capture_output=True, timeout=30)
    (keys / "authorized_keys").write_text((keys / "id.pub").read_text())
    host_key = (keys / "host_key.pub").read_text().split()
    (keys / "known_hosts").write_text("".join(f"{h.ip} {host_key[0]} {host_key[1]}\n" for h in hosts))
    for h in hosts:
        config = keys / f"sshd_config_{h.name}"
        config.write_text(_SSHD_CONFIG.format(ip=h.ip, dir=keys))
        check = subprocess.run([sshd, "-t", "-f", str(config)], capture_output=True, text=True, timeout=30)
        assert check.returncode == 0, check.stderr
        h.popen([sshd, "-D", "-e", "-f", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for h in hosts:  # each answers before the test goes on
        done = h.run(["ssh", "-T", "-o", "BatchMode=yes", "-o", f"UserKnownHostsFile={keys / 'known_hosts'}",
                      "-o", "ConnectionAttempts=20", "-i", str(keys / "id"), h.ip, "true"], timeout=60)
        assert done.returncode == 0, done.stderr
    return {"key": str(keys / "id"), "known_hosts": str(keys / "known_hosts")}
