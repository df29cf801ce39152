"""What a live scheduler does with malformed ops: requests get an error naming the op
and the field; a stream that carries one is closed (its worker removed); nothing is
dropped silently, and everyone else is served."""

from __future__ import annotations

import socket
from typing import Any

import msgpack
import pytest

import shoal
from shoal.comm.security import Security
from shoal.scheduler.server import Scheduler
from shoal_helpers import (
    complete_handshake,
    frame_bytes,
    log_waiter,
    LoopThread,
    message_bytes,
    raw_socket,
    recv_frames,
    recv_until_closed,
)


@pytest.fixture
def scheduler():
    sec = Security.new()
    with LoopThread(name="typed-wire-scheduler") as thread:
        sched = Scheduler(security=sec)
        thread.run(sched.start("tcp://127.0.0.1:0"))
        try:
            yield thread, sched, sec
        finally:
            thread.run(sched.close())


def _raw(sched: Scheduler, sec: Security) -> socket.socket:
    host, port = sched.address.removeprefix("tcp://").rsplit(":", 1)
    sock = raw_socket(host, int(port), 10)
    try:
        complete_handshake(sock, sec.secret)
    except BaseException:
        sock.close()
        raise
    return sock


def _call(sock: socket.socket, msg: dict[str, Any]) -> dict[str, Any]:
    sock.sendall(message_bytes(msg))
    (frame,) = recv_frames(sock)
    return msgpack.unpackb(frame, strict_map_key=False)


def test_a_malformed_request_is_answered_and_the_connection_serves_on(scheduler):
    thread, sched, sec = scheduler
    with _raw(sched, sec) as sock:
        bad = _call(sock, {"op": "who-has", "reply": True, "keys": "not-a-list"})
        assert bad["status"] == "error" and bad["type"] == "shoal.errors.ProtocolError"
        assert "malformed 'who-has'" in bad["message"] and "keys" in bad["message"]
        bad = _call(sock, {"op": "update-data", "reply": True, "who_has": {"k": "tcp://x"}, "nbytes": {}})
        assert bad["status"] == "error" and "who_has" in bad["message"]
        good = _call(sock, {"op": "who-has", "reply": True, "keys": ["nothing"]})
        assert good == {"status": "OK", "result": {"nothing": []}}  # an unknown key has no holders


def test_a_worker_that_sends_a_malformed_op_is_cut_off_and_removed(scheduler):
    thread, sched, sec = scheduler
    with log_waiter() as logs, _raw(sched, sec) as sock:
        reply = _call(sock, {"op": "register-worker", "address": "tcp://127.0.0.1:9", "nthreads": 1})
        assert reply["status"] == "OK"
        assert thread.run(_workers(sched)) == ["tcp://127.0.0.1:9"]
        sock.sendall(message_bytes([{"op": "heartbeat"}, {"op": "task-finished", "key": "k", "nbytes": "big"}]))
        assert recv_until_closed(sock) == b""  # cut off, not ignored
        record = logs.wait_for(lambda r: "closing its connection" in r.getMessage())
        assert "malformed 'task-finished'" in record.getMessage() and "nbytes" in record.getMessage()
    assert thread.run(_workers(sched)) == []


async def _workers(sched: Scheduler) -> list[str]:
    return list(sched.state.workers)


def test_a_registration_with_a_bad_field_is_refused_with_the_field(scheduler):
    thread, sched, sec = scheduler
    with _raw(sched, sec) as sock:
        reply = _call(sock, {"op": "register-worker", "address": "tcp://127.0.0.1:9", "nthreads": "two"})
        assert reply["status"] == "error" and "nthreads" in reply["message"]
        assert recv_until_closed(sock) == b""
    assert thread.run(_workers(sched)) == []


def test_a_client_stream_with_an_unknown_op_is_closed_but_other_clients_work(scheduler):
    thread, sched, sec = scheduler
    with log_waiter() as logs, _raw(sched, sec) as sock:
        assert _call(sock, {"op": "register-client", "client": "raw"})["status"] == "OK"
        sock.sendall(message_bytes([{"op": "steal-everything"}]))
        assert recv_until_closed(sock) == b""
        record = logs.wait_for(lambda r: "closing its connection" in r.getMessage())
        assert "unknown op 'steal-everything'" in record.getMessage()
    with shoal.Client(sched.address, security=sec, timeout=10) as c:
        assert c.scheduler_info()["workers"] == {}


def test_an_unreadable_graph_errs_its_wanted_keys_and_the_stream_goes_on(scheduler):
    thread, sched, sec = scheduler
    with _raw(sched, sec) as sock:
        assert _call(sock, {"op": "register-client", "client": "raw"})["status"] == "OK"
        sock.sendall(message_bytes([{"op": "update-graph", "tasks": [{"key": ["a", "list"]}], "wanted": ["w"]}]))
        (frame,) = recv_frames(sock)
        (erred,) = msgpack.unpackb(frame, strict_map_key=False)
        assert erred["op"] == "task-erred" and erred["key"] == "w" and erred["kind"] == "GraphError"
        assert "task 0" in erred["text"]
        # still served
        sock.sendall(message_bytes([{"op": "update-graph", "tasks": [], "wanted": ["gone"]}]))
        (frame,) = recv_frames(sock)
        (erred,) = msgpack.unpackb(frame, strict_map_key=False)
        assert erred["kind"] == "KeyError"


def test_a_key_nested_250_deep_is_refused_at_submit_and_the_cluster_serves_on(scheduler):
    thread, sched, sec = scheduler
    deep: Any = "k"
    for _ in range(250):
        deep = (deep,)
    with shoal.Client(sched.address, security=sec, timeout=10) as c:
        with pytest.raises(TypeError, match="16 deep"):
            c.submit(abs, -1, key=deep)
        with pytest.raises(TypeError, match="64 bits"):
            c.submit(abs, -1, key=("x", 1 << 80))
        assert c.scheduler_info()["address"] == sched.address


@pytest.mark.parametrize("handshaken", [False, True], ids=["before-handshake", "after-handshake"])
def test_tuples_nested_250_deep_on_the_wire_are_refused_not_a_crash(scheduler, handshaken):
    """The 1.2 KB message that overflowed the scheduler's C stack (SIGSEGV)."""
    thread, sched, sec = scheduler
    data = msgpack.packb("k")
    for _ in range(250):
        data = msgpack.packb(msgpack.ExtType(1, data))
    msg = msgpack.packb({"op": "who-has", "reply": True, "keys": [msgpack.ExtType(1, data)]})
    assert len(msg) < 1300
    host, port = sched.address.removeprefix("tcp://").rsplit(":", 1)
    with log_waiter() as logs, raw_socket(host, int(port), 10) as sock:
        if handshaken:
            complete_handshake(sock, sec.secret)
        sock.sendall(frame_bytes([msg]))
        recv_until_closed(sock)
        logs.wait_for(lambda r: "32 deep" in r.getMessage() or "extension type 1" in r.getMessage())
    with _raw(sched, sec) as sock:  # and it serves on
        assert _call(sock, {"op": "who-has", "reply": True, "keys": []}) == {"status": "OK", "result": {}}
