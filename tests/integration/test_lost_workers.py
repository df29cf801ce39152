"""Workers that die: their running tasks are rescheduled, values only they held are
computed again, and a task that keeps killing workers errs with KilledWorker."""

from __future__ import annotations

import os
import signal
import time

import pytest

import shoal
from shoal.comm import shm
from shoal.testing import wait_for


def pid_then_wait(pidfile, gate, value):
    if not pidfile.exists():
        pidfile.write_text(str(os.getpid()))
    while not gate.exists():  # the task runs until the test opens the gate
        time.sleep(0.01)
    return value


def kill_self():
    os.kill(os.getpid(), signal.SIGKILL)


def inc(x):
    return x + 1


@pytest.fixture
def cluster():
    with shoal.LocalCluster(n_workers=2, processes=True) as c:
        yield c


def test_task_running_on_a_killed_worker_is_rescheduled(cluster, tmp_path):
    pidfile, gate = tmp_path / "pid", tmp_path / "gate"
    with shoal.Client(cluster) as c:
        f = c.submit(pid_then_wait, pidfile, gate, 42, pure=False)
        wait_for(pidfile.exists, what="the task to start")
        victim = int(pidfile.read_text())
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: cluster.restarts >= 1, timeout=20, what="the worker to be replaced")
        gate.touch()
        assert f.result(timeout=30) == 42
        assert victim not in c.run(os.getpid).values()
    assert not shm.segments_of(victim)


def test_values_only_a_dead_worker_held_are_computed_again(cluster):
    import numpy as np

    with shoal.Client(cluster) as c:
        x = c.submit(lambda: np.arange(1 << 18), pure=False)
        x.result(timeout=30)
        holder = c.who_has([x])[x.key][0]
        pids = c.run(os.getpid)
        os.kill(pids[holder], signal.SIGKILL)
        wait_for(lambda: holder not in c.scheduler_info()["workers"], timeout=20, what="the worker to be removed")
        y = c.submit(lambda a: int(a.sum()), x)
        assert y.result(timeout=30) == sum(range(1 << 18))
        assert c.who_has([x])[x.key] and holder not in c.who_has([x])[x.key]


def test_a_task_that_kills_workers_errs_with_killed_worker(cluster):
    with shoal.Client(cluster) as c:
        f = c.submit(kill_self, pure=False)
        with pytest.raises(shoal.KilledWorker, match="kill_self"):
            f.result(timeout=60)
        wait_for(lambda: cluster.restarts >= 3, timeout=20, what="three workers to have died and been replaced")
        # the cluster goes on
        wait_for(lambda: len(c.scheduler_info()["workers"]) == 2, timeout=30, what="replacements")
        assert c.submit(inc, 1, pure=False).result(timeout=30) == 2


def test_client_that_disconnects_releases_its_tasks(cluster):
    with shoal.Client(cluster) as other:
        with shoal.Client(cluster) as c:
            kept = c.submit(inc, 10, pure=False)
            kept.result(timeout=30)
            key = kept.key
            shared = c.submit(inc, 20)
            same = other.submit(inc, 20)  # the same key, wanted by both clients
            assert same.key == shared.key
            shared.result(timeout=30)
        # the first client is gone: its keys go, unless another client holds them
        wait_for(lambda: key not in other.who_has(), what="the departed client's key to go")
        assert same.result(timeout=30) == 21


def test_worker_killed_while_a_peer_fetches_from_it(monkeypatch):
    """The owner is frozen (SIGSTOP) while a peer fetches its value over tcp, then
    killed: the fetch fails, the value is computed again, the dependent completes."""
    import numpy as np

    monkeypatch.setenv("SHOAL_SHM", "0")  # bytes over tcp: the fetch needs the owner
    with shoal.LocalCluster(n_workers=2, processes=True) as cluster, shoal.Client(cluster) as c:
        a_addr, b_addr = cluster.worker_addresses
        pids = c.run(os.getpid)
        x = c.submit(lambda: np.ones(16 << 20, dtype=np.uint8), pure=False)
        x.result(timeout=30)
        owner = c.who_has([x])[x.key][0]
        other = b_addr if owner == a_addr else a_addr
        os.kill(pids[owner], signal.SIGSTOP)
        try:
            y = c.submit(lambda v: int(v.sum()), x, workers=[other])
            state = cluster.scheduler.state
            wait_for(lambda: y.key in state.tasks and state.tasks[y.key].state == "processing",
                     what="the dependent to be sent to the other worker")
        finally:
            os.kill(pids[owner], signal.SIGKILL)
        assert y.result(timeout=60) == 16 << 20
    for pid in pids.values():
        assert not shm.segments_of(pid)


def cut_the_next_large_write(min_bytes):
    """Installed on a worker: its next outgoing message of at least ``min_bytes`` stops
    half-way through a frame and the connection is dropped (once)."""
    from collections import deque

    from shoal.comm import tcp
    from shoal.errors import CommBrokenError

    original = tcp.TCPComm._send
    tcp._cuts = 0

    async def _send(self, views, started=False):
        views = deque(memoryview(v).cast("B") for v in views)
        total = sum(v.nbytes for v in views)
        if total < min_bytes or tcp._cuts:
            return await original(self, views, started)
        tcp._cuts += 1
        half, head = total // 2, deque()
        for v in views:
            head.append(v[:half])
            half -= head[-1].nbytes
            if half <= 0:
                break
        await original(self, head, started)
        self.abort()
        raise CommBrokenError("dropped mid-frame by the test")

    tcp.TCPComm._send = _send


def cuts_made():
    from shoal.comm import tcp

    return getattr(tcp, "_cuts", 0)


def test_tcp_connection_dropped_mid_frame_during_a_transfer(monkeypatch):
    import numpy as np

    monkeypatch.setenv("SHOAL_SHM", "0")  # the value crosses over tcp
    with shoal.LocalCluster(n_workers=2, processes=True) as cluster, shoal.Client(cluster) as c:
        a_addr, b_addr = cluster.worker_addresses
        pids = c.run(os.getpid)
        x = c.submit(lambda: np.arange(4 << 20, dtype=np.float64), workers=[a_addr], pure=False)
        shoal.wait([x], timeout=30)
        c.run(cut_the_next_large_write, 8 << 20, workers=[a_addr])
        y = c.submit(lambda v: float(v.sum()), x, workers=[b_addr])
        assert y.result(timeout=60) == float(sum(range(4 << 20)))
        assert c.run(cuts_made, workers=[a_addr])[a_addr] == 1  # the fault did happen
        # both workers are the same processes, and go on working
        assert c.run(os.getpid) == pids
        z = c.submit(lambda v: float(v[-1]), x, workers=[b_addr], pure=False)
        assert z.result(timeout=30) == float((4 << 20) - 1)
    for pid in pids.values():
        assert not shm.segments_of(pid) and shm.process_gone(pid)
