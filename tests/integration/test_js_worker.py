"""The JavaScript worker (workers/js) in real clusters: a ``shoal scheduler`` process,
``shoal worker`` processes and ``node workers/js/bin/shoal-worker.js`` processes on
127.0.0.1, authenticated with the scheduler's auth file, and a ``shoal.Client``.

Task functions are in ``js_modules/`` (``stats.js``, CommonJS; ``esm_tools.mjs``, an
ES module). Values cross between the languages in the neutral encodings of protocol
§4.5: numpy arrays as ``shoal.call`` ext 4 arguments and ``shoal.value`` results.

The paths a real cluster rarely takes (a holder without the key, a pickled input, a
peer refusing one key of a batch, duplicate ``compute-task``, ``free-keys``,
heartbeats, ``close``) are played to the worker by a scheduler and a peer scripted
in this process with ``foreign_wire``. ``node --test`` runs the worker's own unit
tests (``workers/js/test``).
"""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Iterator
from fractions import Fraction
from typing import Any

import msgpack
import numpy as np
import pytest
from foreign_wire import (
    EOF,
    OOB,
    Connection,
    WireError,
    decode,
    encode,
    find_secret,
    handshake,
    recv_frames,
    send_frames,
)
from shoal_helpers import auth_files, read_line, start_scheduler, start_worker, stop_processes

import shoal
from shoal.testing import wait_for

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
JS_DIR = os.path.join(REPO, "workers", "js")
JS_WORKER = os.path.join(JS_DIR, "bin", "shoal-worker.js")
JS_MODULES = os.path.join(HERE, "js_modules")


def js(function: str, module: str = "stats") -> Any:
    return shoal.foreign("js", module, function)


class Cluster:
    """A scheduler, Python workers and JavaScript workers, all processes, stopped by the
    fixture whatever happens."""

    def __init__(self, tmp_path: Any):
        self.tmp_path = tmp_path
        self.procs: list[subprocess.Popen[Any]] = []
        self.logs: list[Any] = []
        self.auth_before = auth_files()
        self.address = ""
        self.python: list[str] = []
        #: address -> process of each JavaScript worker
        self.js: dict[str, subprocess.Popen[bytes]] = {}
        self.js_logs: dict[str, str] = {}

    def start(self, n_python: int = 0) -> Cluster:
        _, self.address = start_scheduler(self.procs)
        for _ in range(n_python):
            _, address = start_worker(self.procs, self.address, "--nthreads", "1", "--no-nanny",
                                      "--host", "127.0.0.1", "--memory-limit", "0")
            self.python.append(address)
        return self

    def start_js(self, name: str, nthreads: int = 1) -> str:
        log_path = os.path.join(self.tmp_path, f"{name}.log")
        log = open(log_path, "wb")  # noqa: SIM115 - closed in close()
        self.logs.append(log)
        proc = subprocess.Popen(["node", JS_WORKER, self.address, "--nthreads", str(nthreads), "--path", JS_MODULES,
                                 "--name", name, "--listen-host", "127.0.0.1"],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log)
        self.procs.append(proc)
        line = read_line(proc, time.monotonic() + 30)
        assert line.startswith("shoal js worker at tcp://127.0.0.1:"), (line, self.log_of(log_path))
        address = line.split()[-1]
        self.js[address] = proc
        self.js_logs[address] = log_path
        return address

    def log_of(self, path: str) -> str:
        for log in self.logs:
            log.flush()
        with open(path, errors="replace") as f:
            return f.read()[-4000:]

    def close(self) -> None:
        try:
            stop_processes(self.procs, self.auth_before)
        finally:
            for log in self.logs:
                log.close()


@pytest.fixture
def node() -> str:
    """The node executable, with the worker's packages installed; fails (never skips)
    when either is missing, saying how to install them."""
    path = shutil.which("node")
    if path is None:
        pytest.fail("node is not installed: the JavaScript worker needs Node.js >= 20 "
                    "(e.g. apt-get install nodejs), then `cd workers/js && npm ci`")
    if not os.path.isdir(os.path.join(JS_DIR, "node_modules", "@msgpack", "msgpack")):
        pytest.fail("the JavaScript worker's packages are not installed: run `cd workers/js && npm ci`")
    return path


