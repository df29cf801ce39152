"""Large task arguments from a client in the scheduler's process reach worker processes
through shared memory (placed once per task, mapped copy-on-write by the worker)."""

from __future__ import annotations

import os

import numpy as np
import pytest

import shoal
from shoal.comm import shm
from shoal.testing import wait_for

MB = 1 << 20
# the client's advice to scatter large arguments is not what these tests are about
pytestmark = pytest.mark.filterwarnings("ignore:a task of .* MB of arguments:UserWarning")


def total(a):
    return float(a.sum())


def scribble_then_fail_once(a, marker):
    """Writes into its argument, then fails the first time (the task is retried)."""
    writeable = a.flags.writeable
    first = float(a[0])
    a[:] = -1.0
    if not os.path.exists(marker):
        open(marker, "w").close()
        raise RuntimeError("first run fails")
    return writeable, first


@pytest.fixture(scope="module")
def cluster():
    with shoal.LocalCluster(n_workers=2, processes=True) as c:
        yield c
    assert not shm.segments_of(os.getpid())  # the scheduler's process gave its segments back


@pytest.fixture
def client(cluster):
    with shoal.Client(cluster) as c:
        yield c


def _placed() -> set[str]:
    """Segments of this process (the scheduler's) that hold task arguments now."""
    return {n for n in shm.owned() if "-pool" not in n}


def test_a_large_argument_reaches_the_worker_through_shared_memory(client, cluster):
    _, b_addr = cluster.worker_addresses
    a = np.full(4 * MB // 8, 2.0)
    before, placed = client.transfer_stats()[b_addr], _placed()
    y = client.submit(total, a, workers=[b_addr], pure=False)
    assert y.result(timeout=30) == 2.0 * (4 * MB // 8)
    after = client.transfer_stats()[b_addr]
    assert after["shm"] - before["shm"] == a.nbytes
    assert after["tcp"] - before["tcp"] < MB  # the argument did not cross the socket
    assert len(_placed() - placed) == 1  # held for the task while it is known


def test_a_retried_task_maps_the_same_copy_and_sees_no_earlier_writes(client, cluster, tmp_path):
    a = np.full(2 * MB // 8, 7.0)
    placed = _placed()
    y = client.submit(scribble_then_fail_once, a, str(tmp_path / "failed-once"), retries=1, pure=False)
    writeable, first = y.result(timeout=30)
    # the second run got the original values although the first wrote into its input
    assert writeable and first == 7.0
    assert float(a[0]) == 7.0
    assert len(_placed() - placed) == 1  # sent twice, copied once


def test_the_argument_memory_is_reused_once_the_task_is_forgotten(client, cluster):
    _, b_addr = cluster.worker_addresses
    placed = _placed()
    y = client.submit(total, np.ones(3 * MB // 8), workers=[b_addr], pure=False)
    y.result(timeout=30)
    (name,) = _placed() - placed
    del y  # released: the scheduler forgets the task and drops its payload
    wait_for(lambda: name not in shm.owned(), what="the argument's segment to be retired")
    files = set(shm.segments_of(os.getpid()))
    z = client.submit(total, np.full(3 * MB // 8, 2.0), workers=[b_addr], pure=False)
    assert z.result(timeout=30) == 2.0 * (3 * MB // 8)
    # a pooled segment took the new argument (under a new name): no new pages
    assert len(shm.segments_of(os.getpid())) == len(files)


def test_small_arguments_stay_in_the_message(client, cluster):
    _, b_addr = cluster.worker_addresses
    placed = _placed()
    y = client.submit(total, np.ones(1000), workers=[b_addr], pure=False)
    assert y.result(timeout=30) == 1000.0
    # no segment was made for it (an earlier test's may have gone meanwhile)
    assert _placed() <= placed


def test_a_client_in_another_process_hands_its_arguments_over(client, cluster):
    """A client in another process than the scheduler: its transfer segment is taken
    over by the scheduler (which may send the task again) and mapped by the worker."""
    import subprocess
    import sys

    code = (
        "import numpy as np, shoal\n"
        "with shoal.Client(%r) as c:\n"
        "    print(c.submit(np.sum, np.ones(%d), pure=False).result(timeout=30))\n"
    ) % (cluster.scheduler_address, 2 * MB // 8)
    before = sum(s["shm"] for s in client.transfer_stats().values())
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout.strip()) == 2 * MB // 8
    assert sum(s["shm"] for s in client.transfer_stats().values()) - before >= 2 * MB
