"""``shoal.progress`` the way dask.distributed users call it: bars per task prefix for
futures and persisted collections (their dependencies included), text that blocks
until done, the notebook widget that does not, erred tasks counted; the scheduler's
``progress`` op; and ``shoal demo --progress``."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import threading
import time

import dask.array as da
import pytest

import shoal
from shoal import progress
from shoal.scheduler.model import TaskState
from shoal.scheduler.progress import ProgressRequests, ProgressTracker, key_prefix


def inc(x):
    return x + 1


def double(x):
    return 2 * x


def maybe_fail(x):
    if x == 3:
        raise ValueError("three is not allowed")
    return x


def wait_for_file(path, x):
    # the task holds its worker until the test lets it go (or gives up, in 30 s)
    deadline = time.monotonic() + 30
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.005)
    return x


def _bars(text: str) -> dict[str, tuple[int, int, str]]:
    """The last state of each text bar: prefix -> (done, all, rest of the line)."""
    out = {}
    for line in re.split(r"[\r\n]|\x1b\[A", text):
        m = re.match(r"\s*([\w-]+?)\s*: +\d+%\|.*?\| (\d+)/(\d+) \[(.*)\]", line)
        if m:
            out[m.group(1)] = (int(m.group(2)), int(m.group(3)), m.group(4))
    return out


# ------------------------------------------------------------------ in a terminal


def test_progress_draws_a_bar_per_prefix_and_returns_when_done(client):
    x = client.map(inc, range(10))
    y = client.map(double, x)
    total = client.submit(sum, y)
    out = io.StringIO()
    assert progress(total, file=out) is None
    # it blocked until everything was done: the result is there without waiting
    assert total.done() and total.result(timeout=0) == sum(2 * (i + 1) for i in range(10))
    bars = _bars(out.getvalue())
    # the tasks it depends on have bars too, in the order the work flows
    assert list(bars) == ["inc", "double", "sum"]
    assert bars["inc"][:2] == (10, 10) and bars["double"][:2] == (10, 10) and bars["sum"][:2] == (1, 1)
    assert "erred" not in out.getvalue()


def test_progress_takes_many_futures_and_lists_of_them(client):
    a = client.map(inc, range(5))
    b = client.submit(double, 21)
    out = io.StringIO()
    progress(a, b, file=out)
    assert {p: v[:2] for p, v in _bars(out.getvalue()).items()} == {"inc": (5, 5), "double": (1, 1)}
    assert b.result() == 42


def test_erred_tasks_are_counted_and_progress_still_returns(client):
    x = client.map(maybe_fail, range(6))
    total = client.submit(sum, x)
    out = io.StringIO()
    progress(total, file=out)
    assert total.status == "error"
    bars = _bars(out.getvalue())
    assert bars["maybe_fail"][:2] == (5, 6) and "1 erred" in bars["maybe_fail"][2]
    # its dependent erred with it
    assert bars["sum"][:2] == (0, 1) and "1 erred" in bars["sum"][2]
    with pytest.raises(ValueError, match="three is not allowed"):
        total.result()


def test_one_bar_for_all_tasks_with_multi_false(client):
    x = client.map(inc, range(4))
    total = client.submit(sum, x)
    out = io.StringIO()
    progress(total, multi=False, file=out)
    assert {p: v[:2] for p, v in _bars(out.getvalue()).items()} == {"tasks": (5, 5)}


def test_complete_false_leaves_out_what_was_done_already(client, tmp_path):
    x = client.map(double, range(50, 54))
    shoal.wait(x)
    gate = tmp_path / "go"
    # held until progress has drawn its bar (else it could be done before progress looks)
    total = client.submit(wait_for_file, str(gate), x)
    out = io.StringIO()
    opener = threading.Thread(target=_open_when, args=(gate, lambda: "wait_for_file" in out.getvalue()))
    opener.start()
    try:
        progress(total, complete=False, file=out)
    finally:
        opener.join()
    assert {p: v[:2] for p, v in _bars(out.getvalue()).items()} == {"wait_for_file": (1, 1)}
    out = io.StringIO()
    progress(total, file=out)  # complete=True (the default) counts them
    assert {p: v[:2] for p, v in _bars(out.getvalue()).items()} == {"double": (4, 4), "wait_for_file": (1, 1)}


def _open_when(gate, ready, timeout: float = 30.0) -> None:
    """Create ``gate`` once ``ready()`` holds (or after ``timeout``: the task goes on)."""
    deadline = time.monotonic() + timeout
    while not ready() and time.monotonic() < deadline:
        time.sleep(0.005)
    gate.touch()


def test_a_persisted_dask_array_is_accepted(client):
    x = da.ones((40, 40), chunks=(10, 10))
    y = client.persist((x + 1).T)
    out = io.StringIO()
    progress(y, file=out, interval="50ms")
    bars = _bars(out.getvalue())
    name = key_prefix(y.__dask_keys__()[0][0])
    assert bars[name][:2] == (16, 16)
    assert all(done == n for done, n, _ in bars.values())
    assert float(y.sum().compute()) == 2.0 * 40 * 40


def test_nothing_to_follow_returns_at_once():
    out = io.StringIO()
    assert progress([], file=out) is None
    assert progress() is None
    assert _bars(out.getvalue()) == {}


def test_bad_arguments_are_refused(client):
    x = client.submit(inc, 1)
    with pytest.raises(ValueError, match="group_by"):
        progress(x, group_by="spans")
    with pytest.raises(ValueError, match="interval"):
        progress(x, interval="soon")
    with pytest.raises(ValueError, match="interval"):
        progress(x, interval=0)
    assert x.result() == 2


async def test_progress_on_an_asynchronous_client_is_awaited(cluster):
    async with shoal.Client(cluster.scheduler_address, asynchronous=True) as c:
        x = c.map(inc, range(8))
        total = c.submit(sum, x)
        out = io.StringIO()
        await progress(total, file=out)
        assert total.done()
        assert {p: v[:2] for p, v in _bars(out.getvalue()).items()} == {"inc": (8, 8), "sum": (1, 1)}
        assert await total == sum(range(1, 9))


# ------------------------------------------------------------------ in a notebook


def test_the_notebook_widget_returns_at_once_and_is_kept_up_to_date(client, tmp_path):
    gate = tmp_path / "gate"
    x = client.map(inc, range(6))
    held = client.submit(wait_for_file, str(gate), x)
    widget = progress(held, notebook=True)
    try:
        # it returned while a task it follows cannot have finished
        assert not held.done()
        assert widget.status == "running"
    finally:
        gate.touch()
    assert widget.wait(timeout=30)
    assert widget.status == "finished"
    assert set(widget.bars) == {"inc", "wait_for_file"}
    for prefix, n in (("inc", 6), ("wait_for_file", 1)):
        _, bar, text = widget.bars[prefix]
        assert (bar.value, bar.max, bar.bar_style) == (n, n, "success")
        assert f"{n} / {n}" in text.value
    assert widget.counts["inc"]["done"] == 6
    assert "Finished" in widget.elapsed.value
    # it shows as the cell's output, as ipywidgets shows its widgets
    assert widget.widget.children[1:] and "<ProgressWidget finished" in repr(widget)


def test_the_notebook_widget_turns_red_for_erred_tasks(client):
    x = client.map(maybe_fail, range(10, 0, -1))
    widget = progress(client.submit(sum, x), notebook=True, interval=0.05)
    assert widget.wait(timeout=30)
    assert widget.status == "error"
    _, bar, text = widget.bars["maybe_fail"]
    assert (bar.value, bar.max, bar.bar_style) == (9, 10, "danger")
    assert "1 erred" in text.value
    assert widget.bars["sum"][1].bar_style == "danger"


# ------------------------------------------------------------------ the scheduler's op


def test_the_progress_op_refuses_bad_ids_and_serves_on(client):
    rpc = client._scheduler_rpc()
    with pytest.raises(ValueError, match="progress id"):
        client._sync(rpc.progress, id="")
    with pytest.raises(ValueError, match="progress id"):
        client._sync(rpc.progress, id="x" * 201)
    # an id it keeps nothing for, without keys: the client is told to send them
    assert client._sync(rpc.progress, id="never-seen")["known"] is False
    f = client.submit(inc, 41)
    assert f.result() == 42
    reply = client._sync(rpc.progress, id="mine", keys=[f.key])
    assert reply["known"] and reply["finished"] and reply["counts"] == {
        "inc": {"all": 1, "waiting": 0, "processing": 0, "erred": 0, "done": 1}}
    client._sync(rpc.progress, id="mine", stop=True)
    assert client._sync(rpc.progress, id="mine")["known"] is False


# ------------------------------------------------------------------ the tracker alone


def _task(key, state, *deps):
    ts = TaskState(key, state=state, dependencies=tuple(deps))
    for d in deps:
        d.add_dependent(ts)
    return ts


def test_tracker_counts_forgotten_and_released_tasks_as_done():
    a = _task("load-1", "released")  # ran: its dependent is in memory
    b = _task("load-2", "memory")
    c = _task("total-3", "processing", a, b)
    tasks = {t.key: t for t in (a, b, c)}
    tracker = ProgressTracker()
    tracker.add(tasks, ["total-3"])
    tracker.poll(tasks)
    assert tracker.counts() == {
        "load": {"all": 2, "waiting": 0, "processing": 0, "erred": 0, "done": 2},
        "total": {"all": 1, "waiting": 0, "processing": 1, "erred": 0, "done": 0},
    }
    # the inputs are forgotten once the total is in memory: still done
    c.state = "memory"
    del tasks["load-1"], tasks["load-2"]
    tracker.poll(tasks)
    assert tracker.finished() and tracker.counts()["total"]["done"] == 1


def test_tracker_waits_for_keys_not_known_yet_and_bounds_each_poll():
    tasks: dict = {}
    tracker = ProgressTracker()
    tracker.add(tasks, ["sum-0"])  # the graph has not arrived yet
    assert tracker.missing == ["sum-0"] and not tracker.finished()
    leaves = [_task(f"inc-{i}", "waiting") for i in range(10)]
    total = _task("sum-0", "waiting", *leaves)
    tasks.update({t.key: t for t in (*leaves, total)})
    tracker.poll(tasks)
    assert not tracker.missing and tracker.counts()["inc"]["waiting"] == 10
    for t in leaves:
        t.state = "memory"
    tracker.poll(tasks, budget=4)  # looks at 4 of the 11 unfinished tasks
    assert tracker.counts()["inc"]["done"] == 4
    tracker.poll(tasks, budget=4)
    tracker.poll(tasks, budget=4)
    assert tracker.counts()["inc"]["done"] == 10 and not tracker.finished()
    total.state = "erred"
    tracker.poll(tasks, budget=4)
    assert tracker.finished() and tracker.counts()["sum"]["erred"] == 1


def test_a_large_closure_is_walked_over_several_polls():
    leaves = [_task(f"load-{i}", "waiting") for i in range(100)]
    mids = [_task(("part-1a2b3c", i), "waiting", leaf) for i, leaf in enumerate(leaves)]
    total = _task("total-0", "waiting", *mids)
    tasks = {t.key: t for t in (*leaves, *mids, total)}
    tracker = ProgressTracker()
    tracker.add(tasks, ["total-0"])
    polls = 0
    while "total" not in tracker.counts():
        tracker.poll(tasks, budget=25)
        polls += 1
        if polls == 3:
            # a task the walk has yet to take in is forgotten meanwhile: it ran
            i = next(i for i, leaf in enumerate(leaves) if leaf.key not in tracker.keys)
            leaves[i].state = mids[i].state = "memory"
            del tasks[leaves[i].key]
    assert polls > 5
    counts = tracker.counts()
    assert list(counts) == ["load", "part", "total"]  # in the order the work flows
    assert counts["load"]["all"] == counts["part"]["all"] == 100
    assert counts["load"]["done"] == 1 and counts["part"]["done"] == 1 and not tracker.finished()


def test_trackers_are_bounded_and_expire():
    now = [0.0]
    tasks = {"x-1": _task("x-1", "memory")}
    requests = ProgressRequests(lambda: tasks, lambda: now[0])
    for i in range(100):
        assert requests.handle(id=f"bar-{i}", keys=["x-1"])["known"]
    assert len(requests.trackers) == 64 and "bar-99" in requests.trackers
    now[0] = 61.0
    assert requests.handle(id="bar-99")["known"] is False  # unused for too long
    assert requests.trackers == {}


def test_key_prefixes_are_dask_s():
    assert key_prefix("inc-9f2c0123456789abcdef0123456789ab") == "inc"
    assert key_prefix(("sum-aggregate-1a2b3c4d5e6f", 0)) == "sum-aggregate"
    assert key_prefix("sum-c6f3f47f-193e-4c85-8913-b04005bbaaf0") == "sum"
    assert key_prefix(b"random_block-1234") == "random_block"
    assert key_prefix("9f2c0123456789abcdef0123456789ab") == "data"
    assert key_prefix(5) == key_prefix(()) == key_prefix("") == "Other"


# ------------------------------------------------------------------ the demo


def test_demo_shows_progress_bars_with_progress_flag():
    p = subprocess.run([sys.executable, "-m", "shoal", "demo", "--n", "200", "--block", "100",
                        "--chunks", "4", "--chunk-size", "1000", "--arg-mb", "1", "--progress"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    bars = _bars(p.stdout)
    assert {p: v[:2] for p, v in bars.items()} == {
        "random_block": (8, 8), "matmul": (8, 8), "add_all": (4, 4), "lambda": (1, 1),
        "normal_chunk": (4, 4), "histogram": (4, 4), "add": (3, 3),
    }
    # its own report is as before
    assert p.stdout.count("matches numpy") == 2


def test_demo_shows_no_bars_when_stdout_is_not_a_terminal():
    p = subprocess.run([sys.executable, "-m", "shoal", "demo", "--n", "200", "--block", "100",
                        "--chunks", "2", "--chunk-size", "1000", "--arg-mb", "1"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert _bars(p.stdout) == {} and p.stdout.count("matches numpy") == 2
