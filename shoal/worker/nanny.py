"""A nanny: the process that runs a worker process and keeps it running.

``shoal worker`` (unless ``--no-nanny``) and ``LocalCluster(processes=True)`` run each
worker process under a :class:`Nanny`, an object on an event loop of the parent
process (one process may run several nannies: ``--nworkers``, a cluster's workers).

Theory of operation
-------------------
The nanny starts ``python -m shoal worker --no-nanny ... --memory-limit BYTES
--work-dir DIR --nanny-address ADDR`` as its child, in a process group of its own (a
Ctrl-C at a terminal reaches the nanny, which stops the worker in order). Every
``memory-monitor-interval`` seconds it looks at the child:

- gone: a *deliberate* exit (exit code 0 with its work directory removed: the worker
  closed itself as asked, by its scheduler or a signal) ends the nanny too, as does a
  child that gave up (:data:`EXIT_GAVE_UP`: no scheduler, a refused secret). Any other
  exit (killed, a crash, a task's ``os._exit``, an internal error, or giving up on a
  scheduler that still answers: it removed the worker for its silence) is a *crash*: the
  nanny removes what the child left (its shared-memory segments, its directory) and
  starts a new one at once. The scheduler learns of the loss by itself, also at once:
  the dead process's sockets are closed by the kernel, and the scheduler's worker-loss
  path recomputes lost values and counts the tasks that ran there as suspicious (a task
  that kills three workers ends as ``KilledWorker``).
- past ``memory-terminate`` times its memory limit (resident memory): it is killed
  (SIGKILL: a process past that is beyond saving from inside, and a hung one must not
  delay the loss) with a one-line warning, and restarted as after a crash.

More than ``nanny-max-restarts`` crashes within ``nanny-restart-window`` seconds and
the nanny stops restarting: one line says so and it ends with exit code 1.

A worker that cannot be started (no room on disk for its directory, no memory or
process slots left: an ``OSError``) is not a crash of the worker: one line says why, and
the nanny tries again, after 1 s, then twice as long each time up to
:data:`SPAWN_RETRY_MAX` seconds, for as long as it runs.

Each incarnation of the worker gets a fresh ``shoal-worker-*`` directory under the
local directory (``--local-directory``, the ``local-directory`` setting
(``SHOAL_LOCAL_DIRECTORY``), else the system's temporary directory), removed once it
has exited. A child whose nanny dies (SIGKILL) gets SIGTERM from the kernel
(``PR_SET_PDEATHSIG``, set by ``shoal worker`` itself) and closes cleanly, removing
its segments and directory.

The nanny serves a small rpc (authenticated with the cluster's secret as every shoal
server): ``identity``, ``nanny-restart`` (the scheduler's ``restart-workers``, for
``Client.restart``) and ``nanny-close``. Its imports stay light (no numpy, no worker
server): it is a small process that must not fall over.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import IO, Any

from .. import config
from ..comm import Comm, connect, shm
from ..comm.security import Security
from ..protocol.messages import NANNY_REQUESTS
from ..rpc import Server
from .memory import Thresholds, format_bytes
from .monitor import private_memory

__all__ = ["Nanny", "EXIT_GAVE_UP", "local_directory", "die_with_parent"]

logger = logging.getLogger("shoal.worker")

#: the exit code of a worker process (under a nanny) that gave up for a reason a
#: restart would not fix: no scheduler within its death timeout, a refused secret
EXIT_GAVE_UP = 3
#: the longest wait (seconds) between two tries to start a worker that could not start
SPAWN_RETRY_MAX = 30.0
#: seconds a worker asked to close (SIGTERM) may take before it is killed
CLOSE_GRACE = 7.0


def local_directory(directory: str | None = None) -> str:
    """Where workers make their own directories: ``directory``, else the
    ``local-directory`` setting, else the system's temporary directory (made if it is
    missing). Raises ``OSError`` if it cannot be made."""
    path = directory or config.get("local-directory") or tempfile.gettempdir()
    os.makedirs(path, exist_ok=True)
    return path


class Nanny:
    """Runs the worker process ``argv + [--memory-limit, --work-dir, --nanny-address]``
    and keeps it running (see the module).

    ``argv``: the command of the worker, ``python -m shoal worker ADDRESS --no-nanny``
    and its options; ``scheduler_address``: its scheduler's (asked whether it is there
    when the worker gave up on it). ``memory_limit``: bytes or None. ``security``: the cluster's
    credentials for this nanny's rpc, or a callable giving them (looked at again about
    every second: an auth file that a scheduler which came back rewrote). ``env``: the
    child's environment (default: this one's). ``log_path``: a file for the child's
    stdout and stderr (default: this process's). ``say(line)``: how a line for the
    user is told (default: a warning in the ``shoal.worker`` log). ``on_spawn(proc)``
    is called for each new child, ``on_crash(proc, code)`` before one is restarted.
    """

    def __init__(self, argv: list[str], *, scheduler_address: str = "", name: str = "",
                 memory_limit: int | None = None,
                 directory: str | None = None, host: str = "127.0.0.1",
                 security: Security | Callable[[], Security | None] | None = None,
                 env: dict[str, str] | None = None, log_path: str | None = None,
                 say: Callable[[str], None] | None = None,
                 on_spawn: Callable[[subprocess.Popen[bytes]], None] | None = None,
                 on_crash: Callable[[subprocess.Popen[bytes], int], None] | None = None):
        self.argv = list(argv)
        self.scheduler_address = scheduler_address
        self.name = name
        self.memory_limit = memory_limit
        self.directory = local_directory(directory)
        self.host = host
        self._security_source = security if callable(security) else None
        initial = security if isinstance(security, Security) else None
        if initial is None and self._security_source is not None:
            initial = self._security_source()
        #: until a secret is known (a scheduler not started yet) nobody gets in
        self.security = initial if initial is not None else Security.new()
        self.env = dict(os.environ if env is None else env)
        self.log_path = log_path
        self.say = say or (lambda line: logger.warning("%s", line))
        self.on_spawn = on_spawn
        self.on_crash = on_crash
        #: the worker process now (None before start and after it ended for good)
        self.proc: subprocess.Popen[bytes] | None = None
        #: its directory
        self.work_dir = ""
        #: workers started again after a crash, in all
        self.restarts = 0
        self.status = "created"
        self.server = Server({"identity": self.identity, "nanny-restart": self.restart, "nanny-close": self._close_op},
                             deserialize=False, name="Nanny", security=self.security, schemas=NANNY_REQUESTS,
                             role="nanny")
        self._crashes: collections.deque[float] = collections.deque()
        self._busy = False  # restarting or closing: the watch leaves the child alone
        self._lock: asyncio.Lock | None = None
        self._watch: asyncio.Future[None] | None = None
        self._closing: asyncio.Future[None] | None = None
        self._finished: asyncio.Future[int] | None = None
        self._psutil: Any = None
        #: a worker process that could not start: when to try again, how long to wait
        #: after that, and the last reason said
        self._retry_at: float | None = None
        self._retry_delay = 1.0
        self._spawn_error = ""

    @property
    def address(self) -> str:
        """This nanny's rpc address."""
        return self.server.address

    @property
    def pid(self) -> int:
        """The worker process's pid (0: none running)."""
        return self.proc.pid if self.proc is not None else 0

    def identity(self, comm: Comm | None = None) -> dict[str, Any]:
        """``{"type": "Nanny", "address", "name", "pid" (this process), "worker_pid",
        "memory_limit" (0: none), "restarts", "status"}``."""
        return {"type": "Nanny", "address": self.address, "name": self.name, "pid": os.getpid(),
                "worker_pid": self.pid, "memory_limit": self.memory_limit or 0, "restarts": self.restarts,
                "status": self.status}

    # -- life

    async def start(self) -> Nanny:
        """Listen for rpc and start the worker process (not waiting for it to join
        its scheduler); returns self. Raises ``OSError`` if it cannot listen or the
        process cannot start."""
        loop = asyncio.get_running_loop()
        self._lock = asyncio.Lock()
        self._finished = loop.create_future()
        scheme = "tls" if self.security.tls else "tcp"
        await self.server.listen(f"{scheme}://{_hostport(self.host, 0)}")
        try:
            self._spawn()
        except BaseException:
            await self.server.close()
            raise
        self.status = "running"
        self._watch = asyncio.ensure_future(self._watch_child())
        return self

    async def finished(self) -> int:
        """Wait until this nanny has ended; returns its exit code (0: the worker ended
        as asked or the nanny was closed; 1: it gave up)."""
        assert self._finished is not None, "the nanny is not started"
        return await asyncio.shield(self._finished)

    async def restart(self, comm: Comm | None = None, timeout: float | None = None) -> dict[str, int]:
        """Stop the worker (asked to close, killed after ``timeout`` seconds, default
        :data:`CLOSE_GRACE`) and start a new one; returns ``{"pid": its pid}`` once it
        has started (not joined). Not counted as a crash. Raises ``RuntimeError`` on a
        nanny that is not running."""
        assert self._lock is not None
        async with self._lock:
            if self.status != "running":
                raise RuntimeError(f"nanny {self.name or self.address} is {self.status}")
            self._busy = True
            try:
                await self._stop_child(CLOSE_GRACE if timeout is None else max(float(timeout), 0.0))
                error = self._try_spawn()
            finally:
                self._busy = False
        if error is not None:
            raise error  # (the watch keeps trying)
        return {"pid": self.pid}

    async def close(self, timeout: float = CLOSE_GRACE) -> None:
        """Stop the worker (asked to close, killed after ``timeout`` seconds), remove
        what it left and stop serving; returns once done (also when closing already).
        A caller cancelled meanwhile does not stop the closing half-way."""
        if self._finished is None or self._finished.done():
            self.status = "closed"
            return
        if self._closing is None:
            self.status = "closing"
            self._busy = True
            if self._watch is not None and self._watch is not asyncio.current_task():
                self._watch.cancel()
            self._closing = asyncio.ensure_future(self._close(timeout))
        await asyncio.shield(self._closing)

    async def _close(self, timeout: float) -> None:
        assert self._lock is not None
        try:
            async with self._lock:  # after a restart under way: its new child is stopped too
                await self._stop_child(timeout)
            await self.server.close()
        finally:
            self._end(0)

    def _close_op(self, comm: Comm | None = None) -> None:
        asyncio.ensure_future(self.close())  # after the reply has gone

    def _end(self, code: int) -> None:
        self.status = "closed"
        self.proc = None
        if self._watch is not None and self._watch is not asyncio.current_task():
            self._watch.cancel()
        if self._finished is not None and not self._finished.done():
            self._finished.set_result(code)

    # -- the child

    def _spawn(self) -> None:
        self.work_dir = tempfile.mkdtemp(prefix="shoal-worker-", dir=self.directory)
        argv = [*self.argv, "--memory-limit", str(self.memory_limit or 0), "--work-dir", self.work_dir,
                "--nanny-address", self.address]
        env = {**self.env, "SHOAL_NANNY_PID": str(os.getpid())}
        log: IO[bytes] | None = open(self.log_path, "ab") if self.log_path else None  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                                         process_group=0)  # see the module: the nanny stops it in order
        except BaseException:
            shutil.rmtree(self.work_dir, ignore_errors=True)
            raise
        finally:
            if log is not None:
                log.close()  # the child has its own descriptor of it
        self._psutil = None
        if self.on_spawn is not None:
            self.on_spawn(self.proc)

    def _try_spawn(self) -> OSError | None:
        """Start the worker process; when it cannot start now, say why (once per
        reason), have the watch try again later, and return the error."""
        try:
            self._spawn()
        except OSError as exc:
            self.proc = None
            loop = asyncio.get_running_loop()
            self._retry_at = loop.time() + self._retry_delay
            text = f"{type(exc).__name__}: {exc}"
            if text != self._spawn_error:
                self._spawn_error = text
                who = f"worker {self.name}" if self.name else "the worker"
                self.say(f"cannot start {who}: {text}; trying again every {self._retry_delay:g}-{SPAWN_RETRY_MAX:g}s")
            self._retry_delay = min(self._retry_delay * 2, SPAWN_RETRY_MAX)
            return exc
        if self._spawn_error and self.proc is not None:
            self.say(f"worker {self._who(self.proc)} started again")
        self._retry_at, self._retry_delay, self._spawn_error = None, 1.0, ""
        return None

    async def _stop_child(self, timeout: float) -> None:
        """Ask the child to close (SIGTERM), kill it after ``timeout`` seconds, and
        remove what it left."""
        p = self.proc
        if p is None:
            return
        if p.poll() is None:
            p.terminate()
        await wait_or_kill(p, timeout)
        self._clean_up(p)

    def _clean_up(self, p: subprocess.Popen[bytes]) -> None:
        shm.sweep(p.pid)  # (a child that closed cleanly left none)
        if self.work_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)

    async def _watch_child(self) -> None:
        while True:
            await asyncio.sleep(max(float(config.get("memory-monitor-interval")), 0.01))  # a periodic look
            if self._security_source is not None:
                self._refresh_security()
            p = self.proc
            if self._busy:
                continue
            if p is None:
                if self._retry_at is not None and asyncio.get_running_loop().time() >= self._retry_at:
                    self._try_spawn()
                continue
            code = p.poll()
            if code is None:
                self._check_memory(p)
                continue
            deliberate = code == 0 and not os.path.exists(self.work_dir)
            self._clean_up(p)
            if deliberate:
                await self.server.close()
                self._end(0)
                return
            if code == EXIT_GAVE_UP:
                there = await self._scheduler_there()
                if self._busy or self.proc is not p:
                    continue  # restarted or closing meanwhile
                if not there:
                    await self.server.close()
                    self._end(1)  # it said why
                    return
            if not self._may_restart():
                await self.server.close()
                self._end(1)
                return
            self.restarts += 1
            if self.on_crash is not None:
                self.on_crash(p, code)
            else:
                self.say(f"worker {self._who(p)} exited with code {code}; starting it again")
            self._try_spawn()

    async def _scheduler_there(self) -> bool:
        """Whether the scheduler answers (a worker that gave up on it while it is there
        was removed by it, for its silence: it is started again)."""
        if not self.scheduler_address:
            return False
        try:
            comm = await connect(self.scheduler_address, timeout=1.0, deserialize=False, security=self.security,
                                 role="nanny", expect="scheduler")
        except Exception:  # noqa: BLE001 - not there, or it refuses us: either way the worker stays down
            return False
        comm.abort()
        return True

    def _may_restart(self) -> bool:
        """Note a crash now; False (and one line) once there were more than
        ``nanny-max-restarts`` within ``nanny-restart-window`` seconds."""
        now = time.monotonic()
        window = float(config.get("nanny-restart-window"))
        limit = int(config.get("nanny-max-restarts"))
        self._crashes.append(now)
        while self._crashes and self._crashes[0] < now - window:
            self._crashes.popleft()
        if len(self._crashes) <= limit:
            return True
        who = f"worker {self.name}" if self.name else "the worker"
        self.say(f"{who} died {len(self._crashes)} times within {window:g}s (nanny-max-restarts is {limit}): "
                 "not starting it again")
        return False

    def _check_memory(self, p: subprocess.Popen[bytes]) -> None:
        if not self.memory_limit:
            return
        terminate = Thresholds.from_config(self.memory_limit).terminate
        if terminate is None:
            return
        try:
            if self._psutil is None or self._psutil.pid != p.pid:
                import psutil

                self._psutil = psutil.Process(p.pid)
            # its private memory: pages of shared memory are not its alone (a peer's
            # segment it maps is the peer's), and killing it would not free them
            rss = private_memory(self._psutil.memory_info())
        except Exception:  # noqa: BLE001 - gone meanwhile (psutil.NoSuchProcess): the next look sees it
            return
        if rss > terminate:
            self.say(f"worker {self._who(p)} uses {format_bytes(rss)}, past {config.get('memory-terminate'):.0%} "
                     f"of its memory limit of {format_bytes(self.memory_limit)}: restarting it")
            p.kill()  # the next look finds it gone: a crash

    def _refresh_security(self) -> None:
        assert self._security_source is not None
        try:
            found = self._security_source()
        except Exception:  # noqa: BLE001 - an auth file being rewritten: the next look
            return
        if found is not None and found.secret != self.security.secret:
            self.security = found
            self.server.security = found
            for listener in self.server.listeners:
                listener.security = found  # type: ignore[attr-defined]  # (read at each handshake)

    def _who(self, p: subprocess.Popen[bytes]) -> str:
        return f"{self.name} (pid {p.pid})" if self.name else f"pid {p.pid}"

    def __repr__(self) -> str:
        return f"<Nanny {self.name!r} worker pid={self.pid} {self.status}>"


async def wait_or_kill(p: subprocess.Popen[bytes], timeout: float) -> None:
    """Wait for process ``p`` to exit, killing it after ``timeout`` seconds. Polled
    rather than waited for in a thread: a cluster closed at interpreter exit gets no
    executor thread any more."""
    deadline = time.monotonic() + timeout
    while p.poll() is None:
        if time.monotonic() >= deadline:
            p.kill()
            deadline = float("inf")
        await asyncio.sleep(0.01)  # polling: nothing wakes this loop when a child exits


def die_with_parent() -> None:
    """In a worker process started by a nanny (``SHOAL_NANNY_PID`` in its
    environment): have the kernel send it SIGTERM when the nanny dies
    (``PR_SET_PDEATHSIG``, Linux), and leave at once if it is dead already."""
    expected = os.environ.get("SHOAL_NANNY_PID", "")
    if not expected.isdigit():
        return
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != int(expected):  # it died before the call above
        os.kill(os.getpid(), signal.SIGTERM)


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
