"""The dashboard's HTTP server on real clusters, asked as a browser or Prometheus
would: pages, the JSON API, /metrics, the event stream, and how it starts and stops.

Every dashboard here has one secret (:data:`SECURITY`), and the helpers log in as a
script does, with ``Authorization: Bearer TOKEN`` (:data:`AUTH`); what a request
without it gets is test_dashboard_auth.py's subject."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")

import aiohttp  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import shoal  # noqa: E402
from shoal import config  # noqa: E402
from shoal.comm.security import dashboard_token  # noqa: E402
from shoal.dashboard import server as dashboard_server  # noqa: E402
from shoal.dashboard import parse_dashboard_address  # noqa: E402
from shoal.dashboard.pages import PAGES, SCRIPTS  # noqa: E402
from shoal_helpers import free_port, start_scheduler, start_worker  # noqa: E402

#: how long a condition of a test may take to come true
DEADLINE = 20.0
#: the secret of every cluster of this module, and the header that logs a request in
SECRET = "dashboard-http-tests-secret"
SECURITY = shoal.Security(SECRET)
TOKEN = dashboard_token(SECRET.encode())
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def inc(x: int) -> int:
    return x + 1


def fail(x: int) -> int:
    raise ValueError(f"no good: {x}")


def big(n: int) -> bytes:
    return b"x" * n


def size(b: bytes) -> int:
    return len(b)


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, str, bytes]:
    """``(status, content type, body)`` of a GET (an error status too), logged in."""
    request = urllib.request.Request(url, headers={**AUTH, **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.headers.get("Content-Type", ""), e.read()


def get_json(url: str) -> Any:
    status, kind, body = get(url)
    assert status == 200, (url, status, body[:300])
    assert kind.startswith("application/json"), kind
    return json.loads(body)


def wait_until(condition: Callable[[], Any], what: str, timeout: float = DEADLINE) -> Any:
    """``condition()``'s first true value, asked until ``timeout`` seconds have passed."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        time.sleep(0.02)


