"""Same-host transfers through shared memory, on a cluster of worker processes."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

import shoal
from shoal.comm import shm
from shoal.testing import wait_for

MB = 1 << 20


def make(n_bytes, fill=1.0):
    return np.full(n_bytes // 8, fill)


def total(a):
    return float(a.sum())


def scribble(a):
    writeable = a.flags.writeable
    a[:] = -1.0
    return writeable, float(a.sum())


@pytest.fixture(scope="module")
def cluster():
    with shoal.LocalCluster(n_workers=2, processes=True) as c:
        yield c
    for w in getattr(c, "_pids", []):
        assert not shm.segments_of(w)


@pytest.fixture
def client(cluster):
    with shoal.Client(cluster) as c:
        cluster._pids = list(c.run(os.getpid).values())
        yield c


def _pids(client):
    return client.run(os.getpid)


def test_large_values_move_through_shared_memory(client, cluster):
    a_addr, b_addr = cluster.worker_addresses
    before = client.transfer_stats()
    x = client.submit(make, 8 * MB, workers=[a_addr], pure=False)
    y = client.submit(total, x, workers=[b_addr])
    assert y.result(timeout=30) == 8 * MB // 8
    after = client.transfer_stats()
    assert after[b_addr]["shm"] - before[b_addr]["shm"] >= 8 * MB
    assert after[a_addr]["tcp"] - before[a_addr]["tcp"] < MB  # nothing large over tcp
    # the client on this host maps it too
    arr = x.result(timeout=30)
    assert arr.shape == (MB,) and arr.flags.writeable and float(arr[0]) == 1.0


def test_writes_by_one_consumer_are_seen_by_no_one_else(client, cluster):
    a_addr, b_addr = cluster.worker_addresses
    x = client.submit(make, 4 * MB, 2.0, workers=[a_addr], pure=False)
    w1 = client.submit(scribble, x, workers=[b_addr])
    assert w1.result(timeout=30) == (True, -(4 * MB // 8))
    # the owner's copy, a later consumer elsewhere, and the client's copy are unchanged
    assert client.submit(total, x, workers=[a_addr]).result(timeout=30) == 2.0 * (4 * MB // 8)
    assert client.submit(total, x, workers=[b_addr], pure=False).result(timeout=30) == 2.0 * (4 * MB // 8)
    local = x.result(timeout=30)
    local[:] = 7.0
    assert client.submit(total, x, workers=[b_addr], pure=False).result(timeout=30) == 2.0 * (4 * MB // 8)


def _placements():
    return dict(shm.placements)


def _pooled():
    return len(shm.registry.pooled())


def test_arrays_born_in_shared_memory_are_published_without_a_copy(client, cluster):
    a_addr, b_addr = cluster.worker_addresses
    first = client.submit(make, 4 * MB, workers=[a_addr], pure=False)
    shoal.wait([first], timeout=30)
    del first  # its segment retires into worker a's pool
    wait_for(lambda: client.run(_pooled, workers=[a_addr])[a_addr] >= 1, what="a retired segment")
    before = client.run(_placements, workers=[a_addr])[a_addr]
    x = client.submit(make, 4 * MB, 2.0, workers=[a_addr], pure=False)
    shoal.wait([x], timeout=30)
    after = client.run(_placements, workers=[a_addr])[a_addr]
    assert after["born"] == before["born"] + 1 and after["copied"] == before["copied"]
    # the same copy-on-write guarantees as a copied value
    assert client.submit(scribble, x, workers=[b_addr]).result(timeout=30) == (True, -(4 * MB // 8))
    assert client.submit(total, x, workers=[a_addr], pure=False).result(timeout=30) == 2.0 * (4 * MB // 8)
    assert client.submit(total, x, workers=[b_addr], pure=False).result(timeout=30) == 2.0 * (4 * MB // 8)
    assert float(x.result(timeout=30)[0]) == 2.0


def test_a_link_of_a_chain_is_not_placed_and_is_still_served_where_it_is_read_after_all(client, cluster):
    import dask

    a_addr, b_addr = cluster.worker_addresses

    def counts():
        got = client.run(_placements)
        return {w: got[w]["born"] + got[w]["copied"] for w in got}

    before = counts()
    # a chain on one worker: only the end, which the client waits for, is placed
    with dask.annotate(workers=[a_addr]):
        first = dask.delayed(make)(4 * MB, 3.0, dask_key_name="link-1")
        second = dask.delayed(np.add)(first, 1.0, dask_key_name="link-2")
    assert float(client.compute(second).result(timeout=30)[0]) == 4.0
    after = counts()
    assert after[a_addr] - before[a_addr] == 1 and after[b_addr] == before[b_addr]
    # the one dependent made to run elsewhere: the value comes from its owner, right
    with dask.annotate(workers=[a_addr]):
        first = dask.delayed(make)(4 * MB, 5.0, dask_key_name="link-3")
    with dask.annotate(workers=[b_addr]):
        read = dask.delayed(total)(first, dask_key_name="link-4")
    assert client.compute(read).result(timeout=30) == 5.0 * (4 * MB // 8)
    assert counts()[a_addr] == after[a_addr]


def test_segment_removed_when_the_key_is_released(client, cluster):
    a_addr, _ = cluster.worker_addresses
    pid = _pids(client)[a_addr]

    def values() -> set[str]:  # not the pool of retired segments, which earlier tests fill
        return {n for n in shm.segments_of(pid) if not n.startswith(f"shoal-{pid}-pool")}

    before = values()
    x = client.submit(make, 2 * MB, workers=[a_addr], pure=False)
    x.result(timeout=30)
    new = values() - before
    assert len(new) == 1
    del x
    # its name goes (its memory may stay in the worker's pool of segments for reuse)
    wait_for(lambda: not (values() & new), what="the segment to be unlinked")


def test_busy_owner_stopped_with_sigstop_still_serves_its_values(client, cluster):
    a_addr, b_addr = cluster.worker_addresses
    pid_a = _pids(client)[a_addr]
    x = client.submit(make, 16 * MB, 3.0, workers=[a_addr], pure=False)
    x.result(timeout=30)
    os.kill(pid_a, signal.SIGSTOP)
    try:
        y = client.submit(total, x, workers=[b_addr])
        assert y.result(timeout=30) == 3.0 * (16 * MB // 8)
    finally:
        os.kill(pid_a, signal.SIGCONT)


def test_unlinked_segment_falls_back_to_the_owner(client, cluster):
    a_addr, b_addr = cluster.worker_addresses
    pid_a = _pids(client)[a_addr]
    before = set(shm.segments_of(pid_a))
    x = client.submit(make, 2 * MB, 5.0, workers=[a_addr], pure=False)
    x.result(timeout=30)
    for name in set(shm.segments_of(pid_a)) - before:
        os.unlink(os.path.join(shm.SHM_DIR, name))  # gone behind everyone's back
    y = client.submit(total, x, workers=[b_addr])
    assert y.result(timeout=30) == 5.0 * (2 * MB // 8)


def test_tcp_peers_are_served_while_the_owner_runs_a_task(client, cluster, tmp_path):
    a_addr, b_addr = cluster.worker_addresses
    gate = tmp_path / "open"

    def wait_for_gate(path):
        while not path.exists():  # the task itself runs until the test opens the gate
            time.sleep(0.01)
        return "done"

    small = client.submit(lambda: list(range(1000)), workers=[a_addr], pure=False)
    small.result(timeout=30)
    busy = client.submit(wait_for_gate, gate, workers=[a_addr], pure=False)
    try:
        y = client.submit(len, small, workers=[b_addr])
        assert y.result(timeout=30) == 1000
        assert not busy.done()
    finally:
        gate.touch()
    assert busy.result(timeout=30) == "done"


def test_inputs_of_the_next_task_arrive_while_the_current_one_runs(client, cluster, tmp_path):
    a_addr, b_addr = cluster.worker_addresses
    started, gate = tmp_path / "started", tmp_path / "open"

    def hold(started, gate):
        started.touch()
        while not gate.exists():  # runs until the test opens the gate
            time.sleep(0.01)
        return "held"

    x = client.submit(make, 4 * MB, 5.0, workers=[a_addr], pure=False)
    shoal.wait([x], timeout=30)
    before = client.transfer_stats()[b_addr]["shm"]
    busy = client.submit(hold, started, gate, workers=[b_addr], pure=False)
    try:
        wait_for(started.exists, what="the long task to start on b")
        y = client.submit(total, x, workers=[b_addr])  # sent ahead to the busy worker
        # b takes x in while its only thread is still busy with the long task
        wait_for(lambda: client.transfer_stats()[b_addr]["shm"] - before >= 4 * MB,
                 what="b to take the next task's input in")
        assert not busy.done() and not y.done()
    finally:
        gate.touch()
    assert busy.result(timeout=30) == "held"
    assert y.result(timeout=30) == 5.0 * (4 * MB // 8)


def test_full_shared_memory_falls_back_to_tcp(client, cluster):
    a_addr, b_addr = cluster.worker_addresses

    def fill_up():
        import errno

        def full(fd, offset, length):
            raise OSError(errno.ENOSPC, "No space left on device")

        from shoal.comm import shm as worker_shm

        # no retired segment to reuse (none kept from now on either, as earlier tests'
        # values are released): every placement needs new pages
        os._shoal_test_pool_limit = worker_shm.registry.pool_limit
        worker_shm.registry.pool_limit = 0
        worker_shm.drain_pool()
        os._shoal_test_fallocate = os.posix_fallocate
        os.posix_fallocate = full

    def restore():
        from shoal.comm import shm as worker_shm

        os.posix_fallocate = os._shoal_test_fallocate
        worker_shm.registry.pool_limit = os._shoal_test_pool_limit

    client.run(fill_up, workers=[a_addr])
    try:
        before = client.transfer_stats()
        x = client.submit(make, 4 * MB, 6.0, workers=[a_addr], pure=False)
        y = client.submit(total, x, workers=[b_addr])
        assert y.result(timeout=30) == 6.0 * (4 * MB // 8)
        after = client.transfer_stats()
        assert after[a_addr]["tcp"] - before[a_addr]["tcp"] >= 4 * MB
    finally:
        client.run(restore, workers=[a_addr])


def test_kill_9_leaves_no_segments_and_values_are_recomputed():
    with shoal.LocalCluster(n_workers=2, processes=True) as cluster, shoal.Client(cluster) as c:
        a_addr, b_addr = cluster.worker_addresses
        pids = c.run(os.getpid)
        x = c.submit(make, 2 * MB, 4.0, workers=[a_addr], pure=False)
        x.result(timeout=30)
        assert shm.segments_of(pids[a_addr])
        os.kill(pids[a_addr], signal.SIGKILL)
        wait_for(lambda: not shm.segments_of(pids[a_addr]), timeout=20, what="the dead worker's segments to go")
        wait_for(lambda: a_addr not in c.scheduler_info()["workers"], timeout=20, what="the worker to be removed")
        # x lived only on the dead worker: it is computed again (its restriction aside)
        y = c.submit(total, x, workers=[b_addr])
        with pytest.raises(ValueError, match="no such worker"):
            y.result(timeout=30)
    for pid in pids.values():
        assert not shm.segments_of(pid)


def test_shared_memory_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("SHOAL_SHM", "0")
    with shoal.LocalCluster(n_workers=2, processes=True) as cluster, shoal.Client(cluster) as c:
        a_addr, b_addr = cluster.worker_addresses
        pids = c.run(os.getpid)
        x = c.submit(make, 2 * MB, workers=[a_addr], pure=False)
        assert c.submit(total, x, workers=[b_addr]).result(timeout=30) == 2 * MB // 8
        stats = c.transfer_stats()
        assert stats[a_addr]["shm"] == 0 and stats[b_addr]["shm"] == 0
        assert stats[a_addr]["tcp"] >= 2 * MB
        assert not shm.segments_of(pids[a_addr])


def _segment_of(value):
    """The name of the segment ``value``'s buffer lies in, in the process running this."""
    from shoal.comm import shm as here

    where = here.locate(memoryview(value).cast("B"))
    return None if where is None else where[0]


