"""The dashboard's HTTP server: pages, a JSON API, ``/metrics`` and a stream of
updates, served by aiohttp on the scheduler's own event loop.

Theory of operation
-------------------
Every handler reads :class:`~shoal.scheduler.diagnostics.Diagnostics`, whose views
are bounded and cheap (counts per key prefix, a ring buffer of task records), so a
handler holds the loop for about as long as one message of a worker does. Nothing
here changes the cluster: the API is read-only.

A page keeps one connection open to ``/api/v1/events`` (server-sent events). Every
``dashboard-interval`` seconds each such connection gets an ``update``: the summary,
workers, progress and transfers (computed once per interval for all connections, and
encoded once) and the task-stream records made since that connection's previous
update (its own cursor). A page that reconnects sends the last event id it saw, which
is the cursor, and so misses nothing the ring buffer still holds. When more records
came than one update carries, the oldest are skipped: a page always shows the newest.

Errors never become an HTML page: a bad parameter is a 400 and an unknown key a 404,
with ``{"error": "..."}``; a bug in a handler is logged and answered with a 500 in
the same form.

Every request passes one middleware first (:meth:`Dashboard._guard_request`): it
tells the connection guard (:mod:`.guard`) that a request is being answered, refuses
a foreign ``Host`` on a loopback dashboard, and asks :mod:`.access` whether the
request logged in; a refused one is answered there, before any handler reads the
cluster.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
from aiohttp import web

from .. import config
from ..comm.core import parse_address
from ..scheduler.diagnostics import Steps
from . import check_exposure, is_loopback, parse_dashboard_address
from .access import ANONYMOUS, FULL, LOGGED_IN_ONLY, Access, page_name
from .guard import ConnectionGuard, GuardedSite
from .pages import PAGES, STATIC, render_page

if TYPE_CHECKING:
    from ..scheduler.server import Scheduler

__all__ = ["Dashboard", "start_dashboard"]

logger = logging.getLogger("shoal.dashboard")

#: records of the task stream one request or one update carries at most
MAX_RECORDS = 100_000
#: records the first update of an event stream carries (the newest)
FIRST_RECORDS = 1000
#: records a later update carries at most (more: the oldest are skipped)
UPDATE_RECORDS = 10_000
#: records made into JSON at a time: between two such chunks, the loop runs the
#: scheduler (a chunk takes about 5 ms)
CHUNK_RECORDS = 1000
#: the longest key or search text accepted (keys are shown cut to 200 characters)
MAX_TEXT = 1000
#: seconds open requests get to finish when the dashboard closes (then they are cancelled)
SHUTDOWN_TIMEOUT = 1.0

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
T = TypeVar("T")


class BadRequest(ValueError):
    """A query parameter that is not what the endpoint takes (answered with a 400)."""


#: JSON, 10-15 times as fast as the json module (NaN, which JSON lacks, comes out as null)
_encode = msgspec.json.Encoder().encode

_JSON_HEADERS = {"Content-Type": "application/json", "Cache-Control": "no-store"}

#: what the request being answered may see (access.FULL or access.ANONYMOUS), set by
#: the middleware for its handler
_VIEW: ContextVar[str] = ContextVar("shoal_dashboard_view", default=ANONYMOUS)

#: the nav bar's connection indicator, and what goes before it for a viewer who has
#: not logged in to an open dashboard
_CONNECTION = '<span class="connection" id="connection">'
_ANONYMOUS_NOTE = '<span class="anonymous" id="anonymous">not logged in: task keys and errors hidden</span>\n  '


async def _paced(steps: Steps[T]) -> T:
    """The answer of a look through many keys (``Diagnostics.search_steps``, ...),
    letting the loop run the scheduler between its slices."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
        await asyncio.sleep(0)


def _json(value: Any, status: int = 200) -> web.Response:
    return web.Response(body=_encode(value), status=status, headers=_JSON_HEADERS)


def _error(status: int, text: str) -> web.Response:
    return _json({"error": text}, status)


def _one(request: web.Request, name: str) -> str | None:
    values = request.query.getall(name, [])
    if len(values) > 1:
        raise BadRequest(f"{name} is given {len(values)} times")
    return values[0] if values else None


