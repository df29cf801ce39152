"""Workers as Slurm jobs: :class:`SlurmCluster`, in the manner of dask-jobqueue.

The scheduler runs in this process (on the cluster's event loop), listening on an
address the compute nodes reach; each job runs ``shoal worker`` with ``processes``
worker processes that share its ``cores`` and ``memory``. A job script is rendered from
the cluster's settings (``cluster.job_script()`` shows the next one) and handed to
``sbatch``; ``scale(jobs=)`` submits or cancels jobs (``scancel``: its workers get a
SIGTERM and leave the scheduler as for a Ctrl-C), and ``adapt()`` does it by the load.
Jobs may wait in Slurm's queue: ``scale`` returns once they are submitted, and
``client.wait_for_workers(n)`` waits for their workers.

The secret goes to a file only this user may read (in ``log_directory``, which the
nodes must see: a shared file system), named by ``--auth-file`` in the script: the
script holds no secret. What each job prints is in ``log_directory``, and in
``get_logs()``.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import shlex
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from typing import Any

from ..comm.core import route_address
from ..comm.security import Security, write_secret
from ..scheduler.adaptive import plan
from ..worker.memory import parse_memory_limit
from .adaptive import Adaptive
from .local import _hostport
from .spec import DeployedCluster, DeployError, Launched, Launcher, ProcessSpec

__all__ = ["SlurmCluster", "SlurmLauncher"]

#: job states after which a job runs no more
_ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL",
          "DEADLINE", "SPECIAL_EXIT", "REVOKED"}

#: seconds between two looks at a job's output file, and at its state
_TAIL_INTERVAL = 0.2
_STATE_INTERVAL = 1.0


async def _run(argv: list[str], timeout: float = 60.0) -> tuple[int, str]:
    """Run a Slurm command; its exit code and output (stdout and stderr)."""
    try:
        proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    except OSError as exc:
        raise DeployError(f"cannot run {argv[0]!r}: {exc} (is Slurm's client installed here?)") from exc
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        raise DeployError(f"{shlex.join(argv)} did not finish within {timeout}s") from None
    return proc.returncode or 0, out.decode("utf-8", "replace").strip()


class _SlurmJob(Launched):
    def __init__(self, spec: ProcessSpec, job_id: str, log_path: str, launcher: SlurmLauncher):
        super().__init__(spec)
        self.job_id = job_id
        self.log_path = log_path
        self.launcher = launcher
        self.state = "PENDING"
        self._code: int | None = None
        self._offset = 0
        self._partial = b""
        self._watcher = asyncio.ensure_future(self._watch())

    @property
    def returncode(self) -> int | None:
        return self._code

    def text(self) -> str:
        """All the job printed so far: its output file as it is now (the lines read
        by the watcher lag by up to a poll)."""
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode("utf-8", "replace").rstrip("\n")
        except OSError:  # not started yet, or the file is gone: what was read of it
            return super().text()

    def _tail(self) -> None:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:  # not there until the job starts
            return
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        for line in lines:
            self.add_line(line.decode("utf-8", "replace").rstrip("\r"))

    async def _watch(self) -> None:
        next_state = 0.0
        try:
            while True:
                self._tail()
                if time.monotonic() >= next_state:
                    next_state = time.monotonic() + _STATE_INTERVAL
                    state, code = await self.launcher.job_state(self.job_id)
                    self.state = state
                    if state in _ENDED or state == "GONE":
                        self._tail()
                        if self._partial:
                            self.add_line(self._partial.decode("utf-8", "replace"))
                            self._partial = b""
                        self._code = code
                        return
                await asyncio.sleep(_TAIL_INTERVAL)  # polling: Slurm tells no one when a job ends
        finally:
            self.ended()

    async def stop(self, timeout: float) -> None:
        """A running job's batch process (``shoal worker``, which the script execs) gets
        a SIGTERM and stops its workers in order; a plain ``scancel`` would signal every
        process of the job at once, the workers twice (from Slurm and their nanny).
        A pending job, or one still there after ``timeout``, is cancelled outright."""
        if self._code is None:
            self.state = (await self.launcher.job_state(self.job_id))[0]
            running = self.state == "RUNNING"
            signal = ["--batch", "--signal=TERM"] if running else []
            code, out = await _run([*self.launcher.cancel_command, *signal, self.job_id])
            if code != 0 and running:  # (it ended meanwhile, or started: cancelled outright)
                code, out = await _run([*self.launcher.cancel_command, self.job_id])
            if code != 0 and "already completing or completed" not in out.lower():
                self.add_line(f"(scancel {self.job_id}: {out})")
        try:
            await asyncio.wait_for(asyncio.shield(self._watcher), timeout)
        except asyncio.TimeoutError:
            await _run([*self.launcher.cancel_command, self.job_id])
            await asyncio.wait_for(asyncio.shield(self._watcher), 60.0)


class SlurmLauncher(Launcher):
    """Submits each spec as a Slurm batch job whose script :meth:`job_script` renders
    (``#SBATCH`` directives from ``directives``, then ``prologue`` lines, then the
    shoal command); its output goes to ``log_directory``."""

    def __init__(self, directives: list[str], prologue: list[str], python: str, log_directory: str,
                 submit_command: list[str], cancel_command: list[str], state_command: list[str],
                 shebang: str = "#!/usr/bin/env bash"):
        self.directives = directives
        self.prologue = prologue
        self.python = python
        self.log_directory = log_directory
        self.submit_command = submit_command
        self.cancel_command = cancel_command
        self.state_command = state_command
        self.shebang = shebang

    def output_path(self, name: str) -> str:
        return os.path.join(self.log_directory, f"{name}-%j.out")

    def job_script(self, spec: ProcessSpec) -> str:
        lines = [self.shebang, "", f"#SBATCH --job-name={spec.name}", f"#SBATCH --output={self.output_path(spec.name)}",
                 *(f"#SBATCH {d}" for d in self.directives), ""]
        lines += [f"export {k}={shlex.quote(v)}" for k, v in spec.env.items()]
        lines += list(self.prologue)
        lines.append(shlex.join(["exec", self.python, "-m", "shoal", *spec.argv]))
        return "\n".join(lines) + "\n"

    async def start(self, spec: ProcessSpec) -> Launched:
        path = os.path.join(self.log_directory, f"{spec.name}.sh")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o700)
        with os.fdopen(fd, "w") as f:
            f.write(self.job_script(spec))
        code, out = await _run([*self.submit_command, "--parsable", path])
        job_id = out.strip().splitlines()[-1].split(";")[0] if out.strip() else ""
        if code != 0 or not job_id.isdigit():
            raise DeployError(f"sbatch refused {spec.name} (exit code {code}): {out or 'no output'}")
        return _SlurmJob(spec, job_id, self.output_path(spec.name).replace("%j", job_id), self)

    async def job_state(self, job_id: str) -> tuple[str, int | None]:
        """The job's state (``GONE`` once Slurm forgot it) and exit code, if ended."""
        code, out = await _run([*self.state_command, "show", "job", "-o", job_id])
        if code != 0:
            return ("GONE", None) if "invalid job id" in out.lower() else ("UNKNOWN", None)
        state = re.search(r"\bJobState=(\S+)", out)
        exit_code = re.search(r"\bExitCode=(\d+):(\d+)", out)
        return (state.group(1) if state else "UNKNOWN",
                int(exit_code.group(1)) if exit_code else None)


