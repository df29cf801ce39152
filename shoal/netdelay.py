"""Latency for a test host's link, on a kernel without netem: a listener on a netfilter
queue (``NFQUEUE``) that holds each packet for a fixed time before it lets it go.

Theory of operation
-------------------
An iptables rule in the host's namespace sends the packets that come in on its link to
queue ``N`` (:meth:`shoal.testhosts.Host.delay` adds it, with ``--queue-bypass`` so that
packets pass when no listener is bound). The kernel holds each queued packet until a
listener gives its verdict. This listener binds the queue over a netlink socket
(``NETLINK_NETFILTER``, the nfnetlink_queue messages of
``linux/netfilter/nfnetlink_queue.h``), asks for the packets' metadata only (never
their bytes), notes each packet's id with the time it arrived, and accepts it ``ms``
milliseconds later.

The delay is the same for every packet, so packets leave in the order they came, and
one batch verdict ("accept every id up to this one") lets go of all that are due. The
kernel numbers a queue's packets in order, so a batch verdict also lets go of a packet
whose message the listener missed.

Run as ``python -m shoal.netdelay QUEUE MS`` in the host's namespace (root). It prints
``bound`` once the queue is its own; on SIGTERM or SIGINT it lets every held packet go,
unbinds and prints how many packets it held.
"""

from __future__ import annotations

import collections
import os
import select
import signal
import socket
import struct
import sys
import time

__all__ = ["Delay", "check_delay", "main"]

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_CONFIG, NFQNL_MSG_VERDICT_BATCH = 0, 2, 3
NFQA_PACKET_HDR, NFQA_VERDICT_HDR = 1, 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN, NFQA_CFG_MASK, NFQA_CFG_FLAGS = 1, 2, 3, 4, 5
NFQNL_CFG_CMD_BIND, NFQNL_CFG_CMD_UNBIND = 1, 2
NFQNL_COPY_META = 1
NFQA_CFG_F_GSO = 4  # hand GSO packets over whole: fewer, larger packets
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG_ERROR = 2
NF_ACCEPT = 1
SO_RCVBUFFORCE = 33
SOL_NETLINK, NETLINK_NO_ENOBUFS = 270, 5

_HEADER = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, sequence, port id
_ATTR = struct.Struct("=HH")  # nlattr: length, type
_PACKET_HDR = struct.Struct("!IHB")  # nfqnl_msg_packet_hdr: id, hw protocol, hook


def _attr(kind: int, payload: bytes) -> bytes:
    raw = _ATTR.pack(_ATTR.size + len(payload), kind) + payload
    return raw + b"\0" * (-len(raw) % 4)


def check_delay(ms: float) -> None:
    """Raise ``ValueError`` unless ``ms`` is a delay this listener holds packets for."""
    if not 0 < ms <= 10_000:
        raise ValueError(f"a delay is more than 0 and at most 10,000 ms, not {ms!r}")


