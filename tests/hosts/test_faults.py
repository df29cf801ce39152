"""Faults between test hosts, made in host 2's namespace: packets lost at random
(nftables), 20 ms of latency with 1% loss (an NFQUEUE listener holds every packet that
comes in to host 2, :mod:`shoal.netdelay`, since this machine's kernel has no netem), and
partitions (every packet dropped) for less, then for longer, than the liveness timeout
(``worker-ttl``).

The cluster is the one of test_three_hosts.py (scheduler and client on host 0, two
workers on each of hosts 1 and 2) with a short timeout: 4 s, heartbeats every 0.25 s.
The tests run in file order: loss, latency and the short partition first, on the
cluster as it started."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hostcluster import ClientSession, host_cluster

pytestmark = pytest.mark.timeout(240)

TTL = 4.0
# connections whose peer is silent for 3 s are broken (tcp-timeout): a fetch from a host
# behind the partition fails, instead of waiting for the kernel's retransmissions
SETTINGS = {"SHOAL_WORKER_TTL": str(TTL), "SHOAL_HEARTBEAT_INTERVAL": "0.25", "SHOAL_CONNECT_TIMEOUT": "3",
            "SHOAL_TCP_TIMEOUT": "3"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    if shutil.which("nft") is None:
        pytest.fail("partitions between test hosts need nft (Debian's nftables)")
    with host_cluster(tmp_path_factory.mktemp("partitions"), env=SETTINGS) as c:
        yield c


@pytest.fixture
def session(cluster: dict[str, Any]) -> Iterator[ClientSession]:
    s = ClientSession(cluster)
    yield s
    cluster["hosts"][2].heal()
    s.close()


@pytest.mark.parametrize("fault", ["loss", "latency"])
def test_with_packets_lost_or_late_between_hosts_results_are_right(cluster: dict[str, Any],
                                                                  session: ClientSession, fault: str) -> None:
    host2 = cluster["hosts"][2]
    if fault == "loss":
        host2.lose(3)
    else:  # every packet that comes in to host 2 waits 20 ms, and 1% are lost
        host2.delay(20)
        host2.lose(1)
    out = session.step("""
import numpy as np
from operator import add
(a1, a2), (b1, b2) = W["host1"], W["host2"]
big = c.submit(np.full, 2 << 20, 3.0, workers=[a1], key="lossy-big")  # 16 MB to host 2
read = c.submit(lambda a: float(a.sum()), big, workers=[b1], key="lossy-read")
every = [a1, a2, b1, b2]
xs = [c.submit(lambda i: i * i, i, workers=[every[i % 4]], key=f"lossy-sq-{i}") for i in range(40)]
while len(xs) > 1:
    xs = [c.submit(add, a, b) for a, b in zip(xs[::2], xs[1::2])] + ([xs[-1]] if len(xs) % 2 else [])
out = {"read": read.result(timeout=120), "tree": xs[0].result(timeout=120),
       "workers": sorted(c.scheduler_info()["workers"])}
""".replace("lossy-", f"{fault}-"))
    held = host2.packets_delayed
    host2.heal()
    assert (host2.packets_delayed > held) == (fault == "latency")
    assert out["read"] == 3.0 * (2 << 20)
    assert out["tree"] == sum(i * i for i in range(40))
    assert out["workers"] == sorted(sum(cluster["workers"].values(), []))


def test_a_partition_shorter_than_the_timeout_recomputes_nothing(cluster: dict[str, Any],
                                                                session: ClientSession) -> None:
    host2 = cluster["hosts"][2]
    before = session.step("""
import numpy as np
b1, b2 = W["host2"]
x = c.submit(lambda: np.random.default_rng().random(1 << 16), workers=[b1], key="short-x", pure=False)
first = float(x.result().sum())
out = {"sum": first, "workers": sorted(c.scheduler_info()["workers"]), "holders": c.who_has()["short-x"]}
""")
    host2.partition()
    time.sleep(TTL / 4)  # how long the link is down: a quarter of the timeout
    host2.heal()
    after = session.step("""
y = c.submit(lambda a: float(a.sum()), x, workers=[b2], key="short-y")
out = {"sum": y.result(timeout=60), "workers": sorted(c.scheduler_info()["workers"]),
       "holders": c.who_has()["short-x"], "again": float(x.result().sum())}
""")
    # nobody was removed, and x was not computed again (it is random: a new run differs)
    assert after["workers"] == before["workers"] == sorted(sum(cluster["workers"].values(), []))
    assert after["holders"][:1] == before["holders"] == [cluster["workers"]["host2"][0]]
    assert after["sum"] == after["again"] == before["sum"]


def test_a_partition_longer_than_the_timeout_moves_the_work_and_its_workers_rejoin_empty(
        cluster: dict[str, Any], session: ClientSession) -> None:
    host2 = cluster["hosts"][2]
    host1_workers, host2_workers = cluster["workers"]["host1"], cluster["workers"]["host2"]
    before = session.step("""
import numpy as np
(a1, a2), (b1, b2) = W["host1"], W["host2"]
# values on host 2, which may be computed elsewhere too
xs = [c.submit(lambda i: np.full(1 << 16, float(i)), i, workers=[b], allow_other_workers=True,
               key=f"long-x-{i}") for i, b in enumerate([b1, b2, b1, b2])]
shoal.wait(xs)
# host 1's workers have fetched from host 2's before: their pools keep those connections,
# which the partition leaves open but dead
warm = [c.submit(lambda i: i, i, workers=[b], key=f"long-warm-{b}") for i, b in enumerate([b1, b2])]
got = [c.submit(lambda *v: sum(v), *warm, workers=[a], key=f"long-fetch-{a}") for a in (a1, a2)]
assert [g.result(timeout=60) for g in got] == [1, 1]
out = {"holders": {k: v for k, v in c.who_has().items() if k.startswith("long-x")}}
""")
    assert {w for ws in before["holders"].values() for w in ws} <= set(host2_workers)
    host2.partition()
    # a task on host 1 that needs them: it gets them once host 2's workers are removed
    # and the values are computed again on host 1
    during = session.step("""
total = c.submit(lambda *a: float(sum(x.sum() for x in a)), *xs, workers=[a1], key="long-total")
out = {"total": total.result(timeout=120), "workers": sorted(c.scheduler_info()["workers"]),
       "holders": {k: v for k, v in c.who_has().items() if k.startswith("long-x")}}
""")
    assert during["total"] == float((1 << 16) * sum(range(4)))
    assert during["workers"] == sorted(host1_workers)
    assert {w for ws in during["holders"].values() for w in ws} <= set(host1_workers)
    host2.heal()
    # host 2's worker processes find their connection gone and join again, as new
    # workers that hold nothing: no value of before the partition comes back
    after = session.step("""
c.wait_for_workers(4, timeout=120)
info = c.scheduler_info()["workers"]
values = c.gather(xs)
out = {"workers": sorted(info), "has_what": {w: list(k) for w, k in c.has_what().items()},
       "sums": [float(v.sum()) for v in values],
       "holders": {k: v for k, v in c.who_has().items() if k.startswith("long-x")}}
""")
    new = sorted(set(after["workers"]) - set(host1_workers))
    assert len(new) == 2 and not set(new) & set(host2_workers), after["workers"]
    assert all(not after["has_what"].get(w) for w in new), after["has_what"]
    assert {w for ws in after["holders"].values() for w in ws} <= set(host1_workers)
    assert after["sums"] == [float((1 << 16) * i) for i in range(4)]