def metrics(base: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``{(sample name, sorted labels): value}`` of ``base``/metrics."""
    status, kind, body = get(base + "/metrics")
    assert status == 200 and kind.startswith("text/plain"), (status, kind)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body.decode()) for s in family.samples}


class Events:
    """The server-sent events of ``url``, read in this thread (``next_update()``)."""

    def __init__(self, url: str, headers: dict[str, str] | None = None, timeout: float = 10.0) -> None:
        self.response = urllib.request.urlopen(urllib.request.Request(url, headers={**AUTH, **(headers or {})}),
                                               timeout=timeout)
        self.lines: list[str] = []

    def next_event(self) -> dict[str, str] | None:
        """``{"event", "data", "id", "retry"}`` of the next event; None at the end of the stream."""
        event: dict[str, str] = {}
        while True:
            raw = self.response.readline()
            if not raw:
                return None
            line = raw.decode().rstrip("\n")
            self.lines.append(line)
            if not line:
                if event:
                    return event
                continue
            name, _, value = line.partition(": ")
            event[name] = value

    def next_update(self) -> tuple[int, dict[str, Any]]:
        while True:
            event = self.next_event()
            assert event is not None, "the stream ended"
            if event.get("event") == "update":
                return int(event["id"]), json.loads(event["data"])

    def close(self) -> None:
        self.response.close()


@pytest.fixture
def fast_updates() -> Iterator[None]:
    with config.set(dashboard_interval=0.05, heartbeat_interval=0.1):
        yield


@pytest.fixture
def cluster(fast_updates: None) -> Iterator[shoal.LocalCluster]:
    with shoal.LocalCluster(n_workers=2, processes=False, dashboard_address="127.0.0.1:0", security=SECURITY) as c:
        yield c


@pytest.fixture
def client(cluster: shoal.LocalCluster) -> Iterator[shoal.Client]:
    with shoal.Client(cluster) as c:
        yield c


def base_of(link: str | None) -> str:
    """The dashboard's root URL, from its link (with or without the token)."""
    assert link, link
    page = link.partition("?")[0]
    assert page.endswith("/status"), link
    return page[: -len("/status")]


# -- addresses


@pytest.mark.parametrize("text, expected", [
    (":8790", ("", 8790)), ("127.0.0.1:0", ("127.0.0.1", 0)), ("localhost", ("localhost", 8790)),
    ("[::1]:9000", ("::1", 9000)), ("0.0.0.0:8790", ("0.0.0.0", 8790)), ("http://127.0.0.1:1234", ("127.0.0.1", 1234)),
])
def test_dashboard_addresses_are_read(text, expected):
    assert parse_dashboard_address(text) == expected


@pytest.mark.parametrize("text", ["127.0.0.1:x", ":99999", "::1:8790", "[::1", "tls://127.0.0.1:1", ":-1"])
def test_bad_dashboard_addresses_are_refused(text):
    with pytest.raises(ValueError):
        parse_dashboard_address(text)


# -- links and starting


def test_dashboard_link_of_cluster_client_and_scheduler(cluster, client):
    link = cluster.dashboard_link
    assert link is not None and link.startswith("http://127.0.0.1:") and link.endswith(f"/status?token={TOKEN}")
    assert client.dashboard_link == link
    # the scheduler's link, which goes to every client, has no token: each client adds
    # the one of its own secret
    bare = link.partition("?")[0]
    assert cluster.scheduler.dashboard_link == bare
    assert client.scheduler_info()["dashboard"] == bare
    # a client given the scheduler's address (no cluster object) hears it from the scheduler
    with shoal.Client(cluster.scheduler_address) as by_address:
        assert by_address.cluster is None
        assert by_address.dashboard_link == link
    assert get(base_of(link) + "/health")[::2] == (200, b"ok")


def test_local_cluster_serves_on_8790_of_its_host_by_default():
    with shoal.LocalCluster(n_workers=0, processes=False, security=SECURITY) as c:
        assert c.dashboard_address == ":8790"
        host, _, port = base_of(c.dashboard_link).removeprefix("http://").rpartition(":")
        assert host == "127.0.0.1"
        # 8790, or the free port it took because something listens there already
        with socket.socket() as probe:
            taken = probe.connect_ex(("127.0.0.1", 8790)) == 0
        assert taken and (port == "8790" or int(port) > 0)
        assert get(base_of(c.dashboard_link) + "/health")[0] == 200


def test_no_dashboard_when_asked():
    with shoal.LocalCluster(n_workers=1, processes=False, dashboard_address=None) as c, shoal.Client(c) as client:
        assert c.scheduler.dashboard is None
        assert c.dashboard_link is None and client.dashboard_link is None
        assert client.scheduler_info()["dashboard"] is None


def test_a_taken_port_falls_back_to_a_free_one(fast_updates, caplog):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with caplog.at_level(logging.INFO, logger="shoal.dashboard"):
            with shoal.LocalCluster(n_workers=0, processes=False, dashboard_address=f"127.0.0.1:{port}",
                                    security=SECURITY) as c:
                link = c.dashboard_link
                assert link is not None and f":{port}/" not in link
                assert get(base_of(link) + "/health")[::2] == (200, b"ok")
        assert any(f"port {port} is taken" in r.getMessage() for r in caplog.records), caplog.text


def run_without(module: str, code: str) -> subprocess.CompletedProcess[str]:
    """``code`` run by a new Python in which ``import module`` fails, as when it is not
    installed, after ``import shoal`` and with INFO logs on stderr; it must exit with 0."""
    prelude = (
        "import logging, sys\n"
        f"sys.modules[{module!r}] = None\n"
        "logging.basicConfig(level=logging.INFO, format='%(name)s: %(message)s')\n"
        "import shoal\n"
    )
    out = subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out


def test_without_aiohttp_the_cluster_runs_without_a_dashboard():
    out = run_without("aiohttp", (
        "with shoal.LocalCluster(n_workers=1, processes=False) as c, shoal.Client(c) as client:\n"
        "    assert client.submit(lambda: 41 + 1).result() == 42\n"
        "    print('link', c.dashboard_link, client.dashboard_link)\n"
    ))
    assert out.stdout.strip() == "link None None"
    lines = [line for line in out.stderr.splitlines() if line.startswith("shoal.dashboard")]
    assert lines == ["shoal.dashboard: no dashboard: it needs aiohttp (pip install 'shoal[dashboard]')"], out.stderr


def test_without_prometheus_client_there_is_no_metrics_endpoint():
    out = run_without("prometheus_client", (
        "import urllib.request, urllib.error\n"
        f"with shoal.LocalCluster(n_workers=0, processes=False, dashboard_address='127.0.0.1:0',\n"
        f"                        security=shoal.Security({SECRET!r})) as c:\n"
        "    base = c.dashboard_link.rsplit('/', 1)[0]\n"
        "    print(urllib.request.urlopen(base + '/health').read().decode())\n"
        "    try:\n"
        f"        urllib.request.urlopen(urllib.request.Request(base + '/metrics', headers={AUTH!r}))\n"
        "    except urllib.error.HTTPError as e:\n"
        "        with e:\n"
        "            print(e.code)\n"
    ))
    assert out.stdout.split() == ["ok", "501"]
    assert "dashboard without /metrics: install shoal[dashboard]" in out.stderr


# -- pages and static files


def test_pages_static_files_and_health(cluster):
    base = base_of(cluster.dashboard_link)
    assert get(base + "/health") == (200, "text/plain; charset=utf-8", b"ok")
    with urllib.request.urlopen(urllib.request.Request(base + "/", headers=AUTH), timeout=10) as r:  # a redirect
        assert r.url == base + "/status"
    for page in PAGES:  # each a whole document: the shell, its own part, its scripts
        status, kind, body = get(f"{base}/{page}")
        assert status == 200 and kind.startswith("text/html"), (page, status, kind)
        text = body.decode()
        assert text.startswith("<!doctype html>") and f'<body data-page="{page}">' in text
        assert re.findall(r'<a href="(\w+)" aria-current="page">', text) == [page]
        assert not re.search(r'(href|src)="/', text)  # relative: it works behind a path prefix too
        scripts = re.findall(r'<script src="(static/[^"]+)"', text)
        assert scripts[-len(SCRIPTS):] == [f"static/{name}" for name in SCRIPTS], scripts
        for src in scripts:
            assert get(f"{base}/{src}")[0] == 200, (page, src)
    for name in ("../server.py", "..%2Fserver.py", "nothing.js"):
        assert get(f"{base}/static/{name}")[0] == 404, name
    assert get(base + "/nothing")[0] == 404


def test_a_page_that_is_not_installed_is_a_404(cluster, tmp_path, monkeypatch):
    monkeypatch.setattr(dashboard_server, "STATIC", tmp_path)
    (tmp_path / "style.css").write_text("body {}")
    base = base_of(cluster.dashboard_link)
    status, kind, body = get(base + "/status")
    assert status == 404 and kind.startswith("text/plain") and b"not installed" in body
    status, kind, body = get(base + "/static/style.css")
    assert status == 200 and kind.startswith("text/css") and body == b"body {}"


# -- the JSON API


def test_the_json_api_after_a_known_computation(cluster, client):
    futures = client.map(inc, range(20))
    total = client.submit(sum, futures)
    assert total.result() == sum(range(1, 21))
    bad = client.submit(fail, 7)
    with pytest.raises(ValueError):
        bad.result()
    base = base_of(cluster.dashboard_link) + "/api/v1"
    workers = sorted(cluster.worker_addresses)

    summary = get_json(base + "/summary")
    assert summary["workers"] == 2 and summary["threads"] == 2
    assert summary["tasks"] == 22 and summary["memory"] == 21 and summary["erred"] == 1
    assert summary["task_stream_total"] == 22 and summary["time"] > 0

    rows = get_json(base + "/workers")
    assert sorted(r["address"] for r in rows) == workers
    for r in rows:
        assert set(r["memory"]) == {"limit", "managed", "shm", "spilled", "unmanaged", "process"}
        assert set(r["transfers_in"]) == set(r["transfers_out"]) == {"inproc", "shm", "tcp"}
        assert r["nthreads"] == 1 and r["status"] == "running"
    assert sum(r["held"] for r in rows) >= 21

    prefixes = {p["prefix"]: p for p in get_json(base + "/progress")["prefixes"]}
    assert prefixes["inc"] == {"prefix": "inc", "total": 20, "done": 20, "waiting": 0, "processing": 0,
                               "memory": 20, "erred": 0}
    assert prefixes["sum"]["done"] == 1 and prefixes["fail"]["erred"] == 1

    graph = get_json(base + "/graph")
    assert {n["prefix"] for n in graph["nodes"]} == {"inc", "sum", "fail"}
    assert graph["edges"] == [{"from": "inc", "to": "sum"}]

    stream = get_json(base + "/task-stream")
    records = stream["records"]
    assert stream["next"] == 22 and [r["index"] for r in records] == list(range(22))
    assert [r["prefix"] for r in records].count("inc") == 20
    assert {r["worker"] for r in records} <= set(workers)
    assert all(r["stop"] >= r["start"] > 0 for r in records)
    assert [r["status"] for r in records if r["prefix"] == "fail"] == ["error"]
    part = get_json(base + "/task-stream?since=15&limit=3")
    assert part["next"] == 18 and [r["index"] for r in part["records"]] == [15, 16, 17]
    assert get_json(base + "/task-stream?since=22") == {"next": 22, "records": []}
    assert len(get_json(base + "/task-stream?limit=1000000000")["records"]) == 22  # (capped, not refused)

    moved = get_json(base + "/transfers")
    assert set(moved) == {"inproc", "shm", "tcp", "time"}

    one = get_json(base + "/task?key=" + urllib.parse.quote(futures[3].key))
    assert one["key"] == futures[3].key and one["state"] == "memory" and one["worker"] in workers
    assert one["dependents"] == [total.key] and one["error"] is None
    assert any(s["stimulus_id"] for s in one["story"])
    erred = get_json(base + "/task?key=" + urllib.parse.quote(bad.key))
    assert erred["state"] == "erred" and "no good: 7" in erred["error"]
    assert "ValueError" in erred["traceback"] or "fail" in erred["traceback"]
    summed = get_json(base + "/task?key=" + urllib.parse.quote(total.key))
    assert sorted(d["key"] for d in summed["dependencies"]) == sorted(f.key for f in futures)

    found = get_json(base + "/search?q=" + urllib.parse.quote(futures[5].key[:12]))
    assert futures[5].key in found and all(k.startswith("inc-") for k in found)
    assert len(get_json(base + "/search?q=inc&limit=3")) == 3


def test_transfers_show_by_path(cluster, client):
    a, b = cluster.worker_addresses
    x = client.submit(big, 100_000, workers=[a])
    y = client.submit(size, x, workers=[b])
    assert y.result() == 100_000
    base = base_of(cluster.dashboard_link)
    # (the workers report on their own beats: task arguments moved by reference may
    # be counted before the value is)
    moved = wait_until(lambda: (m := get_json(base + "/api/v1/transfers"))["inproc"] >= 100_000 and m,
                       "the transfer reported")
    assert moved["tcp"] == 0
    record = next(r for r in get_json(base + "/api/v1/task-stream")["records"] if r["key"] == y.key)
    assert [(t["key"], t["from"], t["path"]) for t in record["transfers"]] == [(x.key, a, "inproc")]
    assert record["transfers"][0]["bytes"] >= 100_000


def test_a_large_answer_is_sent_a_chunk_at_a_time(cluster, client, monkeypatch):
    futures = client.map(inc, range(23))
    client.gather(futures)
    base = base_of(cluster.dashboard_link) + "/api/v1/task-stream"
    whole = get_json(base)
    monkeypatch.setattr(dashboard_server, "CHUNK_RECORDS", 5)  # 23 records: 5 chunks, the last short
    for query, indices in (("", range(23)), ("?since=3", range(3, 23)), ("?since=2&limit=10", range(2, 12)),
                           ("?limit=20", range(20))):
        got = get_json(base + query)
        assert [r["index"] for r in got["records"]] == list(indices), query
        assert got["next"] == indices[-1] + 1
        assert got["records"] == whole["records"][indices[0]: indices[-1] + 1]


def test_records_older_than_the_buffer_are_gone(fast_updates):
    with config.set(dashboard_task_stream_size=10), \
            shoal.LocalCluster(n_workers=1, processes=False, dashboard_address="127.0.0.1:0",
                               security=SECURITY) as cluster, \
            shoal.Client(cluster) as client:
        futures = client.map(inc, range(25))
        client.gather(futures)
        base = base_of(cluster.dashboard_link) + "/api/v1/"
        got = get_json(base + "task-stream?since=0")
        assert [r["index"] for r in got["records"]] == list(range(15, 25)) and got["next"] == 25
        assert get_json(base + "summary")["task_stream_total"] == 25


@pytest.mark.parametrize("query", [
    "task-stream?since=-1", "task-stream?since=abc", "task-stream?limit=1.5", "task-stream?since=1&since=2",
    "task-stream?limit=" + "9" * 40, "task", "task?key=", "search", "search?q=", "search?q=a&limit=-3",
    "task?key=" + "k" * 1500,
])
def test_bad_parameters_are_a_400_in_json(cluster, query):
    status, kind, body = get(base_of(cluster.dashboard_link) + "/api/v1/" + query)
    assert status == 400 and kind.startswith("application/json"), (status, kind, body[:200])
    assert set(json.loads(body)) == {"error"}


def test_unknown_things_are_a_404_in_json(cluster):
    base = base_of(cluster.dashboard_link) + "/api/v1/"
    for query in ("task?key=nothing-of-the-kind", "nothing"):
        status, kind, body = get(base + query)
        assert status == 404 and kind.startswith("application/json"), (query, status)
        assert "error" in json.loads(body)
    request = urllib.request.Request(base + "summary", data=b"{}", method="POST", headers=AUTH)
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=10)
    with info.value as e:
        assert e.code == 405 and "error" in json.loads(e.read())


