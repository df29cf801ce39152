"""The offline performance report: a file written by ``performance_report`` (with
``render_report``) opens from file:// with every network request refused, and its
charts draw; keys cannot break out of the page."""

from __future__ import annotations

import json
import re
import time

import pytest

import shoal
from shoal.dashboard.pages import SCRIPTS, STATIC, render_page
from shoal.dashboard.report import render_report
from shoal_helpers import boom, inc, total

CHARTS = ("task-stream", "progress", "memory", "cpu", "transfer-rate")

#: pixels drawn (not transparent) in each chart's canvas
DRAWN = """ids => Object.fromEntries(ids.map(id => {
    const canvas = document.querySelector('#' + id + ' canvas');
    if (!canvas) return [id, 0];
    const pixels = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
    let drawn = 0;
    for (let i = 3; i < pixels.length; i += 4) if (pixels[i] > 0) drawn++;
    return [id, drawn];
}))"""


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    path = tmp_path_factory.mktemp("report") / "report.html"
    with shoal.LocalCluster(n_workers=2, threads_per_worker=2, processes=False, dashboard_address=None) as cluster, \
            shoal.Client(cluster) as client:
        with shoal.performance_report(filename=str(path), client=client):
            incs = client.map(inc, range(20))
            whole = client.submit(total, *incs)
            whole.result()
            bad = client.submit(boom, 1)
            with pytest.raises(ValueError):
                bad.result()
        del incs, whole, bad  # held until the block ended: its progress counts them
        workers = sorted(w.name for w in cluster.workers.values())
    return path, workers


def test_the_report_opens_with_no_network_and_draws_its_charts(tab, report):
    path, workers = report
    t = tab(offline=True)
    t.page.goto(path.as_uri())
    t.wait("() => window.shoalDashboard && window.shoalDashboard.taskCount() === 22")
    assert t.page.inner_text("#task-count") == "22 tasks, 1 erred"
    assert t.js("window.shoalDashboard.transferCounts()")["inproc"] >= 1
    assert t.js("window.shoalDashboard.progress()") == {"inc": 100, "total": 100, "boom": 0}
    assert sorted(t.js("window.shoalDashboard.workers()")) == workers
    drawn = t.js(DRAWN, list(CHARTS))
    assert all(drawn[c] > 1000 for c in CHARTS), drawn
    assert "by reference" in t.page.inner_text("#moved")
    assert t.requests == [path.as_uri()], t.requests  # nothing but the file itself
    t.done()


HOSTILE = "</script><script>window.pwned = 1</script><!--"


def hostile_data() -> dict:
    now = time.time()
    record = {"index": 0, "key": HOSTILE, "prefix": HOSTILE, "worker": "inproc://1/2", "thread": 1,
              "start": now, "stop": now + 0.01, "status": "OK", "transfers": []}
    group = {"prefix": HOSTILE, "total": 1, "done": 1, "waiting": 0, "processing": 0, "memory": 1, "erred": 0}
    paths = {"inproc": 0, "shm": 0, "tcp": 0, "time": now}
    return {"task_stream": [record], "progress": {"prefixes": [group]}, "workers": [],
            "transfers": {"start": paths, "stop": paths}, "summary": {"address": HOSTILE, "workers": 0},
            "duration": float("nan")}


def open_report(tab, path, data: dict, **options):
    """An offline tab showing ``render_report(data, **options)``, written to ``path``."""
    path.write_text(render_report(data, **options), encoding="utf-8")
    t = tab(offline=True)
    t.page.goto(path.as_uri())
    return t


def narrow_tasks(n: int, rows: int) -> list[dict]:
    """Records of ``n`` tasks of 50 us, one every 100 us from now, on ``rows`` rows in turn."""
    now = time.time()
    return [{"index": i, "key": f"t-{i}", "prefix": "t", "worker": f"inproc://1/{i % rows}", "thread": 1,
             "start": now + i * 1e-4, "stop": now + i * 1e-4 + 5e-5, "status": "OK", "transfers": []}
            for i in range(n)]


