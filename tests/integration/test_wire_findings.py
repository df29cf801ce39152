"""What fuzzing the wire found (test_fuzz_wire.py, fuzz/), each reduced to the few
messages that show it, against real processes.
"""

from __future__ import annotations

import operator
import os
import pickle
import socket
import struct
import time
import uuid
from typing import Any

import msgpack
import pytest

import shoal
from shoal.comm import security
from shoal.protocol import loads
from shoal_helpers import complete_handshake, frame_bytes, message_bytes, recv_frames
from wire_peers import (
    DEADLINE,
    Cluster,
    Ext,
    Oob,
    encode,
    raw,
    read_messages_until,
    read_response,
    register,
    send,
    start_cluster,
)

pytestmark = pytest.mark.filterwarnings("ignore:a task of .* MB of arguments:UserWarning")


@pytest.fixture
def own_cluster(tmp_path: Any) -> Any:
    """A scheduler and a worker for one test: a finding may end the worker."""
    with start_cluster(str(tmp_path)) as c:
        yield c



def _answer_or_worker_gone(sock: socket.socket, c: Cluster, key: Any) -> Any:
    """The scheduler's first message about ``key`` on the client stream ``sock``, or
    None once the worker process has exited; fails after DEADLINE."""
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        if c.worker.poll() is not None:
            return None
        sock.settimeout(0.2)  # and look at the worker again
        try:
            frames = recv_frames(sock)
        except socket.timeout:
            continue
        msg = loads(frames, deserialize=False)
        for m in msg if isinstance(msg, list) else [msg]:
            if isinstance(m, dict) and m.get("key") == key:
                return m
    raise AssertionError(f"no answer about {key!r} within {DEADLINE}s; {c.log_tail()}")


def assert_worker_still_serving(c: Cluster, answer: Any) -> None:
    """The worker took no harm: the answer is not about losing it, it is registered
    still, and its process runs."""
    assert answer is not None, f"the worker exited; {c.log_tail()}"
    assert answer.get("kind") not in ("LostData", "KilledWorker"), (answer, c.log_tail())
    with raw(c.address, c.secret) as req:
        req.sendall(message_bytes({"op": "identity", "reply": True}))
        response = read_response(req)
    assert c.worker_address in response["result"]["workers"], (response, c.log_tail())
    assert c.worker.poll() is None, c.log_tail()


def _runspec(func: Any, *args: Any, header: Any = None) -> Oob:
    return Oob("shoal.runspec", {} if header is None else header, [pickle.dumps(func), pickle.dumps((args, {}))])


def test_a_key_the_scheduler_cannot_forward_does_not_cut_its_worker_off(own_cluster):
    """Found at c31489c: a msgpack timestamp (ext -1) was taken as a task key, and the
    scheduler re-sent it as a transparent pickle where it was a map key (compute-task's
    who_has); the worker's stream refused that message and the worker shut down."""
    c = own_cluster
    stamp = Ext(-1, struct.pack(">I", 5))
    with raw(c.address, c.secret) as req:  # the worker "holds" the key (a scatter, as told)
        req.sendall(frame_bytes(encode({"op": "update-data", "who_has": {stamp: [c.worker_address]},
                                        "nbytes": {stamp: 8}, "client": "f1"})))
        assert read_response(req) is not None
    with raw(c.address, c.secret) as sock:
        assert register(sock, {"op": "register-client", "client": "f1"})
        sock.sendall(frame_bytes(encode([{"op": "update-graph", "wanted": ["t"], "tasks": [
            {"key": "t", "payload": _runspec(len, "abc"), "deps": [stamp], "workers": None, "retries": 0}]}])))
        # the task runs, or the graph is refused: either way it is answered
        assert_worker_still_serving(c, _answer_or_worker_gone(sock, c, "t"))


@pytest.mark.parametrize("refs", [[None], [["shoal-1-0-ab", 8192, 4096, 8, 0, "t"]]],
                         ids=["more-refs-than-frames", "no-such-segment"])
