"""Fuzzing the wire of live processes (issue 10: a wire that no peer can crash or misuse).

A ``shoal scheduler`` and a ``shoal worker`` run as processes, a :class:`shoal.Client`
runs a graph on them, and meanwhile raw sockets send what hypothesis makes up: bytes
before the handshake, and, after a handshake done by hand with the cluster's secret,
messages of every shape to each entry point (the scheduler's request server, its
``register-worker`` and ``register-client`` streams, the worker's request server):
ill-typed and nested field values, huge ints, msgpack ext types 1, 2, -1 and others,
out-of-band tables of shoal's families and unknown ones, opaque and not, malformed
tables. Each connection must end cleanly: its last request answered, its stream's
marker answered, or the connection closed by the peer, within a deadline; never a
hang. Afterwards the graph's result is right, both processes are alive, and a fresh
client works.

Then: the scheduler never runs a pickle. A canary pickle (unpickling it creates a file
named after the unpickling process's pid) goes, in every position, to every op the
scheduler serves; no file named after the scheduler's pid may appear. Opaque canaries
may be forwarded to the worker or a client, which may decode them: their right.

What the fuzzing found is in test_wire_findings.py, each reduced to a few messages.
"""

from __future__ import annotations

import itertools
import operator
import os
import pickle
import socket
import struct
import subprocess
import sys
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import cloudpickle
import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shoal
from shoal.comm import security
from shoal_helpers import frame_bytes, handshake_bytes, message_bytes, recv_frames, start_session
from shoal.protocol import PROTOCOL_VERSION

pytestmark = pytest.mark.filterwarnings("ignore:a task of .* MB of arguments:UserWarning")

from wire_peers import (
    Cluster,
    Dangling,
    Ext,
    Map,
    Oob,
    big_int,
    encode,
    raw,
    read_messages_until,
    read_response,
    read_until_closed,
    register,
    send,
    start_cluster,
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One cluster for the fuzzing (what it does to the processes adds up)."""
    with start_cluster(str(tmp_path_factory.mktemp("fuzz-wire-logs"))) as c:
        yield c


@pytest.fixture
def own_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A cluster for one test (one that may end its worker)."""
    with start_cluster(str(tmp_path_factory.mktemp("wire-logs"))) as c:
        yield c



# ---------------------------------------------------------------- strategies

_BENIGN = [1, "s", (1, 2), {1, 2}, frozenset({3}), bytearray(b"ab"), ValueError("boom"), None, 2 ** 100, [1.5]]
_FUNCTIONS = [abs, len, str, repr, sorted, 5]
FAMILIES = ["pickle", "bytes", "int", "shoal.same-host", "shoal.runspec", "no-such-family", ""]

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1), st.integers(-5, 5),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12), st.binary(max_size=12),
)
keys = st.one_of(
    st.text(max_size=8), st.integers(-3, 3), st.binary(max_size=4),
    st.tuples(st.text(max_size=3), st.integers(0, 3)), st.tuples(st.tuples(st.text(max_size=2)), st.none()),
)
pickles = st.sampled_from(_BENIGN).map(lambda v: pickle.dumps(v, protocol=5)) | st.binary(max_size=24)


