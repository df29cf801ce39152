"""Behaviour only worker processes have: they deserialize what they receive."""

from __future__ import annotations

import pytest

import shoal


def inc(x):
    return x + 1


def test_payload_that_cannot_be_deserialized_fails_only_that_task(tmp_path, monkeypatch):
    with shoal.LocalCluster(n_workers=1, processes=True) as cluster, shoal.Client(cluster) as c:
        # a module this process can import and the (already started) worker cannot
        (tmp_path / "only_on_the_client.py").write_text("def double(x):\n    return 2 * x\n")
        monkeypatch.syspath_prepend(str(tmp_path))
        import only_on_the_client

        f = c.submit(only_on_the_client.double, 21)
        with pytest.raises(ModuleNotFoundError, match="only_on_the_client"):
            f.result(timeout=10)
        # the worker that failed to deserialize keeps serving
        assert c.gather(c.map(inc, range(10), pure=False)) == list(range(1, 11))
