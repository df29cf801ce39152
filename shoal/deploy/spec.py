"""What deployments on other machines share: a :class:`ProcessSpec` says which shoal
process to run where (``shoal scheduler`` or ``shoal worker`` with its arguments, the
host, the environment it needs), a :class:`Launcher` starts one and returns a
:class:`Launched` handle (its output lines, how to stop it), and
:class:`DeployedCluster` keeps a scheduler and groups of workers running through one:
``scale``, ``get_logs``, ``close``, synchronously or on the caller's loop.

A launcher for another system (Kubernetes, PBS) is one more :class:`Launcher`: it starts
the command of a spec somewhere and hands back its output. The cluster reads the
addresses the processes print (``shoal scheduler at ADDR``, ``shoal worker at ADDR``, one
line per worker process once it has joined) and never needs a shell on the hosts.

Secrets never go on a command line (``ps`` shows it to every user of the host): a spec's
``env`` reaches the process by the launcher's private channel (ssh's stdin, a job
script only its owner may read).
"""

from __future__ import annotations

import abc
import asyncio
import collections
import logging
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any

from .._loop import LoopThread
from ..comm.security import Security
from .adaptive import Adaptive

__all__ = ["DeployError", "ProcessSpec", "Launched", "Launcher", "DeployedCluster"]

logger = logging.getLogger("shoal.deploy")

#: lines of output kept per process for get_logs()
LOG_LINES = 10_000

_SCHEDULER_LINE = re.compile(r"^shoal scheduler at (\S+)\s*$")
_WORKER_LINE = re.compile(r"^shoal worker at (\S+)\s*$")


class DeployError(RuntimeError):
    """A process of a deployment could not be started, or exited while starting: the
    message names the host and says what it printed last."""


@dataclass
class ProcessSpec:
    """One shoal process to start: ``argv`` is what follows ``python -m shoal``
    (``["worker", ADDRESS, "--nworkers", "2"]``); ``env`` holds settings for it alone,
    secrets among them, sent privately; ``processes`` is how many worker processes it
    runs (the ``shoal worker at`` lines to wait for)."""

    name: str
    host: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    processes: int = 1


