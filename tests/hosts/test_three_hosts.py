"""Three test hosts (network namespaces, each with its own /dev/shm): the scheduler on
host 0 (where the client runs too), two worker processes on each of hosts 1 and 2,
all started with the CLI. The client code runs in a process on host 0."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from hostcluster import host_cluster, on_client_host

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    with host_cluster(tmp_path_factory.mktemp("hosts")) as c:
        yield c


def test_the_hosts_see_each_other_only_through_their_addresses(cluster: dict[str, Any]) -> None:
    hosts = cluster["hosts"]
    assert len({h.ip for h in hosts}) == 3 and all(h.ip.startswith("198.18.") for h in hosts)
    # each host's /dev/shm is its own tmpfs
    probe = hosts[1].run(["sh", "-c", "touch /dev/shm/shoal-probe-file && ls /dev/shm"])
    assert "shoal-probe-file" in probe.stdout
    assert "shoal-probe-file" in hosts[1].shm_files() and "shoal-probe-file" not in hosts[2].shm_files()
    os.unlink(os.path.join(hosts[1].shm_dir, "shoal-probe-file"))


def test_a_task_graph_runs_across_hosts(cluster: dict[str, Any]) -> None:
    out = on_client_host(cluster, """
from operator import add
every = W["host1"] + W["host2"]
xs = [c.submit(lambda i: i * i, i, workers=[every[i % 4]], key=f"sq-{i}") for i in range(40)]
while len(xs) > 1:
    xs = [c.submit(add, a, b) for a, b in zip(xs[::2], xs[1::2])] + ([xs[-1]] if len(xs) % 2 else [])
out = {"total": c.gather(xs[0]), "where": sorted(set(w for ws in c.who_has().values() for w in ws))}
""")
    assert out["total"] == sum(i * i for i in range(40))
    assert set(out["where"]) <= set(cluster["workers"]["host1"] + cluster["workers"]["host2"])


def test_a_large_value_crosses_hosts_over_tcp_once_and_is_then_mapped_there(cluster: dict[str, Any]) -> None:
    out = on_client_host(cluster, """
import numpy as np
(a1, _), (b1, b2) = W["host1"], W["host2"]
before = c.run(lambda dask_worker: dask_worker.transfer_stats())
x = c.submit(np.full, 4 << 20, 7.0, workers=[a1], key="big")  # 32 MB, made on host 1
# read on host 2 by one worker, then by the other
first = c.submit(lambda a: float(a.sum()), x, workers=[b1], key="on-b1").result()
holders = sorted(c.who_has()["big"])
second = c.submit(lambda a: float(a.sum()), x, workers=[b2], key="on-b2").result()
after = c.run(lambda dask_worker: dask_worker.transfer_stats())
out = {"sums": [first, second], "before": before, "after": after, "a1": a1, "b1": b1, "b2": b2,
       "holders": holders}
""")
    size = 8 * (4 << 20)
    assert out["sums"] == [7.0 * (4 << 20)] * 2
    moved = {w: {path: out["after"][w][path] - out["before"][w][path] for path in ("tcp", "shm")}
             for w in out["after"]}
    a1, b1, b2 = out["a1"], out["b1"], out["b2"]
    # the maker served it over tcp once (to b1), which keeps it for its host...
    assert size <= moved[a1]["tcp"] < 2 * size, moved
    assert out["holders"] == sorted([a1, b1])
    # ...and b2, on b1's host, mapped b1's segment: no second crossing, nobody served it
    assert moved[b2]["shm"] >= size and moved[b2]["tcp"] < size and moved[b1]["tcp"] < size, moved


def test_two_workers_of_a_host_reading_a_value_at_once_take_it_across_once(cluster: dict[str, Any]) -> None:
    out = on_client_host(cluster, """
import numpy as np
(a1, _), (b1, b2) = W["host1"], W["host2"]
before = c.run(lambda dask_worker: dask_worker.transfer_stats())
x = c.submit(np.full, 4 << 20, 3.0, workers=[a1], key="shared-big")  # 32 MB, made on host 1
shoal.wait([x])
# both readers of host 2 at once: b2 asks b1, the host's fetcher, which answers once it has it
r1 = c.submit(lambda a: float(a.sum()), x, workers=[b1], key="read-b1")
r2 = c.submit(lambda a: float(a.sum()), x, workers=[b2], key="read-b2")
sums = c.gather([r1, r2])
after = c.run(lambda dask_worker: dask_worker.transfer_stats())
out = {"sums": sums, "before": before, "after": after, "a1": a1, "b1": b1, "b2": b2}
""")
    size = 8 * (4 << 20)
    assert out["sums"] == [3.0 * (4 << 20)] * 2
    moved = {w: {path: out["after"][w][path] - out["before"][w][path] for path in ("tcp", "shm")}
             for w in out["after"]}
    a1, b1, b2 = out["a1"], out["b1"], out["b2"]
    assert size <= moved[a1]["tcp"] < 2 * size, moved  # it crossed once...
    # ...and b1 handed its copy to b2 through shared memory
    assert moved[b1]["shm"] >= size and moved[b1]["tcp"] < size and moved[b2]["tcp"] < size, moved


def test_a_value_from_another_host_lands_in_a_pooled_segment_and_is_kept_without_a_copy(
        cluster: dict[str, Any]) -> None:
    out = on_client_host(cluster, """
