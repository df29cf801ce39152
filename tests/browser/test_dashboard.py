"""The live dashboard in a real browser: a cluster runs known work (30 ``inc`` tasks,
a ``total`` of them, one task that raises), and each page shows what a person would
look for: every task in the task stream, the progress bars at 100%, every worker in
the table, the story and the exception of the erred task, the prefixes in the graph.
"""

from __future__ import annotations

import urllib.parse

import pytest

import shoal
from shoal_helpers import boom, inc, total

N_INC = 30


@pytest.fixture(scope="module")
def ran():
    with shoal.LocalCluster(n_workers=2, threads_per_worker=2, processes=False,
                            dashboard_address="127.0.0.1:0") as cluster, shoal.Client(cluster) as client:
        link = cluster.dashboard_link  # (with the token that logs a browser in)
        assert link is not None and link.startswith("http://127.0.0.1:") and "/status?token=" in link
        incs = client.map(inc, range(N_INC))
        whole = client.submit(total, *incs)
        assert whole.result() == sum(range(1, N_INC + 1))
        bad = client.submit(boom, 7)
        with pytest.raises(ValueError, match="no such luck"):
            bad.result()
        yield {"cluster": cluster, "client": client, "link": link, "base": link.partition("?")[0].rsplit("/", 1)[0],
               "incs": incs, "whole": whole, "bad": bad}


def ran_count(cluster) -> int:
    return cluster.scheduler.diagnostics.summary()["task_stream_total"]


def test_status_page_draws_a_rectangle_per_task_that_ran(tab, ran):
    cluster = ran["cluster"]
    expected = ran_count(cluster)
    assert expected == N_INC + 2
    t = tab(login=ran["link"])
    t.page.goto(ran["base"] + "/status")
    t.wait("n => window.shoalDashboard && window.shoalDashboard.taskCount() === n", expected)
    assert t.page.inner_text("#task-count").startswith(f"{expected} tasks, 1 erred")
    # the inputs of `total` came by reference (one process): drawn before it
    moved = t.js("window.shoalDashboard.transferCounts()")
    assert moved["inproc"] >= 1 and moved["shm"] == moved["tcp"] == 0
    # every prefix's bar: inc all done, the erred one not
    progress = t.wait("() => { const p = window.shoalDashboard.progress(); return 'inc' in p && p; }")
    assert progress["inc"] == 100 and progress["total"] == 100 and progress["boom"] == 0
    assert "31/32 done" in t.page.inner_text("#progress-count")
    # memory and CPU charts: a bar per worker
    names = sorted(w.name for w in cluster.workers.values())
    assert sorted(t.wait("n => { const w = window.shoalDashboard.workers(); return w.length === n && w; }",
                         len(names))) == names
    summary = t.page.inner_text("#summary")
    assert "workers 2" in summary.replace("\n", " ") and "erred 1" in summary.replace("\n", " ")
    t.done()


def test_the_task_stream_grows_as_tasks_run(tab, ran):
    cluster, client = ran["cluster"], ran["client"]
    t = tab(login=ran["link"])
    t.page.goto(ran["base"] + "/status")
    before = ran_count(cluster)
    t.wait("n => window.shoalDashboard && window.shoalDashboard.taskCount() === n", before)
    more = client.map(inc, range(100, 110))
    client.gather(more)
    t.wait("n => window.shoalDashboard.taskCount() === n", before + 10)  # through the event stream
    t.wait("n => document.querySelector('#task-count').textContent.startsWith(n + ' tasks')", before + 10)
    t.done()
    client.cancel(more)


def test_clicking_a_task_opens_its_page(tab, ran):
    bad = ran["bad"]
    t = tab(login=ran["link"])
    t.page.goto(ran["base"] + "/status")
    t.wait("() => window.shoalDashboard && window.shoalDashboard.updates() >= 1")  # the page's layout is complete
    point = t.wait("key => window.shoalDashboard && window.shoalDashboard.taskPoint(key)", bad.key)
    t.page.mouse.click(point["x"], point["y"])
    t.page.wait_for_url("**/task?key=*", timeout=15_000)
    assert urllib.parse.parse_qs(urllib.parse.urlparse(t.page.url).query)["key"] == [bad.key]
    t.page.wait_for_selector("#task-state")
    t.done()