def test_a_failing_handler_answers_json_and_logs(cluster, monkeypatch, caplog):
    def broken() -> Any:
        raise RuntimeError("a bug\nwith a second line")

    monkeypatch.setattr(cluster.scheduler.diagnostics, "summary", broken)
    with caplog.at_level(logging.ERROR, logger="shoal.dashboard"):
        status, kind, body = get(base_of(cluster.dashboard_link) + "/api/v1/summary")
    assert status == 500 and kind.startswith("application/json")
    assert json.loads(body) == {"error": "internal error (RuntimeError: a bug)"}
    assert any("/api/v1/summary failed" in r.getMessage() and r.exc_info for r in caplog.records)
    assert get(base_of(cluster.dashboard_link) + "/api/v1/workers")[0] == 200  # the rest still works


def test_a_loopback_dashboard_answers_loopback_hosts_only(cluster):
    base = base_of(cluster.dashboard_link)
    port = base.rpartition(":")[2]
    assert get(base + "/health", {"Host": f"localhost:{port}"})[0] == 200
    status, kind, body = get(base + "/api/v1/summary", {"Host": f"attacker.example:{port}"})
    assert status == 403 and "error" in json.loads(body)


# -- /metrics


def test_metrics_after_a_known_computation(cluster, client):
    a, b = cluster.worker_addresses
    futures = client.map(inc, range(20), workers=[a])
    assert client.gather(futures) == list(range(1, 21))
    x = client.submit(big, 50_000, workers=[a])
    y = client.submit(size, x, workers=[b])
    assert y.result() == 50_000
    base = base_of(cluster.dashboard_link)
    # the workers' figures come with their next reports (the gather's few bytes may
    # come in one before the 50 kB of the transfer)
    m = wait_until(lambda: (m := metrics(base))[("shoal_transfer_bytes_total", (("path", "inproc"),))] >= 50_000
                   and m, "the transfer in /metrics")
    assert m[("shoal_workers", ())] == 2 and m[("shoal_threads", ())] == 2
    assert m[("shoal_tasks", (("state", "memory"),))] == 22
    assert m[("shoal_tasks", (("state", "erred"),))] == 0
    assert m[("shoal_prefix_tasks", (("prefix", "inc"), ("state", "memory")))] == 20
    assert m[("shoal_prefix_tasks", (("prefix", "inc"), ("state", "waiting")))] == 0
    assert m[("shoal_tasks_done_total", ())] == 22
    assert m[("shoal_task_stream_records_total", ())] == 22
    assert m[("shoal_transfer_bytes_total", (("path", "inproc"),))] >= 50_000
    assert m[("shoal_transfer_bytes_total", (("path", "tcp"),))] == 0
    for w in (a, b):
        for kind in ("managed", "shm", "spilled", "unmanaged", "process"):
            assert (("shoal_worker_memory_bytes", (("kind", kind), ("worker", w)))) in m
        assert m[("shoal_worker_cpu_percent", (("worker", w),))] >= 0
    managed = sum(m[("shoal_worker_memory_bytes", (("kind", "managed"), ("worker", w)))] for w in (a, b))
    assert managed >= 50_000


