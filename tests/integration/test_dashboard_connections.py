"""The dashboard's connections are bounded (issue 35): 2,000 silent or slow
connections to its port do not stop the scheduler, a client's graph or a logged-in
page; a connection that sends no whole request in time is closed; a new one makes
room by dropping the oldest idle one that has not logged in, and is refused when all
are busy. Real sockets, against ``shoal scheduler`` and in-process clusters."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import select
import socket
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("aiohttp")

import shoal  # noqa: E402
from shoal import config  # noqa: E402
from shoal_helpers import start_scheduler, start_worker  # noqa: E402

#: how long a condition of a test may take to come true
DEADLINE = 20.0
#: a request head begun and never finished (a slow client)
PARTIAL_HEAD = b"GET /status HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "


def split(link: str) -> tuple[str, int, str]:
    """``(root URL, port, token)`` of a dashboard's link."""
    page, _, query = link.partition("?")
    base = page[: -len("/status")]
    return base, int(base.rpartition(":")[2]), urllib.parse.parse_qs(query)["token"][0]


def get(url: str, token: str) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=DEADLINE) as r:
        return r.status, r.read()


def closed_by_peer(sock: socket.socket, timeout: float = DEADLINE) -> bool:
    """Whether the server closes ``sock`` (end of stream or reset) within ``timeout``."""
    readable, _, _ = select.select([sock], [], [], timeout)
    if not readable:
        return False
    try:
        return sock.recv(1 << 16) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True


def still_open(sock: socket.socket) -> bool:
    """Whether ``sock`` has neither data nor an end waiting (the server keeps it)."""
    readable, _, _ = select.select([sock], [], [], 0)
    return not readable


@contextlib.contextmanager
def sockets() -> Iterator[list[socket.socket]]:
    """A list for the test's raw sockets, all closed at the end."""
    made: list[socket.socket] = []
    try:
        yield made
    finally:
        for s in made:
            s.close()


def connect(port: int, made: list[socket.socket], head: bytes = b"") -> socket.socket | None:
    """A connection to the dashboard (None if the server refused it at once), that
    sent ``head``."""
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=DEADLINE)
    except OSError:
        return None
    made.append(s)
    if head:
        try:
            s.sendall(head)
        except OSError:
            pass  # already dropped to make room for a later one
    return s


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_2000_silent_and_slow_connections_stop_nothing(processes):
    sched, address = start_scheduler(processes, "--dashboard-address", "127.0.0.1:0")
    line = sched.stdout.readline()
    while not line.startswith("shoal dashboard at"):
        line = sched.stdout.readline()
    link = line.split()[-1]
    base, port, token = split(link)
    start_worker(processes, address, "--no-nanny")
    before = open_fds(sched.pid)
    with sockets() as made:
        for i in range(2000):  # every other one begins a request and never ends it
            connect(port, made, PARTIAL_HEAD if i % 2 else b"")
        assert len(made) >= 1000  # (connections refused or reset at once are fine too)
        # a client's graph
        with shoal.Client(address) as client:
            assert client.submit(sum, client.map(abs, range(-50, 0))).result() == sum(range(1, 51))
            # a logged-in page, its API and its event stream
            assert get(base + "/status", token)[0] == 200
            status, body = get(base + "/api/v1/summary", token)
            assert status == 200 and json.loads(body)["workers"] == 1
            with urllib.request.urlopen(urllib.request.Request(base + "/api/v1/events", headers={
                    "Authorization": f"Bearer {token}"}), timeout=DEADLINE) as events:
                assert events.readline().startswith(b"retry: ")
            # the browser's way: the link sets the cookie, the page loads with it
            jar = urllib.request.HTTPCookieProcessor()
            browser = urllib.request.build_opener(jar)
            with browser.open(link, timeout=DEADLINE) as r:
                assert r.status == 200
            with browser.open(base + "/status", timeout=DEADLINE) as r:
                assert r.status == 200 and b'data-page="status"' in r.read()
        # the scheduler held no more connections than its bounds (128 from one host,
        # and at most one accept batch more on their way out)
        assert open_fds(sched.pid) - before <= config.get("dashboard-max-connections-per-host") + 128 + 16
    # and once they are gone, it serves as before
    assert get(base + "/api/v1/summary", token)[0] == 200


@pytest.fixture
def small_dashboard() -> Iterator[dict[str, Any]]:
    """An in-process cluster whose dashboard takes 3 connections, with a long header timeout."""
    with config.set(dashboard_max_connections=3, dashboard_max_connections_per_host=3, dashboard_header_timeout=60.0), \
            shoal.LocalCluster(n_workers=1, processes=False, dashboard_address="127.0.0.1:0") as cluster:
        base, port, token = split(cluster.dashboard_link)
        yield {"cluster": cluster, "base": base, "port": port, "token": token}


def logged_in_connection(port: int, token: str) -> http.client.HTTPConnection:
    """A keep-alive connection that has made one logged-in request (idle now)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=DEADLINE)
    conn.request("GET", "/api/v1/summary", headers={"Authorization": f"Bearer {token}"})
    r = conn.getresponse()
    assert r.status == 200 and "workers" in json.loads(r.read())
    return conn


def test_the_oldest_idle_connection_that_has_not_logged_in_makes_room(small_dashboard):
    port, token = small_dashboard["port"], small_dashboard["token"]
    page = logged_in_connection(port, token)  # the oldest, logged in
    try:
        with sockets() as made:
            a = connect(port, made)
            b = connect(port, made, PARTIAL_HEAD)
            assert a is not None and b is not None
            c = connect(port, made)  # a fourth: a, the oldest that has not logged in, goes
            assert c is not None and closed_by_peer(a)
            assert still_open(b) and still_open(c) and still_open(page.sock)
            # the logged-in page goes on on its own connection
            sock = page.sock
            page.request("GET", "/api/v1/workers", headers={"Authorization": f"Bearer {token}"})
            r = page.getresponse()
            assert r.status == 200 and page.sock is sock
            r.read()
    finally:
        page.close()


def test_a_new_connection_is_refused_when_all_are_busy(small_dashboard):
    base, port, token = small_dashboard["base"], small_dashboard["port"], small_dashboard["token"]
    streams = []
    try:
        for _ in range(3):  # three pages listening: busy for as long as they stay
            r = urllib.request.urlopen(urllib.request.Request(base + "/api/v1/events", headers={
                "Authorization": f"Bearer {token}"}), timeout=DEADLINE)
            streams.append(r)
            assert r.readline().startswith(b"retry: ")
        with sockets() as made:
            refused = connect(port, made)
            assert refused is None or closed_by_peer(refused)
        for r in streams:  # still served
            while not r.readline().startswith(b"event: update"):
                pass
    finally:
        for r in streams:
            r.close()


def test_a_connection_that_sends_no_whole_request_in_time_is_closed():
    with config.set(dashboard_header_timeout=0.2), \
            shoal.LocalCluster(n_workers=0, processes=False, dashboard_address="127.0.0.1:0") as cluster:
        base, port, token = split(cluster.dashboard_link)
        with sockets() as made:
            silent = connect(port, made)
            slow = connect(port, made, PARTIAL_HEAD)
            assert silent is not None and slow is not None
            assert closed_by_peer(silent) and closed_by_peer(slow)
        # a logged-in keep-alive connection left idle goes the same way (a browser opens another)
        page = logged_in_connection(port, token)
        try:
            assert closed_by_peer(page.sock)
        finally:
            page.close()
        assert get(base + "/api/v1/summary", token)[0] == 200