def test_keys_cannot_break_out_of_the_report(tab, tmp_path):
    t = open_report(tab, tmp_path / "hostile.html", hostile_data(), title=HOSTILE)
    t.wait("() => window.shoalDashboard && window.shoalDashboard.taskCount() === 1")
    assert t.js("window.pwned") is None
    assert t.js("JSON.parse(document.getElementById('shoal-data').textContent).task_stream[0].key") == HOSTILE
    assert t.page.inner_text("h1") == HOSTILE
    t.done()


def test_the_report_is_one_self_contained_document():
    html = render_report(hostile_data())
    # three script elements (data, chart library, dashboard), each closed once
    assert len(re.findall(r"<script\b", html, re.IGNORECASE)) == 3
    assert len(re.findall(r"</script", html, re.IGNORECASE)) == 3
    assert not re.search(r"<(script|link|img)[^>]+(src|href)=\"(https?:)?//", html, re.IGNORECASE)
    data = re.search(r'<script type="application/json" id="shoal-data">(.*?)</script>', html, re.DOTALL)
    assert data is not None
    parsed = json.loads(data.group(1))
    assert parsed["task_stream"][0]["key"] == HOSTILE and parsed["duration"] is None  # NaN: not JSON


def test_the_report_has_every_element_of_the_status_page():
    html = render_report(hostile_data())
    status = render_page("status")
    ids = re.findall(r'<(?:div|section|span)[^>]* id="([^"]+)"', status.split("<main>")[1])
    assert "task-stream" in ids and "cpu" in ids
    assert [i for i in ids if f'id="{i}"' not in html] == []
    # the page loads the dashboard's scripts in their order, and the report inlines them in it
    loaded = [status.index(f'src="static/{name}"') for name in SCRIPTS]
    inlined = [html.index((STATIC / name).read_text(encoding="utf-8").splitlines()[0]) for name in SCRIPTS]
    assert loaded == sorted(loaded) and inlined == sorted(inlined)


def test_the_task_stream_keeps_the_newest_20000_rectangles(tab, tmp_path):
    data = {**hostile_data(), "task_stream": narrow_tasks(20_500, rows=4), "progress": {"prefixes": []}}
    t = open_report(tab, tmp_path / "many.html", data)
    t.wait("() => window.shoalDashboard && window.shoalDashboard.taskCount() === 20000")
    assert t.page.inner_text("#task-count") == "20000 tasks (the latest 20000)"
    assert t.js("window.shoalDashboard.taskPoint('t-499')") is None  # the oldest went
    assert t.js("window.shoalDashboard.taskPoint('t-500')") is not None
    assert t.js("window.shoalDashboard.taskPoint('t-20499')") is not None
    t.done()


def test_narrow_tasks_are_drawn_as_runs_until_zoomed_in(tab, tmp_path):
    # 8,000 tasks of 50 us on 2 rows over ~0.8 s: hundreds to a pixel
    records = narrow_tasks(8_000, rows=2)
    now = records[0]["start"]
    records[4_000] = {**records[4_000], "key": "bad", "status": "error"}  # erred: never merged into a run
    data = {**hostile_data(), "task_stream": records, "progress": {"prefixes": []}}
    t = open_report(tab, tmp_path / "narrow.html", data)
    t.wait("() => window.shoalDashboard && window.shoalDashboard.taskCount() === 8000")
    merged = t.js("window.shoalDashboard.taskRectangles()")
    assert 3 <= merged < 800
    assert t.js("window.shoalDashboard.taskPoint('bad')") is not None
    # zoom in on 10 ms: the tasks in view are wider than a pixel, and drawn one by one
    t.js("""t0 => window.shoalDashboard.charts['task-stream'].dispatchAction(
        {type: 'dataZoom', dataZoomIndex: 0, startValue: t0, endValue: t0 + 10})""", (now + 0.4) * 1000)
    more = t.wait("n => { const m = window.shoalDashboard.taskRectangles(); return m > n + 50 && m; }", merged)
    assert more <= 8000 and t.js("window.shoalDashboard.taskCount()") == 8000
    t.done()
