"""A cluster on this machine: scheduler and workers as threads of this process
(``processes=False``, over ``inproc://``) or workers as processes of their own
(``processes=True``, over ``tcp://`` on ``host``).

A process with a cluster of worker processes ends cleanly on SIGTERM as on Ctrl-C:
the signal becomes an exception in the main thread (``SystemExit(143)``), so ``with``
blocks and exit handlers close the cluster, whose workers remove their shared memory
and exit (the clusters still running at exit are closed then). A second SIGTERM
while that runs kills the workers, removes their segments and this process's, and
leaves at once. Worker processes have a process group of their own: a Ctrl-C at the
terminal reaches this process only, which stops them in order.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from typing import Any, NoReturn

from .._loop import LoopThread
from ..comm import shm
from ..comm import security
from ..comm.security import Security
from ..scheduler.server import Scheduler
from ..worker.server import Worker

__all__ = ["LocalCluster"]


class LocalCluster:
    """``LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
    host="127.0.0.1")``; a context manager. ``await LocalCluster(...,
    asynchronous=True)`` starts it on the running loop instead of a thread of its own.

    Worker processes are started with ``python -m shoal worker``, so scripts that make a
    LocalCluster need no ``if __name__ == "__main__":`` guard on shoal's account.
    """

    def __init__(self, n_workers: int = 2, threads_per_worker: int = 1, processes: bool = True,
                 host: str = "127.0.0.1", asynchronous: bool = False, timeout: float = 30.0,
                 security: Security | None = None):
        if n_workers < 0:
            raise ValueError(f"n_workers must be >= 0, got {n_workers}")
        if threads_per_worker < 1:
            raise ValueError(f"threads_per_worker must be >= 1, got {threads_per_worker}")
        self.n_workers = n_workers
        self.threads_per_worker = threads_per_worker
        self.processes = processes
        self.host = host
        #: the cluster's credentials: a fresh secret unless given (workers get it in
        #: their environment, clients of this process from the cluster)
        self.security = Security.new() if security is None else security
        self._auth_file = ""
        self.asynchronous = asynchronous
        self.timeout = timeout
        self.scheduler: Scheduler | None = None
        self.workers: list[Worker] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        self.status = "created"
        self.local_address = ""
        self._watcher: asyncio.Future[None] | None = None
        self._env: dict[str, str] = {}
        self._names: dict[int, str] = {}
        #: worker processes started again after one died
        self.restarts = 0
        self._loop_thread: LoopThread | None = None
        if not asynchronous:
            if processes:
                _handle_sigterm()  # here: the cluster starts in a thread of its own
            self._loop_thread = LoopThread(name="shoal-cluster")
            try:
                self._loop_thread.run(self._start(), timeout=timeout + 10)
            except BaseException:
                self._loop_thread.run(self._close())
                self._loop_thread.stop()
                _release_sigterm()
                raise

    @property
    def scheduler_address(self) -> str:
        assert self.scheduler is not None
        return self.scheduler.address

    @property
    def worker_addresses(self) -> list[str]:
        assert self.scheduler is not None
        return sorted(self.scheduler.state.workers)

    def __await__(self) -> Any:
        return self._start().__await__()

    async def _start(self) -> LocalCluster:
        if self.status == "running":
            return self
        self.scheduler = Scheduler(security=self.security)
        scheme = "tls" if self.security.tls else "tcp"
        await self.scheduler.start(f"{scheme}://" + _hostport(self.host, 0) if self.processes else "inproc://")
        if self.processes and self.security.auth:
            # clients of this user on this host find the secret as for `shoal scheduler`
            self._auth_file = security.write_auth_file(self.scheduler.address, self.security)
        # a client in this process reaches the scheduler by reference, whatever the workers use
        self.local_address = (await self.scheduler.server.listen("inproc://")).contact_address
        if self.processes:
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
            self._env = env
            _running.add(self)
            _handle_sigterm()
            for i in range(self.n_workers):
                self.procs.append(self._spawn(f"worker-{i}"))
            await self._wait_for_processes()
            self._watcher = asyncio.ensure_future(self._watch_processes())
        else:
            for i in range(self.n_workers):
                w = Worker(self.scheduler.address, nthreads=self.threads_per_worker, name=f"worker-{i}",
                           security=self.security)
                await w.start()
                self.workers.append(w)
        self.status = "running"
        return self

    def _spawn(self, name: str) -> subprocess.Popen[bytes]:
        assert self.scheduler is not None
        proc = subprocess.Popen(
            # -P: the current directory does not shadow the PYTHONPATH given above
            [sys.executable, "-P", "-m", "shoal", "worker", self.scheduler.address,
             "--nthreads", str(self.threads_per_worker), "--name", name, "--host", self.host],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=self._env,
            process_group=0,  # not signalled with this process's group (a Ctrl-C): see the module
        )
        self._names[proc.pid] = name
        return proc

    async def _wait_for_processes(self) -> None:
        assert self.scheduler is not None
        waiting = asyncio.ensure_future(self.scheduler.wait_for_workers(self.n_workers, self.timeout))
        try:
            while not waiting.done():
                dead = [p for p in self.procs if p.poll() is not None]
                if dead:
                    raise RuntimeError(
                        f"a worker process exited with code {dead[0].returncode} while starting"
                    )
                await asyncio.wait({waiting}, timeout=0.05)  # poll child exit codes meanwhile
            waiting.result()
        finally:
            waiting.cancel()

    async def _watch_processes(self) -> None:
        """Reap worker processes that die while the cluster runs, remove the shared
        memory they leave behind, and start a replacement (as a nanny would)."""
        while self.status == "running":
            await asyncio.sleep(0.2)  # a periodic check, not a wait for a condition
            for i, p in enumerate(list(self.procs)):
                if p.poll() is None or self.status != "running":
                    continue
                shm.sweep(p.pid)
                name = self._names.pop(p.pid, f"worker-{i}")
                self.restarts += 1
                self.procs[i] = self._spawn(name)

    def close(self) -> Any:
        """Stop the workers and the scheduler (an awaitable when asynchronous)."""
        if self.asynchronous:
            return self._close()
        if self._loop_thread is not None:
            try:
                self._loop_thread.run(self._close(), timeout=self.timeout + 10)
            finally:
                self._loop_thread.stop()
                self._loop_thread = None
        _release_sigterm()
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
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 5.0
        for p in self.procs:
            try:
                p.wait(max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            shm.sweep(p.pid)
        _running.discard(self)

    async def _close(self) -> None:
        if self.status == "closed":
            return
        self.status = "closing"
        if self._watcher is not None:
            self._watcher.cancel()
        if self.scheduler is not None:
            await self.scheduler.close()
            if self._auth_file:
                security.remove_auth_file(self.scheduler.address, self.security)
                self._auth_file = ""
        for w in self.workers:
            await w.close(report=False)
        await asyncio.gather(*(_reap(p, 5.0) for p in self.procs))
        if self._watcher is not None:
            self._watcher.cancel()
        self.status = "closed"
        _running.discard(self)
        _release_sigterm()

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
        return f"<LocalCluster {addr} {self.n_workers} workers ({kind}) {self.status}>"


async def _reap(p: subprocess.Popen[bytes], timeout: float) -> None:
    """Wait for worker process ``p`` to exit, killing it after ``timeout`` seconds, and
    remove the segments it left (it was killed). Polled rather than waited for in a
    thread: a cluster closed at interpreter exit gets no executor thread any more."""
    deadline = time.monotonic() + timeout
    while p.poll() is None:
        if time.monotonic() >= deadline:
            p.kill()
            deadline = float("inf")
        await asyncio.sleep(0.01)  # polling: nothing wakes this loop when a child exits
    # whatever a worker could not remove itself (it was killed) goes now
    shm.sweep(p.pid)


# ------------------------------------------------------------ SIGTERM and exit

#: the clusters of this process with worker processes, not closed yet
_running: weakref.WeakSet[LocalCluster] = weakref.WeakSet()
#: a SIGTERM came: this process is on its way out
_terminating = False


def _handle_sigterm() -> None:
    """Make SIGTERM end this process by ``SystemExit(143)`` in the main thread, which
    runs ``finally`` clauses, ``with`` blocks and exit handlers (they close the
    clusters), where its default action would kill the process on the spot, with its
    workers' shared memory left. Only from the main thread, and only when SIGTERM has
    its default action: a handler of the application's own is left alone."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)


