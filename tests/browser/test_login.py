"""The dashboard's login in a real browser (issue 35): the link ``shoal scheduler``
prints opens the dashboard; the bare URL shows the login page, whose form takes the
token; an open dashboard draws the task stream for a viewer who has not logged in,
without keys, and its task page says to log in."""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterator
from typing import Any

import pytest

import shoal
from shoal import config
from shoal_helpers import boom, inc, start_scheduler, start_worker, stop_processes

#: the console error of a page or request answered with a 401 or 403 (expected here)
REFUSED = ("status of 401", "status of 403")


@pytest.fixture
def processes() -> Iterator[list[Any]]:
    procs: list[Any] = []
    yield procs
    stop_processes(procs)


@pytest.fixture
def cli_cluster(processes) -> dict[str, Any]:
    """A ``shoal scheduler`` with one worker that ran 5 tasks: its printed link."""
    sched, address = start_scheduler(processes, "--dashboard-address", "127.0.0.1:0")
    line = sched.stdout.readline()
    while not line.startswith("shoal dashboard at "):
        line = sched.stdout.readline()
    link = line.split()[-1]
    start_worker(processes, address, "--no-nanny")
    with shoal.Client(address) as client:
        assert client.gather(client.map(abs, range(-5, 0))) == [5, 4, 3, 2, 1]
    return {"link": link, "base": link.partition("?")[0].rsplit("/", 1)[0],
            "token": urllib.parse.parse_qs(link.partition("?")[2])["token"][0]}


def expect_refusals(t: Any) -> None:
    """The tab's console errors were only the refusals the test asked for."""
    t.errors[:] = [e for e in t.errors if not any(r in e for r in REFUSED)]


def test_the_printed_link_opens_the_dashboard(tab, cli_cluster):
    t = tab()
    t.page.goto(cli_cluster["link"])
    t.page.wait_for_url("**/status", timeout=15_000)
    assert "token" not in t.page.url  # it left the address bar
    t.wait("() => window.shoalDashboard && window.shoalDashboard.taskCount() === 5")
    t.wait("() => window.shoalDashboard.updates() >= 1")  # the event stream has the cookie too
    assert t.page.locator("#anonymous").count() == 0
    cookies = t.context.cookies()
    assert [(c["httpOnly"], c["sameSite"], c["path"]) for c in cookies] == [(True, "Strict", "/")]
    # the other pages, with the same cookie
    t.page.click("nav.top >> text=Workers")
    t.page.wait_for_url("**/workers")
    t.wait("() => window.shoalDashboard.workers().length === 1")
    t.done()


def test_the_bare_url_shows_the_login_page_whose_form_logs_in(tab, cli_cluster):
    t = tab()
    answer = t.page.goto(cli_cluster["base"] + "/status")
    assert answer.status == 401
    assert t.page.inner_text("#login-title") == "This dashboard needs the cluster's secret"
    text = t.page.inner_text("body")
    assert "abs" not in text and "worker" not in text.lower()  # nothing of the cluster
    t.screenshot("login")
    t.page.fill("#login-token", "not-the-token")
    t.page.press("#login-token", "Enter")
    t.page.wait_for_selector("#login-wrong")
    t.page.fill("#login-token", cli_cluster["token"])
    t.page.press("#login-token", "Enter")
    t.page.wait_for_url("**/status", timeout=15_000)
    t.wait("() => window.shoalDashboard && window.shoalDashboard.taskCount() === 5")
    expect_refusals(t)
    t.done()


@pytest.fixture
def open_cluster() -> Iterator[dict[str, Any]]:
    """An in-process cluster with an open dashboard that ran 10 tasks and one that erred."""
    with config.set(dashboard_open=1), \
            shoal.LocalCluster(n_workers=1, processes=False, dashboard_address="127.0.0.1:0") as cluster, \
            shoal.Client(cluster) as client:
        assert client.gather(client.map(inc, range(10))) == list(range(1, 11))
        bad = client.submit(boom, 3)
        with pytest.raises(ValueError):
            bad.result()
        yield {"link": cluster.dashboard_link, "base": cluster.dashboard_link.partition("?")[0].rsplit("/", 1)[0],
               "bad": bad.key}


def test_an_open_dashboard_shows_no_keys_to_who_has_not_logged_in(tab, open_cluster):
    t = tab()
    t.page.goto(open_cluster["base"] + "/status")
    t.wait("() => window.shoalDashboard && window.shoalDashboard.taskCount() === 11")
    assert "not logged in" in t.page.inner_text("#anonymous")
    t.screenshot("status")
    # the chart holds no key: its records came without
    assert t.js("key => window.shoalDashboard.taskPoint(key)", open_cluster["bad"]) is None
    # the task page asks to log in instead of showing the task
    t.page.goto(open_cluster["base"] + "/task?key=" + urllib.parse.quote(open_cluster["bad"]))
    t.page.wait_for_selector("#task-login")
    assert "log in" in t.page.inner_text("#task-login")
    assert "no such luck" not in t.page.inner_text("body")
    expect_refusals(t)
    t.done()
    # the link (with the token) shows everything
    full = tab(login=open_cluster["link"])
    full.page.goto(open_cluster["base"] + "/task?key=" + urllib.parse.quote(open_cluster["bad"]))
    full.page.wait_for_selector("#task-error")
    assert "no such luck" in full.page.inner_text("#task-error")
    assert full.page.locator("#anonymous").count() == 0
    full.done()