def test_a_malformed_payload_does_not_cut_off_a_worker_that_gets_it_as_frames(tmp_path, refs):
    with start_cluster(str(tmp_path), worker_env={"SHOAL_SHM": "0"}) as c:
        with raw(c.address, c.secret) as sock:
            assert register(sock, {"op": "register-client", "client": "f2"})
            sock.sendall(frame_bytes(encode([{"op": "update-graph", "wanted": ["t"], "tasks": [
                {"key": "t", "payload": _runspec(len, "abc", header={"refs": refs}), "deps": [],
                 "workers": None, "retries": 0}]}])))
            answer = _answer_or_worker_gone(sock, c, "t")
            assert_worker_still_serving(c, answer)
            assert answer.get("op") == "task-erred", answer  # the task's payload is broken


def test_a_registration_with_an_unhashable_id_is_refused(own_cluster):
    """Found at c31489c: register-client with a list for its id was answered OK, then
    its handler failed (TypeError: unhashable type) and the connection was aborted."""
    c = own_cluster
    with raw(c.address, c.secret) as sock:
        sock.sendall(message_bytes({"op": "register-client", "client": [1, 2]}))
        response = read_response(sock)
        assert response is None or response.get("status") != "OK", response
    with shoal.Client(c.address) as fresh:
        assert fresh.submit(operator.mul, 6, 7).result(timeout=30) == 42


def test_a_worker_s_tiny_duration_does_not_stop_the_scheduler_placing_tasks(own_cluster):
    c = own_cluster
    liar = f"tcp://127.0.0.1:1/liar-{uuid.uuid4().hex}"
    with raw(c.address, c.secret) as sock:
        assert register(sock, {"op": "register-worker", "address": liar, "nthreads": 1})
        with raw(c.address, c.secret) as req:  # a key in memory, held by the liar
            req.sendall(message_bytes({"op": "update-data", "who_has": {"k": [liar]}, "nbytes": {"k": 8},
                                       "client": "f4"}))
            assert read_response(req) is not None
        sock.sendall(message_bytes([{"op": "task-finished", "key": "k", "nbytes": 8, "duration": 5e-324},
                                    {"op": "task-finished", "key": "sync"}]))
        assert read_messages_until(sock, lambda m: isinstance(m, dict) and m.get("op") == "free-keys"
                                   and "sync" in (m.get("keys") or ()))
        with shoal.Client(c.address, timeout=10) as client:
            assert client.submit(operator.add, 1, 2, workers=[c.worker_address]).result(timeout=30) == 3
        send(sock, message_bytes([{"op": "unregister"}]))


def test_a_peer_cannot_take_a_worker_s_segment_over_by_claiming_its_pid(own_cluster):
    """The pid in handshake-auth is only claimed. A peer that claims a worker's pid and
    hands the scheduler a flag-1 ref to that worker's result segment (name and token:
    what a client is told) must not make the scheduler take it: only a segment whose
    header says it is a transfer can be handed over, and once adopted it is not one."""
    import numpy as np

    from shoal.comm import shm

    c = own_cluster
    with shoal.Client(c.address) as client:
        value = client.submit(np.ones, 1 << 17, workers=[c.worker_address], pure=False)
        shoal.wait([value], timeout=30)
        [name] = shm.segments_of(c.worker.pid)  # the result's segment (a client is told name and token)
        with open(os.path.join(shm.SHM_DIR, name), "rb") as f:
            token = f.read(64)[len(b"SHOALSEG"):].rstrip(b"\0").decode()
        size = os.path.getsize(os.path.join(shm.SHM_DIR, name))
        with raw(c.address) as sock:
            complete_handshake(sock, c.secret, pid=c.worker.pid, host="far-away")  # "I am the worker"
            entry = Oob("shoal.same-host", {"refs": [[name, size, 4096, 8, 1, token]]}, [pickle.dumps(None)], True, [1])
            sock.sendall(frame_bytes(encode({"op": "who-has", "reply": True, "keys": [], "x": entry})))
            assert read_response(sock) is not None
        assert shm.segments_of(c.worker.pid) == [name], "the worker's segment was taken from it"
        assert float(value.result(timeout=30).sum()) == 1 << 17