def test_tasks_done_never_goes_down_when_tasks_are_forgotten(cluster, client):
    base = base_of(cluster.dashboard_link)
    futures = client.map(inc, range(10))
    client.gather(futures)
    assert metrics(base)[("shoal_tasks_done_total", ())] == 10
    del futures
    wait_until(lambda: not get_json(base + "/api/v1/progress")["prefixes"], "the tasks forgotten")
    assert metrics(base)[("shoal_tasks_done_total", ())] == 10
    client.gather(client.map(inc, range(100, 105)))
    assert metrics(base)[("shoal_tasks_done_total", ())] == 15


def test_tasks_done_counts_what_ran_between_two_scrapes(cluster, client):
    base = base_of(cluster.dashboard_link)
    before = metrics(base)[("shoal_tasks_done_total", ())]
    futures = client.map(inc, range(200, 210))
    client.gather(futures)
    del futures
    wait_until(lambda: not get_json(base + "/api/v1/progress")["prefixes"], "the tasks forgotten")
    client.gather(client.map(inc, range(300, 303)))  # the same prefix again, nobody scraped in between
    assert metrics(base)[("shoal_tasks_done_total", ())] == before + 13


def test_two_schedulers_of_one_process_have_their_own_metrics(cluster, client, fast_updates):
    client.gather(client.map(inc, range(3)))
    with shoal.LocalCluster(n_workers=1, processes=False, dashboard_address="127.0.0.1:0",
                            security=SECURITY) as other:
        m = metrics(base_of(other.dashboard_link))
        assert m[("shoal_workers", ())] == 1 and m[("shoal_task_stream_records_total", ())] == 0
    assert metrics(base_of(cluster.dashboard_link))[("shoal_task_stream_records_total", ())] == 3