def _release_sigterm() -> None:
    """SIGTERM's default action again once no cluster runs, unless the process is
    leaving because of one (a second one must still find :func:`_on_sigterm`)."""
    if (not _running and not _terminating and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is _on_sigterm):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _on_sigterm(signum: int, frame: Any) -> None:
    global _terminating
    if _terminating:
        _kill_now(signum)
    _terminating = True
    raise SystemExit(128 + signum)


def _kill_now(signum: int) -> NoReturn:
    """A second SIGTERM while the first one's clean-up runs (too slow for whoever sent
    it): kill the worker processes, remove their segments and this process's by name
    (:func:`.shm.sweep` takes no lock, which the interrupted code may hold), and leave."""
    for cluster in list(_running):
        for p in cluster.procs:
            p.kill()
            try:
                os.waitpid(p.pid, 0)  # gone before its names are removed: it makes no more
            except ChildProcessError:
                pass
            shm.sweep(p.pid)
    shm.sweep(os.getpid())
    os.write(2, b"shoal: a second SIGTERM while the cluster closed: its workers were killed; exiting now\n")
    os._exit(128 + signum)


@atexit.register
def _close_clusters() -> None:
    for cluster in list(_running):
        cluster._close_at_exit()


def _cwd() -> str:
    try:
        return os.getcwd()
    except OSError:  # removed meanwhile: nothing to import from there
        return ""


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
