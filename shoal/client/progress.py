"""``shoal.progress``: progress bars per task prefix for futures and persisted
collections, as ``dask.distributed.progress`` draws them.

The client only knows the tasks it holds futures for, so the bars come from the
scheduler: a poll every ``interval`` seconds (op ``progress``, docs/protocol.md §9.3)
returns, per key prefix, how many tasks of the futures' dependency closure are done,
erred, running or waiting. In a terminal the bars are text (tqdm) and ``progress``
returns once every task is done or erred; in a Jupyter kernel with ipywidgets it
returns a widget at once, which the client's event loop keeps up to date.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import re
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO

from tqdm import tqdm

from .. import config
from ..errors import CommError, ProtocolError
from .future import Future
from .structure import futures_of

if TYPE_CHECKING:
    from .client import Client

__all__ = ["progress", "futures_of", "TextProgressBar", "ProgressWidget"]

logger = logging.getLogger("shoal.client")

#: what a progress reply counts per prefix (docs/protocol.md §9.3)
Counts = dict[str, dict[str, int]]


def progress(*futures: Any, notebook: bool | None = None, multi: bool = True, complete: bool = True,
             group_by: str = "prefix", interval: float | str | None = None, file: TextIO | None = None,
             width: int | None = None) -> Any:
    """Show progress bars for ``futures`` (futures, collections of them, persisted dask
    collections) and for every task they depend on: one bar per task prefix (the
    function's name, e.g. ``inc`` for the tasks of ``client.map(inc, ...)``) with
    ``multi``, else one bar for all.

    In a terminal (``notebook=False``, the default outside a Jupyter kernel) the bars
    are text on ``file`` (default ``sys.stdout``), and this blocks until every task is
    done or erred (erred tasks are counted on their bar); it returns None, or an
    awaitable on an asynchronous client. In a Jupyter kernel (``notebook=True``, the
    default there when ipywidgets is installed) it returns a :class:`ProgressWidget` at
    once (shown when it is the cell's value), which the client updates; erred bars
    turn red. ``complete=False`` leaves out tasks already done. ``interval`` is the
    seconds (or a string such as ``"100ms"``) between two polls of the scheduler
    (config ``progress-interval``). ``width`` is the text bars' width in characters.

    Raises ``ValueError`` for a ``group_by`` other than ``"prefix"``, ``ImportError`` for
    ``notebook=True`` without ipywidgets.
    """
    if group_by != "prefix":
        raise ValueError(f"shoal.progress groups tasks by key prefix only (group_by='prefix'), got {group_by!r}")
    seconds = _seconds(config.get("progress-interval") if interval is None else interval)
    found = futures_of(list(futures))
    if notebook is None:
        notebook = _in_kernel() and _have_ipywidgets()
    # a cancelled future's key is gone from the scheduler: nothing to wait for
    live = [f for f in found if f.status != "cancelled"]
    client = live[0].client if live else None
    if notebook:
        widget = ProgressWidget(multi)
        if client is None:
            widget.update({}, 0.0, final=True)
        else:
            widget._start(_Poll(client, live, complete, seconds, widget.update))
        return widget
    bar = TextProgressBar(multi, file=file, width=width)
    if client is None:
        bar.close()
        return _nothing() if _asynchronous(found) else None
    poll = _Poll(client, live, complete, seconds, bar.update)
    if client.asynchronous:
        return _run_then_close(poll, bar)
    if client._loop_thread is None:
        raise RuntimeError("this client is closed")
    fut = asyncio.run_coroutine_threadsafe(_run_then_close(poll, bar), client._loop_thread.loop)
    try:
        fut.result()
    except BaseException:
        fut.cancel()  # interrupted (Ctrl-C): the poll ends too
        raise
    return None


async def _run_then_close(poll: _Poll, bar: TextProgressBar) -> None:
    try:
        await poll.run()
    finally:
        bar.close()


async def _nothing() -> None:
    return None


def _asynchronous(futures: list[Future]) -> bool:
    return bool(futures) and futures[0].client.asynchronous


_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0}


def _seconds(interval: float | str) -> float:
    """``interval`` in seconds: a number, or a string such as ``"100ms"`` or ``"0.5s"``.
    Raises ``ValueError`` for anything else, or a number not above 0."""
    if isinstance(interval, str):
        match = re.fullmatch(r"\s*([0-9.]+(?:e-?\d+)?)\s*(us|ms|s|min|m)?\s*", interval)
        if match is None:
            raise ValueError(f"interval must be seconds or a duration such as '100ms', got {interval!r}")
        value = float(match.group(1)) * _UNITS[match.group(2) or "s"]
    elif isinstance(interval, (int, float)) and not isinstance(interval, bool):
        value = float(interval)
    else:
        raise ValueError(f"interval must be seconds or a duration such as '100ms', got {interval!r}")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"interval must be more than 0 seconds, got {interval!r}")
    return value


def _in_kernel() -> bool:
    """Whether this runs in a Jupyter (IPython) kernel, as opposed to a terminal."""
    if "IPython" not in sys.modules:
        return False
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return getattr(get_ipython(), "kernel", None) is not None


def _have_ipywidgets() -> bool:
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True


class _Poll:
    """Asks the scheduler how far ``futures``' tasks are until all are done or erred;
    ``on_update(counts, elapsed, final)`` is called on the client's loop after each
    answer (``final`` the last time)."""

    def __init__(self, client: Client, futures: list[Future], complete: bool, interval: float,
                 on_update: Callable[[Counts, float, bool], None]):
        self.client = client
        self.futures = futures  # held: the keys stay known while the bars follow them
        self.complete = complete
        self.interval = interval
        self.on_update = on_update
        self.id = f"{client.id}-progress-{uuid.uuid4().hex[:12]}"
        self.counts: Counts = {}

    async def run(self) -> Counts:
        """Poll until finished (or the client or its scheduler is gone); returns the
        last counts."""
        keys = [f.key for f in self.futures]
        start = time.monotonic()
        first = True
        final = False
        try:
            while not final:
                if not first:
                    await asyncio.sleep(self.interval)
                reply = await self._ask(keys if first else None)
                if reply is None:
                    break  # the scheduler is gone: the bars stay as they were
                if not reply.get("known"):
                    reply = await self._ask(keys)  # it dropped this bar's closure: send it again
                    if reply is None:
                        break
                first = False
                self.counts = reply.get("counts") or {}
                final = bool(reply.get("finished")) or (
                    # keys it will never know (a scheduler restarted under us): go by the futures
                    bool(reply.get("missing")) and all(f.done() for f in self.futures)
                ) or self.client.status != "running"
                self.on_update(self.counts, time.monotonic() - start, final)
        finally:
            if not first:
                # the scheduler drops the closure now rather than when it expires
                asyncio.ensure_future(self._stop())
        return self.counts

    async def _ask(self, keys: list[Any] | None) -> dict[str, Any] | None:
        if self.client.status != "running":
            return None
        try:
            kwargs: dict[str, Any] = {"id": self.id, "complete": self.complete}
            if keys is not None:
                kwargs["keys"] = keys
            reply = await self.client._scheduler_rpc().progress(**kwargs)
        except (CommError, ProtocolError, OSError) as exc:
            logger.warning("progress: no answer from the scheduler (%s); the bars stop here", exc)
            return None
        return reply if isinstance(reply, dict) else None

    async def _stop(self) -> None:
        try:
            if self.client.status == "running":
                await self.client._scheduler_rpc().progress(id=self.id, stop=True)
        except Exception:  # noqa: BLE001 - a courtesy: unused closures expire anyway
            pass


def _totals(counts: Counts) -> Counts:
    """All prefixes added up, as one group."""
    out: dict[str, int] = {}
    for c in counts.values():
        for name, n in c.items():
            out[name] = out.get(name, 0) + n
    return {"tasks": out} if out else {}


class _Bar(tqdm):  # type: ignore[misc]
    # the bars are refreshed by each poll: no monitor thread of tqdm's is needed
    # (it would outlive them, for the rest of the process)
    monitor_interval = 0


class TextProgressBar:
    """Text bars (tqdm) on ``file``, one per prefix (or one for all); updated by
    :meth:`update` from the poll, closed (left on screen) by :meth:`close`."""

    def __init__(self, multi: bool = True, file: TextIO | None = None, width: int | None = None):
        self.multi = multi
        self.file = file
        self.width = width
        self.bars: dict[str, Any] = {}
        self._closed = False

    def update(self, counts: Counts, elapsed: float, final: bool = False) -> None:
        """Bring the bars to ``counts``, making bars for prefixes seen first."""
        groups = counts if self.multi else _totals(counts)
        pad = max((len(p) for p in groups), default=0)
        for prefix, c in groups.items():
            bar = self.bars.get(prefix)
            if bar is None:
                # written where the caller writes (dask's bars go to stdout too)
                bar = self.bars[prefix] = _Bar(
                    total=c.get("all", 0), desc=prefix.ljust(pad), file=self.file or sys.stdout,
                    position=len(self.bars), leave=True, ncols=self.width,
                    bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]",
                    dynamic_ncols=self.width is None and self.file is None,
                )
            if bar.total != c.get("all", 0):
                bar.total = c.get("all", 0)
            erred = c.get("erred", 0)
            if erred:
                bar.set_postfix_str(f"{erred} erred", refresh=False)
            done = c.get("done", 0)
            if final:
                bar.n = done  # shown as it closes
            elif done != bar.n:
                bar.update(done - bar.n)  # shown if its last display is older than tqdm's mininterval

    def close(self) -> None:
        """End the bars (they stay on the screen as they are)."""
        if self._closed:
            return
        self._closed = True
        for bar in self.bars.values():
            bar.close()


class ProgressWidget:
    """A Jupyter widget (ipywidgets) with a bar per prefix, or one for all: ``done /
    all`` beside each, red for a prefix with erred tasks, green once a prefix is done.
    Displayed when it is a cell's value; kept up to date by the client's event loop.
    :meth:`wait` waits for the end (a shoal addition, handy outside a notebook)."""

    def __init__(self, multi: bool = True):
        try:
            import ipywidgets
        except ImportError as exc:
            raise ImportError("shoal.progress(notebook=True) needs ipywidgets (pip install ipywidgets)") from exc
        self._w = ipywidgets
        self.multi = multi
        self.elapsed = ipywidgets.HTML(value="")
        self.widget = ipywidgets.VBox([self.elapsed])
        #: prefix -> (label, bar, text)
        self.bars: dict[str, tuple[Any, Any, Any]] = {}
        #: the last counts, as the scheduler gave them
        self.counts: Counts = {}
        self.status = "running"
        self._finished = threading.Event()
        self._task: concurrent.futures.Future[Any] | asyncio.Future[Any] | None = None

    def _start(self, poll: _Poll) -> None:
        """Run ``poll`` on its client's loop, without waiting for it."""
        client = poll.client
        if client.asynchronous:
            self._task = asyncio.ensure_future(poll.run())
        else:
            if client._loop_thread is None:
                raise RuntimeError("this client is closed")
            self._task = asyncio.run_coroutine_threadsafe(poll.run(), client._loop_thread.loop)
        self._task.add_done_callback(self._ended)

    def _ended(self, task: Any) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.error("progress: the poll failed", exc_info=task.exception())
        if not self._finished.is_set():
            self.status = "stopped"
            self._finished.set()

    def update(self, counts: Counts, elapsed: float, final: bool = False) -> None:
        """Bring the widget to ``counts``."""
        w = self._w
        self.counts = counts
        groups = counts if self.multi else _totals(counts)
        rows_added = False
        any_erred = False
        for prefix, c in groups.items():
            row = self.bars.get(prefix)
            if row is None:
                label = w.HTML(value=f"<div style='text-align: right; padding-right: 6px'><b>{_escape(prefix)}</b></div>",
                               layout=w.Layout(width="160px"))
                bar = w.IntProgress(min=0, max=1, value=0, layout=w.Layout(width="60%"))
                text = w.HTML(value="")
                row = self.bars[prefix] = (label, bar, text)
                rows_added = True
            _, bar, text = row
            total, done, erred = c.get("all", 0), c.get("done", 0), c.get("erred", 0)
            bar.max = max(total, 1)
            bar.value = done if total else 1
            any_erred = any_erred or bool(erred)
            bar.bar_style = "danger" if erred else ("success" if done == total else "")
            text.value = f"<div style='padding-left: 6px'>{done} / {total}" + (
                f", <span style='color: #d9534f'>{erred} erred</span>" if erred else "") + "</div>"
        if rows_added:
            self.widget.children = [self.elapsed] + [w.HBox(list(r)) for r in self.bars.values()]
        state = "Finished" if final else "Running"
        self.elapsed.value = f"<div style='padding: 0px 10px 5px 10px'>{state}: {elapsed:.1f} s</div>"
        if final:
            self.status = "error" if any_erred else "finished"
            self._finished.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the bars are final; False after ``timeout`` seconds."""
        return self._finished.wait(timeout)

    def _ipython_display_(self, **kwargs: Any) -> None:
        from IPython.display import display

        display(self.widget)

    def __repr__(self) -> str:
        bars = ", ".join(f"{p}: {c.get('done', 0)}/{c.get('all', 0)}" for p, c in self.counts.items())
        return f"<ProgressWidget {self.status} {bars}>"


def _escape(text: str) -> str:
    import html

    return html.escape(text)