import numpy as np
from shoal.comm import shm
from shoal.testing import wait_for
(a1, _), (b1, b2) = W["host1"], W["host2"]
def placements():
    return dict(shm.placements)
def pooled():
    return len(shm.registry.pooled())
rounds = []
for i in range(2):
    x = c.submit(np.full, 2 << 20, float(i + 1), workers=[a1], pure=False)  # 16 MB
    before = c.run(placements, workers=[b1])[b1]
    total = c.submit(lambda a: float(a.sum()), x, workers=[b1], pure=False).result()
    mapped = c.submit(lambda a: float(a.sum()), x, workers=[b2], pure=False).result()  # from b1's segment
    after = c.run(placements, workers=[b1])[b1]
    rounds.append({"sums": [total, mapped], "born": after["born"] - before["born"],
                   "copied": after["copied"] - before["copied"]})
    key = x.key
    held = c.run(pooled, workers=[b1])[b1]
    del x
    # released on b1: its segment goes to b1's pool, where the next value lands
    wait_for(lambda: c.run(pooled, workers=[b1])[b1] > held, timeout=30, what="the segment back in the pool")
out = {"rounds": rounds}
""")
    first, second = out["rounds"]
    n = 2 << 20
    assert first["sums"] == [1.0 * n] * 2 and second["sums"] == [2.0 * n] * 2
    # the first value is copied into a segment (or lands in one an earlier test left)...
    assert first["born"] + first["copied"] == 1
    # ...the second lands where the first was and is kept there as received
    assert second == {"sums": [2.0 * n] * 2, "born": 1, "copied": 0}


def test_scattered_and_broadcast_values_reach_every_host(cluster: dict[str, Any]) -> None:
    out = on_client_host(cluster, """
import numpy as np
(a1, a2), (b1, b2) = W["host1"], W["host2"]
arr = np.arange(1 << 18, dtype="float64")  # 2 MB: kept in segments where it lands
[x] = c.scatter([arr], workers=[a1])
sums = [c.submit(lambda v: float(v.sum()), x, workers=[w], pure=False).result() for w in (b1, b2)]
holders = sorted(c.who_has([x])[x.key])
[y] = c.scatter([arr * 2], broadcast=True)
everywhere = sorted(c.who_has([y])[y.key])
bsums = [c.submit(lambda v: float(v.sum()), y, workers=[w], pure=False).result() for w in (a1, a2, b1, b2)]
out = {"sums": sums, "holders": holders, "everywhere": everywhere, "bsums": bsums, "a1": a1,
       "all": sorted([a1, a2, b1, b2]), "host2": [b1, b2]}
""")
    total = float(sum(range(1 << 18)))
    assert out["sums"] == [total] * 2
    # scattered to a1, read on host 2 twice: it crossed once, to one holder there
    assert len(out["holders"]) == 2 and out["a1"] in out["holders"]
    assert len(set(out["holders"]) & set(out["host2"])) == 1
    # broadcast: a copy on every worker of every host, each of them right
    assert out["everywhere"] == out["all"]
    assert out["bsums"] == [2 * total] * 4


def test_dask_arrays_run_across_hosts(cluster: dict[str, Any]) -> None:
    pytest.importorskip("dask.array")
    out = on_client_host(cluster, """
import dask, dask.array as da
x = da.arange(200_000, chunks=10_000)
with dask.config.set(scheduler=c.get):
    out = {"sum": int((x * 2).sum().compute())}
""")
    assert out["sum"] == 2 * sum(range(200_000))


def test_a_lost_worker_host_process_is_recomputed_elsewhere(cluster: dict[str, Any]) -> None:
    out = on_client_host(cluster, """
import os
x = c.submit(lambda: 41, key="on-lost", pure=False)
shoal.wait([x])
w = c.who_has()["on-lost"][0]
try:
    c.run(lambda: os._exit(1), workers=[w])
except Exception:
    pass
y = c.submit(lambda v: v + 1, x, key="after-loss")
out = {"y": y.result(timeout=60)}
""")
    assert out["y"] == 42