def _count(request: web.Request, name: str, default: int, maximum: int) -> int:
    """Query parameter ``name``: an integer >= 0 (at most ``maximum``: larger ones are
    taken as ``maximum``)."""
    raw = _one(request, name)
    if raw is None:
        return default
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 18:
        raise BadRequest(f"{name} must be an integer >= 0, got {raw[:40]!r}")
    return min(int(raw), maximum)


def _text(request: web.Request, name: str) -> str:
    raw = _one(request, name)
    if raw is None or raw == "":
        raise BadRequest(f"{name} is required")
    if len(raw) > MAX_TEXT:
        raise BadRequest(f"{name} is longer than {MAX_TEXT} characters")
    return raw


def _split_host(host_header: str) -> str:
    """The host of a ``Host`` header (``name:port``, ``[::1]:port``, ``name``)."""
    if host_header.startswith("["):
        return host_header[1:].partition("]")[0]
    return host_header.rpartition(":")[0] if host_header.count(":") == 1 else host_header


def _scheduler_host(scheduler: Scheduler) -> str:
    """The host the scheduler listens on (the first tcp/tls listener's), else 127.0.0.1."""
    for listener in scheduler.server.listeners:
        scheme, location = parse_address(listener.listen_address)
        if scheme in ("tcp", "tls"):
            host = location.rpartition(":")[0].strip("[]")
            if host:
                return host
    return "127.0.0.1"


def _contact_host(host: str) -> str:
    """A host a browser can reach the dashboard at when it listens on ``host``."""
    if host not in ("", "0.0.0.0", "::"):
        return host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _without_keys(record: dict[str, Any]) -> dict[str, Any]:
    """A task-stream record as an anonymous viewer sees it: no key, its own or its inputs'."""
    return {**record, "key": None, "transfers": [{**t, "key": None} for t in record["transfers"]]}


class _Shared:
    """The part of an update that is the same for every connection, encoded once per
    interval however many pages listen."""

    def __init__(self, scheduler: Scheduler, interval: float) -> None:
        self.scheduler = scheduler
        self.interval = interval
        self._at = -float("inf")
        self._text = b""

    def text(self) -> bytes:
        """``"summary":...,"workers":...,"progress":...,"transfers":...`` (JSON members)."""
        now = time.monotonic()
        if now - self._at >= self.interval / 2:
            d = self.scheduler.diagnostics
            self._text = _encode({"summary": d.summary(), "workers": d.workers(), "progress": d.progress(),
                                  "transfers": d.transfers()})[1:-1]
            self._at = now
        return self._text