@st.composite
def family_entry(draw: Any) -> Oob:
    family = draw(st.sampled_from(FAMILIES) | st.text(max_size=10))
    if family == "pickle":
        header, frames = {}, [draw(pickles)]
    elif family == "bytes":
        kind = draw(st.sampled_from(["bytes", "bytearray", "memoryview", "pickle", "other"]) | scalars)
        header = {"kind": kind}
        if kind == "memoryview":
            header |= {"format": draw(st.sampled_from(["B", "i", "d", "Q", "xx", ""])),
                       "shape": draw(st.lists(st.integers(-1, 9), max_size=3))}
        frames = [draw(pickles) if kind == "pickle" else draw(st.binary(max_size=40))]
    elif family == "int":
        digits = draw(st.integers().map(str) | st.sampled_from(["1" * 5000, "x", "", " 7"]) | scalars)
        header, frames = {"int": digits}, []
    elif family in ("shoal.same-host", "shoal.runspec"):
        ref = st.none() | st.tuples(
            st.sampled_from(["shoal-1-0-ab", "shoal-../x", "x", ""]), st.integers(-1, 9000),
            st.integers(-1, 9000), st.integers(-1, 9000), st.integers(-1, 2), st.text(max_size=4),
        ).map(list)
        header = draw(st.just({}) | st.builds(lambda r: {"refs": r}, st.lists(ref, max_size=2) | scalars))
        if family == "shoal.runspec":
            func = pickle.dumps(draw(st.sampled_from(_FUNCTIONS)))
            args = pickle.dumps((tuple(draw(st.lists(st.integers(-9, 9) | st.text(max_size=3), max_size=2))), {}))
            frames = [func, args]
        else:
            frames = [draw(pickles)]
    else:
        header, frames = draw(st.just({}) | scalars), draw(st.lists(st.binary(max_size=8), max_size=2))
    if draw(st.integers(0, 9)) == 0:  # frames the entry does not own, or too few
        frames = frames[:-1] if frames and draw(st.booleans()) else [*frames, b"extra"]
    opaque = draw(st.sampled_from([True, True, True, False, 0, 1, None, "", [], "yes"]))
    leases = draw(st.none() | st.lists(st.integers(0, 1 << 40), max_size=2) | st.just(["x"]))
    return Oob(family, header, frames, opaque, leases)


#: what breaks the wire (ext types other than 1 and 2, dangling references) or may not
#: reach the scheduler (transparent entries other than plain bytes and ints): rarer than
#: plain values, so that most streams survive long enough to reach the state machines
specials = st.one_of(
    st.integers(1 << 64, 1 << 300).map(big_int),
    st.integers(-(1 << 300), -(1 << 63) - 1).map(big_int),
    st.builds(Ext, st.sampled_from([-1, -2, -128, 0, 3, 42, 127]), st.binary(max_size=12)),
    st.builds(lambda s: Ext(-1, struct.pack(">I", s)), st.integers(0, (1 << 32) - 1)),  # a valid timestamp
    st.builds(Dangling, st.integers(0, 1 << 33), st.sampled_from([1, 2, 4, 8, 9])),
    family_entry(),
)
leaves = st.one_of(scalars, keys, scalars, keys, scalars, specials)


def _nest(children: Any) -> Any:
    return st.one_of(
        st.lists(children, max_size=3),
        st.tuples(children, children),
        st.dictionaries(st.text(max_size=6), children, max_size=3),
        st.builds(Map, st.lists(st.tuples(leaves | st.lists(scalars, max_size=1), children), max_size=2)),
    )


values = st.recursive(leaves, _nest, max_leaves=8)


def a_key_or_value() -> Any:
    return keys | values


@st.composite
def op_message(draw: Any, ops: dict[str, dict[str, Any]]) -> Any:
    """A map with a known op (its fields drawn from their strategies, sometimes
    missing, sometimes anything), or an unknown op, or not a map at all."""
    choice = draw(st.integers(0, 19))
    if choice == 0:
        return draw(values)  # not a map (or a map without op)
    op = draw(st.sampled_from(sorted(ops))) if choice > 2 else draw(st.text(max_size=10) | scalars)
    msg: dict[str, Any] = {"op": op}
    for name, strategy in ops.get(op, {}).items():
        # mostly well typed, so that most messages get past the decoder to the handlers
        if draw(st.integers(0, 7)):
            msg[name] = draw(strategy if draw(st.integers(0, 7)) else values)
    msg.update(draw(st.dictionaries(st.sampled_from(["x", "reply", "op2", "key"]), values, max_size=2)))
    return msg


@st.composite
def framed(draw: Any, messages: Any) -> bytes:
    """Messages framed on the wire, some of them malformed (a bad header frame, a bad
    table, frames the table does not name)."""
    out = []
    for msg in draw(st.lists(messages, min_size=1, max_size=3)):
        frames = encode(msg)
        damage = draw(st.integers(0, 15))
        if damage == 1:
            frames[0] = draw(st.binary(max_size=16))
        elif damage == 2 and len(frames) > 1:
            frames[1] = draw(st.binary(max_size=16) | st.just(msgpack.packb([["pickle", {}, 99, True]])))
        elif damage == 3:
            frames = [*frames, b"unnamed"]
        elif damage == 4 and len(frames) > 2:
            frames = frames[:-1]
        out.append(frame_bytes(frames))
    return b"".join(out)


