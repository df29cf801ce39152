"""Connections that never finish their handshake, for test_strangers.py; run as
``python flooder.py SPEC`` (a JSON object), in a process of its own (its descriptors and
its CPU are not the test's).

SPEC: ``targets`` (a list of ``[host, port, tls]``), ``count`` (connections per target),
``protocol`` (the shoal protocol version its handshakes name),
``slow`` (the fraction of them that dribble bytes), ``reconnect`` (open a new one for
each the peer closes, so that ``count`` are always trying), ``interval`` (seconds
between two bytes of a slow connection).

- silent: connects and sends nothing (it reads, and drops, what the peer sends);
- slow: connects and sends the first message of a handshake a byte at a time (tcp: the
  shoal ``handshake`` of docs/protocol.md §3; tls: a TLS ClientHello), then nothing.

It prints ``ready {...}`` once every target has had ``count`` connections established
(its counts, JSON), floods until its stdin closes, closes every socket, and prints
``done {...}`` with the final counts per target: ``opened`` (connects that succeeded),
``closed`` (closed by the peer), ``failed`` (connects that failed).
"""

from __future__ import annotations

import errno
import json
import os
import resource
import selectors
import socket
import ssl
import struct
import sys
import time
from typing import Any

import msgpack


def _shoal_hello(protocol: int) -> bytes:
    msg = msgpack.packb({"op": "handshake", "protocol": protocol, "nonce": os.urandom(32), "auth": True},
                       use_bin_type=True)
    return struct.pack("<QQ", 1, len(msg)) + msg


def _client_hello() -> bytes:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_side=False)
    try:
        obj.do_handshake()
    except ssl.SSLWantReadError:
        pass
    return outgoing.read()


class Slot:
    __slots__ = ("target", "slow", "sock", "connected", "sent", "next_byte")

    def __init__(self, target: int, slow: bool):
        self.target = target
        self.slow = slow
        self.sock: socket.socket | None = None
        self.connected = False
        self.sent = 0
        self.next_byte = 0.0


class Flood:
    def __init__(self, spec: dict[str, Any]):
        self.targets = [(str(h), int(p), bool(t)) for h, p, t in spec["targets"]]
        self.count = int(spec["count"])
        self.reconnect = bool(spec.get("reconnect", True))
        self.interval = float(spec.get("interval", 0.2))
        slow_every = spec.get("slow", 0.5)
        self.payloads = {False: _shoal_hello(int(spec["protocol"])), True: _client_hello()}
        self.sel = selectors.DefaultSelector()
        self.again: list[Slot] = []
        self.stats = [{"opened": 0, "closed": 0, "failed": 0} for _ in self.targets]
        self.slots = [Slot(t, i < self.count * slow_every) for t in range(len(self.targets))
                      for i in range(self.count)]

    def _open(self, slot: Slot) -> None:
        host, port, _ = self.targets[slot.target]
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        slot.sock, slot.connected, slot.sent = sock, False, 0
        err = sock.connect_ex((host, port))
        if err not in (0, errno.EINPROGRESS):
            self._lost(slot, failed=True)
            return
        self.sel.register(sock, selectors.EVENT_WRITE, slot)

    def _lost(self, slot: Slot, failed: bool = False) -> None:
        sock = slot.sock
        if sock is not None:
            try:
                self.sel.unregister(sock)
            except (KeyError, ValueError):
                pass
            sock.close()
        slot.sock = None
        self.stats[slot.target]["failed" if failed else "closed"] += 1
        if self.reconnect:
            self.again.append(slot)  # on the next turn (a connect that fails at once would recurse)

    def _event(self, slot: Slot, mask: int) -> None:
        sock = slot.sock
        assert sock is not None
        if not slot.connected:
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                self._lost(slot, failed=True)
                return
            slot.connected = True
            slot.next_byte = time.monotonic() + self.interval
            self.stats[slot.target]["opened"] += 1
            self.sel.modify(sock, selectors.EVENT_READ, slot)
            return
        try:
            data = sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._lost(slot)

    def _dribble(self, now: float) -> None:
        for slot in self.slots:
            if not (slot.slow and slot.connected and slot.sock is not None) or slot.next_byte > now:
                continue
            payload = self.payloads[self.targets[slot.target][2]]
            if slot.sent >= len(payload):
                continue
            try:
                slot.sock.send(payload[slot.sent:slot.sent + 1])
                slot.sent += 1
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                self._lost(slot)
                continue
            slot.next_byte = now + self.interval

    def ready(self) -> bool:
        return all(s["opened"] >= self.count for s in self.stats)

    def run(self, stdin_fd: int) -> None:
        self.sel.register(stdin_fd, selectors.EVENT_READ, None)
        for slot in self.slots:
            self._open(slot)
        said_ready = False
        last_dribble = 0.0
        while True:
            for key, mask in self.sel.select(0.05):
                if key.data is None:
                    if not os.read(stdin_fd, 4096):
                        return
                    continue
                self._event(key.data, mask)
            again, self.again = self.again, []
            for slot in again:
                self._open(slot)
            now = time.monotonic()
            if now - last_dribble >= 0.02:
                self._dribble(now)
                last_dribble = now
            if not said_ready and self.ready():
                said_ready = True
                print("ready", json.dumps(self.stats), flush=True)

    def close(self) -> None:
        for slot in self.slots:
            if slot.sock is not None:
                slot.sock.close()
                slot.sock = None
        self.sel.close()


def main() -> int:
    spec = json.loads(sys.argv[1])
    need = len(spec["targets"]) * int(spec["count"]) + 64
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            print(f"error: needs {need} descriptors, the hard limit is {hard}", flush=True)
            return 2
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    flood = Flood(spec)
    try:
        flood.run(sys.stdin.fileno())
    finally:
        flood.close()
    print("done", json.dumps(flood.stats), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
