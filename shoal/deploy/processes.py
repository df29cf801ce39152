"""Worker processes of a :class:`~.local.LocalCluster`: their command (``python -m shoal
worker``, run by a :class:`~shoal.worker.nanny.Nanny` of the cluster's process, their
output to a log file of the cluster), reaping them, and how a process that has such
workers ends on SIGTERM.

A process with a cluster of worker processes ends cleanly on SIGTERM as on Ctrl-C:
the signal becomes an exception in the main thread (``SystemExit(143)``), so ``with``
blocks and exit handlers close the cluster, whose workers remove their shared memory
and exit (the clusters still running at exit are closed then). A second SIGTERM
while that runs kills the workers, removes their segments and this process's, and
leaves at once. Worker processes have a process group of their own: a Ctrl-C at the
terminal reaches this process only, which stops them in order.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading
import weakref
from typing import Any, NoReturn, Protocol

from ..comm import shm
from ..worker.nanny import wait_or_kill
from ..protocol.resources import check_resources as checked_resources

__all__ = ["WorkerProcess", "worker_argv", "reap", "format_resources"]


class WorkerProcess:
    """A worker process of a cluster (the values of ``LocalCluster.workers`` with
    ``processes=True``): its ``name``, ``pid``, ``proc`` (the ``subprocess.Popen``; a
    new one after its nanny restarted it), ``log_path`` (its stdout and stderr),
    ``address`` (its worker's, once it has joined the scheduler; ``""`` before),
    ``nanny`` (the :class:`~shoal.worker.nanny.Nanny`, or None) and ``nanny_pid``
    (the process its nanny runs in: the cluster's)."""

    def __init__(self, name: str, proc: subprocess.Popen[bytes], log_path: str, nanny: Any = None):
        self.name = name
        self.proc = proc
        self.log_path = log_path
        self.address = ""
        self.nanny = nanny
        self.nanny_pid = os.getpid() if nanny is not None else 0

    @property
    def pid(self) -> int:
        return self.proc.pid

    def __repr__(self) -> str:
        state = "running" if self.proc.poll() is None else f"exited {self.proc.returncode}"
        return f"<WorkerProcess {self.name!r} pid={self.pid} {self.address or '-'} {state}>"


def format_resources(resources: dict[str, float]) -> str:
    """The ``shoal worker --resources`` argument for ``resources`` (read back exactly:
    floats by their repr)."""
    return ",".join(f"{name}={float(amount)!r}" for name, amount in resources.items())


def check_resources(resources: Any) -> dict[str, float]:
    """``resources`` as ``{name: float}`` (:func:`shoal.protocol.resources.check_resources`),
    with names that can travel on a command line: no ``=``, ``,`` or spaces. Raises
    ``TypeError``/``ValueError``."""
    out = checked_resources(resources)
    for name in out:
        if any(c in name for c in "=, \t\n"):
            raise ValueError(f"resources: a name must be a non-empty string without '=', ',' or spaces, got {name!r}")
    return out


def worker_argv(scheduler_address: str, name: str, nthreads: int, host: str, resources: dict[str, float],
                local_directory: str | None) -> list[str]:
    """The command of the worker process ``name`` (its nanny adds its memory limit and
    directories). It leaves when its scheduler does (``--death-timeout 0``: the
    scheduler is the cluster's process, no worker need wait for it to come back).
    The nanny starts it in a process group of its own, not signalled with this
    process's group (a Ctrl-C): see the module."""
    args = [sys.executable, "-P", "-m", "shoal", "worker", scheduler_address,  # -P: see the cluster's PYTHONPATH
            "--no-nanny", "--nthreads", str(nthreads), "--name", name, "--host", host, "--death-timeout", "0"]
    if resources:
        args += ["--resources", format_resources(resources)]
    if local_directory:
        args += ["--local-directory", local_directory]
    return args


async def reap(p: subprocess.Popen[bytes], timeout: float) -> None:
    """Wait for worker process ``p`` to exit, killing it after ``timeout`` seconds, and
    remove the segments it left (it was killed)."""
    await wait_or_kill(p, timeout)
    # whatever a worker could not remove itself (it was killed) goes now
    shm.sweep(p.pid)


# ------------------------------------------------------------ SIGTERM and exit


class _HasProcesses(Protocol):
    @property
    def procs(self) -> list[subprocess.Popen[bytes]]: ...

    def _close_at_exit(self) -> None: ...

    def _remove_files_now(self) -> None: ...


#: the clusters of this process with worker processes, not closed yet
running: weakref.WeakSet[Any] = weakref.WeakSet()
#: a SIGTERM came: this process is on its way out
_terminating = False


def handle_sigterm() -> None:
    """Make SIGTERM end this process by ``SystemExit(143)`` in the main thread, which
    runs ``finally`` clauses, ``with`` blocks and exit handlers (they close the
    clusters), where its default action would kill the process on the spot, with its
    workers' shared memory left. Only from the main thread, and only when SIGTERM has
    its default action: a handler of the application's own is left alone."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)


def release_sigterm() -> None:
    """SIGTERM's default action again once no cluster runs, unless the process is
    leaving because of one (a second one must still find :func:`_on_sigterm`)."""
    if (not running and not _terminating and threading.current_thread() is threading.main_thread()
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
    cluster: _HasProcesses
    for cluster in list(running):
        for p in cluster.procs:
            p.kill()
            try:
                os.waitpid(p.pid, 0)  # gone before its names are removed: it makes no more
            except ChildProcessError:
                pass
            shm.sweep(p.pid)
        cluster._remove_files_now()
    shm.sweep(os.getpid())
    os.write(2, b"shoal: a second SIGTERM while the cluster closed: its workers were killed; exiting now\n")
    os._exit(128 + signum)


@atexit.register
def _close_clusters() -> None:
    cluster: _HasProcesses
    for cluster in list(running):
        cluster._close_at_exit()