@pytest.mark.timeout(60)
def test_js_unit_tests_pass(node: str) -> None:
    """workers/js/test (node --test): the codec and the value mapping against the bytes
    of docs/protocol.md §12 and the rules of §2 and §4."""
    done = subprocess.run([node, "--test", "test/"], cwd=JS_DIR, capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "# fail 0" in done.stdout


@pytest.fixture
def cluster(node: str, tmp_path: Any) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.close()


@pytest.mark.timeout(120)
def test_mixed_cluster_passes_arrays_between_python_and_js(cluster: Cluster) -> None:
    cluster.start(n_python=2)
    here = cluster.start_js("js-1", nthreads=2)
    py_a, py_b = cluster.python
    with shoal.Client(cluster.address, timeout=30) as c:
        info = c.scheduler_info()["workers"]
        assert info[here]["name"] == "js-1" and info[here]["nthreads"] == 2

        # a numpy array made in Python -> a JS transform -> a Python reduction
        x = c.submit(lambda: np.arange(100_000, dtype="float64") * 0.25, workers=[py_a])
        y = c.submit(js("scale"), x, 2.0)
        z = c.submit(lambda a: float(a.sum()), y, workers=[py_b])
        expected = np.arange(100_000, dtype="float64") * 0.25 * 2.0
        assert z.result(timeout=30) == float(expected.sum())
        assert c.who_has([y]) == {y.key: [here]}
        got = y.result(timeout=30)  # the client fetches a JS value itself
        assert got.dtype == np.float64 and got.shape == (100_000,) and np.array_equal(got, expected)

        # a JS reduction returning a number; an argument array given directly (ext 4)
        assert c.submit(js("total"), y).result(timeout=30) == float(expected.sum())
        ints = np.arange(12, dtype="int32").reshape(3, 4)
        assert c.submit(js("total"), ints).result(timeout=30) == 66

        # n-d arrays made in JS, gathered as numpy: dtype, shape and values exact
        grid = c.submit(js("grid"), 3, 4).result(timeout=30)
        assert grid.dtype == np.int32 and grid.shape == (3, 4)
        assert np.array_equal(grid, np.arange(12, dtype="int32").reshape(3, 4))
        scaled = c.submit(js("scale"), ints, 0.5).result(timeout=30)
        assert scaled.dtype == np.float64 and scaled.shape == (3, 4)
        assert np.array_equal(scaled, ints * 0.5)
        ramp = c.submit(js("ramp"), 5).result(timeout=30)  # a bare Float32Array: 1-D
        assert ramp.dtype == np.float32 and np.array_equal(ramp, np.arange(5, dtype="float32") / 2)

        # msgpack-native values both ways; ints beyond 2^53 are BigInt in JS and come back exact
        value = {"list": [1, 2.5, "s", None, True], "bytes": b"\x00\xff", "big": 2**60, "neg": -(2**40)}
        assert c.submit(js("describe"), 2**60).result(timeout=30) == "bigint"
        assert c.submit(js("describe"), b"ab").result(timeout=30) == "Uint8Array"
        assert c.submit(js("later", "esm_tools"), value).result(timeout=30) == {"value": value, "kind": "object"}
        # dependencies from a Python worker in each neutral form: bytes, a list, a number
        neutral = ((lambda: b"x" * 100_000, "Uint8Array"), (lambda: [1, "a"], "array(2)"), (lambda: 7, "number"))
        for make, kind in neutral:
            assert c.submit(js("describe"), c.submit(make, workers=[py_a])).result(timeout=30) == kind
        # keyword arguments arrive as one object after the positional ones
        assert c.submit(js("join", "esm_tools"), ["a", "b"], "-").result(timeout=30) == "a-b"
        assert c.submit(js("withOptions", "esm_tools"), 1, sep="-").result(timeout=30) == {
            "first": 1, "options": {"sep": "-"}}
        assert c.submit(js("withOptions", "esm_tools"), 1).result(timeout=30) == {"first": 1, "options": None}

        # a JS value as input of a JS task on the same worker
        again = c.submit(js("scale"), y, 0.5)
        assert np.array_equal(again.result(timeout=30), np.arange(100_000, dtype="float64") * 0.25)

        # the busy owner: while both JS threads spin, a Python task still fetches a JS value
        held = c.submit(js("grid"), 3, 4, pure=False)
        held.result(timeout=30)
        spinning = [c.submit(js("slow"), 4000, i, pure=False) for i in range(2)]
        wait_for(lambda: len(c.processing([here])[here]) == 2, timeout=10, what="both JS threads busy")
        assert c.submit(lambda g: int(g.sum()), held, workers=[py_a]).result(timeout=30) == 66
        assert not any(f.done() for f in spinning)
        assert c.gather(spinning) == [0, 1]


@pytest.mark.timeout(90)
def test_js_error_reaches_the_client_with_its_stack(cluster: Cluster) -> None:
    cluster.start(n_python=1)
    cluster.start_js("js-err")
    with shoal.Client(cluster.address, timeout=30) as c:
        bad = c.submit(js("fail"), "bad value 7")
        good = c.submit(js("grid"), 2, 2)
        with pytest.raises(shoal.RemoteError, match="RangeError: bad value 7") as excinfo:
            bad.result(timeout=30)
        notes = "".join(getattr(excinfo.value, "__notes__", []))
        assert "at fail (" in notes and "stats.js" in notes, notes
        # a dependent of the failed task fails with the same error; other tasks complete
        with pytest.raises(shoal.RemoteError, match="bad value 7"):
            c.submit(js("total"), bad).result(timeout=30)
        assert good.result(timeout=30).shape == (2, 2)
        # an unknown module or function errs that task the same way
        with pytest.raises(shoal.RemoteError, match="ModuleNotFoundError: no module 'nosuch' on the search path"):
            c.submit(js("f", "nosuch"), 1).result(timeout=30)
        with pytest.raises(shoal.RemoteError, match="AttributeError: module 'stats' has no function 'nosuch'"):
            c.submit(js("nosuch"), 1).result(timeout=30)
        # a result that is no neutral value (a Map) errs with SerializationError
        with pytest.raises(shoal.SerializationError, match="a value of type Map has no meaning"):
            c.submit(js("mapped")).result(timeout=30)
        assert c.submit(js("grid"), 1, 1).result(timeout=30).shape == (1, 1)


@pytest.mark.timeout(90)
def test_python_value_that_is_not_neutral_errs_the_js_task(cluster: Cluster) -> None:
    cluster.start(n_python=1)
    cluster.start_js("js-ser")
    (py,) = cluster.python
    with shoal.Client(cluster.address, timeout=30) as c:
        a_set = c.submit(lambda: {1, 2}, workers=[py])
        with pytest.raises(shoal.SerializationError, match="set"):
            c.submit(js("describe"), a_set).result(timeout=30)
        obj = c.submit(Fraction, 1, 3, workers=[py])  # an object no other language reads
        with pytest.raises(shoal.SerializationError, match="Fraction"):
            c.submit(js("describe"), obj).result(timeout=30)
        # the same values given directly are refused at submit already
        with pytest.raises(shoal.SerializationError, match="set"):
            c.submit(js("describe"), {1, 2})
        # the cluster goes on: neutral Python values still reach JS tasks
        arr = c.submit(lambda: np.ones(10, dtype="int64"), workers=[py])
        assert c.submit(js("total"), arr).result(timeout=30) == 10
        assert c.submit(js("describe"), arr).result(timeout=30) == "object"


@pytest.mark.timeout(120)
def test_killed_js_worker_task_is_rescheduled_on_another(cluster: Cluster) -> None:
    cluster.start()
    first = cluster.start_js("js-a")
    second = cluster.start_js("js-b")
    with shoal.Client(cluster.address, timeout=30) as c:
        wait_for(lambda: {first, second} <= set(c.scheduler_info()["workers"]), timeout=30, what="both JS workers")
        # a JS worker fetches its input from the other one
        grid = c.submit(js("grid"), 3, 4, workers=[first])
        assert c.submit(js("total"), grid, workers=[second]).result(timeout=30) == 66
        f = c.submit(js("slow"), 3000, 42, pure=False)

        def where() -> list[str]:
            return [w for w, keys in c.processing().items() if f.key in keys]

        wait_for(lambda: bool(where()), timeout=30, what="the task to start")
        (victim,) = where()
        cluster.js[victim].send_signal(signal.SIGKILL)
        assert f.result(timeout=60) == 42
        (survivor,) = {first, second} - {victim}
        assert c.who_has([f]) == {f.key: [survivor]}
        assert cluster.js[victim].wait(10) == -signal.SIGKILL


def _garbage_after_handshake(address: str, secret: bytes | None, payload: bytes | list[bytes]) -> bytes:
    """Handshakes with ``address``, sends ``payload`` (bytes as they are, or frames as a
    message with its session tag), and returns what comes back until the connection
    ends (the JS worker closes it)."""
    conn = Connection(address, "test-garbage", secret=secret, reads="neutral")
    try:
        sock = conn.sock
        if isinstance(payload, list):
            send_frames(sock, payload, time.monotonic() + 30)
        else:
            sock.settimeout(30)
            sock.sendall(payload)
        got = b""
        while True:
            try:
                chunk = sock.recv(4096)
            except ConnectionResetError:
                return got
            if not chunk:
                return got
            got += chunk
    finally:
        conn.close()


@pytest.mark.timeout(90)
def test_malformed_bytes_cut_off_that_connection_only(cluster: Cluster) -> None:
    cluster.start()
    here = cluster.start_js("js-hostile")
    secret = find_secret(cluster.address)
    with shoal.Client(cluster.address, timeout=30) as c:
        held = c.submit(js("grid"), 2, 3)
        held.result(timeout=30)
        # a peer that keeps a connection open meanwhile, to see it is not affected
        with Connection(here, "test-bystander", secret=secret, reads="neutral") as bystander:
            # zero frames; too many frames; a frame over the limit; a header that is no msgpack;
            # an ext type not allowed in a header; a table that does not match the frames
            # (those that are messages carry their session tags: the worker reads them);
            # and a request whose tag is not the session's
            request = encode({"op": "get-data", "reply": True, "keys": [held.key]})[0]
            bad: list[bytes | list[bytes]] = [
                struct.pack("<Q", 0),
                struct.pack("<Q", 1 << 40),
                struct.pack("<QQ", 1, 1 << 62),
                [b"\xc1"],
                [b"\xd6\x05\x00\x00\x00\x00"],
                [b"\x80", b"\x91\x90"],
                struct.pack("<QQ", 1, len(request)) + request + bytes(16),
            ]
            for payload in bad:
                assert _garbage_after_handshake(here, secret, payload) == b"", payload
            # a request that is no map with an op: cut off too, without a reply
            assert _garbage_after_handshake(here, secret, [b"\x01"]) == b""
            # the worker still serves on the connection that behaved, and runs tasks
            reply = bystander.call("get-data", keys=[held.key])
            assert reply["status"] == "OK"
            entry = reply["result"]["data"][held.key]
            assert isinstance(entry, OOB) and entry.family == "shoal.value"
            unknown = bystander.call("no-such-op")
            assert unknown["status"] == "error" and "no handler for op 'no-such-op'" in unknown["message"]
        assert cluster.js[here].poll() is None
        assert np.array_equal(c.submit(js("scale"), held, 2.0).result(timeout=30),
                              np.arange(6, dtype="float64").reshape(2, 3) * 2)
    log = cluster.log_of(cluster.js_logs[here])
    assert log.count("connection aborted") >= len(bad) + 1, log


@pytest.mark.timeout(60)
def test_js_worker_leaves_cleanly_on_sigterm(cluster: Cluster) -> None:
    cluster.start()
    here = cluster.start_js("js-leave")
    with shoal.Client(cluster.address, timeout=30) as c:
        assert c.submit(js("grid"), 1, 2).result(timeout=30).shape == (1, 2)
        cluster.js[here].send_signal(signal.SIGTERM)
        assert cluster.js[here].wait(30) == 0
        wait_for(lambda: here not in c.scheduler_info()["workers"], timeout=30, what="the JS worker to unregister")
    # its listener is closed
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", int(here.rsplit(":", 1)[1])), timeout=5):
        pass


@pytest.mark.timeout(60)
def test_js_worker_stops_when_the_scheduler_closes(cluster: Cluster) -> None:
    cluster.start()
    here = cluster.start_js("js-close")
    scheduler = cluster.procs[0]
    with shoal.Client(cluster.address, timeout=30) as c:
        assert c.submit(js("ramp"), 2).result(timeout=30).shape == (2,)
    scheduler.send_signal(signal.SIGTERM)  # it sends close to every worker
    assert cluster.js[here].wait(30) == 0
    assert scheduler.wait(30) == 0


# -- a scripted scheduler and peer: the protocol paths a real cluster rarely takes ------


class ScriptedPeer:
    """A worker's listener played by this test (a thread): it serves ``get-data`` from
    ``values`` (key -> what to put in ``data``: an OOB or an inline value); a key in
    ``refuse`` makes the whole request err with a SerializationError, as a Python peer
    does for a value it cannot send neutrally. It records the keys of every request."""

    def __init__(self, secret: bytes, values: dict[Any, Any], refuse: set[Any]):
        self.secret, self.values, self.refuse = secret, values, refuse
        self.requests: list[list[Any]] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.05)  # (accept looks at the stop flag this often)
        self.address = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            conn.settimeout(None)
            self._conns.append(conn)
            t = threading.Thread(target=self._requests, args=(conn,), daemon=True)
            self._threads.append(t)
            t.start()

    def _requests(self, conn: socket.socket) -> None:
        with conn:
            try:
                handshake(conn, "scripted-peer", time.monotonic() + 10, secret=self.secret, connector=False)
                while True:
                    msg = decode(recv_frames(conn, time.monotonic() + 60))
                    keys = list(msg["keys"])
                    self.requests.append(keys)
                    if self.refuse & set(keys):
                        response: dict[str, Any] = {
                            "status": "error", "type": "shoal.errors.SerializationError",
                            "message": "a value of type builtins.set has no meaning in another language",
                            "traceback": "Traceback (python peer)", "exception": None}
                    else:
                        data = {k: self.values[k] for k in keys if k in self.values}
                        response = {"status": "OK", "result": {"data": data}}
                    send_frames(conn, encode(response), time.monotonic() + 10)
            except (EOF, WireError, OSError):
                return

    def close(self) -> None:
        """Stop serving; every thread and socket of ours is gone when this returns."""
        self._stop.set()
        self.thread.join(10)
        self.listener.close()
        for conn in self._conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked reading it
            except OSError:
                pass
            conn.close()
        for t in self._threads:
            t.join(10)
        assert not self.thread.is_alive() and not any(t.is_alive() for t in self._threads)


