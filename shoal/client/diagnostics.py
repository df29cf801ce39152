"""What ran, for the client: ``client.get_task_stream()``, the ``get_task_stream()``
context manager, and ``performance_report``, which writes what ran inside a block
into one self-contained HTML file.

The scheduler keeps the task stream (:mod:`shoal.scheduler.diagnostics`): a ring of
records numbered from 0 for its life. A block notes the number the next record will
get when it begins and asks for the records from there when it ends, so it sees the
tasks that finished inside it, and no others.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from .coordination import _seconds

if TYPE_CHECKING:
    from .client import Client

__all__ = ["TaskStreamMethods", "TaskStream", "get_task_stream", "performance_report"]

#: records asked for in one request (the scheduler keeps 100,000 by default)
BATCH = 100_000


def _with_startstops(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with dask's ``startstops`` too (transfers, then the compute)."""
    steps = [{"action": "transfer", "start": t["start"], "stop": t["stop"], "source": t["from"], "key": t["key"],
              "bytes": t["bytes"], "path": t["path"]} for t in record.get("transfers", ())]
    steps.append({"action": "compute", "start": record["start"], "stop": record["stop"]})
    return {**record, "startstops": steps}


def _since_time(value: Any, now: float) -> float | None:
    """``start``/``stop`` of ``get_task_stream``: epoch seconds, or a duration before
    now ("10s", "500ms", a timedelta); ``None`` stays ``None``."""
    if value is None:
        return None
    if isinstance(value, str) or hasattr(value, "total_seconds"):
        ago = _seconds(value)
        assert ago is not None
        return now - ago
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"start and stop are times (epoch seconds) or durations like '10s', got {value!r}")
    return float(value)


class TaskStreamMethods:
    """``get_task_stream`` for :class:`~shoal.Client`."""

    @property
    def _stream_client(self) -> Client:
        return self  # type: ignore[return-value]

    def get_task_stream(self, start: Any = None, stop: Any = None, count: int | None = None) -> Any:
        """The tasks that ran (as the scheduler still keeps them), oldest first: one dict
        per task with ``key``, ``prefix``, ``worker``, ``thread``, ``start``, ``stop``
        (epoch seconds), ``status`` ("OK" or "error"), ``transfers`` (the inputs moved
        for it: ``key``, ``from``, ``bytes``, ``path`` of "inproc", "shm" or "tcp",
        ``start``, ``stop``) and dask's ``startstops``. ``start``/``stop``: only tasks
        that ended after/before it (epoch seconds, or "10s" meaning ten seconds ago);
        ``count``: only the last ``count``. Raises ``TypeError``/``ValueError`` for
        arguments of the wrong kind."""
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 0):
            raise ValueError(f"count must be an integer >= 0, got {count!r}")
        now = time.time()
        lo, hi = _since_time(start, now), _since_time(stop, now)
        return self._stream_client._sync(self._get_task_stream, 0, lo, hi, count)

    async def _get_task_stream(self, since: int, lo: float | None = None, hi: float | None = None,
                               count: int | None = None) -> list[dict[str, Any]]:
        records: list[dict[str, Any]] = []
        rpc = self._stream_client._scheduler_rpc()
        while True:
            got = await rpc.get_task_stream(since=since, limit=BATCH)
            records.extend(got["records"])
            if not got["records"] or got["next"] <= since:
                break
            since = got["next"]
        out = [r for r in records if (lo is None or r["stop"] >= lo) and (hi is None or r["stop"] <= hi)]
        if count is not None:
            out = out[-count:] if count else []
        return [_with_startstops(r) for r in out]

    async def _task_stream_next(self) -> int:
        got = await self._stream_client._scheduler_rpc().get_task_stream(since=2**62, limit=0)
        return int(got["next"])

    async def _diagnostics(self) -> dict[str, Any]:
        return dict(await self._stream_client._scheduler_rpc().diagnostics())


class TaskStream:
    """What ``with get_task_stream() as ts:`` gives: ``ts.data`` holds the records of
    the tasks that finished inside the block (see :meth:`Client.get_task_stream`)."""

    def __init__(self, client: Client):
        self.client = client
        self.data: list[dict[str, Any]] = []
        self._start = 0

    def __enter__(self) -> TaskStream:
        self._start = self.client._sync(self.client._task_stream_next)
        return self

    def __exit__(self, *exc: object) -> None:
        self.data = self.client._sync(self.client._get_task_stream, self._start)

    async def __aenter__(self) -> TaskStream:
        self._start = await self.client._task_stream_next()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.data = await self.client._get_task_stream(self._start)


def _client_or_default(client: Client | None) -> Client:
    if client is not None:
        return client
    from .default import default_client

    return default_client()


def get_task_stream(client: Client | None = None) -> TaskStream:
    """``with get_task_stream() as ts: ...``; then ``ts.data`` holds the task-stream
    records of what finished inside the block (the default client's, unless
    ``client`` is given). Also ``async with`` for an asynchronous client."""
    return TaskStream(_client_or_default(client))


@contextmanager
def performance_report(filename: str = "shoal-report.html", client: Client | None = None) -> Iterator[None]:
    """``with performance_report(filename="report.html"): ...`` writes one HTML file
    (it opens with no network and no server) showing the task stream, progress, memory
    per worker and bytes moved by path of what ran inside the block. Raises
    ``ImportError`` if the dashboard's files are not installed, ``OSError`` if the file
    cannot be written (after the block ran)."""
    from ..dashboard.report import render_report

    c = _client_or_default(client)
    began = time.time()
    first = c._sync(c._task_stream_next)
    before = c._sync(c._diagnostics)
    yield
    records = c._sync(c._get_task_stream, first)
    after = c._sync(c._diagnostics)
    data = {
        "task_stream": records,
        "progress": after["progress"],
        "workers": after["workers"],
        "transfers": {"start": before["transfers"], "stop": after["transfers"]},
        "summary": after["summary"],
        "duration": time.time() - began,
    }
    html = render_report(data, title=f"shoal performance report ({time.strftime('%Y-%m-%d %H:%M:%S')})")
    with open(filename, "w", encoding="utf-8") as f:
        f.write(html)
