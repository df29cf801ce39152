"""A shoal worker written from docs/protocol.md alone, for test_protocol_doc.py.

It uses only the standard library (``socket``, ``struct``, ``mmap``, ``fcntl``,
``pickle``, ...), ``msgpack`` and ``cloudpickle``: nothing from shoal. The sections
(§) named in comments are those of docs/protocol.md.
"""


from __future__ import annotations

import os
import pickle
import socket
import sys
import threading
import time
import traceback
import uuid
from typing import Any

# =====================================================================================
# The foreign worker (docs/protocol.md only; no shoal imports in this part)
# =====================================================================================
from foreign_wire import (
    EOF,
    LEASE_ACK,
    OP_TIMEOUT,
    POLL,
    SegmentPool,
    Stopped,
    WireError,
    attach,
    connect,
    count,
    decode,
    encode,
    find_secret,
    get_data,
    handshake,
    is_lease_ack,
    pickled,
    recv_frames,
    remove_segment,
    send_frames,
    substitute,
    value_of,
)


def host_identity() -> str:
    """This host's identity as §3 writes it: hostname, boot id, device of /dev/shm."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        dev = format(os.stat("/dev/shm").st_dev, "x")
    except OSError:
        dev = ""
    return f"{socket.gethostname()}/{boot}/{dev}"


class ForeignWorker:
    """One thread for the scheduler stream (tasks run there, one at a time:
    ``nthreads=1``), one accepting peers, one per peer connection.

    With ``shm`` (§4.7, §11 a-e) it answers ``"can_map": true`` to peers whose probe it
    can open, decodes ``shoal.same-host`` and acknowledges leases, maps the inputs
    ``compute-task`` names in ``shm``, and puts large results in segments of its own,
    released (renamed away, kept for reuse) when their keys are freed."""

    def __init__(self, scheduler_address: str, name: str = "foreign", deadline: float = 120.0,
                 shm: bool = False, secret: bytes | None = None, port: int = 0):
        self.scheduler_address = scheduler_address
        #: the cluster's secret (§3.1), proven on every connection
        self.secret = find_secret(scheduler_address) if secret is None else secret
        self.name = name
        self.shm = shm
        # with shared memory the host identity of §3, so that the scheduler hands segments
        # between us and the Python workers of this host; without, one of our own
        self.host_id = host_identity() if shm else f"foreign-{uuid.uuid4().hex}"
        self.deadline = time.monotonic() + deadline
        self.data: dict[Any, Any] = {}
        #: key -> the segment info of a result we placed (§4.7); released with the key
        self.segments: dict[Any, list[Any]] = {}
        self.pool = SegmentPool()
        self.errors: list[BaseException] = []
        self.ops_received: list[str] = []
        self.freed: set[Any] = set()
        #: keys served by get-data (values mapped from our segments are not among them)
        self.served: list[Any] = []
        #: handshake answers on connections peers opened to us
        self.peer_handshakes: list[dict[str, Any]] = []
        self.scheduler_handshake: dict[str, Any] = {}
        self.shm_hints = 0
        self.cond = threading.Condition()
        self.closed_by_scheduler = threading.Event()
        self.stream_ended = threading.Event()
        self._stop = threading.Event()
        self._unregister = threading.Event()
        self._threads: list[threading.Thread] = []
        self._socks: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._stream: socket.socket | None = None
        self.address = ""
        #: the port to listen on (0: any free one)
        self.port = port

    # lifecycle (§10)

    def start(self) -> ForeignWorker:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._track(listener)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        self.address = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
        self._spawn(self._accept_loop, "foreign-accept")
        deadline = time.monotonic() + OP_TIMEOUT
        sock, self.scheduler_handshake = connect(self.scheduler_address, self.host_id, deadline, self.shm,
                                                 secret=self.secret, expect="scheduler")
        self._track(sock)
        send_frames(sock, encode({
            "op": "register-worker", "address": self.address, "nthreads": 1,
            "host": self.host_id, "pid": os.getpid(), "name": self.name,
            "ops": ["update-data", "identity", "has-keys"],  # of the optional ops (§7.1, §8.2), those served below
        }), deadline)
        reply = decode(recv_frames(sock, deadline))
        if not isinstance(reply, dict) or reply.get("status") != "OK":
            raise WireError(f"the scheduler refused: {reply!r:.200}")
        self._stream = sock
        self._send([{"op": "heartbeat"}])  # a sign of life (§7.3)
        self._spawn(self._stream_loop, "foreign-stream")
        return self

    def leave(self, timeout: float = 30.0) -> None:
        """Unregister (§7.3) and wait until the scheduler has closed the stream."""
        self._unregister.set()
        if not self.stream_ended.wait(timeout):
            raise TimeoutError("the scheduler did not close the stream after unregister")

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            socks = list(self._socks)
        for s in socks:
            try:
                s.close()
            except OSError:
                pass
        for t in self._threads:
            t.join(10)
        alive = [t.name for t in self._threads if t.is_alive()]
        with self._lock:
            segments, self.segments = list(self.segments.values()), {}
        for info in segments:  # the owner removes its segments at shutdown (§4.7)
            remove_segment(info[0])
        self.pool.drain()
        assert not alive, f"threads still running: {alive}"

    def wait_freed(self, key: Any, timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: key in self.freed, timeout)

    # plumbing

    def _track(self, sock: socket.socket) -> None:
        with self._lock:
            self._socks.add(sock)

    def _untrack(self, sock: socket.socket) -> None:
        with self._lock:
            self._socks.discard(sock)
        sock.close()

    def _spawn(self, fn: Any, name: str, *args: Any) -> None:
        def run() -> None:
            try:
                fn(*args)
            except (Stopped, EOF):
                pass
            except BaseException as exc:  # noqa: BLE001 - recorded; the test asserts there are none
                if not self._stop.is_set():
                    self.errors.append(exc)

        t = threading.Thread(target=run, name=name, daemon=True)
        self._threads.append(t)
        t.start()

    def _send(self, msgs: list[dict[str, Any]]) -> None:
        assert self._stream is not None
        send_frames(self._stream, encode(msgs), time.monotonic() + OP_TIMEOUT)

    def _store(self, key: Any, value: Any) -> None:
        with self._lock:
            self.data[key] = value

    def _drop(self, key: Any) -> None:
        with self._lock:
            self.data.pop(key, None)
            info = self.segments.pop(key, None)
        if info is not None:
            self.pool.release(info)  # the key left our memory: its name goes at once (§4.7)

    # the scheduler stream (§6, §7.2, §7.3)

    def _stream_loop(self) -> None:
        sock = self._stream
        assert sock is not None
        pending: list[dict[str, Any]] = []
        try:
            while True:
                if self._unregister.is_set():
                    self._send([{"op": "unregister"}])
                    self._unregister.clear()
                try:
                    batch = decode(recv_frames(sock, self.deadline, self._stop_or_unregister()))
                except Stopped:
                    if self._stop.is_set():
                        raise
                    continue  # unregister was asked for: send it at the top of the loop
                if is_lease_ack(batch):
                    continue  # §4.8: we never send lease ids; nothing to end
                for msg in batch if isinstance(batch, list) else [batch]:
                    if not isinstance(msg, dict):
                        continue
                    op = msg.get("op")
                    self.ops_received.append(str(op))
                    if op == "compute-task":
                        if msg.get("shm"):
                            self.shm_hints += 1
                        pending.append(msg)
                    elif op == "free-keys":
                        keys = list(msg.get("keys") or ())
                        pending = [m for m in pending if m["key"] not in keys]
                        for k in keys:
                            self._drop(k)
                        with self.cond:
                            self.freed.update(keys)
                            self.cond.notify_all()
                    elif op == "close":
                        self.closed_by_scheduler.set()
                        return
                    # unknown ops are ignored (§6)
                pending.sort(key=lambda m: list(m.get("priority") or [0]))
                while pending:
                    acks: list[int] = []
                    out = self._compute(pending.pop(0), acks)
                    if acks:
                        # a message of its own, never inside a stream array (§4.8)
                        send_frames(sock, encode({"op": LEASE_ACK, "ids": acks}), time.monotonic() + OP_TIMEOUT)
                        count("acks-sent")
                    self._send(out)
        except EOF:
            pass
        finally:
            self.stream_ended.set()
            self._untrack(sock)

    def _stop_or_unregister(self) -> _AnyEvent:
        # a read between messages wakes up both to stop and to send unregister
        return _AnyEvent(self._stop, self._unregister)

    def _finished(self, key: Any, value: Any, duration: float | None = None) -> dict[str, Any]:
        msg: dict[str, Any] = {"op": "task-finished", "key": key, "nbytes": sys.getsizeof(value)}
        if duration is not None:
            msg["duration"] = duration  # optional (§7.3)
        info = self.segments.get(key)
        if info is not None:
            msg["shm"] = info  # optional: the value also lies in this segment (§7.3, §4.7)
        return msg

    def _fetch(self, dep: Any, holders: list[str], info: Any, out: list[dict[str, Any]]) -> tuple[bool, Any]:
        """A dependency's value: mapped from its segment, else fetched from a holder."""
        if info is not None and self.shm:
            try:
                return True, attach(info)  # §7.2 "shm": no holder involved
            except (OSError, ValueError, TypeError, WireError, pickle.UnpicklingError):
                pass  # fall back to get-data
        for holder in [h for h in holders if h != self.address]:
            try:
                got = get_data(holder, self.host_id, [dep], self.shm, secret=self.secret)
            except (WireError, EOF, OSError):  # OSError covers timeouts and refusals
                got = {}
            if dep in got:
                return True, got[dep]
            out.append({"op": "missing-data", "key": dep, "errant_worker": holder})
        return False, None

    def _compute(self, msg: dict[str, Any], acks: list[int]) -> list[dict[str, Any]]:
        key = msg["key"]
        if key in self.data:
            return [self._finished(key, self.data[key])]
        deps: dict[Any, Any] = {}
        out: list[dict[str, Any]] = []
        segment_infos = msg.get("shm") or {}
        for dep, holders in (msg.get("who_has") or {}).items():
            if dep in self.data:
                deps[dep] = self.data[dep]
                continue
            ok, value = self._fetch(dep, holders, segment_infos.get(dep), out)
            if ok:
                deps[dep] = value
                continue
            if self.address in holders:
                out.append({"op": "missing-data", "key": dep, "errant_worker": self.address})
            return [*out, {"op": "reschedule", "key": key}]
        start = time.perf_counter()
        try:
            spec = value_of(msg["payload"], acks)
            value = spec.func(*substitute(spec.args, deps), **substitute(spec.kwargs, deps))
        except Exception as exc:  # noqa: BLE001 - the task's error, whatever it is
            try:
                exception: Any = pickled(exc)
            except Exception:  # noqa: BLE001 - unpicklable: nil, the text still tells
                exception = None
            return [*out, {
                "op": "task-erred", "key": key, "exception": exception,
                "traceback": "".join(traceback.format_exception(exc)),
                "text": f"{type(exc).__name__}: {exc}",
            }]
        duration = time.perf_counter() - start
        info = self.pool.place(value) if self.shm else None
        with self._lock:
            self.data[key] = value
            if info is not None:
                self.segments[key] = info
        return [*out, self._finished(key, value, duration)]

    # peers and clients (§8)

    def _accept_loop(self) -> None:
        listener = self._listener
        assert listener is not None
        listener.settimeout(POLL)
        while not self._stop.is_set():
            try:
                conn, peer = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                raise
            assert peer[0] == "127.0.0.1"
            self._track(conn)
            self._spawn(self._serve, "foreign-peer", conn)

    def _serve(self, conn: socket.socket) -> None:
        try:
            hs = handshake(conn, self.host_id, time.monotonic() + 10.0, self._stop, shm=self.shm,
                           secret=self.secret, connector=False)
            self.peer_handshakes.append(hs)
            while True:
                msg = decode(recv_frames(conn, self.deadline, self._stop))
                if is_lease_ack(msg):
                    continue  # §4.8: not a request, never answered
                if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
                    return  # not a request: close
                op = msg["op"]
                acks: list[int] = []
                if op == "get-data":
                    response: dict[str, Any] = self._get_data(list(msg.get("keys") or ()))
                elif op == "update-data":
                    values = {k: value_of(v, acks) for k, v in (msg.get("data") or {}).items()}
                    for k, v in values.items():
                        self._store(k, v)
                    response = {"status": "OK", "result": {"nbytes": {k: sys.getsizeof(v) for k, v in values.items()}}}
                elif op == "has-keys":
                    response = self._has_keys(list(msg.get("keys") or ()))
                elif op == "identity":
                    response = {"status": "OK", "result": {"address": self.address, "nthreads": 1,
                                                           "name": self.name, "pid": os.getpid(),
                                                           "host": self.host_id}}
                else:
                    response = {"status": "error", "type": "builtins.ValueError",
                                "message": f"foreign worker has no handler for op {op!r}",
                                "traceback": "", "exception": None}
                if acks:
                    # before the response: the requester reads nothing after it (§4.8)
                    send_frames(conn, encode({"op": LEASE_ACK, "ids": acks}), time.monotonic() + OP_TIMEOUT)
                    count("acks-sent")
                if msg.get("reply", True):
                    send_frames(conn, encode(response), time.monotonic() + OP_TIMEOUT)
        finally:
            self._untrack(conn)


    def _get_data(self, keys: list[Any]) -> dict[str, Any]:
        """The response to get-data (§8.1): the values held of ``keys``."""
        with self._lock:
            held = {k: self.data[k] for k in keys if k in self.data}
        self.served.extend(held)
        return {"status": "OK", "result": {"data": {k: pickled(v) for k, v in held.items()}}}

    def _has_keys(self, keys: list[Any]) -> dict[str, Any]:
        """The response to has-keys (§8.2): those of ``keys`` held here."""
        with self._lock:
            held = [k for k in keys if k in self.data]
        return {"status": "OK", "result": {"held": held}}


class _AnyEvent:
    """``is_set()`` when any of the events is set."""

    def __init__(self, *events: threading.Event):
        self.events = events

    def is_set(self) -> bool:
        return any(e.is_set() for e in self.events)