# -- the event stream


def test_each_update_carries_the_records_since_the_last_one(cluster, client, monkeypatch):
    monkeypatch.setattr(dashboard_server, "FIRST_RECORDS", 5)
    monkeypatch.setattr(dashboard_server, "CHUNK_RECORDS", 3)  # an update of many chunks too
    client.gather(client.map(inc, range(8)))  # 8 records: the first update carries the last 5
    events = Events(base_of(cluster.dashboard_link) + "/api/v1/events")
    try:
        assert events.response.headers["Content-Type"] == "text/event-stream"
        cursor, first = events.next_update()
        assert set(first) == {"summary", "workers", "progress", "transfers", "task_stream"}
        assert [r["index"] for r in first["task_stream"]["records"]] == [3, 4, 5, 6, 7]
        assert cursor == first["task_stream"]["next"] == 8
        assert len(first["workers"]) == 2 and first["summary"]["task_stream_total"] == 8
        futures = client.map(inc, range(100, 120))
        client.gather(futures)
        seen: list[int] = []
        while len(seen) < 20:
            cursor, update = events.next_update()
            indices = [r["index"] for r in update["task_stream"]["records"]]
            assert all(i >= 8 for i in indices) and not set(indices) & set(seen)  # only new records
            seen += indices
            assert cursor == update["task_stream"]["next"]
        assert sorted(seen) == list(range(8, 28))
        assert sorted(r["key"] for r in get_json(base_of(cluster.dashboard_link) + "/api/v1/task-stream?since=8")
                      ["records"]) == sorted(f.key for f in futures)
        _, quiet = events.next_update()
        assert quiet["task_stream"] == {"next": 28, "records": []}
        assert events.lines[0].startswith("retry: ")
    finally:
        events.close()