def test_a_scattered_value_is_mapped_by_the_holders_peers(client, cluster):
    a_addr, b_addr = cluster.worker_addresses
    pid_a = _pids(client)[a_addr]
    [x] = client.scatter([np.full(4 * MB // 8, 9.0)], workers=[a_addr])
    # the worker keeps the segment the value came in, under a name of its own ...
    on_a = client.submit(_segment_of, x, workers=[a_addr], pure=False).result(timeout=30)
    assert on_a is not None and on_a.startswith(f"shoal-{pid_a}-")
    # ... which its peer maps: no copy of the value is made for it
    assert client.submit(_segment_of, x, workers=[b_addr], pure=False).result(timeout=30) == on_a
    assert client.submit(total, x, workers=[b_addr]).result(timeout=30) == 9.0 * (4 * MB // 8)
    del x
    wait_for(lambda: on_a not in shm.segments_of(pid_a), what="the released value's segment to go")


def test_a_broadcast_value_is_copied_once_and_mapped_by_every_worker(client, cluster):
    a_addr, b_addr = cluster.worker_addresses
    [x] = client.scatter([np.full(4 * MB // 8, 5.0)], broadcast=True)
    assert sorted(client.who_has([x])[x.key]) == sorted([a_addr, b_addr])
    names = {w: client.submit(_segment_of, x, workers=[w], pure=False).result(timeout=30) for w in (a_addr, b_addr)}
    # both map the one segment this process made (no copy per worker)
    assert names[a_addr] == names[b_addr] and names[a_addr].startswith(f"shoal-{os.getpid()}-")
    assert [client.submit(total, x, workers=[w], pure=False).result(timeout=30) for w in (a_addr, b_addr)] == [
        5.0 * (4 * MB // 8)] * 2


def test_a_scattered_value_is_read_while_its_holder_is_stopped(client, cluster):
    """Like a result: the scheduler knows where it lies, so a peer maps it without
    asking the holder, whose process may be stopped."""
    a_addr, b_addr = cluster.worker_addresses
    pid_a = _pids(client)[a_addr]
    [x] = client.scatter([np.full(4 * MB // 8, 6.0)], workers=[a_addr])
    os.kill(pid_a, signal.SIGSTOP)
    try:
        assert client.submit(total, x, workers=[b_addr]).result(timeout=30) == 6.0 * (4 * MB // 8)
    finally:
        os.kill(pid_a, signal.SIGCONT)