# the entry points' ops and the strategies of their fields
addresses = st.sampled_from(["tcp://127.0.0.1:1", "tcp://[::1]:2", "", "x"]) | st.text(max_size=10)
key_lists = st.lists(keys, max_size=3)
SCHEDULER_OPS = {
    "identity": {},
    "scheduler-info": {},
    "who-has": {"keys": st.none() | key_lists},
    "update-data": {"who_has": st.dictionaries(keys, st.lists(addresses, max_size=2), max_size=2),
                    "nbytes": st.dictionaries(keys, st.integers(-1, 1 << 70), max_size=2),
                    "client": st.text(max_size=8), "shm": values},
    "ncores": {},
    "counters": {},
}
WORKER_STREAM_OPS = {
    "task-finished": {"key": keys, "nbytes": st.integers(-1, 1 << 70) | st.floats() | st.text(max_size=3),
                      "duration": st.floats() | st.integers(), "shm": values, "value": family_entry()},
    "task-erred": {"key": keys, "exception": family_entry() | st.none(), "traceback": st.text(max_size=20),
                   "text": st.text(max_size=20)},
    "missing-data": {"key": keys, "errant_worker": addresses},
    "add-replica": {"key": keys, "shm": values, "nbytes": st.integers(-1, 1 << 70) | st.text(max_size=3)},
    "reschedule": {"key": keys},
    "heartbeat": {},
    "worker-memory": {"managed": st.integers(-1, 1 << 70) | st.text(max_size=3), "paused": st.booleans() | values},
}
_task = st.fixed_dictionaries({"key": keys}, optional={
    "payload": family_entry(), "deps": key_lists | values, "workers": st.none() | st.lists(addresses, max_size=1),
    "retries": st.integers(-2, 3) | values})
CLIENT_STREAM_OPS = {
    "update-graph": {"tasks": st.lists(_task, max_size=3), "wanted": key_lists},
    "release-keys": {"keys": key_lists},
    "cancel-keys": {"keys": key_lists},
    "heartbeat": {},
}
WORKER_OPS = {
    "get-data": {"keys": key_lists},
    "update-data": {"data": st.dictionaries(keys, values, max_size=2)},
    "run": {"function": family_entry(), "args": values, "kwargs": values},
    "identity": {},
    "transfer-stats": {},
}

# bytes a stranger may send instead of a handshake
garbage = st.one_of(
    st.binary(min_size=1, max_size=200),
    st.builds(lambda n, rest: struct.pack("<Q", n) + rest, st.sampled_from([0, 2, 1 << 20, (1 << 64) - 1]),
              st.binary(max_size=40)),  # frame counts
    st.builds(lambda n, rest: struct.pack("<QQ", 1, n) + rest,
              st.sampled_from([0, 4097, 1 << 30, 1 << 36, (1 << 64) - 1]), st.binary(max_size=40)),  # lengths
    st.builds(lambda m, cut: message_bytes(m)[:cut], st.dictionaries(st.text(max_size=5), scalars, max_size=3),
              st.integers(1, 40)),  # truncated
    framed(values),  # messages of any kind where a handshake belongs
    st.builds(lambda rest: handshake_bytes(nonce=os.urandom(32)) + rest, st.binary(max_size=60)),
)

FUZZ = settings(max_examples=30, deadline=None, database=None, derandomize=False,
                suppress_health_check=list(HealthCheck))

_ids = itertools.count()


# ---------------------------------------------------------------- the fuzzing


def _request_marker(sock: socket.socket) -> None:
    """After the fuzzed requests, one that must be answered (or the connection closed)."""
    if send(sock, message_bytes({"op": "identity", "reply": True})):
        while True:
            response = read_response(sock)
            if response is None or (isinstance(response, dict) and isinstance(response.get("result"), dict)
                                    and "address" in response["result"]):
                return


def fuzz_stranger(c: Cluster) -> None:
    @FUZZ
    @given(data=garbage)
    def example(data: bytes) -> None:
        with raw(c.address) as sock:
            send(sock, data)
            sock.shutdown(socket.SHUT_WR)
            read_until_closed(sock)

    example()


