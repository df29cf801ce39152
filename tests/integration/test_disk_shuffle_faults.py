"""dask's "disk" shuffle on worker processes of one host while a worker is killed -9:
the result is right or a clear RunOnceError, never a wrong value.

The shuffle appends rows to a partd directory: a split run a second time appends its
rows again, and the store made again is empty. shoal sends the tasks that make the
store or write into it to run at most once, so a kill that would have one of them run
again errs the result instead (a test says what main gave instead: a wrong value); and
a graph made again, with the same keys, is right. Each test kills at a point it waits
for (a task that says it runs and then waits for a gate file), never after a delay;
the partd directories go into the test's own temporary directory."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dask
import dask.bag as db
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest

from shoal import Client, LocalCluster, RunOnceError
from shoal.testing import wait_for

pytestmark = pytest.mark.timeout(180)


class Gate:
    """Files of the test's: the first process to call :meth:`stop` writes its pid
    and waits there until the test opens the gate; later calls go on at once."""

    def __init__(self, directory: Path):
        self.pidfile = directory / "pid"
        self.gate = directory / "gate"

    def stop(self) -> None:
        try:
            fd = os.open(self.pidfile, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        while not self.gate.exists():  # (in the worker: the test kills it here, or opens the gate)
            time.sleep(0.01)

    def stopped(self) -> int:
        """The pid of the process waiting at the gate (once one is)."""
        wait_for(lambda: self.pidfile.exists() and self.pidfile.read_text(), timeout=60,
                 what="a task to reach the gate")
        return int(self.pidfile.read_text())

    def open(self) -> None:
        self.gate.touch()


class StopAt:
    """A bag's grouper (``i % 7``) that stops at the gate when it meets ``at``."""

    def __init__(self, gate: Gate, at: int):
        self.gate, self.at = gate, at

    def __call__(self, i: int) -> int:
        if i == self.at:
            self.gate.stop()
        return i % 7


class PassAt:
    """A bag's map that passes each element on as it is, and stops at the gate on
    ``at``."""

    def __init__(self, gate: Gate, at: Any):
        self.gate, self.at = gate, at

    def __call__(self, x: Any) -> Any:
        if x == self.at or (isinstance(x, tuple) and x[0] == self.at):  # (an element, or a group)
            self.gate.stop()
        return x


def stop_on_row(part: pd.DataFrame, gate: Gate, row: int) -> pd.DataFrame:
    """``part`` as it is; the partition that holds row ``row`` (its ``w``) stops at
    the gate."""
    if row in part["w"].values:
        gate.stop()
    return part


def _cluster(tmp_path: Path, threads: int) -> Iterator[LocalCluster]:
    with dask.config.set(temporary_directory=str(tmp_path)):  # (partd's directories)
        with LocalCluster(n_workers=2, threads_per_worker=threads, processes=True, dashboard_address=None) as c:
            yield c


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    yield from _cluster(tmp_path, 1)


@pytest.fixture
def cluster2(tmp_path: Path) -> Iterator[LocalCluster]:
    """Two threads per worker: one may wait at the gate while the other works on."""
    yield from _cluster(tmp_path, 2)


def _frame(rows: int = 3000) -> pd.DataFrame:
    rng = np.random.default_rng(3)
    return pd.DataFrame({"k": rng.integers(0, 100, rows), "v": rng.random(rows), "w": np.arange(rows)})


def _rows(df: pd.DataFrame) -> pd.DataFrame:
    df = df.reset_index(drop=True)
    return df.sort_values(list(df.columns)).reset_index(drop=True)


def _groups(got: list[tuple[int, list[int]]]) -> dict[int, list[int]]:
    return {g: sorted(v) for g, v in got}


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def test_a_split_killed_half_way_errs_instead_of_appending_its_rows_again(cluster: LocalCluster,
                                                                           tmp_path: Path) -> None:
    """A bag's split appends its partition block by block (``blocksize`` elements): it
    is killed after three blocks went into the store. Run again, it would append them
    a second time (at main: groups with elements twice). The same graph made again
    (the same keys) is right."""
    gate = Gate(tmp_path)
    with Client(cluster) as client:
        bag = db.from_sequence(range(200), npartitions=4).groupby(StopAt(gate, 35), shuffle="disk", blocksize=10)
        future = client.compute(bag)
        try:
            _kill(gate.stopped())
            with pytest.raises(RunOnceError, match=r"'disk' shuffle.*'tasks'") as info:
                future.result(timeout=60)
        finally:
            gate.open()
        assert "would have had to run again" in str(info.value), info.value
        future.release()
        # the cluster goes on: the same graph (the same keys), left to run, is right
        assert _groups(client.compute(bag).result(timeout=60)) == {
            g: [i for i in range(200) if i % 7 == g] for g in range(7)}


