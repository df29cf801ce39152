"""The attack of issue 35, with real processes: a local user without the secret takes
the port of a scheduler that crashed, relays the worker's reconnection to the worker's
own nanny (which answers the handshake with the secret it has), and then speaks as the
scheduler: a registration answer and a ``compute-task`` whose payload writes a file.

Before sessions and roles the worker completed that handshake and ran the task. Now
it sees that the peer proves to be a nanny, not the scheduler it dialed, and refuses;
and whatever the stranger says after a relayed handshake fails its session tag.
"""

from __future__ import annotations

import os
import struct
import threading
from typing import Any

import pytest

import shoal
from relay import relay
from shoal.protocol import REMOTE, prepare, to_serialize
from shoal.taskspec import RunSpec
from shoal_helpers import start_scheduler, start_worker


def _touch(path: str) -> None:
    with open(path, "w") as f:
        f.write("the stranger's code ran")


def _message(msg: Any) -> bytes:
    """``msg`` in the tcp framing, as a shoal end without a session sends it."""
    frames = [bytes(memoryview(f)) for f in prepare(msg).frames(REMOTE)]
    return struct.pack(f"<Q{len(frames)}Q", len(frames), *map(len, frames)) + b"".join(frames)


@pytest.mark.timeout(120)
def test_a_stranger_on_a_dead_scheduler_s_port_cannot_make_its_worker_run_code(processes, tmp_path):
    procs = processes
    sched, address = start_scheduler(procs)
    worker, worker_address = start_worker(procs, address, "--death-timeout", "60")
    with shoal.Client(address, timeout=30) as client:
        nanny = client.scheduler_info()["workers"][worker_address]["nanny"]
    assert nanny.startswith("tcp://")
    port = int(address.rsplit(":", 1)[1])
    marker = str(tmp_path / "ran")
    evil = [{"op": "compute-task", "key": "evil", "payload": to_serialize(RunSpec(_touch, (marker,))),
             "who_has": {}, "nbytes": {}, "priority": [0, 0, 0]}]
    sched.kill()
    sched.wait()

    said = threading.Event()
    holder: list[Any] = []

    def edit(direction: str, index: int, data: bytes) -> bytes:
        if direction == "up" and index >= 2:
            if b"handshake-refused" in data:
                said.set()
            elif index == 3:  # the worker's register-worker: answer it, and give it work
                holder[0].inject("down", _message({"status": "OK", "address": worker_address}) + _message(evil))
        return data

    with relay(nanny, edit=edit, port=port) as stranger:
        holder.append(stranger)
        assert said.wait(60), f"the worker did not refuse the relayed nanny; it said {stranger.seen['up']!r:.300}"
        refusal = next(m for m in stranger.seen["up"] if b"handshake-refused" in m)
        assert b"meant to reach a scheduler and the peer is a 'nanny'" in refusal
    # the worker never took the stranger for its scheduler: nothing ran
    worker.terminate()
    _, err = worker.communicate(timeout=30)
    assert not os.path.exists(marker), "the stranger's compute-task ran"
    assert "nanny" in err and "scheduler" in err, err[-2000:]


def test_the_relay_passes_a_real_session_through():
    # (the relay itself passes a real handshake through: without it the test above
    # would prove nothing) a client through it reaches a scheduler of its own
    with shoal.LocalCluster(n_workers=1, dashboard_address=None) as cluster:
        with relay(cluster.scheduler_address) as r:
            with shoal.Client(r.address, security=cluster.security, timeout=30) as client:
                assert client.submit(sum, [1, 2, 3]).result(timeout=30) == 6
            assert r.seen["up"] and r.seen["down"]