def fuzz_requests(c: Cluster, address: str, ops: dict[str, dict[str, Any]]) -> None:
    @FUZZ
    @given(data=framed(op_message(ops)))
    def example(data: bytes) -> None:
        with raw(address, c.secret) as sock:
            if send(sock, data):
                _request_marker(sock)

    example()


def fuzz_worker_stream(c: Cluster) -> None:
    registration = st.fixed_dictionaries(
        {"op": st.just("register-worker"), "address": st.just("") | st.just(c.worker_address) | addresses,
         "nthreads": st.just(1) | values},
        optional={"host": values, "pid": values, "name": values, "x": values})

    @FUZZ
    @given(data=framed(op_message(WORKER_STREAM_OPS) | st.lists(op_message(WORKER_STREAM_OPS), max_size=3)),
           reg=registration | st.just(None), bad_registration=st.booleans())
    def example(data: bytes, reg: dict[str, Any] | None, bad_registration: bool) -> None:
        n = next(_ids)
        if reg is None or not bad_registration:
            reg = {"op": "register-worker", "address": f"tcp://127.0.0.1:1/fuzz-{n}", "nthreads": 1}
        marker = f"sync-{n}-{uuid.uuid4().hex}"
        with raw(c.address, c.secret) as sock:
            if not register(sock, reg):
                return
            if send(sock, data) and send(sock, message_bytes([{"op": "task-finished", "key": marker}])):
                # answered with free-keys for a key it does not know: all before was handled
                read_messages_until(sock, lambda m: isinstance(m, dict) and m.get("op") == "free-keys"
                                    and marker in (m.get("keys") or ()))
            send(sock, message_bytes([{"op": "unregister"}]))

    example()


def fuzz_client_stream(c: Cluster) -> None:
    @FUZZ
    @given(data=framed(op_message(CLIENT_STREAM_OPS) | st.lists(op_message(CLIENT_STREAM_OPS), max_size=3)),
           client=st.text(max_size=8) | values)
    def example(data: bytes, client: Any) -> None:
        marker = f"sync-{next(_ids)}-{uuid.uuid4().hex}"
        with raw(c.address, c.secret) as sock:
            if not register(sock, {"op": "register-client", "client": client}):
                return
            if send(sock, data) and send(sock, message_bytes([{"op": "update-graph", "tasks": [],
                                                               "wanted": [marker]}])):
                # a wanted key it does not know: told so, after everything before
                read_messages_until(sock, lambda m: isinstance(m, dict) and m.get("key") == marker)

    example()


def _tree(c: shoal.Client, base: Any, n: int, worker: str) -> tuple[Any, int]:
    """n leaves (each adds ``base``'s value) summed pairwise: 2n - 1 tasks."""
    level = c.map(operator.add, range(n), [base] * n, workers=[worker])
    while len(level) > 1:
        level = [c.submit(operator.add, a, b, workers=[worker]) for a, b in zip(level[::2], level[1::2])]
    return level[0], n


@pytest.mark.timeout(120)
def test_no_peer_crashes_the_scheduler_or_the_worker_while_a_graph_runs(cluster):
    import numpy as np

    c = cluster
    stages = [
        lambda: fuzz_stranger(c),
        lambda: fuzz_requests(c, c.address, SCHEDULER_OPS),
        lambda: fuzz_worker_stream(c),
        lambda: fuzz_client_stream(c),
        lambda: fuzz_requests(c, c.worker_address, WORKER_OPS),
    ]
    with shoal.Client(c.address) as client:
        # a 2 MB argument: handed to the scheduler in shared memory, which it adopts
        big = client.submit(np.sum, np.arange(1 << 18, dtype=np.float64), workers=[c.worker_address])
        root, expected = client.submit(operator.add, 0, 0, workers=[c.worker_address]), 0
        try:
            for stage in stages:
                # one more part of the graph, depending on the last, runs while this
                # stage's fuzzing goes on
                root, n = _tree(client, root, 64, c.worker_address)
                expected = n * expected + n * (n - 1) // 2
                stage()
                assert c.alive(), c.log_tail()
            assert root.result(timeout=60) == expected
            assert big.result(timeout=60) == (1 << 18) * ((1 << 18) - 1) // 2
        finally:
            del big, root
    assert c.alive(), c.log_tail()
    with shoal.Client(c.address) as fresh:
        assert fresh.submit(operator.mul, 6, 7, workers=[c.worker_address]).result(timeout=30) == 42
        assert fresh.gather(fresh.map(abs, range(-20, 0))) == list(range(20, 0, -1))
    assert c.alive(), c.log_tail()