def _split_held_by(client: Client, pid: int) -> bool:
    """Whether the worker of process ``pid`` holds a finished split of a disk shuffle."""
    info = client.scheduler_info()["workers"]
    there = {address for address, w in info.items() if w.get("pid") == pid}
    return any(str(key[0]).startswith("shuffle-partition") and there & set(holders)
               for key, holders in client.who_has().items() if isinstance(key, tuple))


def test_finished_splits_lost_with_their_worker_err_instead_of_running_again(cluster2: LocalCluster,
                                                                             tmp_path: Path) -> None:
    """A dataframe's disk shuffle waits for its last split (its input stops at the
    gate); the other worker, which holds finished splits, is killed. Their rows are in
    the store, which may be on it too: run again, the splits would append them a second
    time, into it or into a store made again without the others' (at main: a wrong
    result, 1,500 rows of 3,000 in a run)."""
    gate = Gate(tmp_path)
    pdf = _frame()
    with Client(cluster2) as client:
        df = dd.from_pandas(pdf, npartitions=8, sort=False)
        shuffled = df.map_partitions(stop_on_row, gate, len(pdf) - 1, meta=df._meta).shuffle("k", shuffle_method="disk")
        future = client.compute(shuffled)
        try:
            waiting = gate.stopped()
            pids = {w["pid"] for w in client.scheduler_info()["workers"].values()}
            (other,) = pids - {waiting}
            wait_for(lambda: _split_held_by(client, other), timeout=60, what="a split finished on the other worker")
            _kill(other)
        finally:
            gate.open()
        with pytest.raises(RunOnceError, match=r"'disk' shuffle.*'tasks'") as info:
            future.result(timeout=60)
        assert "would have had to run again" in str(info.value), info.value


#: where the worker process is killed: none, while an input of the shuffle is made (the
#: store and splits may be on it, or not), after the shuffle (its outputs may be on it)
KILLS = ["none", "before", "after"]


@pytest.mark.parametrize("kill", KILLS)
def test_a_bag_groupby_on_disk_is_right_or_a_clear_error(cluster: LocalCluster, tmp_path: Path, kill: str) -> None:
    gate = Gate(tmp_path)
    with Client(cluster) as client:
        bag = db.from_sequence(range(300), npartitions=6)
        if kill == "before":
            bag = bag.map(PassAt(gate, 170))
        grouped = bag.groupby(lambda i: i % 7, shuffle="disk")
        if kill == "after":
            grouped = grouped.map(PassAt(gate, 3))
        want = {g: [i for i in range(300) if i % 7 == g] for g in range(7)}
        _right_or_run_once(client, client.compute(grouped), gate, kill,
                           lambda got: _groups(got) == want)


@pytest.mark.parametrize("kill", KILLS)
def test_a_dataframe_shuffle_on_disk_is_right_or_a_clear_error(cluster: LocalCluster, tmp_path: Path,
                                                               kill: str) -> None:
    gate = Gate(tmp_path)
    pdf = _frame()
    with Client(cluster) as client:
        df = dd.from_pandas(pdf, npartitions=6, sort=False)
        if kill == "before":
            df = df.map_partitions(stop_on_row, gate, 1700, meta=df._meta)
        shuffled = df.shuffle("k", shuffle_method="disk")
        if kill == "after":
            shuffled = shuffled.map_partitions(stop_on_row, gate, 1700, meta=df._meta)
        _right_or_run_once(client, client.compute(shuffled), gate, kill,
                           lambda got: _rows(got).equals(_rows(pdf)))


def _right_or_run_once(client: Client, future: Any, gate: Gate, kill: str, right: Any) -> None:
    """Kill the worker that waits at ``gate`` (unless ``kill`` is ``"none"``); then
    ``future``'s result must be right, or a RunOnceError that says why."""
    try:
        if kill != "none":
            _kill(gate.stopped())
    finally:
        gate.open()
    try:
        got = future.result(timeout=90)
    except RunOnceError as exc:
        assert kill != "none", exc
        assert "'disk' shuffle" in str(exc) and "'tasks'" in str(exc), exc
    else:
        assert right(got), "a wrong result"
