"""Who may read the dashboard (issue 35), over real HTTP against real schedulers.

Without the cluster's token nothing is served and nothing leaks (the same short
answer whatever was asked); the token link sets a cookie, after which pages, the API
and the event stream work; a bearer works for scripts; a wrong token is refused.
``/metrics`` is open only with ``metrics-public`` and never shows a key or an error.
An open dashboard (``dashboard-open``, loopback only) hides keys and errors from who
has not logged in; a cluster without a secret serves its dashboard open on loopback
and nowhere else. The command line says all this in its flags and its output.
"""

from __future__ import annotations

import http.cookiejar
import json
import logging
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import shoal  # noqa: E402
from shoal import config  # noqa: E402
from shoal.comm.security import dashboard_token, read_secret  # noqa: E402
from shoal.dashboard.pages import PAGES  # noqa: E402
from shoal_helpers import start_scheduler, start_worker  # noqa: E402

#: what an erred task's error says: the value of its argument
PRIVATE = "hunter2-private-argument"


def secret_payroll(x: int) -> int:
    return x + 1


def leaky_failure(text: str) -> None:
    raise ValueError(f"cannot use {text}")


class Answer:
    """What a request got: ``status``, ``headers`` (an email.message.Message), ``body``."""

    def __init__(self, status: int, headers: Any, body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    @property
    def kind(self) -> str:
        return self.headers.get("Content-Type", "")

    def json(self) -> Any:
        assert self.kind.startswith("application/json"), self.kind
        return json.loads(self.body)


def ask(url: str, headers: dict[str, str] | None = None, opener: Any = None, method: str = "GET") -> Answer:
    """A request (no redirect followed), its answer whatever its status."""
    request = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with (opener or _opener).open(request, timeout=10) as r:
            return Answer(r.status, r.headers, r.read())
    except urllib.error.HTTPError as e:
        with e:
            return Answer(e.code, e.headers, e.read())


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # (a 302 comes back as it is)


_opener = urllib.request.build_opener(_NoRedirect())


def browser() -> tuple[Any, http.cookiejar.CookieJar]:
    """An opener that keeps cookies, as a browser does, and its jar."""
    jar = http.cookiejar.CookieJar()
    return urllib.request.build_opener(_NoRedirect(), urllib.request.HTTPCookieProcessor(jar)), jar


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def first_update(url: str, headers: dict[str, str] | None = None, opener: Any = None) -> dict[str, Any]:
    """The first ``update`` of the event stream at ``url``."""
    request = urllib.request.Request(url, headers=headers or {})
    with (opener or _opener).open(request, timeout=10) as r:
        assert r.headers["Content-Type"] == "text/event-stream"
        event = ""
        while True:
            line = r.readline().decode()
            assert line, "the stream ended"
            if line.startswith("event: "):
                event = line[7:].strip()
            elif line.startswith("data: ") and event == "update":
                return json.loads(line[6:])


def split(link: str) -> tuple[str, str]:
    """``(root URL, token)`` of a dashboard's link."""
    page, _, query = link.partition("?")
    assert page.endswith("/status"), link
    return page[: -len("/status")], urllib.parse.parse_qs(query)["token"][0]


def run_work(client: shoal.Client) -> dict[str, Any]:
    """Tasks with keys of their own, one of which errs with PRIVATE in its error."""
    futures = client.map(secret_payroll, range(7))
    assert client.gather(futures) == list(range(1, 8))
    bad = client.submit(leaky_failure, PRIVATE)
    with pytest.raises(ValueError, match=PRIVATE):
        bad.result()
    return {"futures": futures, "bad": bad, "keys": [f.key for f in futures] + [bad.key]}


@pytest.fixture(scope="module")
def ran() -> Iterator[dict[str, Any]]:
    with config.set(dashboard_interval=0.05), \
            shoal.LocalCluster(n_workers=1, processes=False, dashboard_address="127.0.0.1:0") as cluster, \
            shoal.Client(cluster) as client:
        base, token = split(cluster.dashboard_link)
        yield {"cluster": cluster, "client": client, "base": base, "token": token, **run_work(client)}


def leaks(body: bytes, ran: dict[str, Any], prefixes: bool = True) -> list[str]:
    """What of the cluster's tasks ``body`` shows: keys, the error's text, and (with
    ``prefixes``) the key prefixes."""
    text = body.decode("utf-8", "replace")
    found = [k for k in ran["keys"] if k in text]
    found += [w for w in (PRIVATE, "cannot use") if w in text]
    if prefixes:
        found += [p for p in ("secret_payroll", "leaky_failure") if p in text]
    return found


# -- without a login


PAGE_PATHS = ["/", *[f"/{p}" for p in PAGES], "/task?key=x"]
OTHER_PATHS = ["/api/v1/summary", "/api/v1/workers", "/api/v1/task-stream", "/api/v1/progress", "/api/v1/graph",
               "/api/v1/transfers", "/api/v1/search?q=secret", "/api/v1/events", "/metrics", "/static/style.css",
               "/static/pages.js", "/nothing", "/api/v1/nothing"]


def test_without_a_login_nothing_is_served_and_nothing_leaks(ran):
    base = ran["base"]
    task_path = "/api/v1/task?key=" + urllib.parse.quote(ran["bad"].key)
    pages = [ask(base + p) for p in PAGE_PATHS]
    others = [ask(base + p) for p in [*OTHER_PATHS, task_path]]
    for path, a in zip(PAGE_PATHS + OTHER_PATHS + [task_path], pages + others):
        assert a.status == 401, (path, a.status)
        assert a.headers["WWW-Authenticate"] == 'Bearer realm="shoal dashboard"', path
        assert a.headers.get("Set-Cookie") is None, path
        assert not leaks(a.body, ran), (path, leaks(a.body, ran))
    # the same answer whatever was asked: it cannot say anything of the cluster
    assert len({a.body for a in pages}) == 1 and len({a.body for a in others}) == 1
    page = pages[0]
    assert page.kind.startswith("text/html")
    assert b"This dashboard needs the cluster's secret" in page.body and b"?token=" in page.body
    assert set(others[0].json()) == {"error"} and "Authorization: Bearer" in others[0].json()["error"]
    # another method: the same 401, not a 405 that would tell the route exists
    assert ask(base + "/api/v1/summary", method="POST").status == 401
    # what a load balancer asks still answers, and says nothing else
    health = ask(base + "/health")
    assert (health.status, health.body) == (200, b"ok")


# -- the token link, the cookie, a bearer


def test_the_token_link_sets_a_cookie_then_pages_api_and_events_work(ran):
    base, token, cluster = ran["base"], ran["token"], ran["cluster"]
    assert token == dashboard_token(cluster.security.secret)
    opener, jar = browser()
    onward = ask(f"{base}/status?token={token}", opener=opener)
    assert onward.status == 200 and onward.kind.startswith("text/html")
    assert token.encode() not in onward.body  # on to the page without the token
    assert b'location.replace("status")' in onward.body and b'url=status"' in onward.body
    assert onward.headers["Referrer-Policy"] == "no-referrer"
    cookie = onward.headers["Set-Cookie"]
    name, _, rest = cookie.partition("=")
    assert name == f"shoal-dashboard-{cluster.scheduler.dashboard.port}"
    attributes = {a.strip().lower() for a in rest.split(";")[1:]}
    assert attributes == {"httponly", "path=/", "samesite=strict"}, cookie
    assert token not in cookie  # the cookie holds a value of its own, not the token
    assert [c.name for c in jar] == [name]

    page = ask(base + "/status", opener=opener)
    assert page.status == 200 and b'data-page="status"' in page.body and b'id="anonymous"' not in page.body
    summary = ask(base + "/api/v1/summary", opener=opener).json()
    assert summary["tasks"] == 8 and summary["erred"] == 1
    task = ask(base + "/api/v1/task?key=" + urllib.parse.quote(ran["bad"].key), opener=opener).json()
    assert task["state"] == "erred" and PRIVATE in task["error"]  # (a logged-in viewer sees errors)
    stream = ask(base + "/api/v1/task-stream", opener=opener).json()
    assert sorted(r["key"] for r in stream["records"]) == sorted(ran["keys"])
    update = first_update(base + "/api/v1/events", opener=opener)
    assert sorted(r["key"] for r in update["task_stream"]["records"]) == sorted(ran["keys"])
    assert update["summary"]["tasks"] == 8
    # without the cookie the same requests are refused again
    assert ask(base + "/api/v1/summary").status == 401


def test_the_link_to_a_task_page_keeps_its_key(ran):
    key = ran["bad"].key
    onward = ask(f"{ran['base']}/task?key={urllib.parse.quote(key)}&token={ran['token']}")
    assert onward.status == 200
    target = "task?" + urllib.parse.urlencode({"key": key})
    assert f'location.replace("{target}")'.encode() in onward.body
    assert ran["token"].encode() not in onward.body


def test_a_wrong_token_is_refused(ran):
    base, token = ran["base"], ran["token"]
    other = dashboard_token(b"the secret of another cluster")
    for headers, path in (({}, f"/status?token={other}"), ({}, "/status?token="), ({}, "/api/v1/summary?token=x"),
                          (bearer(other), "/api/v1/summary"), (bearer(token[:-1]), "/metrics"),
                          (bearer(other), "/api/v1/events"), ({"Authorization": "Bearer"}, "/api/v1/summary"),
                          ({}, f"/api/v1/summary?token={other}&token={other[::-1]}")):
        a = ask(base + path, headers)
        assert a.status == 403, (path, headers, a.status)
        assert a.headers.get("Set-Cookie") is None and not leaks(a.body, ran)
    # one right token is enough (a proxy in front may add a bearer of its own)
    assert ask(f"{base}/api/v1/summary?token={token}", bearer(other)).status == 200
    assert ask(f"{base}/api/v1/summary?token={other}&token={token}").status == 200
    page = ask(f"{base}/status?token={other}")
    assert page.kind.startswith("text/html") and b'id="login-wrong"' in page.body
    assert ask(base + "/api/v1/summary", bearer(other)).json() == {"error": "this token is not the cluster's"}


def test_a_cookie_that_is_not_this_dashboards_counts_as_none(ran):
    base, port = ran["base"], ran["cluster"].scheduler.dashboard.port
    opener, _ = browser()
    right = ask(f"{base}/status?token={ran['token']}", opener=opener).headers["Set-Cookie"].split(";")[0]
    value = right.partition("=")[2]
    for cookie in (f"shoal-dashboard-{port}=nothing", f"shoal-dashboard-{port + 1}={value}",
                   f"shoal-dashboard-{port}={ran['token']}"):
        assert ask(base + "/api/v1/summary", {"Cookie": cookie}).status == 401, cookie
    assert ask(base + "/api/v1/summary", {"Cookie": right}).status == 200
    # a right cookie and a proxy's bearer of its own: logged in
    assert ask(base + "/api/v1/summary", {"Cookie": right, **bearer("a-proxys-own")}).status == 200


def test_a_bearer_logs_a_script_in(ran):
    base, token = ran["base"], ran["token"]
    for path in ("/status", "/api/v1/summary", "/api/v1/task-stream", "/metrics", "/static/style.css"):
        a = ask(base + path, bearer(token))
        assert a.status == 200 and a.headers.get("Set-Cookie") is None, path
    assert ask(base + "/api/v1/summary", {"Authorization": f"bearer  {token} "}).status == 200
    assert first_update(base + "/api/v1/events", bearer(token))["summary"]["tasks"] == 8
    # ?token= on anything but a page serves it at once (no cookie)
    a = ask(f"{base}/api/v1/summary?token={token}")
    assert a.status == 200 and a.headers.get("Set-Cookie") is None
    # another scheme (a proxy's own) is not a token: no login, not a wrong one
    assert ask(base + "/api/v1/summary", {"Authorization": "Basic dXNlcjpwYXNz"}).status == 401


# -- /metrics


def metric_samples(body: bytes) -> list[Any]:
    return [s for family in text_string_to_metric_families(body.decode()) for s in family.samples]


def check_metrics_show_no_task_data(body: bytes, ran: dict[str, Any]) -> None:
    """Counts by state, prefix, worker and path: never a key or an error's text."""
    assert not leaks(body, ran, prefixes=False), leaks(body, ran, prefixes=False)
    workers = set(ran["cluster"].scheduler.state.workers)
    for s in metric_samples(body):
        assert set(s.labels) <= {"state", "prefix", "worker", "kind", "path"}, s
        assert s.labels.get("prefix", "x") in {"x", "secret_payroll", "leaky_failure"}, s
        assert s.labels.get("worker", "x") in workers | {"x"}, s


def test_metrics_need_a_login_unless_public(ran):
    base, token = ran["base"], ran["token"]
    assert ask(base + "/metrics").status == 401
    body = ask(base + "/metrics", bearer(token)).body
    check_metrics_show_no_task_data(body, ran)
    assert any(s.name == "shoal_tasks" and s.labels["state"] == "erred" and s.value == 1 for s in metric_samples(body))


def test_public_metrics_are_served_without_login_and_nothing_else_is():
    with config.set(metrics_public=1), \
            shoal.LocalCluster(n_workers=1, processes=False, dashboard_address="127.0.0.1:0") as cluster, \
            shoal.Client(cluster) as client:
        ran = {"cluster": cluster, **run_work(client)}
        base, token = split(cluster.dashboard_link)
        public = ask(base + "/metrics")
        assert public.status == 200 and public.kind.startswith("text/plain")
        check_metrics_show_no_task_data(public.body, ran)
        assert {s.name for s in metric_samples(public.body)} == {
            s.name for s in metric_samples(ask(base + "/metrics", bearer(token)).body)}
        for path in ("/status", "/api/v1/summary", "/api/v1/events"):
            assert ask(base + path).status == 401, path


# -- an open dashboard, a cluster without a secret


def test_an_open_dashboard_hides_keys_and_errors_from_who_has_not_logged_in(caplog):
    with caplog.at_level(logging.WARNING, logger="shoal.dashboard"), \
            config.set(dashboard_open=1, dashboard_interval=0.05), \
            shoal.LocalCluster(n_workers=1, processes=False, dashboard_address="127.0.0.1:0") as cluster, \
            shoal.Client(cluster) as client:
        ran = {"cluster": cluster, **run_work(client)}
        base, token = split(cluster.dashboard_link)
        assert any("served without login" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
        page = ask(base + "/status")
        assert page.status == 200 and b'id="anonymous"' in page.body
        summary = ask(base + "/api/v1/summary").json()
        assert summary["tasks"] == 8 and summary["erred"] == 1
        progress = {p["prefix"] for p in ask(base + "/api/v1/progress").json()["prefixes"]}
        assert progress == {"secret_payroll", "leaky_failure"}  # (counts by prefix: documented)
        stream = ask(base + "/api/v1/task-stream")
        records = stream.json()["records"]
        assert len(records) == 8 and all(r["key"] is None for r in records)
        assert not leaks(stream.body, ran, prefixes=False)
        update = first_update(base + "/api/v1/events")
        assert [r["key"] for r in update["task_stream"]["records"]] == [None] * 8
        for path in ("/api/v1/task?key=" + urllib.parse.quote(ran["bad"].key), "/api/v1/search?q=secret"):
            refused = ask(base + path)
            assert refused.status == 401 and not leaks(refused.body, ran), path
        assert ask(base + "/metrics").status == 401  # (open by its own choice only)
        # who logs in sees everything
        opener, _ = browser()
        assert ask(f"{base}/status?token={token}", opener=opener).status == 200
        assert b'id="anonymous"' not in ask(base + "/status", opener=opener).body
        task = ask(base + "/api/v1/task?key=" + urllib.parse.quote(ran["bad"].key), opener=opener).json()
        assert PRIVATE in task["error"]
        assert sorted(r["key"] for r in ask(base + "/api/v1/task-stream", opener=opener).json()["records"]) \
            == sorted(ran["keys"])
        # a wrong token is still refused, not taken as no login
        assert ask(base + "/api/v1/summary", bearer("wrong")).status == 403


@pytest.mark.parametrize("security", [None, shoal.Security.disabled()], ids=["open", "no-secret"])
def test_a_dashboard_without_login_is_refused_on_other_addresses(security):
    with config.set(dashboard_open=1 if security is None else 0):
        with pytest.raises(ValueError, match="on a loopback address only, not on 0.0.0.0"):
            shoal.LocalCluster(n_workers=0, processes=False, dashboard_address="0.0.0.0:0", security=security)
    # with a secret and a login, it may listen there (and asks for the login)
    with shoal.LocalCluster(n_workers=0, processes=False, dashboard_address="0.0.0.0:0") as cluster:
        base, token = split(cluster.dashboard_link)
        local = "http://127.0.0.1:" + base.rpartition(":")[2]
        assert ask(local + "/api/v1/summary").status == 401
        assert ask(local + "/api/v1/summary", bearer(token)).status == 200


def test_a_cluster_without_a_secret_serves_its_dashboard_open_on_loopback(caplog):
    with caplog.at_level(logging.WARNING, logger="shoal.dashboard"), \
            shoal.LocalCluster(n_workers=1, processes=False, dashboard_address="127.0.0.1:0",
                               security=shoal.Security.disabled()) as cluster, shoal.Client(cluster) as client:
        ran = run_work(client)
        assert "?" not in cluster.dashboard_link and "?" not in client.dashboard_link  # no token to give
        base = cluster.dashboard_link[: -len("/status")]
        assert any("without a secret" in r.getMessage() for r in caplog.records)
        task = ask(base + "/api/v1/task?key=" + urllib.parse.quote(ran["bad"].key)).json()
        assert PRIVATE in task["error"]  # (any local user may run code in it anyway)
        assert ask(base + "/metrics").status == 200


# -- the command line


def dashboard_line(sched: subprocess.Popen) -> str:
    line = sched.stdout.readline().strip()
    while line.startswith("shoal scheduler auth file"):
        line = sched.stdout.readline().strip()
    assert line.startswith("shoal dashboard at "), line
    return line.split()[-1]


def test_cli_prints_the_token_link(processes):
    sched, address = start_scheduler(processes, "--dashboard-address", "127.0.0.1:0")
    link = dashboard_line(sched)
    base, token = split(link)
    secret = read_secret(shoal.comm.security.auth_file_for(address))
    assert token == dashboard_token(secret)
    assert ask(base + "/status").status == 401
    opener, _ = browser()
    assert ask(link, opener=opener).status == 200
    assert ask(base + "/api/v1/workers", opener=opener).json() == []
    with shoal.Client(address) as client:
        assert client.dashboard_link == link  # (made from the secret it found)


def test_cli_dashboard_open_and_metrics_public(processes):
    sched, address = start_scheduler(processes, "--dashboard-address", "127.0.0.1:0", "--dashboard-open",
                                     "--metrics-public")
    base, token = split(dashboard_line(sched))
    _, worker = start_worker(processes, address, "--no-nanny")
    with shoal.Client(address) as client:
        assert client.submit(abs, -3).result() == 3
        bad = client.submit(int, PRIVATE)
        with pytest.raises(ValueError, match=PRIVATE):
            bad.result()
        assert ask(base + "/status").status == 200
        assert [w["address"] for w in ask(base + "/api/v1/workers").json()] == [worker]
        stream = ask(base + "/api/v1/task-stream")
        assert [r["key"] for r in stream.json()["records"]] == [None, None] and PRIVATE.encode() not in stream.body
        assert ask(base + "/api/v1/task?key=" + urllib.parse.quote(bad.key)).status == 401
        metrics = ask(base + "/metrics")
        assert metrics.status == 200 and bad.key.encode() not in metrics.body and PRIVATE.encode() not in metrics.body
    sched.terminate()
    _, err = sched.communicate(timeout=30)
    assert "served without login" in err and "dashboard-open" in err


@pytest.mark.parametrize("flags", [["--dashboard-open", "--dashboard-address", "0.0.0.0:0"],
                                   ["--no-auth", "--dashboard-address", "0.0.0.0:0"],
                                   ["--no-auth", "--host", "0.0.0.0"]])
def test_cli_refuses_a_dashboard_without_login_on_other_addresses(flags):
    out = subprocess.run([sys.executable, "-m", "shoal", "scheduler", "--port", "0", *flags],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert "serves the dashboard without login, on a loopback address only, not on 0.0.0.0" in out.stderr
    assert "shoal scheduler at" not in out.stdout


def test_cli_without_a_secret_serves_the_dashboard_open_on_loopback(processes):
    sched, address = start_scheduler(processes, "--no-auth", "--dashboard-address", "127.0.0.1:0")
    link = dashboard_line(sched)
    assert "?" not in link
    assert ask(link).status == 200
    sched.terminate()
    _, err = sched.communicate(timeout=30)
    assert "without a secret (--no-auth): served without login" in err