# ---------------------------------------------------------------- the canary


def _canary_bytes(directory: str) -> bytes:
    """A pickle whose unpickling creates ``directory/ran-in-<pid of the unpickler>``.
    The function goes by value (cloudpickle): any process with cloudpickle runs it."""

    def touch(directory: str) -> None:
        import os

        open(os.path.join(directory, f"ran-in-{os.getpid()}"), "w").close()

    class Canary:
        def __reduce__(self) -> Any:
            return touch, (directory,)

    return cloudpickle.dumps(Canary(), protocol=5)


#: every op the scheduler serves: requests (Scheduler.server's handlers), the two
#: registrations, and the ops of each stream; the field where the canary goes (an
#: argument the op takes, where it has one) and what else makes the op well formed
REQUEST_OPS = {
    "identity": ("x", {}),
    "scheduler-info": ("x", {}),
    "who-has": ("keys", {}),
    "update-data": ("shm", {"who_has": {}, "nbytes": {}, "client": "canary"}),
    "ncores": ("x", {}),
    "counters": ("x", {}),
    "get-task-stream": ("x", {}),
    "diagnostics": ("x", {}),
    "retire-all": ("x", {}),  # the extra field makes it a bad call: it never runs
    # coordination (waiting ops with timeout 0: they answer at once)
    "variable-set": ("data", {"name": "canary"}),
    "variable-get": ("x", {"name": "canary-unset", "timeout": 0}),
    "variable-delete": ("x", {"name": "c"}),
    "queue-put": ("data", {"name": "canary"}),
    "queue-get": ("x", {"name": "e", "timeout": 0}),
    "queue-size": ("x", {"name": "c"}),
    "semaphore-acquire": ("x", {"name": "c", "max_leases": 1, "lease": "l", "timeout": 0}),
    "semaphore-release": ("x", {"name": "c", "lease": "l"}),
    "semaphore-value": ("x", {"name": "c"}),
    "event-wait": ("x", {"name": "c", "timeout": 0}),
    "event-set": ("x", {"name": "c"}),
    "event-clear": ("x", {"name": "c"}),
    "event-is-set": ("x", {"name": "c"}),
    "pubsub-get": ("x", {"name": "c", "sub": "s", "timeout": 0}),
    "publish-put": ("data", {"names": ["c"], "keys": [[]]}),
    "publish-get": ("x", {"names": ["c"]}),
    "publish-delete": ("x", {"names": ["c"]}),
    "publish-list": ("x", {}),
    # the client's inspection and control ops, and progress (upload-file's canary is
    # its data, which must be bytes: refused before anything is kept)
    "has-what": ("x", {}),
    "processing": ("x", {}),
    "versions": ("x", {}),
    "rebalance-plan": ("keys", {}),
    "remove-replicas": ("x", {}),
    "wait-for-workers": ("x", {"n_workers": 1, "timeout": 0}),
    "restart": ("x", {"client": "canary"}),
    "restart-workers": ("x", {}),  # the extra field makes it a bad call: it never runs
    "upload-file": ("data", {"filename": "canary.py", "load": False}),
    "adaptive-plan": ("workers", {}),
    "progress": ("keys", {"id": "canary"}),
    # worker plugins: kept opaque for the workers that join later
    "register-worker-plugin": ("plugin", {"name": "canary"}),
    "unregister-worker-plugin": ("x", {"name": "canary"}),
}
WORKER_STREAM = {
    "task-finished": ("value", {"key": "canary-unknown"}),
    "task-erred": ("exception", {"key": "canary-unknown", "traceback": "", "text": ""}),
    "missing-data": ("errant_worker", {"key": "canary-unknown"}),
    "add-replica": ("shm", {"key": "canary-unknown"}),
    "reschedule": ("key", {}),
    "long-running": ("key", {}),
    "heartbeat": ("x", {}),
    "worker-memory": ("x", {}),
    "unregister": ("x", {}),
}
CLIENT_STREAM = {
    "update-graph": ("payload", {}),
    "release-keys": ("keys", {}),
    "cancel-keys": ("keys", {}),
    "heartbeat": ("x", {}),
    "close-client": ("x", {}),
    "fire-and-forget": ("keys", {}),
    "coordination-flush": ("x", {"uid": "u"}),
    "pubsub-subscribe": ("x", {"name": "c", "sub": "s"}),
    "pubsub-unsubscribe": ("x", {"sub": "s"}),
    "pubsub-publish": ("data", {"name": "c"}),
}
#: (family, header) of a canary entry; each goes opaque and transparent
CANARY_KINDS = [("pickle", {}), ("bytes", {"kind": "pickle"})]
POSITIONS = ["value", "key", "nested", "unreferenced"]


