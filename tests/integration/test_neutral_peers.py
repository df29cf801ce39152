"""A peer that reads only language-neutral encodings (protocol §3 ``reads``, §4.5
``shoal.value``): what a Python worker sends it, byte by byte, over a real socket to a
real worker process. The peer here is the doc-written wire code (foreign_wire), which
decodes msgpack itself; nothing of shoal decodes what the worker sent."""

from __future__ import annotations

import msgpack
import pytest

import shoal
from foreign_wire import Connection, WireError

np = pytest.importorskip("numpy")

pytestmark = pytest.mark.timeout(120)


def make_array():
    return np.arange(12, dtype=np.float64).reshape(3, 4)


def make_record():
    return {"name": "x", "count": 3, "parts": (1, 2.5, None), "data": np.array([1, 2, 3], dtype=np.int32),
            "raw": b"\x00\x01"}


def make_set():
    return {1, 2}


def make_big_int():
    return 1 << 80


@pytest.fixture(scope="module")
def cluster():
    with shoal.LocalCluster(n_workers=1, processes=True, memory_limit=0) as c, shoal.Client(c) as client:
        yield c, client


def _fetch(cluster, fn):
    c, client = cluster
    future = client.submit(fn, pure=False)
    future.result()
    (address,) = client.who_has([future])[future.key]
    with Connection(address, "neutral-test", secret=c.security.secret, reads="neutral") as conn:
        return future.key, conn.call("get-data", keys=[future.key])


def _array(ext: msgpack.ExtType, frames: list) -> np.ndarray:
    assert ext.code == 4
    dtype, shape, index = msgpack.unpackb(ext.data)
    return np.frombuffer(frames[index], dtype=np.dtype(dtype)).reshape(shape)


def test_an_array_goes_as_a_shoal_value_with_its_bytes_out_of_band(cluster):
    key, response = _fetch(cluster, make_array)
    assert response["status"] == "OK"
    entry = response["result"]["data"][key]
    assert (entry.family, entry.header, entry.opaque) == ("shoal.value", {}, True)
    ext = msgpack.unpackb(entry.frames[0])
    assert ext.code == 4 and msgpack.unpackb(ext.data) == ["<f8", [3, 4], 1]
    assert (_array(ext, entry.frames) == make_array()).all()


def test_a_record_goes_as_msgpack_with_its_arrays_as_ext_4(cluster):
    key, response = _fetch(cluster, make_record)
    entry = response["result"]["data"][key]
    assert entry.family == "shoal.value"
    value = msgpack.unpackb(entry.frames[0])
    data = value.pop("data")
    assert value == {"name": "x", "count": 3, "parts": [1, 2.5, None], "raw": b"\x00\x01"}
    assert _array(data, entry.frames).tolist() == [1, 2, 3]


@pytest.mark.parametrize("fn, name", [(make_set, "builtins.set"), (make_big_int, "an int of 81 bits")])
def test_a_value_with_no_neutral_form_is_refused_naming_its_type(cluster, fn, name):
    key, response = _fetch(cluster, fn)
    assert response["status"] == "error"
    assert response["type"] == "shoal.errors.SerializationError"
    assert name in response["message"]
    # the worker goes on: a Python client still gets the value
    assert cluster[1].submit(fn, pure=False).result() == fn()


def test_a_peer_that_reads_something_unknown_is_refused_in_the_handshake(cluster):
    c, client = cluster
    (address,) = client.scheduler_info()["workers"]
    with pytest.raises(WireError, match="reads 'klingon'"):
        Connection(address, "neutral-test", secret=c.security.secret, reads="klingon")


def test_python_reads_a_shoal_value_back_without_copying_its_arrays():
    from shoal.protocol import NEUTRAL, deserialize, serialize

    value = make_record()
    s = serialize(value, NEUTRAL)
    assert s.family == "shoal.value"
    back = deserialize(s)
    assert back["parts"] == [1, 2.5, None], "tuples travel as arrays"
    assert back["data"].tolist() == [1, 2, 3] and not back["data"].flags.owndata
    assert {k: back[k] for k in ("name", "count", "raw")} == {"name": "x", "count": 3, "raw": b"\x00\x01"}
    with pytest.raises(shoal.SerializationError, match="builtins.set"):
        serialize({"a": {1}}, NEUTRAL)
