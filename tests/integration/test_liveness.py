"""Liveness: workers and clients send heartbeats, and the scheduler removes a worker
it heard nothing from for ``worker-ttl`` seconds, as if its connection had died."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from shoal_helpers import log_waiter

import shoal
from shoal import config
from shoal.comm import connect, shm
from shoal.errors import CommError
from shoal.scheduler.server import Scheduler
from shoal.testing import wait_for

FAKE = "tcp://127.0.0.1:1"  # a worker address nobody connects to: the scheduler never does


@pytest.mark.timeout(10)
@pytest.mark.async_timeout(5)
async def test_any_message_keeps_a_worker_and_silence_removes_it(caplog: pytest.LogCaptureFixture) -> None:
    with config.set(worker_ttl=0.3):
        sched = await Scheduler().start("tcp://127.0.0.1:0")
    worker = client = None
    try:
        worker = await connect(sched.address, deserialize=False)
        await worker.write({"op": "register-worker", "address": FAKE, "nthreads": 1})
        assert (await worker.read())["status"] == "OK"
        client = await connect(sched.address, deserialize=False)
        await client.write({"op": "register-client", "client": "silent-client"})
        assert (await client.read())["status"] == "OK"
        loop = asyncio.get_running_loop()
        end = loop.time() + 1.0
        while loop.time() < end:  # three ttls of messages that are not heartbeats
            await worker.write([{"op": "reschedule", "key": "no-such-task"}])
            await asyncio.sleep(0.05)  # paces the messages; waits for no condition
        assert FAKE in sched.state.workers
        silent_from = loop.time()
        with pytest.raises(CommError):  # the scheduler ends the stream of a silent worker
            while True:
                await worker.read()
        assert loop.time() - silent_from >= 0.3
        assert FAKE not in sched.state.workers and FAKE not in sched.worker_streams
        warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert any(FAKE in m and "silent for" in m for m in warnings), warnings
        # the client sent nothing at all, and stays
        assert "silent-client" in sched.client_streams and "silent-client" in sched.state.clients
    finally:
        for comm in (worker, client):
            if comm is not None:
                comm.abort()
        await sched.close()


def pid_then_wait(pidfile: Path, gate: Path, value: Any) -> Any:
    if not pidfile.exists():
        pidfile.write_text(str(os.getpid()))
    while not gate.exists():  # the task runs until the test opens the gate
        time.sleep(0.01)
    return value


@pytest.mark.timeout(20)
def test_a_stopped_worker_is_removed_and_its_task_completes_elsewhere(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHOAL_HEARTBEAT_INTERVAL", "0.1")  # for the worker processes
    pidfile, gate = tmp_path / "pid", tmp_path / "gate"
    with config.set(worker_ttl=1.0, heartbeat_interval=0.1), log_waiter("shoal.scheduler") as logs, \
            shoal.LocalCluster(n_workers=2, processes=True) as cluster, shoal.Client(cluster) as c:
        pids = c.run(os.getpid)
        f = c.submit(pid_then_wait, pidfile, gate, 42, pure=False)
        wait_for(lambda: pidfile.exists() and pidfile.read_text(), what="the task to start")
        victim = int(pidfile.read_text())
        (victim_addr,) = [a for a, p in pids.items() if p == victim]
        (other_addr,) = [a for a in pids if a != victim_addr]
        (proc,) = [p for p in cluster.procs if p.pid == victim]
        os.kill(victim, signal.SIGSTOP)
        try:
            logs.wait_for(lambda r: victim_addr in r.getMessage() and "silent for" in r.getMessage(),
                          timeout=10)
            assert victim_addr not in cluster.worker_addresses
            gate.touch()  # the task's second run, on the other worker, may finish
            assert f.result(timeout=10) == 42
            assert c.who_has([f])[f.key] == [other_addr]
            # a task whose worker went silent counts as one its worker died running
            assert cluster.scheduler is not None
            assert cluster.scheduler.state.tasks[f.key].suspicious == 1
            # woken up, the worker finds its connection gone and exits by itself
            os.kill(victim, signal.SIGCONT)
            proc.wait(timeout=10)
        finally:
            if proc.poll() is None:
                os.kill(victim, signal.SIGCONT)
                proc.kill()
                proc.wait(timeout=10)
        # the cluster goes on, and replaces the worker that exited (waited for here
        # also because a worker still starting when the cluster closes is killed late)
        wait_for(lambda: cluster.restarts == 1 and len(cluster.worker_addresses) == 2, timeout=15,
                 what="a replacement worker")
        assert c.submit(pid_then_wait, tmp_path / "pid2", gate, 7, pure=False).result(timeout=10) == 7
    for pid in pids.values():
        assert shm.process_gone(pid) and not shm.segments_of(pid)


@pytest.mark.timeout(10)
@pytest.mark.async_timeout(5)
async def test_both_ends_of_a_tcp_connection_break_when_the_peer_goes_silent() -> None:
    """tcp-timeout: keepalive probes on an idle connection and a bound on unacknowledged
    data, so that a peer behind a partition fails a fetch instead of holding it for the
    kernel's quarter of an hour of retransmissions."""
    import socket

    from shoal.comm import listen

    accepted: asyncio.Queue[Any] = asyncio.Queue()

    async def handler(comm: Any) -> None:
        await accepted.put(comm)
        await comm.read()

    with config.set(tcp_timeout=6.0):
        listener = await listen("tcp://127.0.0.1:0", handler)
        try:
            conn = await connect(listener.contact_address)
            try:
                served = await accepted.get()
                for comm in (conn, served):
                    sock = comm._wsock
                    assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
                    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 6000
                    # idle half the timeout, then three probes in the other half
                    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 3
                    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 1
                    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 3
            finally:
                await conn.close()
        finally:
            listener.stop()
