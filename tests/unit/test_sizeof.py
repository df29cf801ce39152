"""Managed sizes (shoal.protocol.sizes): dask's where dask is there, shoal's own
registry otherwise, never an exception."""

from __future__ import annotations

import sys

import numpy as np
import pandas as pd
import pytest

from shoal.protocol import sizes
from shoal.protocol.sizes import UNKNOWN_SIZE, managed_sizeof, register_sizeof


@pytest.fixture(params=["dask", "own"])
def which(request, monkeypatch):
    """Run a test with dask's sizeof and with shoal's own registry (dask hidden)."""
    monkeypatch.setattr(sizes, "_resolved", {})
    if request.param == "own":
        monkeypatch.setattr(sizes, "_dask", None)
    else:
        monkeypatch.setattr(sizes, "_dask", False)  # looked for again: found
    return request.param


class Raising:
    def __sizeof__(self):
        raise RuntimeError("no size for you")


class RaisingNbytes:
    @property
    def nbytes(self):
        raise ValueError("nope")

    def __sizeof__(self):
        raise ValueError("nope")


def test_bytes_and_arrays_count_their_buffers(which):
    assert managed_sizeof(b"x" * 1000) == 1000
    assert managed_sizeof(bytearray(500)) == 500
    assert managed_sizeof(memoryview(b"y" * 300)) >= 300
    a = np.zeros(10_000)
    assert managed_sizeof(a) >= 80_000
    # a broadcast array holds only the memory of its one row
    b = np.broadcast_to(np.zeros(1000), (1000, 1000))
    assert managed_sizeof(b) < 100_000


def test_containers_are_estimated_from_samples(which):
    items = [b"z" * 1000 for _ in range(1000)]
    size = managed_sizeof(items)
    assert 1_000_000 <= size <= 1_200_000
    d = {i: np.zeros(1000) for i in range(100)}
    assert 800_000 <= managed_sizeof(d) <= 1_000_000
    # a list that holds itself ends somewhere
    loop: list = [1]
    loop.append(loop)
    assert managed_sizeof(loop) > 0


def test_pandas_frames_count_their_columns(which):
    df = pd.DataFrame({"a": np.arange(100_000, dtype="int64"), "b": ["some text"] * 100_000})
    size = managed_sizeof(df)
    assert size >= 800_000 + 100_000 * 9  # the ints, and the strings
    assert managed_sizeof(df["a"]) >= 800_000


def test_a_users_sizeof_that_raises_counts_64(which):
    assert managed_sizeof(Raising()) == UNKNOWN_SIZE
    assert managed_sizeof(RaisingNbytes()) == UNKNOWN_SIZE
    # inside a container: the container still has a size
    assert managed_sizeof([Raising()] * 5) > 0


def test_registered_sizes_win(which, monkeypatch):
    monkeypatch.setattr(sizes, "_user", {})

    class Blob:
        pass

    @register_sizeof(Blob)
    def _blob(obj):
        return 12345

    class SubBlob(Blob):
        pass

    assert managed_sizeof(Blob()) == 12345
    assert managed_sizeof(SubBlob()) == 12345

    @register_sizeof(Blob)
    def _raising(obj):
        raise TypeError("broken")

    assert managed_sizeof(Blob()) == UNKNOWN_SIZE


def test_dask_is_imported_only_for_values_that_need_it():
    import subprocess

    code = ("import sys; from shoal.protocol.sizes import managed_sizeof; "
            "managed_sizeof(b'x'); managed_sizeof(1); managed_sizeof('s'); "
            "print('dask' in sys.modules); managed_sizeof([1, 2]); print('dask' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["False", "True"]


def test_own_registry_never_imports_numpy_or_pandas(monkeypatch):
    monkeypatch.setattr(sizes, "_resolved", {})
    monkeypatch.setattr(sizes, "_dask", None)
    # the lazy registrations run only for modules already imported (numpy is here)
    assert managed_sizeof(np.ones(100)) == 800
    assert "pandas" in sys.modules or "pandas" in sizes._lazy


def test_serialized_values_count_their_frames(which):
    from shoal.protocol import Serialize, serialize
    from shoal.protocol.serialize import Serialized

    a = np.zeros(10_000)
    assert managed_sizeof(Serialize(a)) >= a.nbytes
    s = serialize(a, "remote")
    assert isinstance(s, Serialized) and managed_sizeof(s) >= a.nbytes


def test_the_hot_path_size_of_a_frame_is_its_managed_size(which):
    # not pandas' __sizeof__, which walks every string (27 ms for 100,000 of them, on
    # every result and every transfer)
    from shoal.protocol.serialize import sizeof, sizes as both

    df = pd.DataFrame({"s": ["some text"] * 1000, "x": np.arange(1000)})
    assert sizeof(df) == managed_sizeof(df) == both(df)[0] == both(df)[1]
    a = np.zeros(100)
    assert both(a) == (sizeof(a), managed_sizeof(a))
    assert both([1, 2, 3]) == (sizeof([1, 2, 3]), managed_sizeof([1, 2, 3]))
    with pytest.raises(RuntimeError, match="no size for you"):
        both(Raising())
    assert sizeof(Raising()) == 64
