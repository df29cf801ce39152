"""How long a fetch of values may wait for its answer (``fetch-timeout``)."""

from __future__ import annotations

from shoal import config
from shoal.rpc import fetch_deadline
from shoal.rpc.pool import FETCH_BYTES_PER_SECOND


def test_a_fetch_is_given_its_base_and_time_for_the_bytes_it_expects() -> None:
    with config.set(fetch_timeout=60.0):
        assert fetch_deadline() == 60.0
        assert fetch_deadline(-5) == 60.0  # (a size not known)
        assert fetch_deadline(30 * FETCH_BYTES_PER_SECOND) == 90.0


def test_a_fetch_timeout_of_0_waits_for_ever() -> None:
    with config.set(fetch_timeout=0.0):
        assert fetch_deadline(1 << 30) is None