class Dashboard:
    """A running dashboard of ``scheduler`` (made by :func:`start_dashboard`):
    ``host`` and ``port`` where it listens, ``link`` its status page's URL and
    ``login_link`` the same with the token that logs its opener in. ``open_``: serve
    viewers who have not logged in (the anonymous view); ``metrics_public``: serve
    ``/metrics`` without login (see :mod:`.access`). ``guard``: the bounds of its
    connections."""

    def __init__(self, scheduler: Scheduler, interval: float, open_: bool = False, metrics_public: bool = False,
                 guard: ConnectionGuard | None = None) -> None:
        self.scheduler = scheduler
        self.interval = interval
        self.host = ""
        self.port = 0
        self.link = ""
        self.login_link = ""
        self.closed = False
        #: it listens on a loopback address: it answers requests for loopback hosts only
        self.loopback_only = False
        #: event streams open now (pages that listen)
        self.open_streams = 0
        self.open = open_
        self.metrics_public = metrics_public
        self.guard = guard or ConnectionGuard(int(config.get("dashboard-max-connections")),
                                              int(config.get("dashboard-max-connections-per-host")),
                                              float(config.get("dashboard-header-timeout")))
        #: who may read it (made when its port is known: the cookie's name says it)
        self.access = Access(scheduler.security.secret, 0, open_, metrics_public)
        self._closing = asyncio.Event()
        self._shared = _Shared(scheduler, interval)
        self._metrics: Any = None
        self._runner: web.AppRunner | None = None

    def __repr__(self) -> str:
        return f"<Dashboard {self.link or 'not started'}>"

    # -- starting and stopping

    def _app(self) -> web.Application:
        app = web.Application(middlewares=[self._guard_request, self._errors], client_max_size=1 << 16)
        app.router.add_get("/", self._root)
        for page in PAGES:
            app.router.add_get(f"/{page}", self._page)
        app.router.add_get("/static/{name:.+}", self._static)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics_text)
        api = {
            "summary": self._summary, "workers": self._workers, "task-stream": self._task_stream,
            "progress": self._progress, "graph": self._graph, "transfers": self._transfers,
            "task": self._task, "search": self._search, "events": self._events,
        }
        for name, handler in api.items():
            app.router.add_get(f"/api/v1/{name}", handler)
        return app

    async def _start(self, host: str, port: int) -> None:
        secret = self.scheduler.security.secret
        check_exposure(host, secret is not None, self.open)
        try:
            from .metrics import Metrics

            self._metrics = Metrics(self.scheduler.diagnostics)
        except ImportError as exc:
            logger.info("dashboard without /metrics: install shoal[dashboard] (%s)", exc)
        runner = web.AppRunner(self._app(), access_log=None, handle_signals=False,
                               shutdown_timeout=SHUTDOWN_TIMEOUT)
        await runner.setup()
        self._runner = runner
        try:
            site = GuardedSite(runner, host, port, self.guard)
            try:
                await site.start()
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE or port == 0:
                    raise
                await site.stop()
                site = GuardedSite(runner, host, 0, self.guard)
                await site.start()
                logger.info("dashboard: port %d is taken, serving on port %d instead", port,
                            runner.addresses[0][1])
        except BaseException:
            await runner.cleanup()
            self._runner = None
            raise
        self.host = host
        self.loopback_only = is_loopback(host)
        self.port = int(runner.addresses[0][1])
        self.access = Access(secret, self.port, self.open, self.metrics_public)
        where = _contact_host(host)
        self.link = f"http://{f'[{where}]' if ':' in where else where}:{self.port}/status"
        self.login_link = self.access.login_link(self.link)
        if secret is None:
            logger.warning("dashboard of a cluster without a secret (--no-auth): served without login on %s; "
                           "every user of this host reads its tasks, keys and errors", host)
        elif self.open:
            logger.warning("dashboard served without login on %s (dashboard-open): every user of this host sees its "
                           "workers and counts by key prefix; task keys and errors need the token", host)
        if self.metrics_public and secret is not None:
            logger.info("dashboard: /metrics is served without login (metrics-public)")
        if not is_loopback(host):
            logger.info("dashboard listens on %s: reachable from other hosts (login required)",
                        host or "all interfaces")
        logger.info("dashboard at %s%s", self.link,
                    "" if secret is None else " (log in with the link 'shoal scheduler' prints, or "
                    "client.dashboard_link)")

    async def close(self) -> None:
        """Stop serving: open event streams end (within a moment), then the listener
        and every connection close. Closing twice is harmless."""
        if self.closed:
            return
        self.closed = True
        self._closing.set()
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        self.guard.close()

    # -- middleware

    @web.middleware
    async def _guard_request(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Who may ask what (see the module), with the guard told of the request."""
        transport = request.transport
        view, presented = self.access.viewer(request)
        self.guard.began(transport, bool(presented))
        try:
            if self.loopback_only and not is_loopback(_split_host(request.host)):
                # a dashboard of this host only: a page of another site that had a name of
                # its own resolve to 127.0.0.1 (DNS rebinding) must not read it
                return _error(403, "this dashboard answers requests for a loopback host only")
            if request.path == "/health":
                return await handler(request)
            page = page_name(request.path, PAGES)
            if view is None:
                return self.access.refusal(presented, page is not None)
            if view != FULL and request.path in LOGGED_IN_ONLY:
                return self.access.anonymous_refusal()
            if presented and page is not None and "token" in request.query and request.method == "GET":
                return self.access.onward(request, page)
            reset = _VIEW.set(view)
            try:
                return await handler(request)
            finally:
                _VIEW.reset(reset)
        finally:
            self.guard.ended(transport)

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except BadRequest as exc:
            return _error(400, str(exc))
        except web.HTTPException as exc:
            if request.path.startswith("/api/") and exc.status >= 400:
                return _error(exc.status, exc.reason)
            raise
        except Exception as exc:
            logger.exception("dashboard: GET %s failed", request.path)
            text = f"{type(exc).__name__}: {exc}".splitlines()[0][:300] if str(exc) else type(exc).__name__
            return _error(500, f"internal error ({text})")

    # -- pages

    async def _root(self, request: web.Request) -> web.StreamResponse:
        raise web.HTTPFound("/status")

    async def _page(self, request: web.Request) -> web.StreamResponse:
        try:
            text = render_page(request.path.strip("/"), STATIC)
        except FileNotFoundError:
            return web.Response(status=404, text=f"{request.path}: the page is not installed")
        if _VIEW.get() != FULL:
            text = text.replace(_CONNECTION, _ANONYMOUS_NOTE + _CONNECTION, 1)
        return web.Response(text=text, content_type="text/html",
                            headers={"Cache-Control": "no-cache", "Referrer-Policy": "no-referrer"})

    async def _static(self, request: web.Request) -> web.StreamResponse:
        root = STATIC.resolve()
        path = (root / request.match_info["name"]).resolve()
        if not path.is_relative_to(root) or not path.is_file():
            raise web.HTTPNotFound()
        return web.FileResponse(path, headers={"Cache-Control": "no-cache"})

    async def _health(self, request: web.Request) -> web.StreamResponse:
        return web.Response(text="ok")

    async def _metrics_text(self, request: web.Request) -> web.StreamResponse:
        if self._metrics is None:
            return web.Response(status=501, text="/metrics needs prometheus_client: install shoal[dashboard]\n")
        from prometheus_client import CONTENT_TYPE_LATEST

        return web.Response(body=self._metrics.text(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    # -- the JSON API

    async def _summary(self, request: web.Request) -> web.StreamResponse:
        return _json(self.scheduler.diagnostics.summary())

    async def _workers(self, request: web.Request) -> web.StreamResponse:
        return _json(self.scheduler.diagnostics.workers())

    def _chunk(self, since: int, limit: int, keys: bool = True) -> tuple[bytes, int, int]:
        """Up to ``limit`` (at most CHUNK_RECORDS) records from ``since``: their JSON
        (the members of a list), the next ``since``, and how many there are. Without
        ``keys`` (an anonymous viewer), the records' keys are None."""
        part = self.scheduler.diagnostics.task_stream(since, min(limit, CHUNK_RECORDS))
        records = part["records"]
        if not keys:
            records = [_without_keys(r) for r in records]
        return _encode(records)[1:-1], part["next"], len(records)

    async def _write_records(self, write: Callable[[bytes], Awaitable[None]], since: int, limit: int,
                             first: tuple[bytes, int, int] | None = None, head: bytes = b"",
                             keys: bool = True) -> int:
        """Write ``head`` and ``{"records":[...],"next":N`` (no closing brace: the
        caller may add members) with ``write``, a chunk at a time, the loop free in
        between; returns N. ``first``: the first chunk, if already made; ``keys``: as
        for :meth:`_chunk`."""
        body, since, n = first or self._chunk(since, limit, keys)
        await write(head + b'{"records":[' + body)
        limit -= n
        while n == CHUNK_RECORDS and limit > 0:
            await asyncio.sleep(0)
            body, since, n = self._chunk(since, limit, keys)
            if n:
                await write(b"," + body)
            limit -= n
        await write(b'],"next":%d' % since)
        return since

    async def _task_stream(self, request: web.Request) -> web.StreamResponse:
        since = _count(request, "since", 0, 1 << 62)
        limit = _count(request, "limit", 10_000, MAX_RECORDS)
        keys = _VIEW.get() == FULL
        first = self._chunk(since, limit, keys)
        body, after, n = first
        if n < CHUNK_RECORDS or limit <= CHUNK_RECORDS:  # all of it at once
            return web.Response(body=b'{"records":[%s],"next":%d}' % (body, after), headers=_JSON_HEADERS)
        response = web.StreamResponse(headers=_JSON_HEADERS)
        await response.prepare(request)
        try:
            await self._write_records(response.write, since, limit, first, keys=keys)
            await response.write(b"}")
        except ConnectionError:
            pass  # the reader went
        except Exception:
            # begun: the reader gets a cut answer (not JSON), and the log says why
            logger.exception("dashboard: GET %s failed", request.path_qs[:200])
        return response

    async def _progress(self, request: web.Request) -> web.StreamResponse:
        return _json(self.scheduler.diagnostics.progress())

    async def _graph(self, request: web.Request) -> web.StreamResponse:
        return _json(self.scheduler.diagnostics.graph())

    async def _transfers(self, request: web.Request) -> web.StreamResponse:
        return _json(self.scheduler.diagnostics.transfers())

    async def _task(self, request: web.Request) -> web.StreamResponse:
        key = _text(request, "key")
        found = await _paced(self.scheduler.diagnostics.task_steps(key))
        if found is None:
            return _error(404, f"no task with key {key[:200]!r}")
        return _json(found)

    async def _search(self, request: web.Request) -> web.StreamResponse:
        text = _text(request, "q")
        limit = _count(request, "limit", 20, 1000)
        return _json(await _paced(self.scheduler.diagnostics.search_steps(text, limit)))

    async def _events(self, request: web.Request) -> web.StreamResponse:
        d = self.scheduler.diagnostics
        keys = _VIEW.get() == FULL
        last = request.headers.getall("Last-Event-ID", [])
        if last:  # a page that reconnects: on from where it was
            if len(last) > 1 or not (last[0].isascii() and last[0].isdigit()) or len(last[0]) > 18:
                raise BadRequest("Last-Event-ID must be an integer >= 0")
            cursor = int(last[0])
        else:
            cursor = max(0, d.next_index - FIRST_RECORDS)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               "X-Accel-Buffering": "no"})
        await response.prepare(request)
        self.open_streams += 1
        try:
            # a page whose connection broke tries again after this many milliseconds
            await response.write(f"retry: {max(1000, int(self.interval * 2000))}\n\n".encode())
            while not self._closing.is_set():
                # one event, written in pieces: its id (the cursor) comes last
                head = b"event: update\ndata: {" + self._shared.text() + b',"task_stream":'
                cursor = await self._write_records(response.write, max(cursor, d.next_index - UPDATE_RECORDS),
                                                   UPDATE_RECORDS, head=head, keys=keys)
                await response.write(b"}}\nid: %d\n\n" % cursor)
                try:
                    await asyncio.wait_for(self._closing.wait(), self.interval)
                except TimeoutError:
                    pass
        except ConnectionError:
            pass  # the page went
        except Exception:
            # the response has begun: the page sees the stream end, and tries again
            logger.exception("dashboard: the event stream failed")
        finally:
            self.open_streams -= 1
        return response


async def start_dashboard(scheduler: Scheduler, address: str) -> Dashboard:
    """Serve ``scheduler``'s dashboard at ``address`` (``":8790"``, ``"127.0.0.1:0"``,
    ``"host:port"``; no host: the one the scheduler listens on) on the running loop.
    A port that is taken is replaced by a free one (logged). The settings
    ``dashboard-open`` and ``metrics-public`` say who may read it without login.
    Returns the :class:`Dashboard`; raises ``ValueError`` for an address it cannot
    read, or one not on loopback for a dashboard without login (``dashboard-open``, or
    a scheduler without a secret), and ``OSError`` if it cannot listen there."""
    host, port = parse_dashboard_address(address)
    if not host:
        host = _scheduler_host(scheduler)
    dashboard = Dashboard(scheduler, float(config.get("dashboard-interval")), open_=bool(config.get("dashboard-open")),
                          metrics_public=bool(config.get("metrics-public")))
    await dashboard._start(host, port)
    return dashboard
