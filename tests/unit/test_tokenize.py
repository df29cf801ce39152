"""``shoal.taskspec.tokenize``: the content keys of ``submit(pure=True)`` and scatter."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from shoal import taskspec
from shoal.taskspec import tokenize


@pytest.fixture(params=["default", "sha1"])
def hasher(request, monkeypatch):
    """Both hashes: xxh3 when xxhash is installed, sha1 without it."""
    if request.param == "sha1":
        monkeypatch.setattr(taskspec, "_hasher", taskspec._sha1)
    return request.param


def test_equal_contents_give_equal_tokens(hasher):
    a = np.arange(1 << 18, dtype="float64")
    assert tokenize(a) == tokenize(a.copy())
    assert tokenize({"x": [1, 2.5, "s", None], "y": (a, b"raw")}) == tokenize({"x": [1, 2.5, "s", None], "y": (a.copy(), b"raw")})
    assert len(tokenize(a)) == 32 and int(tokenize(a), 16) >= 0


def test_contents_dtype_shape_and_types_matter(hasher):
    a = np.zeros(1000)
    b = a.copy()
    b[-1] = 1.0
    tokens = {tokenize(a), tokenize(b), tokenize(a.astype("float32")), tokenize(a.reshape(10, 100)),
              tokenize(1), tokenize(1.0), tokenize("1"), tokenize(b"1"), tokenize([1]), tokenize((1,))}
    assert len(tokens) == 10


def test_other_objects_hash_by_identity(hasher):
    lock = threading.Lock()
    assert tokenize(lock) == tokenize(lock)
    assert tokenize(lock) != tokenize(threading.Lock())