def test_workers_page_lists_every_worker(tab, ran):
    cluster = ran["cluster"]
    t = tab(login=ran["link"])
    t.page.goto(ran["base"] + "/workers")
    addresses = sorted(cluster.scheduler.state.workers)
    shown = t.wait("n => { const w = window.shoalDashboard.workers(); return w.length === n && w; }", len(addresses))
    assert sorted(shown) == addresses
    rows = t.page.locator("#workers tbody tr")
    for i in range(rows.count()):
        cells = rows.nth(i).locator("td").all_inner_texts()
        assert cells[0] in addresses and cells[1].startswith("worker-") and cells[3] == "2"
        assert cells[-1] == "running" and cells[-2].endswith("s ago")
        assert "by reference" in cells[12] and "shared memory" in cells[12] and "tcp" in cells[12]
    assert t.page.inner_text("#worker-count") == "2 workers"
    t.wait("() => window.shoalDashboard.updates() >= 2")  # and it stays live
    t.done()


def open_task_page(tab, ran, key: str):
    """A tab showing task ``key``'s page, once its story is drawn."""
    t = tab(login=ran["link"])
    t.page.goto(ran["base"] + "/task?key=" + urllib.parse.quote(key))
    t.page.wait_for_selector("#task-story")
    return t


def test_task_page_of_an_erred_task_shows_its_story_and_exception(tab, ran):
    t = open_task_page(tab, ran, ran["bad"].key)
    assert t.page.inner_text("#task-state") == "erred"
    assert "ValueError" in t.page.inner_text("#task-error") and "no such luck" in t.page.inner_text("#task-error")
    traceback = t.page.inner_text("#task-traceback")
    assert "Traceback" in traceback and "in boom" in traceback
    story = t.page.locator("#task-story tbody tr").all_inner_texts()
    assert any("processing" in row and "erred" in row for row in story)
    assert all(row.split("\t")[-1].strip() for row in story)  # each with its stimulus id
    t.done()


def test_task_page_shows_inputs_and_how_they_came(tab, ran):
    t = open_task_page(tab, ran, ran["whole"].key)
    assert t.page.inner_text("#task-state") == "memory"
    text = t.page.inner_text("#task")
    assert f"Dependencies ({N_INC})" in text and "by reference" in text
    # a dependency is a link to its own page
    first = ran["incs"][0].key
    t.page.click(f"a[href='task?key={urllib.parse.quote(first, safe='')}']")
    t.page.wait_for_url("**/task?key=inc*", timeout=15_000)
    t.page.wait_for_selector("#task-state")
    assert t.page.inner_text("#task-state") == "memory"
    assert "Dependents (1)" in t.page.inner_text("#task")
    t.done()


def test_search_finds_a_key(tab, ran):
    bad = ran["bad"]
    t = tab(login=ran["link"])
    t.page.goto(ran["base"] + "/task")
    t.page.fill("#search-input", "boom")
    t.page.wait_for_selector("#search-results a")
    assert t.page.locator("#search-results a").all_inner_texts() == [bad.key]
    t.page.press("#search-input", "Enter")  # one match: its page
    t.page.wait_for_url("**/task?key=boom*", timeout=15_000)
    t.page.wait_for_selector("#task-error")
    t.done()


def test_graph_page_shows_the_prefixes(tab, ran):
    t = tab(login=ran["link"])
    t.page.goto(ran["base"] + "/graph")
    nodes = t.wait("() => { const n = window.shoalDashboard && window.shoalDashboard.graphNodes(); return n && n.length >= 3 && n; }")
    assert sorted(nodes) == ["boom", "inc", "total"]
    assert t.page.inner_text("#graph-count") == "3 prefixes, 1 edge"
    t.done()


def test_nav_bar_links_the_four_pages(tab, ran):
    t = tab(login=ran["link"])
    t.page.goto(ran["base"] + "/")
    t.page.wait_for_url("**/status")
    for name in ("Workers", "Task", "Graph", "Status"):
        t.page.click(f"nav.top >> text={name}")
        t.page.wait_for_url(f"**/{name.lower()}")
        assert t.page.get_attribute("nav.top a[aria-current=page]", "href") == name.lower()
    t.done()