def _call(function: str, args: list[Any], module: str = "stats") -> OOB:
    """A ``shoal.call`` payload (§4.5); args may hold ``msgpack.ExtType`` refs."""
    return OOB("shoal.call", {"language": "js", "module": module, "function": function},
               [msgpack.packb([args, {}], use_bin_type=True)])


def _ref(key: Any) -> msgpack.ExtType:
    """ext 3: the value of task ``key``."""
    return msgpack.ExtType(3, encode(key)[0])


@pytest.mark.timeout(90)
def test_js_worker_against_a_scripted_scheduler(cluster: Cluster) -> None:
    secret = b"scripted-secret"
    listener = socket.create_server(("127.0.0.1", 0))
    address = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    pickled_set = OOB("pickle", {}, [pickle.dumps({1, 2})])
    peer = ScriptedPeer(secret, {"a": "x", "b": "y", "pickled": pickled_set, "s2": 5}, refuse={"s1"})
    log = open(os.path.join(cluster.tmp_path, "scripted-js.log"), "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(["node", JS_WORKER, address, "--nthreads", "2", "--path", JS_MODULES,
                             "--listen-host", "127.0.0.1"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=log, env={**os.environ, "SHOAL_AUTH": secret.decode()})
    cluster.procs.append(proc)
    cluster.logs.append(log)
    try:
        listener.settimeout(30)
        sock, _ = listener.accept()
        with sock:
            hs = handshake(sock, "scripted-scheduler", time.monotonic() + 10, secret=secret, connector=False,
                           role="scheduler")
            assert hs["peer"]["reads"] == "neutral" and "shm_probe" not in hs["peer"]
            assert hs["peer_maps_ours"] is False
            reg = decode(recv_frames(sock, time.monotonic() + 10))
            assert reg["op"] == "register-worker" and reg["languages"] == ["js"] and reg["nthreads"] == 2
            me = reg["address"]
            send_frames(sock, encode({"status": "OK", "address": address}), time.monotonic() + 10)
            ops: list[dict[str, Any]] = []

            def send(*msgs: dict[str, Any]) -> None:
                send_frames(sock, encode(list(msgs)), time.monotonic() + 10)

            def until(pred: Any, what: str, start: int = 0) -> dict[str, Any]:
                """The first op from the ``start``-th on for which pred holds."""
                deadline = time.monotonic() + 30
                while True:
                    for op in ops[start:]:
                        if pred(op):
                            return op
                    msg = decode(recv_frames(sock, deadline))
                    ops.extend(msg if isinstance(msg, list) else [msg])
                    assert time.monotonic() < deadline, f"no {what} in {ops}"

            def task(key: Any, payload: OOB, who_has: dict[Any, list[str]]) -> dict[str, Any]:
                return {"op": "compute-task", "key": key, "payload": payload, "who_has": who_has,
                        "nbytes": {k: 10 for k in who_has}, "priority": [0, 0, 0], "unknown-field": 1}

            # an unknown op is ignored; two inputs from one peer come in one get-data
            send({"op": "no-such-op"},
                 task(("joined", 1), _call("join", [[_ref("a"), _ref("b")], "+"], "esm_tools"),
                      {"a": [peer.address], "b": [peer.address]}))
            done = until(lambda op: op.get("key") == ("joined", 1), "task-finished")
            assert done["op"] == "task-finished" and done["type"] == "js:string" and done["nbytes"] > 0
            assert sorted(peer.requests[0]) == ["a", "b"]
            # the value, served in the family shoal.value to a requester reading neutral encodings
            with Connection(me, "scripted-client", secret=secret, reads="neutral") as conn:
                entry = conn.call("get-data", keys=[("joined", 1)])["result"]["data"][("joined", 1)]
                assert entry.family == "shoal.value" and msgpack.unpackb(entry.frames[0]) == "x+y"
                # the scheduler's question (§8.2 has-keys): the keys it holds of those asked
                assert conn.call("has-keys", keys=[("joined", 1), "nowhere"])["result"] == {"held": [("joined", 1)]}
            # again for a key in memory: reported at once
            send(task(("joined", 1), _call("join", [[], ""], "esm_tools"), {}))
            until(lambda op: op is not done and op.get("key") == ("joined", 1), "a second task-finished")

            # an input no holder has: missing-data for each holder named, then reschedule
            send(task("lost", _call("describe", [_ref("gone")]), {"gone": [peer.address, me]}))
            until(lambda op: op.get("op") == "reschedule" and op.get("key") == "lost", "reschedule")
            missing = [op["errant_worker"] for op in ops if op.get("op") == "missing-data" and op["key"] == "gone"]
            assert sorted(missing) == sorted([peer.address, me])

            # a pickled input: the task errs with SerializationError, no exception object
            send(task("unpickled", _call("describe", [_ref("pickled")]), {"pickled": [peer.address]}))
            erred = until(lambda op: op.get("key") == "unpickled", "task-erred")
            assert erred["op"] == "task-erred" and erred["exception"] is None
            assert erred["text"].startswith("SerializationError: ") and "pickled" in erred["text"]

            # a peer that cannot send one key of a batch: asked for each alone; only the
            # task that needs that key errs, with the peer's message
            send(task("needs-s1", _call("describe", [_ref("s1")]), {"s1": [peer.address]}),
                 task("needs-s2", _call("describe", [_ref("s2")]), {"s2": [peer.address]}))
            erred = until(lambda op: op.get("key") == "needs-s1", "task-erred")
            assert erred["op"] == "task-erred"
            assert erred["text"] == ("SerializationError: a value of type builtins.set has no meaning "
                                     "in another language")
            assert until(lambda op: op.get("key") == "needs-s2", "task-finished")["op"] == "task-finished"
            assert sorted(sorted(keys) for keys in peer.requests[-3:]) == [["s1"], ["s1", "s2"], ["s2"]]

            # free-keys: the value goes
            send({"op": "free-keys", "keys": [("joined", 1)]})
            with Connection(me, "scripted-client", secret=secret, reads="neutral") as conn:
                wait_for(lambda: conn.call("get-data", keys=[("joined", 1)])["result"]["data"] == {},
                         timeout=10, what="the freed value to go")

            # with nothing else to say, the worker sends heartbeats
            until(lambda op: op.get("op") == "heartbeat", "heartbeat", start=len(ops))

            # close: the worker stops
            send({"op": "close"})
            assert proc.wait(30) == 0
    finally:
        peer.close()
        listener.close()
