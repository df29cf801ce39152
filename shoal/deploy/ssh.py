"""A cluster on machines reached by OpenSSH: :class:`SSHCluster` (and ``shoal ssh
HOST...`` on the command line) starts the scheduler on the first host and groups of
workers on the others, each through an ``ssh`` client process of this machine.

The ssh client is the machine's own (``ssh``: its configuration, agent and known hosts
apply), run with ``BatchMode`` (no password prompt can hang the cluster: use keys) and
keepalives, so that a host that goes away ends its processes' sessions. On the remote
side the command is ``REMOTE_PYTHON -m shoal.deploy.remote shoal ARGS``
(:mod:`.remote`): the cluster's secret arrives on the session's stdin, and the shoal
process stops when the session ends. The hosts need shoal installed for
``remote_python`` and an sshd this user can log in to with a key.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import signal
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from ..comm.security import Security
from .spec import DeployedCluster, DeployError, Launched, Launcher, ProcessSpec

__all__ = ["SSHCluster", "SSHLauncher"]

#: what connect_options may say, as asyncssh's names for them
CONNECT_OPTIONS = ("username", "port", "client_keys", "known_hosts", "config", "options", "connect_timeout")

#: what worker_options may say
WORKER_OPTIONS = ("n_workers", "nworkers", "nthreads", "memory_limit", "resources", "local_directory",
                  "death_timeout", "nanny", "host")

#: what scheduler_options may say
SCHEDULER_OPTIONS = ("port", "dashboard_address", "host")

#: the exit code of ssh for its own errors (no connection, no login)
SSH_FAILED = 255


def ssh_argv(host: str, command: list[str], options: Mapping[str, Any]) -> list[str]:
    """The ssh client's command line that runs ``command`` on ``host`` with
    connect options ``options`` (see :class:`SSHCluster`)."""
    unknown = set(options) - set(CONNECT_OPTIONS)
    if "password" in options:
        raise ValueError("SSHCluster logs in with keys only (ssh runs in batch mode): give client_keys, "
                         "or load the key into an ssh agent")
    if unknown:
        raise TypeError(f"unknown connect option(s) {sorted(unknown)}; known: {', '.join(CONNECT_OPTIONS)}")
    timeout = options.get("connect_timeout", 10)
    argv = ["ssh", "-T", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={int(timeout)}",
            "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3"]
    if options.get("config"):
        argv += ["-F", str(options["config"])]
    if options.get("username"):
        argv += ["-l", str(options["username"])]
    if options.get("port"):
        argv += ["-p", str(int(options["port"]))]
    keys = options.get("client_keys") or []
    for key in [keys] if isinstance(keys, (str, os.PathLike)) else keys:
        argv += ["-i", os.fspath(key), "-o", "IdentitiesOnly=yes"]
    if "known_hosts" in options:
        known = options["known_hosts"]
        if known is None:  # as asyncssh: no checking of host keys at all
            argv += ["-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR"]
        else:
            argv += ["-o", f"UserKnownHostsFile={os.fspath(known)}", "-o", "StrictHostKeyChecking=yes"]
    for name, value in (options.get("options") or {}).items():
        argv += ["-o", f"{name}={value}"]
    return [*argv, host, "--", shlex.join(command)]


class _SSHProcess(Launched):
    def __init__(self, spec: ProcessSpec, proc: asyncio.subprocess.Process):
        super().__init__(spec)
        self.proc = proc
        self._reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        try:
            while True:
                line = await self.proc.stdout.readline()
                if not line:
                    break
                self.add_line(line.decode("utf-8", "replace").rstrip("\r\n"))
            await self.proc.wait()
            if self.proc.returncode == SSH_FAILED:
                self.add_line(f"(ssh to {self.host} failed: exit code {SSH_FAILED}; could it connect and log in?)")
        finally:
            self.ended()

    @property
    def returncode(self) -> int | None:
        # only once its output is read: the lines say why it ended
        return self.proc.returncode if self._reader.done() else None

    async def stop(self, timeout: float) -> None:
        proc = self.proc
        if proc.returncode is None and proc.stdin is not None and not proc.stdin.is_closing():
            proc.stdin.close()  # the remote side sees its stdin end: the shoal process closes
        for sig in (None, signal.SIGTERM, signal.SIGKILL):
            if sig is not None and proc.returncode is None:
                proc.send_signal(sig)
            try:
                await asyncio.wait_for(asyncio.shield(self._reader), timeout if sig is None else 5.0)
                return
            except asyncio.TimeoutError:
                continue


class SSHLauncher(Launcher):
    """Starts each spec's command on its host by the ssh client; ``connect_options``
    maps a host to its options (see :class:`SSHCluster`)."""

    def __init__(self, connect_options: Mapping[str, Mapping[str, Any]], remote_python: Mapping[str, str]):
        self.connect_options = connect_options
        self.remote_python = remote_python

    async def start(self, spec: ProcessSpec) -> Launched:
        command = [self.remote_python[spec.host], "-m", "shoal.deploy.remote", *spec.argv]
        argv = ssh_argv(spec.host, command, self.connect_options.get(spec.host, {}))
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                start_new_session=True)  # (a Ctrl-C of this process is the cluster's to handle)
        except OSError as exc:
            raise DeployError(f"cannot run the ssh client for {spec.host}: {exc}") from exc
        launched = _SSHProcess(spec, proc)
        assert proc.stdin is not None
        proc.stdin.write(json.dumps({"env": spec.env}).encode() + b"\n")
        try:
            await proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            pass  # ssh is gone already: its output says why
        return launched


def _address_part(host: str) -> str:
    """The host of ``user@host``."""
    return host.rpartition("@")[2]


class SSHCluster(DeployedCluster):
    """``SSHCluster(hosts, connect_options=None, worker_options=None,
    scheduler_options=None, remote_python=None)``: the scheduler on ``hosts[0]``, a
    group of workers on each of ``hosts[1:]`` (name a host twice for two groups; name
    the scheduler's host again to have workers there too).

    ``connect_options``, one dict for every host or a list of one per host:
    ``username``, ``port``, ``client_keys`` (a key file or a list of them),
    ``known_hosts`` (a known-hosts file; None checks no host key, as asyncssh's None),
    ``config`` (an ssh_config file), ``options`` (more ``-o`` options of ssh),
    ``connect_timeout`` (seconds, default 10). Passwords are not supported: keys only.
    ``worker_options``: ``n_workers`` (worker processes per group, default 1),
    ``nthreads``, ``memory_limit``, ``resources``, ``local_directory``,
    ``death_timeout``, ``nanny`` (default True), ``host`` (the interface workers
    listen on; default the host's name as given). ``scheduler_options``: ``port``
    (default 8686; 0 picks a free one), ``dashboard_address`` (default ``":8790"``;
    None: none), ``host`` (default the first host's name).
    ``remote_python``: the interpreter on the hosts (one for all, or a list of one
    per host; default this one's path). ``env``: environment variables for every
    process started on the hosts (sent on the sessions' stdin, as the secret).

    ``security``: the cluster's credentials (default: a new secret). With TLS files
    (``Security(ca_file=, cert=, key=)``) the cluster is ``tls://``; the files' contents
    go to the hosts with the secret, on each session's stdin.

    ``scale(n)`` runs ``n`` worker processes (whole groups, over the worker hosts in
    turn); ``adapt(minimum=, maximum=)`` scales by the load (groups of one worker
    process); ``get_logs()``; ``close()``. A host that cannot be reached fails the start
    (or the scale) with :class:`~.spec.DeployError`, saying what ssh said.
    """

    def __init__(self, hosts: Sequence[str], connect_options: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None
                 = None, worker_options: Mapping[str, Any] | None = None,
                 scheduler_options: Mapping[str, Any] | None = None,
                 remote_python: str | Sequence[str] | None = None, env: Mapping[str, str] | None = None,
                 asynchronous: bool = False, timeout: float = 60.0, security: Security | None = None):
        hosts = [hosts] if isinstance(hosts, str) else list(hosts)
        if len(hosts) < 2 or not all(isinstance(h, str) and h for h in hosts):
            raise ValueError("SSHCluster needs at least two hosts: the scheduler's, then one per group of "
                             "workers (a host may be named twice)")
        self.hosts = hosts
        #: environment variables for every process started on the hosts
        self.env = {str(k): str(v) for k, v in (env or {}).items()}
        self._options = self._per_host(hosts, connect_options or {}, "connect_options")
        for options in self._options.values():
            ssh_argv("check", [], options)  # unknown names fail now, not on the first start
        pythons = self._per_host(hosts, remote_python or sys.executable, "remote_python")
        self.worker_options = dict(worker_options or {})
        unknown = set(self.worker_options) - set(WORKER_OPTIONS)
        if unknown:
            raise TypeError(f"unknown worker option(s) {sorted(unknown)}; known: {', '.join(WORKER_OPTIONS)}")
        self.scheduler_options = dict(scheduler_options or {})
        unknown = set(self.scheduler_options) - set(SCHEDULER_OPTIONS)
        if unknown:
            raise TypeError(f"unknown scheduler option(s) {sorted(unknown)}; known: {', '.join(SCHEDULER_OPTIONS)}")
        per_group = self.worker_options.get("n_workers", self.worker_options.get("nworkers", 1))
        if isinstance(per_group, bool) or not isinstance(per_group, int) or per_group < 1:
            raise ValueError(f"worker_options n_workers must be an integer >= 1, got {per_group!r}")
        nthreads = self.worker_options.get("nthreads", 1)
        if isinstance(nthreads, bool) or not isinstance(nthreads, int) or nthreads < 1:
            raise ValueError(f"worker_options nthreads must be an integer >= 1, got {nthreads!r}")
        self.threads_per_worker = nthreads
        super().__init__(SSHLauncher(self._options, pythons), workers_per_group=per_group,
                         asynchronous=asynchronous, timeout=timeout, security=security)
        self._begin(len(hosts) - 1)

    @staticmethod
    def _per_host(hosts: list[str], value: Any, what: str) -> dict[str, Any]:
        if isinstance(value, (str, Mapping)):
            return {h: value for h in hosts}
        values = list(value)
        if len(values) != len(hosts):
            raise ValueError(f"{what} has {len(values)} entries for {len(hosts)} hosts")
        out: dict[str, Any] = {}
        for h, v in zip(hosts, values):
            if h in out and out[h] != v:
                raise ValueError(f"{what}: host {h!r} is named twice with different settings")
            out[h] = v
        return out

    def _secret_env(self) -> dict[str, str]:
        # the hosts may not have this host's files: the TLS files go with the secret
        try:
            return self.security.to_env(inline=True)
        except OSError as exc:
            raise DeployError(f"cannot read the cluster's TLS files: {exc}") from exc

    def _scheduler_spec(self) -> ProcessSpec:
        host = self.hosts[0]
        opts = self.scheduler_options
        argv = ["scheduler", "--host", str(opts.get("host") or _address_part(host)),
                "--port", str(int(opts.get("port", 8686)))]
        dashboard = opts.get("dashboard_address", ":8790")
        argv += ["--no-dashboard"] if dashboard is None else ["--dashboard-address", str(dashboard)]
        return ProcessSpec("Scheduler", host, argv, env={**self.env, **self._secret_env()})

    def _worker_spec(self, name: str, index: int) -> ProcessSpec:
        worker_hosts = self.hosts[1:]
        host = worker_hosts[index % len(worker_hosts)]
        opts = self.worker_options
        argv = ["worker", self.scheduler_address, "--name", name, "--host", str(opts.get("host") or _address_part(host)),
                "--nworkers", str(self.workers_per_group), "--nthreads", str(int(opts.get("nthreads", 1)))]
        if opts.get("memory_limit") is not None:
            argv += ["--memory-limit", str(opts["memory_limit"] or 0)]
        if opts.get("resources"):
            from .processes import format_resources, check_resources

            argv += ["--resources", format_resources(check_resources(opts["resources"]))]
        if opts.get("local_directory"):
            argv += ["--local-directory", str(opts["local_directory"])]
        if opts.get("death_timeout") is not None:
            argv += ["--death-timeout", str(float(opts["death_timeout"]))]
        if opts.get("nanny") is False:
            argv.append("--no-nanny")
        return ProcessSpec(name, host, argv, env={**self.env, **self._secret_env()},
                           processes=self.workers_per_group)