def test_a_page_that_reconnects_goes_on_from_its_last_event_id(cluster, client):
    client.gather(client.map(inc, range(6)))
    events = Events(base_of(cluster.dashboard_link) + "/api/v1/events", {"Last-Event-ID": "4"})
    try:
        cursor, update = events.next_update()
        assert [r["index"] for r in update["task_stream"]["records"]] == [4, 5] and cursor == 6
    finally:
        events.close()
    status, kind, body = get(base_of(cluster.dashboard_link) + "/api/v1/events", {"Last-Event-ID": "x"})
    assert status == 400 and "error" in json.loads(body)


def test_updates_come_every_interval(cluster):
    events = Events(base_of(cluster.dashboard_link) + "/api/v1/events")
    try:
        # the scheduler's clock in each update: about an interval (0.05 s here) apart,
        # however fast or slow this reader is (the loop's timers may fire a little early)
        times = [events.next_update()[1]["summary"]["time"] for _ in range(6)]
        gaps = [b - a for a, b in zip(times, times[1:])]
        assert min(gaps) >= 0.05 / 2, gaps
    finally:
        events.close()


def test_closing_the_cluster_ends_an_open_event_stream(fast_updates):
    cluster = shoal.LocalCluster(n_workers=1, processes=False, dashboard_address="127.0.0.1:0", security=SECURITY)
    try:
        events = Events(base_of(cluster.dashboard_link) + "/api/v1/events")
    except BaseException:
        cluster.close()
        raise
    try:
        events.next_update()
        closer = threading.Thread(target=cluster.close)
        closer.start()
        while events.next_event() is not None:
            pass  # updates sent before the close; then the stream ends (a hang: the read times out)
        closer.join(DEADLINE)
        assert not closer.is_alive()
    finally:
        events.close()
        cluster.close()