def _placed(field: str, position: str, entry: Oob) -> tuple[dict[str, Any], tuple[Oob, ...]]:
    """The field(s) holding the canary in ``position``, and unreferenced entries."""
    if position == "value":
        return {field: entry}, ()
    if position == "key":
        return {field: Map([(entry, 1)])}, ()
    if position == "nested":
        return {field: [{"a": ("t", [entry])}]}, ()
    return {field: 1}, (entry,)


def _canary_cases(canary: bytes) -> list[tuple[str, str, str, Oob]]:
    cases = []
    for (family, header), opaque in itertools.product(CANARY_KINDS, (True, False)):
        entry = Oob(family, header, [canary], opaque)
        for position in POSITIONS:
            for where, ops in (("request", REQUEST_OPS), ("worker", WORKER_STREAM), ("client", CLIENT_STREAM),
                               ("register", {"register-worker": ("x", {}), "register-client": ("x", {})})):
                cases.extend((where, op, position, entry) for op in ops)
    return cases


def _send_canary(c: Cluster, where: str, op: str, position: str, entry: Oob) -> None:
    n = next(_ids)
    marker = f"sync-{n}-{uuid.uuid4().hex}"
    with raw(c.address, c.secret) as sock:
        if where == "request":
            field, rest = REQUEST_OPS[op]
            fields, unreferenced = _placed(field, position, entry)
            if op == "who-has" and position == "value":
                fields = {"keys": [entry]}
            if send(sock, frame_bytes(encode({"op": op, "reply": True, **rest, **fields}, unreferenced))):
                _request_marker(sock)
            return
        if where == "register":
            fields, unreferenced = _placed("x", position, entry)
            base = ({"address": f"tcp://127.0.0.1:1/canary-{n}", "nthreads": 1} if op == "register-worker"
                    else {"client": f"canary-{n}"})
            if not send(sock, frame_bytes(encode({"op": op, **base, **fields}, unreferenced))):
                return
            response = read_response(sock)
            if isinstance(response, dict) and response.get("status") == "OK":
                send(sock, message_bytes([{"op": "unregister"}] if op == "register-worker"
                                         else [{"op": "close-client"}]))
                read_until_closed(sock)
            return
        if where == "worker":
            if not register(sock, {"op": "register-worker", "address": f"tcp://127.0.0.1:1/canary-{n}", "nthreads": 1}):
                raise AssertionError(f"cannot register a worker: {c.log_tail()}")
            field, rest = WORKER_STREAM[op]
            sync = {"op": "task-finished", "key": marker}
            done = lambda m: isinstance(m, dict) and m.get("op") == "free-keys" and marker in (m.get("keys") or ())
        else:
            if not register(sock, {"op": "register-client", "client": f"canary-{n}"}):
                raise AssertionError(f"cannot register a client: {c.log_tail()}")
            field, rest = CLIENT_STREAM[op]
            sync = {"op": "update-graph", "tasks": [], "wanted": [marker]}
            done = lambda m: isinstance(m, dict) and m.get("key") == marker
        fields, unreferenced = _placed(field, position, entry)
        msg = {"op": op, **rest, **fields}
        if op == "update-graph":
            msg = {"op": op, "tasks": [{"key": f"canary-task-{n}", **fields}], "wanted": []}
        if op in ("release-keys", "cancel-keys", "fire-and-forget") and position == "value":
            msg["keys"] = [entry]
        ends = op in ("unregister", "close-client")
        if send(sock, frame_bytes(encode([msg], unreferenced))):
            if ends:
                read_until_closed(sock)
            elif send(sock, message_bytes([sync])):
                read_messages_until(sock, done)
        if not ends:
            send(sock, message_bytes([{"op": "unregister"}] if where == "worker" else [{"op": "close-client"}]))


