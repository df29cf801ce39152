"""What a :class:`~.local.LocalCluster`'s parts logged, for ``cluster.get_logs()``.

- Worker processes write their stdout and stderr to a file each, in a temporary
  directory the cluster owns (removed when it closes).
- In this process (the scheduler, always; the workers with ``processes=False``) a
  handler on the ``shoal`` logger keeps the records of this cluster, as far as it can
  tell them apart from other clusters' of the process: a record logged by code that
  runs for one of its parts (a context variable set when the part starts, inherited
  by the asyncio tasks it starts) belongs to that part, and so does one logged by a
  task that one of its workers runs (``get_worker()``); one from the cluster's event
  loop thread without either mark belongs to the scheduler when the scheduler's
  logger made it, else to the cluster. Records are kept at the level the ``shoal`` loggers
  let through (``logging.getLogger("shoal").setLevel(logging.INFO)`` for more).
- The cluster's own events (workers started, retired, replaced) are noted directly.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import shutil
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterator

__all__ = ["ClusterLogs"]

#: (id of the ClusterLogs, name of the part) of the code running now
_owner: contextvars.ContextVar[tuple[int, str] | None] = contextvars.ContextVar("shoal_log_owner", default=None)

_FORMAT = "%(asctime)s - %(name)s - %(levelname)s - %(message)s"
#: records kept per part (the oldest go first)
MAX_LINES = 10_000


class ClusterLogs:
    """The logs of one cluster: ``files`` (a temporary directory for worker processes'
    output, or none) and what this process logged for it."""

    def __init__(self, files: bool):
        self.files = files
        #: the directory of the files (made by :meth:`attach`)
        self.dir = ""
        self._lines: dict[str, deque[str]] = {}
        self._lock = threading.Lock()
        self._handler = _Handler(self)
        self._thread: int | None = None
        self._formatter = logging.Formatter(_FORMAT)
        #: id(Worker) -> name, of the cluster's workers in this process
        self._workers: dict[int, str] = {}

    def path(self, name: str) -> str:
        """The file a worker process ``name`` writes to."""
        assert self.dir, "no log files (yet, or any more)"
        return os.path.join(self.dir, f"{_safe(name)}.log")

    def attach(self) -> None:
        """Start keeping this process's records; the calling thread is the cluster's
        event loop thread."""
        self._thread = threading.get_ident()
        if self.files and not self.dir:
            self.dir = tempfile.mkdtemp(prefix="shoal-cluster-logs-")
        logging.getLogger("shoal").addHandler(self._handler)

    @contextlib.contextmanager
    def owned_by(self, name: str) -> Iterator[None]:
        """Code in this block (and the asyncio tasks it starts) logs for part ``name``."""
        token = _owner.set((id(self), name))
        try:
            yield
        finally:
            _owner.reset(token)

    def add_worker(self, name: str, worker: object) -> None:
        """Records of the tasks ``worker`` (in this process) runs belong to ``name``."""
        self._workers[id(worker)] = name

    def remove_worker(self, worker: object) -> None:
        self._workers.pop(id(worker), None)

    def _task_worker(self) -> str | None:
        """The name of this cluster's worker whose task logs now, if that is it."""
        if not self._workers:
            return None
        try:
            from ..worker.context import get_worker

            return self._workers.get(id(get_worker()))
        except Exception:  # noqa: BLE001 - not in a task (ValueError), or no such API
            return None

    def note(self, text: str) -> None:
        """One of the cluster's own events, for its ``"Cluster"`` log."""
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        self._add("Cluster", f"{stamp} - shoal.deploy - INFO - {text}")

    def _add(self, name: str, line: str) -> None:
        with self._lock:
            lines = self._lines.get(name)
            if lines is None:
                lines = self._lines[name] = deque(maxlen=MAX_LINES)
            lines.append(line)

    def _keep(self, record: logging.LogRecord) -> None:
        if record.name.startswith("shoal.deploy"):
            return  # noted already
        owner = _owner.get()
        if owner is not None:
            if owner[0] != id(self):
                return  # another cluster's
            name = owner[1]
        else:
            task_of = self._task_worker()
            if task_of is not None:
                name = task_of
            elif record.thread == self._thread:
                name = "Cluster"
            else:
                return
        if record.name.startswith("shoal.scheduler"):
            name = "Scheduler"
        try:
            line = self._formatter.format(record)
        except Exception:  # noqa: BLE001 - a record whose arguments do not format
            line = f"{record.name} - {record.levelname} - {record.msg!r}"
        self._add(name, line)

    def text(self, name: str) -> str:
        """What part ``name`` logged in this process, one record a line."""
        with self._lock:
            return "\n".join(self._lines.get(name, ()))

    def file_text(self, name: str) -> str:
        """What worker process ``name`` wrote (``""`` when nothing, or no file)."""
        if not self.dir:
            return ""
        try:
            with open(self.path(name), "rb") as f:
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def close(self) -> None:
        """Stop keeping records; the files go (what was read stays read)."""
        logging.getLogger("shoal").removeHandler(self._handler)
        self.remove_files()

    def remove_files(self) -> None:
        """Remove the files now (it takes no lock: a signal handler may call it)."""
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = ""


class _Handler(logging.Handler):
    def __init__(self, logs: ClusterLogs):
        super().__init__(logging.NOTSET)
        self.logs = logs

    def emit(self, record: logging.LogRecord) -> None:
        self.logs._keep(record)


def _safe(name: str) -> str:
    """``name`` as a file name."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "_"