async def test_a_page_that_goes_away_ends_its_stream(fast_updates):
    async with shoal.LocalCluster(n_workers=1, processes=False, asynchronous=True,
                                  dashboard_address="127.0.0.1:0", security=SECURITY) as cluster:
        base = base_of(cluster.dashboard_link)
        dashboard = cluster.scheduler.dashboard
        async with aiohttp.ClientSession(headers=AUTH) as session:
            for _ in range(3):
                async with session.get(base + "/api/v1/events") as r:
                    assert r.status == 200
                    await r.content.readuntil(b"event: update\n")
                    assert dashboard.open_streams >= 1
            # the server notices at its next write, within an interval
            deadline = asyncio.get_running_loop().time() + DEADLINE
            while dashboard.open_streams:
                assert asyncio.get_running_loop().time() < deadline, "event streams still open"
                await asyncio.sleep(0.02)
            async with session.get(base + "/health") as r:
                assert await r.text() == "ok"


# -- the command line


def _dashboard_line(sched) -> str:
    """The scheduler's "shoal dashboard at" line (after its auth file line, if any)."""
    line = sched.stdout.readline().strip()
    while line.startswith("shoal scheduler auth file"):
        line = sched.stdout.readline().strip()
    return line


def test_cli_scheduler_serves_a_dashboard(processes):
    sched, address = start_scheduler(processes, "--dashboard-address", "127.0.0.1:0", env={"SHOAL_AUTH": SECRET})
    line = _dashboard_line(sched)
    assert line.startswith("shoal dashboard at http://127.0.0.1:") and line.endswith(f"/status?token={TOKEN}"), line
    link = line.split()[-1]
    base = base_of(link)
    env = {"SHOAL_HEARTBEAT_INTERVAL": "0.1"}
    _, a = start_worker(processes, address, "--no-nanny", env=env)
    _, b = start_worker(processes, address, "--no-nanny", env=env)
    with shoal.Client(address) as client:
        assert client.dashboard_link == link
        # (functions the worker processes can import: this module is not on their path)
        futures = client.map(abs, range(-20, 0))
        assert client.gather(futures) == list(range(20, 0, -1))
        x = client.submit(bytes, 200_000, workers=[a])
        y = client.submit(len, x, workers=[b])
        assert y.result() == 200_000
        progress = {p["prefix"]: p for p in get_json(base + "/api/v1/progress")["prefixes"]}
        assert progress["abs"]["done"] == 20
        assert sorted(w["address"] for w in get_json(base + "/api/v1/workers")) == sorted([a, b])
        # two processes of one host: the value went through shared memory (or tcp, without it)
        def moved() -> Any:
            m = metrics(base)
            return m if sum(m[("shoal_transfer_bytes_total", (("path", p),))] for p in ("shm", "tcp")) >= 200_000 else None

        m = wait_until(moved, "the transfer in /metrics")
        assert m[("shoal_workers", ())] == 2
        assert m[("shoal_task_stream_records_total", ())] == 22
        assert m[("shoal_transfer_bytes_total", (("path", "inproc"),))] == 0


def test_cli_scheduler_without_a_dashboard(processes):
    sched, address = start_scheduler(processes, "--no-dashboard")
    with shoal.Client(address) as client:
        assert client.dashboard_link is None
        assert client.scheduler_info()["dashboard"] is None
    sched.terminate()
    out, _ = sched.communicate(timeout=30)
    assert "shoal dashboard at" not in out


def test_cli_dashboard_on_the_schedulers_host_by_default(processes):
    port = free_port()
    sched, address = start_scheduler(processes, "--dashboard-address", f":{port}", env={"SHOAL_AUTH": SECRET})
    line = _dashboard_line(sched)
    assert line == f"shoal dashboard at http://127.0.0.1:{port}/status?token={TOKEN}", line
    assert get(base_of(line.split()[-1]) + "/health")[0] == 200


def test_cli_refuses_a_bad_dashboard_address():
    out = subprocess.run([sys.executable, "-m", "shoal", "scheduler", "--port", "0", "--dashboard-address", "x:y"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--dashboard-address: bad port in dashboard address 'x:y'" in out.stderr
