"""``tls://``: a cluster of processes over mutual TLS, and what is refused."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest

import shoal
from shoal.comm import connect, listen
from shoal.comm.security import Security, warn_if_exposed
from shoal.errors import CommConnectError, HandshakeError


@pytest.fixture(scope="module")
def tls() -> Security:
    return Security.temporary()


def _column_sums(a: np.ndarray) -> np.ndarray:
    return a.sum(axis=0)


@pytest.mark.timeout(120)
def test_a_cluster_of_processes_over_tls_still_shares_memory(tls):
    with shoal.LocalCluster(n_workers=2, processes=True, security=tls) as cluster:
        assert cluster.scheduler_address.startswith("tls://127.0.0.1:")
        assert all(a.startswith("tls://") for a in cluster.worker_addresses)
        with shoal.Client(cluster) as c:
            w0, w1 = cluster.worker_addresses
            big = c.submit(np.ones, (512, 1024), workers=[w0])  # 4 MB, made on w0
            sums = c.submit(_column_sums, big, workers=[w1])  # used on w1
            assert (sums.result(timeout=60) == 512).all()
            got = big.result(timeout=60)
            assert got.shape == (512, 1024) and got.flags.writeable
            moved = c.transfer_stats()
            # the 4 MB went from w0 to w1 through shared memory, not the TLS stream
            assert moved[w1]["shm"] >= got.nbytes and moved[w1]["tcp"] < got.nbytes // 100


async def test_a_certificate_of_another_ca_is_refused(tls):
    async def handler(comm):
        await comm.read()

    listener = await listen("tls://127.0.0.1:0", handler, security=tls)
    try:
        with pytest.raises(HandshakeError, match="TLS handshake failed"):
            await connect(listener.contact_address, security=Security.temporary(tls.secret), timeout=5)
        # plain tcp to a tls port: the bytes are not a TLS session
        with pytest.raises((HandshakeError, CommConnectError)):
            await connect("tcp://" + listener.contact_address.removeprefix("tls://"),
                          security=Security(tls.secret), timeout=2)
        comm = await connect(listener.contact_address, security=tls)  # the right one gets in
        assert comm.peer_info["authenticated"] is True
        comm.abort()
    finally:
        listener.stop()
        await asyncio.sleep(0)  # let the listener's loop close the server


async def test_require_encryption_refuses_plain_tcp(tls):
    async def handler(comm):
        pass

    with pytest.raises(ValueError, match="requires encryption"):
        await listen("tcp://127.0.0.1:0", handler, security=tls)
    with pytest.raises(CommConnectError, match="requires encryption"):
        await connect("tcp://127.0.0.1:9", security=tls, timeout=1)
    with pytest.raises(CommConnectError, match="tls:// needs"):
        await connect("tls://127.0.0.1:9", security=Security.new(), timeout=1)


def test_listening_beyond_loopback_without_tls_warns(caplog):
    caplog.set_level(logging.WARNING, logger="shoal")
    assert warn_if_exposed("tcp://0.0.0.0:8786", Security.new())
    assert "unencrypted" in caplog.text
    assert warn_if_exposed("tls://0.0.0.0:8786", Security.disabled())
    assert "NO authentication" in caplog.text
    assert not warn_if_exposed("tcp://127.0.0.1:8786", Security.new())
    assert not warn_if_exposed("tls://10.1.2.3:8786", Security.temporary())