class Launched(abc.ABC):
    """A started process: its output (stdout and stderr, line by line, the last
    :data:`LOG_LINES` kept) and how to stop it."""

    def __init__(self, spec: ProcessSpec):
        self.spec = spec
        self.lines: collections.deque[str] = collections.deque(maxlen=LOG_LINES)
        self._seen = 0
        self._changed = asyncio.Event()

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def host(self) -> str:
        return self.spec.host

    def add_line(self, line: str) -> None:
        """For the launcher: a line the process wrote."""
        self.lines.append(line)
        self._seen += 1
        self._changed.set()

    def ended(self) -> None:
        """For the launcher: the process is gone (no more lines)."""
        self._changed.set()

    @property
    @abc.abstractmethod
    def returncode(self) -> int | None:
        """The exit code once the process ended (None while it runs)."""

    @abc.abstractmethod
    async def stop(self, timeout: float) -> None:
        """Stop the process (it closes as for a Ctrl-C: workers tell the scheduler),
        killing it after ``timeout`` seconds; returns once it is gone."""

    def text(self) -> str:
        return "\n".join(self.lines)

    def tail(self, n: int = 8) -> str:
        return "\n".join(list(self.lines)[-n:])

    async def wait_lines(self, pattern: re.Pattern[str], count: int, timeout: float) -> list[str]:
        """The first group of the first ``count`` lines that match ``pattern``, once
        the process has written them. Raises :class:`DeployError` if it ends first or
        after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            found = [m.group(1) for m in map(pattern.match, self.lines) if m]
            if len(found) >= count:
                return found[:count]
            if self.returncode is not None:
                raise DeployError(f"{self.name} on {self.host} exited with code {self.returncode} while starting"
                                  + _said(self))
            left = deadline - time.monotonic()
            if left <= 0:
                raise DeployError(f"{self.name} on {self.host}: {len(found)} of {count} expected process(es) "
                                  f"started within {timeout}s" + _said(self))
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
                pass


def _said(launched: Launched) -> str:
    tail = launched.tail()
    return f"; it printed:\n{tail}" if tail else "; it printed nothing"


class Launcher(abc.ABC):
    """Starts the process of a :class:`ProcessSpec` somewhere."""

    @abc.abstractmethod
    async def start(self, spec: ProcessSpec) -> Launched:
        """Start it; returns at once (the cluster waits for the lines it expects)."""


class DeployedCluster(abc.ABC):
    """A scheduler and groups of worker processes started by a :class:`Launcher`; a
    context manager (``async with`` when ``asynchronous=True``).

    Subclasses say how the scheduler runs (:meth:`_scheduler_spec`, or in this process:
    :meth:`_start_scheduler`) and how each group of workers is started
    (:meth:`_worker_spec`); a group runs ``workers_per_group`` worker processes, and
    ``scale`` waits for them to join unless ``wait_for_groups`` is false (batch jobs). ``scale(n)`` runs ``n`` worker processes in all (rounded up to
    whole groups), starting new groups or stopping the newest first;
    ``get_logs()`` is ``{"Scheduler": text, group name: text, ...}``; ``close()`` stops
    the workers, then the scheduler. ``Client(cluster)`` connects with the cluster's
    secret (``security``).
    """

    def __init__(self, launcher: Launcher, workers_per_group: int = 1, asynchronous: bool = False,
                 timeout: float = 60.0, security: Security | None = None):
        self.launcher = launcher
        self.workers_per_group = max(1, int(workers_per_group))
        self.asynchronous = asynchronous
        self.timeout = timeout
        #: the cluster's credentials: clients use them, every process gets the secret
        self.security = Security.new() if security is None else security
        self.scheduler_address = ""
        #: the scheduler's process (None when it runs in this one, or before it starts)
        self.scheduler_process: Launched | None = None
        #: the running groups of workers, oldest first, by name
        self.workers: dict[str, Launched] = {}
        #: what was stopped, kept for get_logs()
        self._ended: dict[str, Launched] = {}
        self.status = "created"
        self._next = 0
        self._initial = 0
        self._lock: asyncio.Lock | None = None
        self._loop_thread: LoopThread | None = None
        self._adaptive: Adaptive | None = None

    def _begin(self, n_groups: int) -> None:
        """For subclasses, last in ``__init__``: start ``n_groups`` groups (at once
        unless asynchronous; else on ``await``)."""
        self._initial = n_groups
        if not self.asynchronous:
            self._loop_thread = LoopThread(name="shoal-deploy")
            try:
                self._loop_thread.run(self._start(), timeout=self.timeout * 2 + 30)
            except BaseException:
                self._loop_thread.run(self._close(), timeout=self.timeout + 30)
                self._loop_thread.stop()
                self._loop_thread = None
                raise

    # -- what subclasses say

    @abc.abstractmethod
    def _scheduler_spec(self) -> ProcessSpec:
        """The scheduler's process."""

    @abc.abstractmethod
    def _worker_spec(self, name: str, index: int) -> ProcessSpec:
        """The ``index``-th group of workers (0, 1, ...), named ``name`` unless the
        spec names it otherwise."""

    def _secret_env(self) -> dict[str, str]:
        return self.security.to_env()

    #: threads of each worker process (what adaptive scaling counts in)
    threads_per_worker = 1

    #: whether starting groups (and so ``scale``) waits until their workers have joined;
    #: a batch system's jobs may wait in its queue: ``client.wait_for_workers`` does that
    wait_for_groups = True

    async def _start_scheduler(self) -> None:
        """Start the scheduler and set ``scheduler_address`` (default: the launcher
        runs :meth:`_scheduler_spec`'s process)."""
        self.scheduler_process = await self.launcher.start(self._scheduler_spec())
        (self.scheduler_address,) = await self.scheduler_process.wait_lines(_SCHEDULER_LINE, 1, self.timeout)

    async def _stop_scheduler(self) -> None:
        if self.scheduler_process is not None:
            await self.scheduler_process.stop(10.0)

    @property
    def worker_addresses(self) -> dict[str, list[str]]:
        """``{group name: [address, ...]}``: the workers each running group has said
        joined the scheduler so far."""
        return {name: [m.group(1) for m in map(_WORKER_LINE.match, w.lines) if m]
                for name, w in self.workers.items()}

    # -- starting

    def __await__(self) -> Any:
        return self._start().__await__()

    async def _start(self) -> DeployedCluster:
        if self.status == "running":
            return self
        self._lock = asyncio.Lock()
        await self._start_scheduler()
        self.status = "running"
        async with self._lock:
            await self._add_groups(self._initial)
        return self

    async def _add_groups(self, n: int) -> None:
        started = []
        for _ in range(n):
            index = self._next
            self._next += 1
            spec = self._worker_spec(f"worker-{index}", index)
            launched = await self.launcher.start(spec)
            self.workers[spec.name] = launched
            started.append(launched)
        if not self.wait_for_groups:
            return
        # they start side by side; each is running once all its processes have joined
        results = await asyncio.gather(
            *(w.wait_lines(_WORKER_LINE, w.spec.processes, self.timeout) for w in started), return_exceptions=True)
        failed = [(w, got) for w, got in zip(started, results) if isinstance(got, BaseException)]
        if failed:
            await asyncio.gather(*(self._stop_group(w.name) for w, _ in failed))
            raise failed[0][1]

    # -- scaling

    def scale(self, n: int) -> Any:
        """Run ``n`` worker processes in all (rounded up to whole groups of
        ``workers_per_group``): start groups, or stop the newest. Returns once done
        (an awaitable when asynchronous)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"scale() needs a number of workers >= 0, got {n!r}")
        return self._sync(self._scale(math.ceil(n / self.workers_per_group)))

    async def _scale(self, groups: int) -> None:
        if self.status != "running":
            raise RuntimeError(f"cannot scale a {self.status} cluster")
        assert self._lock is not None
        async with self._lock:
            for name in [n for n, w in self.workers.items() if w.returncode is not None]:
                # its process ended on its own (a host that went away): replaced below
                logger.warning("%s on %s had ended (exit code %s)", name, self.workers[name].host,
                               self.workers[name].returncode)
                await self._stop_group(name)
            have = len(self.workers)
            if groups > have:
                await self._add_groups(groups - have)
            elif groups < have:
                await self._stop_groups(list(self.workers)[groups:])

    async def _stop_groups(self, names: list[str]) -> None:
        """Stop the groups ``names`` and return once the scheduler lists none of
        their workers."""
        gone = [a for name in names for a in self.worker_addresses.get(name, [])]
        await asyncio.gather(*(self._stop_group(name) for name in names))
        await self._until_gone(gone)

    async def _stop_group(self, name: str) -> None:
        launched = self.workers.pop(name, None)
        if launched is not None:
            self._ended[name] = launched
            # shielded: a caller cancelled meanwhile (adapt stopped) must not cut the
            # stop short; close() stops only the groups still in self.workers
            await asyncio.shield(launched.stop(10.0))

    async def _until_gone(self, addresses: list[str]) -> None:
        """Return once the scheduler lists none of the workers ``addresses`` (they told
        it as they closed; it may not have read that yet), or after ``timeout``."""
        from ..comm import connect
        from ..rpc.core import send_recv

        if not addresses:
            return
        deadline = time.monotonic() + self.timeout
        comm = await connect(self.scheduler_address, timeout=self.timeout, deserialize=False, security=self.security,
                             expect="scheduler")
        try:
            while time.monotonic() < deadline:
                info = await send_recv(comm, "identity")
                if not set(addresses) & set(info.get("workers") or {}):
                    return
                await asyncio.sleep(0.05)  # polling: the scheduler reads their goodbyes on their streams
            logger.warning("the scheduler still lists workers stopped %ss ago", self.timeout)
        finally:
            await comm.close()

    # -- adaptive scaling

    def adapt(self, minimum: int = 0, maximum: float = math.inf, interval: float | str = "1s",
              wait_count: int = 3, target_duration: float | str = "5s") -> Adaptive:
        """Start groups while tasks wait for threads and stop idle ones whose values are
        safe elsewhere, between ``minimum`` and ``maximum`` workers, as
        :meth:`LocalCluster.adapt <shoal.deploy.LocalCluster.adapt>` (the policy reads
        the scheduler's state through its ``adaptive-plan`` op). Needs groups of one
        worker process: a group's workers go together. Replaces an earlier ``adapt()``;
        returns the :class:`~.adaptive.Adaptive`, whose ``stop()`` ends it."""
        if self.workers_per_group != 1:
            raise ValueError("adapt() needs groups of one worker process: it retires workers one by one, "
                             "and a group's workers go together")
        adaptive = Adaptive(self, minimum=minimum, maximum=maximum, interval=interval, wait_count=wait_count,
                            target_duration=target_duration)
        if self._adaptive is not None:
            self._adaptive.stop()
        loop = self._loop_thread.loop if self._loop_thread is not None else asyncio.get_running_loop()
        self._adaptive = adaptive.start(loop)
        return adaptive

    def _addresses(self) -> dict[str, str]:
        """``{group name: its worker's address}``, ``""`` until it has joined."""
        return {name: (found[0] if found else "") for name, found in self.worker_addresses.items()}

    async def _adaptive_plan(self, addresses: dict[str, str], target_duration: float) -> tuple[int, list[str]] | None:
        """The scheduler's :func:`~shoal.scheduler.adaptive.plan` for ``addresses``,
        asked through its ``adaptive-plan`` op."""
        from ..comm import connect
        from ..rpc.core import send_recv

        comm = await connect(self.scheduler_address, timeout=self.timeout, security=self.security, expect="scheduler")
        try:
            got = await send_recv(comm, "adaptive-plan", workers=addresses, threads_per_worker=self.threads_per_worker,
                                  target_duration=target_duration)
        finally:
            await comm.close()
        return int(got["desired"]), [str(name) for name in got["retirable"]]

    async def _retire_safely(self, names: list[str]) -> list[str]:
        """Stop those of the groups ``names`` whose workers are still retirable now (they
        were when chosen; a task may have gone there since); returns their names."""
        assert self._lock is not None
        async with self._lock:
            # (the duration only shapes how many workers the plan desires: not used here)
            planned = await self._adaptive_plan(self._addresses(), 1.0)
            still = set(planned[1]) if planned is not None else set()
            chosen = [name for name in names if name in self.workers and name in still]
            await self._stop_groups(chosen)
            return chosen

    # -- logs

    def get_logs(self, scheduler: bool = True, workers: bool | list[str] = True) -> dict[str, str]:
        """What the processes printed: ``{"Scheduler": text, group name: text}``
        (``workers`` may name some groups; stopped groups are included)."""
        out: dict[str, str] = {}
        if scheduler:
            out["Scheduler"] = self._scheduler_log()
        groups = {**self._ended, **self.workers}
        names = list(groups) if workers is True else [n for n in (workers or []) if n in groups]
        for name in names:
            out[name] = groups[name].text()
        return out

    def _scheduler_log(self) -> str:
        return self.scheduler_process.text() if self.scheduler_process is not None else ""

    # -- closing

    def close(self) -> Any:
        """Stop the workers, then the scheduler (an awaitable when asynchronous)."""
        if self.asynchronous:
            return self._close()
        if self._loop_thread is not None:
            try:
                self._loop_thread.run(self._close(), timeout=self.timeout + 30)
            finally:
                self._loop_thread.stop()
                self._loop_thread = None
        return None

    async def _close(self) -> None:
        if self.status == "closed":
            return
        self.status = "closing"
        if self._adaptive is not None:
            self._adaptive.stop()
        await asyncio.gather(*(self._stop_group(name) for name in list(self.workers)))
        await self._stop_scheduler()
        self.status = "closed"

    def _sync(self, coro: Any) -> Any:
        if self.asynchronous:
            return coro
        assert self._loop_thread is not None, "the cluster is closed"
        return self._loop_thread.run(coro, timeout=self.timeout * 2 + 30)

    def __enter__(self) -> DeployedCluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    async def __aenter__(self) -> DeployedCluster:
        return await self._start()

    async def __aexit__(self, *exc: Any) -> None:
        await self._close()

    def __repr__(self) -> str:
        n = sum(len(a) for a in self.worker_addresses.values())
        return f"<{type(self).__name__} {self.scheduler_address or '-'} {n} workers {self.status}>"