def _default_host() -> str:
    """An address of this host that other hosts can reach: the one of the interface
    with the default route."""
    try:
        return route_address("tcp://192.0.2.1:9")  # (TEST-NET-1: only the route is looked up)
    except OSError:
        return "127.0.0.1"


class SlurmCluster(DeployedCluster):
    """``SlurmCluster(cores=1, memory="1GiB", processes=1, queue=None, account=None,
    walltime="00:30:00", ...)``: each job asks Slurm for ``cores`` CPUs and ``memory``
    on one node, for ``walltime``, in partition ``queue`` (and ``account``), and runs
    ``processes`` worker processes with ``cores // processes`` threads and an equal
    part of ``memory`` as their memory limit.

    ``job_extra_directives``: more ``#SBATCH`` options (``["--gres=gpu:1"]``);
    ``job_script_prologue``: shell lines run before the worker (``["module load
    python"]``); ``worker_extra_args``: more ``shoal worker`` options; ``env``:
    variables the jobs export; ``python``: the interpreter on the nodes (default: this
    one's path); ``log_directory``: where job scripts, their output and the secret go
    (default: a new directory under the system's temporary one; it must be visible to
    the nodes); ``scheduler_options``: ``host`` (the address the nodes reach; default:
    this host's address on its default route), ``port`` (default 0: a free one),
    ``dashboard_address`` (default None). ``n_workers``: worker processes to start with.
    ``security``: with TLS files (``Security(ca_file=, cert=, key=)``) the cluster is
    ``tls://``, and the jobs' workers read the files by their paths (the nodes share
    the filesystem, as for ``log_directory``).

    ``job_script()`` is the next job's script; ``scale(n)`` (worker processes) or
    ``scale(jobs=)``; ``adapt(minimum=, maximum=)`` (workers, with ``processes=1``);
    ``get_logs()``; ``close()`` cancels the jobs and stops the scheduler.
    """

    wait_for_groups = False

    def __init__(self, cores: int = 1, memory: str | int = "1GiB", processes: int = 1, queue: str | None = None,
                 account: str | None = None, walltime: str | None = "00:30:00", job_name: str = "shoal-worker",
                 job_extra_directives: Iterable[str] = (), job_script_prologue: Iterable[str] = (),
                 worker_extra_args: Iterable[str] = (), env: Mapping[str, str] | None = None,
                 python: str | None = None, log_directory: str | None = None,
                 scheduler_options: Mapping[str, Any] | None = None, n_workers: int = 0,
                 asynchronous: bool = False, timeout: float = 60.0, security: Security | None = None,
                 submit_command: str = "sbatch", cancel_command: str = "scancel", state_command: str = "scontrol"):
        if isinstance(cores, bool) or not isinstance(cores, int) or cores < 1:
            raise ValueError(f"cores must be an integer >= 1, got {cores!r}")
        if isinstance(processes, bool) or not isinstance(processes, int) or not 1 <= processes <= cores:
            raise ValueError(f"processes must be an integer from 1 to cores ({cores}), got {processes!r}")
        if isinstance(n_workers, bool) or not isinstance(n_workers, int) or n_workers < 0:
            raise ValueError(f"n_workers must be an integer >= 0, got {n_workers!r}")
        total = parse_memory_limit(memory, 1)
        if not total:
            raise ValueError(f"memory must be a size (\"4GiB\", bytes), got {memory!r}")
        unknown = set(scheduler_options or {}) - {"host", "port", "dashboard_address"}
        if unknown:
            raise TypeError(f"unknown scheduler option(s) {sorted(unknown)}; known: host, port, dashboard_address")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", job_name):
            raise ValueError(f"job_name may hold letters, digits and _.- only, got {job_name!r}")
        self.cores, self.processes, self.memory = cores, processes, total
        self.threads_per_worker = cores // processes
        self.job_name = job_name
        self.scheduler_options = dict(scheduler_options or {})
        self.worker_extra_args = [str(a) for a in worker_extra_args]
        self.env = {str(k): str(v) for k, v in (env or {}).items()}
        self._own_directory = log_directory is None
        self.log_directory = log_directory or tempfile.mkdtemp(prefix="shoal-slurm-")
        os.makedirs(self.log_directory, exist_ok=True)
        directives = ["--nodes=1", "--ntasks=1", f"--cpus-per-task={cores}", f"--mem={max(1, total >> 20)}M"]
        if walltime:
            directives.append(f"--time={walltime}")
        if queue:
            directives.append(f"--partition={queue}")
        if account:
            directives.append(f"--account={account}")
        directives += [str(d) for d in job_extra_directives]
        launcher = SlurmLauncher(directives, [str(line) for line in job_script_prologue], python or sys.executable,
                                 self.log_directory, shlex.split(submit_command), shlex.split(cancel_command),
                                 shlex.split(state_command))
        super().__init__(launcher, workers_per_group=processes, asynchronous=asynchronous, timeout=timeout,
                         security=security)
        self.scheduler: Any = None
        self._secret_file = os.path.join(self.log_directory, "secret")
        self._begin(math.ceil(n_workers / processes))

    # -- the scheduler, in this process

    async def _start_scheduler(self) -> None:
        from ..scheduler.server import Scheduler

        opts = self.scheduler_options
        host = str(opts.get("host") or _default_host())
        self.scheduler = Scheduler(security=self.security, dashboard_address=opts.get("dashboard_address"))
        scheme = "tls" if self.security.tls else "tcp"
        await self.scheduler.start(f"{scheme}://{_hostport(host, int(opts.get('port', 0)))}")
        self.scheduler_address = self.scheduler.address
        if self.security.secret is not None:
            write_secret(self._secret_file, self.security.secret)

    async def _stop_scheduler(self) -> None:
        if self.scheduler is not None:
            await self.scheduler.close()
        try:
            os.unlink(self._secret_file)
        except FileNotFoundError:
            pass
        if self._own_directory and self.status != "running":
            import shutil

            shutil.rmtree(self.log_directory, ignore_errors=True)

    def _scheduler_spec(self) -> ProcessSpec:
        raise NotImplementedError("the scheduler runs in this process")

    # -- the jobs

    def _worker_spec(self, name: str, index: int) -> ProcessSpec:
        limit = self.memory // self.processes
        argv = ["worker", self.scheduler_address, "--name", f"{self.job_name}-{index}", "--host", "auto",
                "--nworkers", str(self.processes), "--nthreads", str(self.threads_per_worker),
                "--memory-limit", str(limit)]
        if self.security.secret is not None:
            argv += ["--auth-file", self._secret_file]
        # a batch cluster's nodes share the filesystem: the TLS files go by their paths
        for flag, path in (("--tls-ca-file", self.security.ca_file), ("--tls-cert", self.security.cert),
                           ("--tls-key", self.security.key)):
            if path is not None:
                argv += [flag, os.path.abspath(path)]
        argv += self.worker_extra_args
        return ProcessSpec(f"{self.job_name}-{index}", "slurm", argv, env=dict(self.env), processes=self.processes)

    def job_script(self) -> str:
        """The script of the next job ``scale`` would submit."""
        assert isinstance(self.launcher, SlurmLauncher)
        return self.launcher.job_script(self._worker_spec(f"{self.job_name}-{self._next}", self._next))

    def scale(self, n: int | None = None, jobs: int | None = None) -> Any:  # type: ignore[override]
        """Have ``n`` worker processes (whole jobs of ``processes``) or ``jobs`` jobs:
        submit jobs, or cancel the newest. Returns once submitted or cancelled (an
        awaitable when asynchronous); their workers join when Slurm runs them."""
        if jobs is not None:
            if n is not None:
                raise TypeError("scale() takes n or jobs, not both")
            if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 0:
                raise ValueError(f"scale() needs a number of jobs >= 0, got {jobs!r}")
            return self._sync(self._scale(jobs))
        return super().scale(0 if n is None else n)

    def _scheduler_log(self) -> str:
        return ""

    # -- what Adaptive asks of a cluster

    @property
    def worker_addresses(self) -> dict[str, list[str]]:
        """``{job name: [address, ...]}``: the workers of each job that have joined
        (known by their names, ``JOB`` or ``JOB-i``; the scheduler is here)."""
        out: dict[str, list[str]] = {name: [] for name in self.workers}
        if self.scheduler is None:
            return out
        for ws in list(self.scheduler.state.workers.values()):
            job = ws.name if ws.name in out else str(ws.name).rpartition("-")[0]
            if job in out:
                out[job].append(ws.address)
        return out

    async def _adaptive_plan(self, addresses: dict[str, str], target_duration: float) -> tuple[int, list[str]] | None:
        if self.scheduler is None:
            return None
        return plan(self.scheduler.state, addresses, self.threads_per_worker, target_duration)

    def adapt(self, minimum: int = 0, maximum: float = math.inf, interval: float | str = "1s",
              wait_count: int = 3, target_duration: float | str = "5s",
              minimum_jobs: int | None = None, maximum_jobs: int | None = None) -> Adaptive:
        """Submit jobs while tasks wait for threads and cancel idle ones whose values
        are safe elsewhere, between ``minimum`` and ``maximum`` workers (or jobs), as
        :meth:`LocalCluster.adapt <shoal.deploy.LocalCluster.adapt>`. Needs
        ``processes=1`` (a job is then one worker)."""
        if self.processes != 1:
            raise ValueError("adapt() needs processes=1: it retires workers one by one, and a job's "
                             "workers go together")
        if minimum_jobs is not None:
            minimum = minimum_jobs
        if maximum_jobs is not None:
            maximum = maximum_jobs
        return super().adapt(minimum=minimum, maximum=maximum, interval=interval, wait_count=wait_count,
                             target_duration=target_duration)
