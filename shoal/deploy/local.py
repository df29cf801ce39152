"""A cluster on this machine: scheduler and workers as threads of this process
(``processes=False``, over ``inproc://``) or workers as processes of their own
(``processes=True``, over ``tcp://`` on ``host``). The scheduler always lives in this
process, on the cluster's event loop; so does the cluster's bookkeeping (scaling,
:mod:`adaptive <.adaptive>` scaling), which reads the scheduler's state directly, and
each worker process's :class:`~shoal.worker.nanny.Nanny` (restarting it when it dies
or passes its memory limit, ``client.restart()``).

How a process with worker processes ends on SIGTERM: :mod:`.processes`. What
``get_logs()`` returns: :mod:`.logs`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from typing import Any

from .._loop import LoopThread
from ..comm import security, shm
from ..comm.security import Security
from ..scheduler.adaptive import plan
from ..scheduler.server import Scheduler
from ..worker.memory import parse_memory_limit
from ..worker.nanny import Nanny
from ..worker.server import Worker
from . import processes as _procs
from .adaptive import Adaptive, retirable, retirement_order
from .logs import ClusterLogs
from .processes import WorkerProcess, check_resources, reap, worker_argv

__all__ = ["LocalCluster"]

logger = logging.getLogger("shoal.deploy")

#: seconds the scheduler may take to see a retired worker go
_RETIRE_TIMEOUT = 10.0


class LocalCluster:
    """``LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
    host="127.0.0.1", resources=None, memory_limit="auto", local_directory=None)``; a
    context manager. ``await LocalCluster(..., asynchronous=True)`` starts it on the
    running loop instead of a thread of its own.

    ``resources`` (``{"GPU": 2}``): the abstract resources each worker offers.
    ``memory_limit``: each worker's (bytes, ``"4GiB"``, a fraction of the host's
    memory, ``"auto"``: the host's memory divided among ``n_workers``, or 0/None:
    none; see :func:`~shoal.worker.memory.parse_memory_limit`). ``local_directory``:
    where workers make their directories for spilled values (default: the
    ``local-directory`` setting, else the system's temporary directory). Worker
    processes run under nannies in this process, which start them again when they die
    or pass their memory limit (``restarts`` counts it).
    ``dashboard_address``: where the scheduler serves its dashboard (``":8790"``, port
    8790 of ``host``, or the next free port if taken; ``"127.0.0.1:0"``; None: no
    dashboard), whose status page is ``dashboard_link`` (with its login token);
    ``silence_logs`` (a level, or True for warnings) sets the level of shoal's loggers.
    ``workers`` is ``{name: worker}``: :class:`~shoal.worker.server.Worker` objects
    in-process, :class:`~.processes.WorkerProcess` handles with processes; names are
    ``worker-0``, ``worker-1``, ... ``scale(n)`` and ``adapt(minimum=, maximum=)``
    change their number, ``get_logs()`` says what they and the scheduler logged.

    Worker processes are started with ``python -m shoal worker``, so scripts that make a
    LocalCluster need no ``if __name__ == "__main__":`` guard on shoal's account.
    """

    def __init__(self, n_workers: int = 2, threads_per_worker: int = 1, processes: bool = True,
                 host: str = "127.0.0.1", asynchronous: bool = False, timeout: float = 30.0,
                 security: Security | None = None, resources: dict[str, float] | None = None,
                 dashboard_address: str | None = ":8790", silence_logs: int | bool | None = None,
                 memory_limit: Any = "auto", local_directory: str | None = None):
        if not isinstance(n_workers, int) or n_workers < 0:
            raise ValueError(f"n_workers must be an integer >= 0, got {n_workers!r}")
        #: each worker's memory limit in bytes (None: none)
        self.memory_limit = parse_memory_limit(memory_limit, max(n_workers, 1))
        self.local_directory = local_directory
        if threads_per_worker < 1:
            raise ValueError(f"threads_per_worker must be >= 1, got {threads_per_worker}")
        #: where the scheduler serves its dashboard (None: nowhere)
        self.dashboard_address = dashboard_address
        if silence_logs:
            # as dask: shoal's loggers show only this level and above (True: warnings)
            logging.getLogger("shoal").setLevel(logging.WARNING if silence_logs is True else int(silence_logs))
        self.n_workers = n_workers
        self.threads_per_worker = threads_per_worker
        self.processes = processes
        self.host = host
        #: the abstract resources each worker offers
        self.resources = check_resources(resources)
        #: the cluster's credentials: a fresh secret unless given (workers get it in
        #: their environment, clients of this process from the cluster)
        self.security = Security.new() if security is None else security
        self._auth_file = ""
        self.asynchronous = asynchronous
        self.timeout = timeout
        self.scheduler: Scheduler | None = None
        #: the workers by name: Worker objects (in-process) or WorkerProcess handles
        self.workers: dict[str, Any] = {}
        #: workers being retired (no longer in ``workers``, not closed or reaped yet)
        self._retiring: dict[str, Any] = {}
        self.status = "created"
        self.local_address = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._env: dict[str, str] = {}
        #: how many workers scale() asked for; the next worker's number
        self._target = n_workers
        self._next = 0
        self._scaling: asyncio.Lock | None = None
        self._correction: asyncio.Future[None] | None = None
        self._adaptive: Adaptive | None = None
        self._logs = ClusterLogs(files=processes)
        #: worker processes started again after one died (by their nannies)
        self.restarts = 0
        #: the nannies of the worker processes, by name (those being retired included)
        self._nannies: dict[str, Nanny] = {}
        self._loop_thread: LoopThread | None = None
        if not asynchronous:
            if processes:
                _procs.handle_sigterm()  # here: the cluster starts in a thread of its own
            self._loop_thread = LoopThread(name="shoal-cluster")
            try:
                self._loop_thread.run(self._start(), timeout=timeout + 10)
            except BaseException:
                self._loop_thread.run(self._close())
                self._loop_thread.stop()
                _procs.release_sigterm()
                raise

    # -- what it is

    @property
    def scheduler_address(self) -> str:
        """The scheduler's address (``inproc://...`` with ``processes=False``)."""
        assert self.scheduler is not None
        return self.scheduler.address

    @property
    def dashboard_link(self) -> str | None:
        """The dashboard's status page with the token that logs its opener in
        (``http://127.0.0.1:8790/status?token=...``), or None."""
        dashboard = self.scheduler.dashboard if self.scheduler is not None else None
        return dashboard.login_link if dashboard is not None else None

    @property
    def worker_addresses(self) -> list[str]:
        assert self.scheduler is not None
        return sorted(self.scheduler.state.workers)

    @property
    def scheduler_info(self) -> dict[str, Any]:
        """``{"address": ..., "workers": {address: {"nthreads", "name", ...}}}``, as
        ``client.scheduler_info()``."""
        scheduler = self.scheduler
        assert scheduler is not None
        if self._loop_thread is None or threading.get_ident() == self._loop_thread.thread.ident:
            return scheduler.identity()

        async def identity() -> dict[str, Any]:  # read on the loop that changes it
            return scheduler.identity()

        return self._loop_thread.run(identity(), timeout=self.timeout)

    @property
    def procs(self) -> list[subprocess.Popen[bytes]]:
        """The worker processes, those being stopped included."""
        handles = [*self.workers.values(), *self._retiring.values()]
        return [h.proc for h in handles if isinstance(h, WorkerProcess)]

    async def _adaptive_plan(self, addresses: dict[str, str], target_duration: float) -> tuple[int, list[str]] | None:
        """What :class:`~.adaptive.Adaptive` asks of the scheduler (in this process)."""
        if self.scheduler is None:
            return None
        return plan(self.scheduler.state, addresses, self.threads_per_worker, target_duration)

    def _addresses(self) -> dict[str, str]:
        """``{name: worker address}`` of the workers, ``""`` for those that have not
        joined the scheduler (yet, or again after a restart)."""
        assert self.scheduler is not None
        joined = self.scheduler.state.workers
        if not self.processes:
            return {name: (w.address if w.status == "running" and w.address in joined else "")
                    for name, w in self.workers.items()}
        by_pid = {ws.pid: ws.address for ws in joined.values()}
        out = {}
        for name, h in self.workers.items():
            h.address = by_pid.get(h.pid, "")
            out[name] = h.address
        return out

    # -- starting

    def __await__(self) -> Any:
        return self._start().__await__()

    async def _start(self) -> LocalCluster:
        if self.status == "running":
            return self
        self._loop = asyncio.get_running_loop()
        self._scaling = asyncio.Lock()
        self._logs.attach()
        dashboard = self.dashboard_address
        if isinstance(dashboard, str) and dashboard.startswith(":"):
            dashboard = _hostport(self.host, 0).rpartition(":")[0] + dashboard  # (an inproc scheduler has no host)
        self.scheduler = Scheduler(security=self.security, dashboard_address=dashboard)
        scheme = "tls" if self.security.tls else "tcp"
        with self._logs.owned_by("Scheduler"):
            await self.scheduler.start(f"{scheme}://" + _hostport(self.host, 0) if self.processes else "inproc://")
        if self.processes and self.security.auth:
            # clients of this user on this host find the secret as for `shoal scheduler`
            self._auth_file = security.write_auth_file(self.scheduler.address, self.security)
        # a client in this process reaches the scheduler by reference, whatever the workers use
        self.local_address = (await self.scheduler.server.listen("inproc://")).contact_address
        if self.processes:
            self._env = self._worker_env()
            _procs.running.add(self)
            _procs.handle_sigterm()
        async with self._scaling:
            await self._add_workers(self._target)
        self.status = "running"
        return self

    def _worker_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("SHOAL_AUTH_FILE", None)
        env.pop("SHOAL_AUTH", None)
        for var in ("SHOAL_TLS_CA_FILE", "SHOAL_TLS_CERT", "SHOAL_TLS_KEY"):
            env.pop(var, None)
        env.update(self.security.to_env())
        # workers import what this process can import (as multiprocessing's spawn
        # does; "" is the current directory, which -P leaves out of their path)
        paths = [p or _cwd() for p in sys.path] + env.get("PYTHONPATH", "").split(os.pathsep)
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
        # one BLAS/OpenMP thread per task thread: workers x threads already fill the cores
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env.setdefault(var, "1")
        return env

    async def _add_workers(self, n: int, names: list[str] | None = None) -> None:
        """Start ``n`` workers (named ``names``; default: new names) and wait until
        they have joined the scheduler. Raises ``RuntimeError`` if a worker process
        exits meanwhile, ``TimeoutError`` after ``timeout`` seconds."""
        assert self.scheduler is not None
        if names is None:
            names = [f"worker-{self._next + i}" for i in range(n)]
            self._next += n
        if not self.processes:
            for name in names:
                w = Worker(self.scheduler.address, nthreads=self.threads_per_worker, name=name,
                           security=self.security, resources=self.resources, memory_limit=self.memory_limit,
                           local_directory=self.local_directory)
                try:
                    with self._logs.owned_by(name):
                        await w.start()
                except BaseException:  # (the cluster closes meanwhile: cancelled)
                    await w.close(report=False)
                    raise
                self.workers[name] = w
                self._logs.add_worker(name, w)
                self._logs.note(f"started {name} at {w.address}")
            return
        for name in names:
            await self._start_nanny(name)
        await self._wait_joined(names)
        for name in names:
            h = self.workers.get(name)
            if h is not None:
                self._logs.note(f"started {name} (pid {h.pid}) at {h.address}")

    async def _start_nanny(self, name: str) -> None:
        """Start the nanny of worker process ``name`` (a new one in place of one that
        ended), which starts the process; ``workers[name]`` is its handle."""
        assert self.scheduler is not None
        argv = worker_argv(self.scheduler.address, name, self.threads_per_worker, self.host, self.resources,
                           self.local_directory)

        def spawned(proc: subprocess.Popen[bytes]) -> None:
            h = self.workers.get(name) or self._retiring.get(name)
            if h is not None and h.nanny is nanny:
                h.proc, h.address = proc, ""

        def crashed(proc: subprocess.Popen[bytes], code: int) -> None:
            self.restarts += 1
            self._logs.note(f"{name} (pid {proc.pid}) exited with code {code}; starting it again")

        def say(line: str) -> None:  # a worker past its memory limit, a nanny that gives up
            self._logs.note(line)
            logger.warning("%s", line)

        nanny = Nanny(argv, scheduler_address=self.scheduler.address, name=name, memory_limit=self.memory_limit,
                      directory=self.local_directory, host=self.host, security=self.security, env=self._env,
                      log_path=self._logs.path(name), say=say, on_spawn=spawned, on_crash=crashed)
        old = self._nannies.get(name)
        self._nannies[name] = nanny
        if old is not None:
            await old.close(5.0)
        await nanny.start()
        assert nanny.proc is not None
        self.workers[name] = WorkerProcess(name, nanny.proc, self._logs.path(name), nanny=nanny)

    async def _wait_joined(self, names: list[str]) -> None:
        deadline = time.monotonic() + self.timeout
        while True:
            addresses = self._addresses()
            waiting = [n for n in names if n in self.workers and not addresses.get(n)]
            if not waiting:
                return
            for name in waiting:
                code = self.workers[name].proc.poll()
                if code is not None:
                    tail = self._logs.file_text(name).strip().splitlines()[-5:]
                    raise RuntimeError(f"worker process {name} exited with code {code} while starting"
                                       + (":\n" + "\n".join(tail) if tail else ""))
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{len(waiting)} of {len(names)} worker(s) did not join within {self.timeout}s")
            await asyncio.sleep(0.05)  # polling child exit codes and the scheduler's workers

    # -- scaling

    def scale(self, n: int | None = None, cores: int | None = None) -> None:
        """Have ``n`` workers (or enough for ``cores`` threads): start new ones, or
        retire some, those whose data is safe elsewhere first (see
        :func:`.adaptive.retirement_order`: a value that exists only on a retired worker
        is computed again). Returns at once, as dask's; ``client.wait_for_workers(n)``
        waits for new ones to join."""
        if cores is not None:
            if n is not None:
                raise TypeError("scale() takes n or cores, not both")
            n = math.ceil(cores / self.threads_per_worker)
        if n is None:
            n = 0
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"scale() needs a number of workers >= 0, got {n!r}")
        if self.status not in ("created", "running"):
            raise RuntimeError(f"cannot scale a {self.status} cluster")
        self._target = n
        if self._loop is not None:  # (else it starts with that many)
            self._call_soon(self._schedule_correction)

    async def _scale(self, n: int) -> None:
        """Have ``n`` workers; returns when that is done."""
        self._target = n
        assert self._scaling is not None
        async with self._scaling:
            await self._correct_locked()

    async def _retire_safely(self, names: list[str]) -> list[str]:
        """Retire those of the workers ``names`` that are still :func:`retirable
        <.adaptive.retirable>` now (they were when chosen; a task may have gone there
        since), and scale to what is left. Returns the names retired."""
        assert self._scaling is not None and self.scheduler is not None
        async with self._scaling:
            state = self.scheduler.state
            addresses = self._addresses()
            going: list[Any] = []
            chosen = []
            for name in names:
                ws = state.workers.get(addresses.get(name, ""))
                if ws is not None and retirable(ws, going):
                    chosen.append(name)
                    going.append(ws)
            if chosen:
                await self._retire(chosen)
            self._target = len(self.workers)
            return chosen

    def _schedule_correction(self) -> None:
        if self._correction is None or self._correction.done():
            self._correction = asyncio.ensure_future(self._correct())

    async def _correct(self) -> None:
        assert self._scaling is not None
        try:
            async with self._scaling:
                await self._correct_locked()
        except Exception as exc:  # noqa: BLE001 - reported: nobody awaits a scale()
            self._logs.note(f"scaling to {self._target} workers failed: {type(exc).__name__}: {exc}")
            logger.error("scaling %r to %d workers failed", self, self._target, exc_info=True)

    async def _correct_locked(self) -> None:
        assert self.scheduler is not None
        while self.status in ("created", "running"):
            have, want = len(self.workers), self._target
            if have < want:
                await self._add_workers(want - have)
            elif have > want:
                order = retirement_order(self.scheduler.state, self._addresses())
                await self._retire(order[:have - want])
            else:
                return

    async def _retire(self, names: list[str]) -> None:
        """Retire the workers ``names``: they leave the scheduler cleanly (their tasks
        go elsewhere, their values are dropped) and stop; returns once the scheduler
        has seen them go."""
        assert self.scheduler is not None
        addresses = self._addresses()
        gone = [addresses[n] for n in names if addresses.get(n)]
        handles = {name: self.workers.pop(name) for name in names}
        self._retiring.update(handles)  # closed by close() should that come first
        # shielded: a caller cancelled meanwhile (adapt stopped) must not cut a close
        # short, or close() would wait for it for ever; the handles stay in _retiring
        if self.processes:
            # each worker closes as for a Ctrl-C (it tells the scheduler first), and its
            # nanny with it
            await asyncio.shield(asyncio.gather(*(h.nanny.close(5.0) for h in handles.values())))
            for name in handles:
                self._nannies.pop(name, None)
        else:
            await asyncio.shield(asyncio.gather(*(w.close() for w in handles.values())))
            for w in handles.values():
                self._logs.remove_worker(w)
        for name in handles:
            self._retiring.pop(name, None)
        for name in names:
            self._logs.note(f"retired {name}")
        deadline = time.monotonic() + _RETIRE_TIMEOUT
        while any(a in self.scheduler.state.workers for a in gone) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # polling: the scheduler hears of it on the worker's stream

    async def _restart_workers(self) -> None:
        """Stop every worker and start one of the same name in its place (a new
        process, by its nanny; or a new Worker object), for ``Client.restart``; returns
        once they have joined. Raises as :meth:`_add_workers` does."""
        assert self._scaling is not None
        async with self._scaling:
            names = list(self.workers)
            if not self.processes:
                await self._retire(names)
                await self._add_workers(len(names), names)
                return
            running = [name for name in names if self._nannies[name].status == "running"]
            for name in names:
                if name not in running:  # its nanny gave up: a new one
                    await self._start_nanny(name)
            await asyncio.gather(*(self._nannies[name].restart(timeout=5.0) for name in running))
            await self._wait_joined(names)

    def adapt(self, minimum: int = 0, maximum: float = math.inf, minimum_cores: int | None = None,
              maximum_cores: int | None = None, interval: float | str = "1s", wait_count: int = 3,
              target_duration: float | str = "5s") -> Adaptive:
        """Scale between ``minimum`` and ``maximum`` workers (or enough for
        ``minimum_cores``/``maximum_cores`` threads) by the load, checked every
        ``interval``: up while tasks wait for threads (more than ``target_duration``
        of work per thread), down when workers idle ``wait_count`` checks in a row,
        only those whose data is safe elsewhere (:mod:`.adaptive`). Replaces an
        earlier ``adapt()``. Returns the :class:`~.adaptive.Adaptive`; its ``stop()``
        ends it."""
        if minimum_cores is not None:
            minimum = math.ceil(minimum_cores / self.threads_per_worker)
        if maximum_cores is not None:
            maximum = maximum_cores // self.threads_per_worker
        adaptive = Adaptive(self, minimum=minimum, maximum=maximum, interval=interval, wait_count=wait_count,
                            target_duration=target_duration)
        if self._adaptive is not None:
            self._adaptive.stop()
        assert self._loop is not None, "the cluster is not started"
        self._adaptive = adaptive.start(self._loop)
        return adaptive

    async def _wait_for_workers(self, n: int, timeout: float | None) -> None:
        assert self.scheduler is not None
        await self.scheduler.wait_for_workers(n, timeout)

    def wait_for_workers(self, n_workers: int, timeout: float | None = None) -> Any:
        """Wait until at least ``n_workers`` workers have joined (an awaitable when
        asynchronous). Raises ``TimeoutError`` after ``timeout`` seconds."""
        if self.asynchronous:
            return self._wait_for_workers(n_workers, timeout)
        assert self._loop_thread is not None
        return self._loop_thread.run(self._wait_for_workers(n_workers, timeout),
                                     timeout=None if timeout is None else timeout + 10)

    def _call_soon(self, fn: Any) -> None:
        """Call ``fn()`` on the cluster's loop (from any thread)."""
        assert self._loop is not None, "the cluster is not started"
        try:
            here = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            here = False
        if here:
            fn()
        else:
            self._loop.call_soon_threadsafe(fn)

    # -- logs

    def get_logs(self, cluster: bool = True, scheduler: bool = True, workers: bool | list[str] = True) -> dict[str, str]:
        """What the cluster, the scheduler and the workers logged: ``{"Cluster": text,
        "Scheduler": text, worker name: text, ...}`` (``workers`` may name some).
        Worker processes' logs are all they wrote to stdout and stderr; what this
        process logged is what the ``shoal`` loggers let through (:mod:`.logs`)."""
        out: dict[str, str] = {}
        if cluster:
            out["Cluster"] = self._logs.text("Cluster")
        if scheduler:
            out["Scheduler"] = self._logs.text("Scheduler")
        if workers:
            names = list(self.workers) if workers is True else [n for n in workers if n in self.workers]
            for name in names:
                out[name] = self._logs.file_text(name) if self.processes else self._logs.text(name)
        return out

    # -- closing

    def close(self, timeout: float | None = None) -> Any:
        """Stop the workers and the scheduler (an awaitable when asynchronous)."""
        if self.asynchronous:
            return self._close()
        if self._loop_thread is not None:
            try:
                self._loop_thread.run(self._close(), timeout=(timeout or self.timeout) + 10)
            finally:
                self._loop_thread.stop()
                self._loop_thread = None
        _procs.release_sigterm()
        return None

    def _close_at_exit(self) -> None:
        """At interpreter exit: close as :meth:`close` does if the cluster's loop can
        still do it, then stop (SIGTERM, then SIGKILL) whatever worker process is still
        there, without an event loop (an asynchronous cluster's is gone by then)."""
        if self.status != "closed" and self._loop_thread is not None:
            try:
                self.close()
            except Exception:
                pass
        procs = self.procs
        for p in procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 5.0
        for p in procs:
            try:
                p.wait(max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            shm.sweep(p.pid)
        for nanny in self._nannies.values():
            if nanny.work_dir:
                shutil.rmtree(nanny.work_dir, ignore_errors=True)  # (a worker killed above left it)
        self._logs.close()
        _procs.running.discard(self)

    def _remove_files_now(self) -> None:
        """The cluster's files go at once (the process leaves on a second SIGTERM), and
        the directories of its worker processes (killed: they could not)."""
        self._logs.remove_files()
        for nanny in self._nannies.values():
            if nanny.work_dir:
                shutil.rmtree(nanny.work_dir, ignore_errors=True)

    async def _close(self) -> None:
        if self.status == "closed":
            return
        self.status = "closing"
        if self._adaptive is not None:
            self._adaptive.stop()
        if self._correction is not None:
            self._correction.cancel()
        if self.scheduler is not None:
            await self.scheduler.close()
            if self._auth_file:
                security.remove_auth_file(self.scheduler.address, self.security)
                self._auth_file = ""
        for w in [*self.workers.values(), *self._retiring.values()]:
            if isinstance(w, Worker):
                await w.close(report=False)
        # the scheduler told the worker processes to close: their nannies end with them
        # (or stop them) and remove what they left
        await asyncio.gather(*(n.close(5.0) for n in self._nannies.values()))
        await asyncio.gather(*(reap(p, 5.0) for p in self.procs))
        self.status = "closed"
        self._logs.close()
        _procs.running.discard(self)
        _procs.release_sigterm()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    async def __aenter__(self) -> LocalCluster:
        return await self._start()

    async def __aexit__(self, *exc: Any) -> None:
        await self._close()

    def __repr__(self) -> str:
        addr = self.scheduler.address if self.scheduler else "-"
        kind = "processes" if self.processes else "threads"
        return f"<LocalCluster {addr} {len(self.workers)} workers ({kind}) {self.status}>"


def _cwd() -> str:
    try:
        return os.getcwd()
    except OSError:  # removed meanwhile: nothing to import from there
        return ""


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