class Delay:
    """Holds the packets of netfilter queue ``queue`` for ``ms`` milliseconds each."""

    def __init__(self, queue: int, ms: float, max_held: int = 1 << 16):
        if not 0 <= queue < 1 << 16:
            raise ValueError(f"a queue number is 0-65535, not {queue!r}")
        check_delay(ms)
        self.queue = queue
        self.delay = ms / 1000.0
        self.held = 0  # packets held so far
        self._due: collections.deque[tuple[float, int]] = collections.deque()  # (due time, packet id)
        self._seq = 0
        self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 32 << 20)
            self._sock.setsockopt(SOL_NETLINK, NETLINK_NO_ENOBUFS, 1)
            self._sock.bind((0, 0))
            self._config(_attr(NFQA_CFG_CMD, struct.pack("!BBH", NFQNL_CFG_CMD_BIND, 0, socket.AF_INET)))
            self._config(_attr(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META))
                         + _attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", max_held)))
            self._config(_attr(NFQA_CFG_MASK, struct.pack("!I", NFQA_CFG_F_GSO))
                         + _attr(NFQA_CFG_FLAGS, struct.pack("!I", NFQA_CFG_F_GSO)))
        except BaseException:
            self._sock.close()
            raise
        self._sock.setblocking(False)

    def _send(self, msg: int, attrs: bytes, flags: int) -> int:
        self._seq += 1
        body = struct.pack("=BB", socket.AF_UNSPEC, 0) + struct.pack("!H", self.queue) + attrs
        kind = NFNL_SUBSYS_QUEUE << 8 | msg
        self._sock.send(_HEADER.pack(_HEADER.size + len(body), kind, NLM_F_REQUEST | flags, self._seq, 0) + body)
        return self._seq

    def _config(self, attrs: bytes) -> None:
        """Send a config message and wait for the kernel's answer (an error or 0)."""
        seq = self._send(NFQNL_MSG_CONFIG, attrs, NLM_F_ACK)
        while True:
            data = self._sock.recv(1 << 16)
            for kind, got, body in self._messages(data):
                if kind == NLMSG_ERROR and got == seq:
                    (error,) = struct.unpack_from("=i", body)
                    if error:
                        raise OSError(-error, f"nfnetlink_queue config of queue {self.queue}: {os.strerror(-error)}")
                    return

    @staticmethod
    def _messages(data: bytes) -> list[tuple[int, int, memoryview]]:
        out = []
        view = memoryview(data)
        at = 0
        while at + _HEADER.size <= len(data):
            length, kind, _flags, seq, _port = _HEADER.unpack_from(data, at)
            if length < _HEADER.size:
                break
            out.append((kind, seq, view[at + _HEADER.size:at + length]))
            at += (length + 3) & ~3
        return out

    def fileno(self) -> int:
        return self._sock.fileno()

    def take(self) -> None:
        """Note the packets that have come, each due ``delay`` from now."""
        due = time.monotonic() + self.delay
        packet = NFNL_SUBSYS_QUEUE << 8 | NFQNL_MSG_PACKET
        while True:
            try:
                data = self._sock.recv(1 << 16)
            except BlockingIOError:
                return
            for kind, _seq, body in self._messages(data):
                if kind != packet:
                    continue
                at = 4  # past nfgenmsg
                while at + _ATTR.size <= len(body):
                    length, attr = _ATTR.unpack_from(body, at)
                    if length < _ATTR.size:
                        break
                    if attr & 0x3FFF == NFQA_PACKET_HDR:
                        (packet_id, _, _) = _PACKET_HDR.unpack_from(body, at + _ATTR.size)
                        self._due.append((due, packet_id))
                        self.held += 1
                        break
                    at += (length + 3) & ~3

    def release(self, everything: bool = False) -> float | None:
        """Let go of the packets that are due (every held one with ``everything``); the
        seconds until the next is due, or None when none is held."""
        now = time.monotonic()
        last = None
        while self._due and (everything or self._due[0][0] <= now):
            last = self._due.popleft()[1]
        if last is not None:
            self._send(NFQNL_MSG_VERDICT_BATCH, _attr(NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, last)), 0)
        return max(0.0, self._due[0][0] - now) if self._due else None

    def close(self) -> None:
        try:
            self.release(everything=True)
            self._sock.setblocking(True)
            self._config(_attr(NFQA_CFG_CMD, struct.pack("!BBH", NFQNL_CFG_CMD_UNBIND, 0, socket.AF_INET)))
        except OSError:
            pass  # the socket's close unbinds too
        finally:
            self._sock.close()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m shoal.netdelay QUEUE MS", file=sys.stderr)
        return 2
    delay = Delay(int(args[0]), float(args[1]))
    # a signal writes to this pipe, which wakes the select (a handler alone would not:
    # select is restarted after it)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    print("bound", flush=True)
    wait: float | None = None
    try:
        while True:
            ready, _, _ = select.select([delay.fileno(), wake_r], [], [], wait)
            if wake_r in ready:
                break
            if ready:
                delay.take()
            wait = delay.release()
    finally:
        delay.close()
        os.close(wake_r)
        os.close(wake_w)
    print(f"held {delay.held}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