def _send_canary_in_handshake(c: Cluster, step: int, entry: Oob | None, canary: bytes) -> None:
    """Steps before ``step`` done right; ``step`` carries the canary (out of band, or,
    with ``entry`` None, as a bin field value)."""
    with raw(c.address) as sock:
        nonce = os.urandom(32)
        hello = {"op": "handshake", "protocol": PROTOCOL_VERSION, "nonce": nonce, "auth": True}
        msgs = [hello]
        if step > 1:
            sock.sendall(message_bytes(hello))
            (theirs,) = recv_frames(sock)
            peer_nonce = msgpack.unpackb(theirs)["nonce"]
            step2 = {"op": "handshake-auth", "proof": security.proof(c.secret, b"connector", nonce, peer_nonce),
                     "pid": 1, "host": "elsewhere"}
            msgs.append(step2)
            if step > 2:
                sock.sendall(message_bytes(step2))
                (info,) = recv_frames(sock)
                # step 3 carries the session's tag (docs/protocol.md §2.5)
                start_session(sock, c.secret, [message_bytes(hello), message_bytes(step2)], [theirs, info])
                msgs.append({"op": "handshake-shm", "can_map": False})
        bad = dict(msgs[-1])
        bad["x"] = entry if entry is not None else canary
        send(sock, frame_bytes(encode(bad)))
        sock.shutdown(socket.SHUT_WR)
        read_until_closed(sock)


def test_the_canary_goes_to_every_op_the_scheduler_serves():
    from shoal.scheduler.server import Scheduler

    server = Scheduler().server  # (nothing started)
    assert set(server.handlers) == set(REQUEST_OPS)
    assert set(server.stream_handlers) == {"register-worker", "register-client"}
    try:
        from shoal.protocol.messages import CLIENT_TO_SCHEDULER, WORKER_TO_SCHEDULER
    except ImportError:  # before the typed messages the stream ops were only in the server's code
        return
    assert set(WORKER_TO_SCHEDULER) == set(WORKER_STREAM)
    assert set(CLIENT_TO_SCHEDULER) == set(CLIENT_STREAM)


@pytest.mark.timeout(120)
def test_the_scheduler_never_runs_a_pickle(own_cluster, tmp_path):
    c = own_cluster
    canary = _canary_bytes(str(tmp_path))
    # the canary works: a process that unpickles it leaves its mark
    child = subprocess.run([sys.executable, "-c", "import pickle, sys; pickle.loads(sys.stdin.buffer.read())"],
                           input=canary, timeout=60, capture_output=True)
    assert child.returncode == 0, child.stderr
    marks = os.listdir(tmp_path)
    assert len(marks) == 1 and marks[0].startswith("ran-in-"), marks
    os.unlink(tmp_path / marks[0])

    cases = _canary_cases(canary)
    with ThreadPoolExecutor(4) as pool:
        # retire-all (which may run: extra fields are ignored) closes the worker: last
        for f in [pool.submit(_send_canary, c, *case) for case in cases if case[1] != "retire-all"]:
            f.result()
        handshakes = [pool.submit(_send_canary_in_handshake, c, step, entry, canary)
                      for step in (1, 2, 3)
                      for entry in [None, *(Oob(fam, h, [canary], o) for (fam, h), o in
                                            itertools.product(CANARY_KINDS, (True, False)))]]
        for f in handshakes:
            f.result()
    assert c.alive(), c.log_tail()
    for case in cases:
        if case[1] == "retire-all":
            _send_canary(c, *case)
    assert c.scheduler.poll() is None, c.log_tail()
    ran = sorted(os.listdir(tmp_path))
    assert f"ran-in-{c.scheduler.pid}" not in ran, f"the scheduler unpickled a canary; marks: {ran}"
    # opaque canaries went on to the worker (task payloads, errors): decoding them there is its right
    assert set(ran) <= {f"ran-in-{c.worker.pid}", f"ran-in-{os.getpid()}"}, ran
    assert f"ran-in-{os.getpid()}" not in ran, "the test itself decoded a canary"

