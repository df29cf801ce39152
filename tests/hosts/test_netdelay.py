"""Latency between test hosts (:meth:`shoal.testhosts.Host.delay`, the NFQUEUE listener of
:mod:`shoal.netdelay`): packets coming in to a delayed host wait, nothing is lost or
reordered, and healing lets every packet through again."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from hostcluster import require_hosts

from shoal.netdelay import Delay
from shoal.testhosts import TestHosts

pytestmark = pytest.mark.timeout(120)

# host 1: a server that answers each connection with the sha256 of what it was sent
_SERVER = r"""
import hashlib, socket, sys
s = socket.socket()
s.bind((sys.argv[1], 9100))
s.listen(16)
print("READY", flush=True)
while True:
    c, _ = s.accept()
    h = hashlib.sha256()
    while True:
        data = c.recv(1 << 20)
        if not data:
            break
        h.update(data)
    c.sendall(h.hexdigest().encode())
    c.close()
"""

# host 0: connects a few times, sends `nbytes` on the last connection; prints the connect
# times (the handshake's round trip) and whether the server saw the same bytes
_CLIENT = r"""
import hashlib, json, os, socket, sys, time
ip, nbytes = sys.argv[1], int(sys.argv[2])
payload = os.urandom(nbytes)
connects = []
for _ in range(3):
    t = time.perf_counter()
    s = socket.create_connection((ip, 9100), timeout=30)
    connects.append(time.perf_counter() - t)
    s.shutdown(socket.SHUT_WR)
    s.recv(100)
    s.close()
s = socket.create_connection((ip, 9100), timeout=30)
s.sendall(payload)
s.shutdown(socket.SHUT_WR)
digest = b""
while len(digest) < 64:
    part = s.recv(100)
    if not part:
        break
    digest += part
print(json.dumps({"connects": connects, "same": digest.decode() == hashlib.sha256(payload).hexdigest()}))
"""


@pytest.fixture(scope="module")
def hosts() -> Iterator[TestHosts]:
    require_hosts()
    with TestHosts(2, shm_size="16m") as th:
        server = th[1].popen([sys.executable, "-c", _SERVER, th[1].ip], stdout=subprocess.PIPE, text=True)
        assert server.stdout is not None and server.stdout.readline().strip() == "READY"
        yield th


def _talk(hosts: TestHosts, nbytes: int) -> dict[str, Any]:
    done = hosts[0].run([sys.executable, "-c", _CLIENT, hosts[1].ip, str(nbytes)], timeout=90)
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


def test_a_delayed_host_answers_no_sooner_than_its_delay_and_loses_nothing(hosts: TestHosts) -> None:
    h1 = hosts[1]
    h1.delay(30)
    try:
        out = _talk(hosts, 8 << 20)
    finally:
        h1.heal()
    # a connection's handshake waits for the SYN to reach host 1, which the listener held
    assert min(out["connects"]) >= 0.030
    assert out["same"]  # 8 MB into the delayed host, intact and in order
    assert h1.packets_delayed > 0


def test_healing_lets_every_packet_through_and_a_new_delay_replaces_the_old(hosts: TestHosts) -> None:
    h1 = hosts[1]
    h1.delay(5)
    h1.delay(25)  # the 5 ms listener stops; one rule and one listener remain
    rules = subprocess.run(["ip", "netns", "exec", h1.netns, "iptables-legacy", "-S", "INPUT"],
                           capture_output=True, text=True, timeout=30).stdout
    assert rules.count("NFQUEUE") == 1
    try:
        out = _talk(hosts, 1 << 20)
    finally:
        h1.heal()
    assert min(out["connects"]) >= 0.025 and out["same"]
    rules = subprocess.run(["ip", "netns", "exec", h1.netns, "iptables-legacy", "-S", "INPUT"],
                           capture_output=True, text=True, timeout=30).stdout
    assert "NFQUEUE" not in rules
    assert _talk(hosts, 1 << 20)["same"]  # healed: the link works with no listener


def test_bad_delays_are_refused(hosts: TestHosts) -> None:
    for ms in (0, -5, 20_000):
        with pytest.raises(ValueError, match="delay"):
            hosts[1].delay(ms)
    with pytest.raises(ValueError, match="queue"):
        Delay(70_000, 20)
    with pytest.raises(ValueError, match="delay"):
        Delay(1, 0)
    assert _talk(hosts, 1024)["same"]  # nothing was left in the link's way
