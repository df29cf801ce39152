"""shoal.protocol: messages to frames and back, serializer families, function cache."""

from __future__ import annotations

import collections
import dataclasses
import gc
import pickle
import threading
import weakref

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from shoal.errors import ProtocolError, SerializationError, ShoalError
from shoal.protocol import (
    REMOTE,
    SAME_HOST,
    SAME_PROCESS,
    Serialize,
    Serialized,
    clear_function_cache,
    deserialize,
    dumps,
    dumps_function,
    function_cache_info,
    loads,
    loads_function,
    register_serializer,
    serialize,
    to_serialize,
)
from shoal_helpers import assert_same


@dataclasses.dataclass
class Point:
    x: int
    y: float
    tags: tuple = ()


class Unpicklable:
    def __reduce__(self):
        raise RuntimeError("refuses to be pickled")


def table_of(frames):
    """The out-of-band table of a message's frames: [[family, header, n, opaque], ...]."""
    return msgpack.unpackb(frames[1]) if len(frames) > 1 else []


def roundtrip(msg, destination=REMOTE, deserialize=True):
    return loads(dumps(msg, destination), deserialize=deserialize)


# ------------------------------------------------------------------------ round trips

ROUNDTRIP_CASES = {
    "scalars": {"none": None, "t": True, "f": False, "i": -7, "x": 1.5, "s": "héllo", "b": b"\x00\x01"},
    "tuples stay tuples": {"a": (1, (2, [3, (4,)]), ()), "b": [(), [()]]},
    "tuple dict keys": {(1, 2): "a", ("x", (3, None)): [1], "plain": (5,)},
    "other dict keys": {7: "int", b"k": "bytes", None: "none", True: "bool", 2.5: "float"},
    "big ints": [1 << 64, -(1 << 63) - 1, (1 << 64) - 1, -(1 << 63), 3**200, -(5**90)],
    "big int keys keep order": {"a": 1, 1 << 70: "big", "z": 2, -(1 << 65): (3,)},
    "bytes small and large": [b"", b"x" * 100, b"y" * (1 << 16), b"z" * ((1 << 16) + 1), bytes(200_000)],
    "bytearray": [bytearray(), bytearray(b"abc"), bytearray(100_000)],
    "memoryview 1-d": memoryview(b"abcdef"),
    "memoryview empty": memoryview(b""),
    "memoryview 2-d": memoryview(bytearray(range(24))).cast("i", (2, 3)),
    "memoryview 3-d float": memoryview(np.arange(24.0).reshape(2, 3, 4)),
    "memoryview 0-d": memoryview(b"abcd").cast("i", []),
    "memoryview 0-d numpy": memoryview(np.array(3.25)),
    "memoryview non-contiguous": memoryview(b"abcdefgh")[::3],
    "memoryview non-contiguous 2-d": memoryview(np.arange(12.0).reshape(3, 4)[:, ::2]),
    "numpy small": np.arange(10),
    "numpy 0-d": np.array(42),
    "numpy empty": np.zeros((0, 3)),
    "numpy non-contiguous": np.arange(100).reshape(10, 10)[::2, 1::3],
    "numpy fortran": np.asfortranarray(np.arange(12.0).reshape(3, 4)),
    "numpy float with nan": np.array([1.5, np.nan, -0.0, np.inf]),
    "numpy big-endian": np.arange(5, dtype=">i4"),
    "numpy structured": np.array([(1, 2.5, b"ab"), (3, -1.0, b"cd")], dtype=[("a", "<i4"), ("b", "<f8"), ("c", "S2")]),
    "numpy object": np.array([1, "two", (3,)], dtype=object),
    "numpy in to_serialize": to_serialize(np.arange(6).reshape(2, 3)),
    "objects of this module": [Point(1, 2.0, ("a",)), {"p": Point(-1, 0.5)}],
    "sets and frozensets": [{1, 2}, frozenset({"a"}), {frozenset({1}): "frozenset key"}],
    "dict subclasses": [collections.OrderedDict(b=1, a=2), collections.Counter("abb")],
}


def expected(value):
    """What a receiver that deserializes gets: ``to_serialize`` wrappers unwrapped."""
    return value.data if isinstance(value, Serialize) else value


@pytest.mark.parametrize("value", list(ROUNDTRIP_CASES.values()), ids=list(ROUNDTRIP_CASES))
@pytest.mark.parametrize("destination", [REMOTE, SAME_HOST])
def test_roundtrip(value, destination):
    msg = {"op": "x", "args": (1, [value]), "kw": {"v": value}}
    out = roundtrip(msg, destination)
    assert_same(out, {"op": "x", "args": (1, [expected(value)]), "kw": {"v": expected(value)}})


def test_roundtrip_top_level_values():
    for value in [5, "s", None, (1,), [2], b"b", 1 << 100, np.arange(3)]:
        assert_same(roundtrip(value), value)


def test_big_int_is_not_silently_truncated():
    out = roundtrip({"n": (1 << 64) + 1, "m": [-(1 << 63) - 1]})
    assert out["n"] == (1 << 64) + 1 and out["m"][0] == -(1 << 63) - 1


def test_lambdas_and_closures_roundtrip_through_cloudpickle():
    offset = 10

    def closure(x):
        return x + offset

    msg = {"f": lambda x: x * 3, "g": closure, "h": to_serialize(lambda: "hi")}
    out = roundtrip(msg)
    assert out["f"](2) == 6
    assert out["g"](1) == 11
    assert out["h"]() == "hi"
    assert out["f"] is not msg["f"]  # it travelled by value


def test_importable_function_travels_by_reference():
    out = roundtrip({"f": assert_same, "g": len})
    assert out["f"] is assert_same
    assert out["g"] is len


# ------------------------------------------------------------------------ zero copy


def test_large_array_is_not_copied_into_the_header():
    arr = np.ones(100 * 2**20, dtype=np.uint8)  # 100 MB
    frames = dumps({"op": "put", "data": arr})
    big = [f for f in frames if memoryview(f).nbytes >= arr.nbytes]
    assert len(big) == 1, "the array's buffer is one frame of its own"
    (frame,) = big
    view = np.frombuffer(frame, dtype=np.uint8)
    assert np.shares_memory(view, arr), "the frame is the array's memory, not a copy"
    small = sum(memoryview(f).nbytes for f in frames) - arr.nbytes
    assert small < 1000, f"{small} bytes besides the buffer"

    out = loads(frames)["data"]
    assert np.shares_memory(out, arr), "loads builds the array on the received frame"
    assert out.dtype == arr.dtype and out.shape == arr.shape


def test_large_bytes_and_bytearray_travel_as_their_own_frames():
    big_bytes = b"q" * (1 << 17)
    big_ba = bytearray(1 << 17)
    frames = dumps({"a": big_bytes, "b": big_ba, "small": b"s" * 100})
    assert any(f is big_bytes for f in frames)
    assert any(f is big_ba for f in frames)
    assert len(frames[0]) < 200


def test_non_contiguous_array_roundtrips_contiguous_values():
    base = np.arange(1_000_000, dtype=np.float64).reshape(1000, 1000)
    view = base[::3, ::7]
    out = roundtrip({"v": view})["v"]
    assert_same(out, np.ascontiguousarray(view))


def test_received_values_are_freed_without_the_cyclic_gc():
    gc.collect()
    gc.disable()
    try:
        out = loads(dumps({"a": np.arange(10), "t": (1, [2, (3,)])}))
        ref = weakref.ref(out["a"])
        del out
        assert ref() is None, "loads left a reference cycle holding the received values"
    finally:
        gc.enable()


# ------------------------------------------------------------------------ Serialized


def test_serialized_is_forwarded_byte_identical():
    value = {"arr": np.arange(1000, dtype=np.int32).reshape(10, 100)[:, ::2], "p": Point(3, 4.0)}
    frames = dumps({"op": "compute", "payload": to_serialize(value), "key": ("x", 1)})

    middle = loads(frames, deserialize=False)
    assert type(middle["payload"]) is Serialized
    assert middle["key"] == ("x", 1)
    forwarded = dumps(middle)
    assert len(forwarded) == len(frames)
    for a, b in zip(frames, forwarded):
        assert bytes(a) == bytes(b)

    # and once more through a second middle hop
    again = dumps(loads(forwarded, deserialize=False))
    assert [bytes(f) for f in again] == [bytes(f) for f in frames]

    final = loads(again)
    assert_same(final["payload"], {"arr": np.ascontiguousarray(value["arr"]), "p": value["p"]})


def test_transparent_values_come_back_as_values_without_deserializing():
    msg = {"b": b"x" * 100_000, "ba": bytearray(b"12"), "n": 1 << 90, "arr": np.arange(3)}
    out = loads(dumps(msg), deserialize=False)
    assert_same(out["b"], msg["b"])
    assert_same(out["ba"], msg["ba"])
    assert out["n"] == 1 << 90
    assert type(out["arr"]) is Serialized  # opaque: left for the final receiver
    assert_same(deserialize(out["arr"]), msg["arr"])


def test_serialize_and_deserialize():
    s = serialize(Point(1, 2.0))
    assert type(s) is Serialized and s.family == "pickle"
    assert deserialize(s) == Point(1, 2.0)
    assert serialize(s) is s
    assert deserialize(serialize(to_serialize([1, 2]))) == [1, 2]
    assert s == serialize(Point(1, 2.0))
    assert s.nbytes == sum(len(bytes(f)) for f in s.frames)


def test_serialized_nested_in_to_serialize_value_is_not_lost():
    inner = serialize(np.arange(4))
    out = roundtrip({"x": inner})
    assert_same(out["x"], np.arange(4))


# ------------------------------------------------------------------------ errors


def test_unpicklable_object_names_type_and_path():
    lock = threading.Lock()
    msg = {"op": "run", "args": (1, {"lock": lock, "ok": 2})}
    with pytest.raises(SerializationError) as info:
        dumps(msg)
    text = str(info.value)
    assert "_thread.lock" in text
    assert "args[1]['lock']" in text
    assert isinstance(info.value, ShoalError) and isinstance(info.value, TypeError)
    assert info.value.__cause__ is not None


def test_unpicklable_inside_to_serialize_names_the_inner_path():
    msg = {"args": [0, to_serialize({"a": [1, Unpicklable()]})]}
    with pytest.raises(SerializationError, match=r"Unpicklable' at args\[1\]\['a'\]\[1\]"):
        dumps(msg)


def test_unpicklable_after_a_big_int_key_gets_the_right_path():
    msg = {"d": {1 << 70: 1, "x": threading.Lock()}}
    with pytest.raises(SerializationError, match=r"at d\['x'\]"):
        dumps(msg)


@pytest.mark.parametrize(
    "mv",
    [memoryview(np.arange(3, dtype=">i4")), memoryview(np.zeros(2, dtype=[("a", "<i4"), ("b", "<f8")]))],
    ids=["big-endian", "structured"],
)
def test_memoryview_that_cannot_be_rebuilt_fails_at_the_sender(mv):
    # the receiver could not cast the bytes back to this format: refuse before sending
    with pytest.raises(SerializationError, match="memoryview"):
        dumps({"mv": mv})


def test_unencodable_string_is_a_serialization_error():
    with pytest.raises(SerializationError):
        dumps({"s": "lone surrogate \ud800"})


def test_unknown_destination_is_a_value_error():
    with pytest.raises(ValueError, match="destination"):
        dumps({"a": 1}, "mars")
    with pytest.raises(ValueError, match="destination"):
        dumps({"a": np.arange(3)}, "mars")
    with pytest.raises(ValueError, match="destination"):
        serialize(Point(1, 1.0), "mars")
    with pytest.raises(ValueError, match="destination"):
        register_serializer(Point, lambda o, d: ({}, []), lambda h, f: None, destinations=["mars"])


@pytest.mark.parametrize(
    "frames",
    [
        [],
        [b"\xc1"],  # never-used msgpack byte
        [b"\x92\x01"],  # truncated array
        [msgpack.packb(msgpack.ExtType(2, (0).to_bytes(4, "little")))],  # reference, no table
        [msgpack.packb(msgpack.ExtType(9, b""))],  # unknown extension
        [msgpack.packb(1), b"\xc1"],  # bad table
        [msgpack.packb(1), msgpack.packb({"not": "a list"})],
        [msgpack.packb(1), msgpack.packb([["pickle", {}, 5, True]])],  # names missing frames
        [msgpack.packb(1), msgpack.packb([]), b"extra"],  # frame not in the table
        [msgpack.packb(1), msgpack.packb([["pickle", {}, -1, True]])],
    ],
)
def test_bad_frames_are_protocol_errors(frames):
    with pytest.raises(ProtocolError):
        loads(frames)


# ------------------------------------------------------------------------ families


class Base:
    def __init__(self, value):
        self.value = value


class Derived(Base):
    pass


class MoreDerived(Derived):
    pass


def _base_dumps(obj, destination):
    return {"value": obj.value, "cls": type(obj).__name__, "dest": destination, "shape": (2, 3)}, [b"frame"]


def _base_loads(header, frames):
    obj = {"Base": Base, "Derived": Derived, "MoreDerived": MoreDerived}[header["cls"]](header["value"])
    obj.seen = (header["dest"], header["shape"], bytes(frames[0]))
    return obj


register_serializer(Base, _base_dumps, _base_loads, name="test-protocol-base")


def test_family_found_along_the_mro():
    for cls in (Base, Derived, MoreDerived):
        frames = dumps({"v": cls(7)})
        assert table_of(frames)[0][0] == "test-protocol-base"
        out = loads(frames)["v"]
        assert type(out) is cls and out.value == 7
        # a family's header comes back as it was sent (tuples included)
        assert out.seen == (REMOTE, (2, 3), b"frame")


def test_more_specific_family_wins():
    class Special(Derived):
        pass

    register_serializer(
        Special,
        lambda obj, dest: ({"v": obj.value}, []),
        lambda header, frames: Special(header["v"] * 10),
        name="test-protocol-special",
    )
    assert loads(dumps(Special(2))).value == 20
    assert loads(dumps(MoreDerived(2))).value == 2  # a sibling branch keeps the base family


class RemoteOnly:
    def __init__(self, value=0):
        self.value = value

    def __eq__(self, other):
        return type(other) is RemoteOnly and other.value == self.value


register_serializer(
    RemoteOnly,
    lambda obj, dest: ({"value": obj.value, "dest": dest}, []),
    lambda header, frames: RemoteOnly(header["value"] + 1000),
    destinations=[REMOTE],
    name="test-protocol-remote-only",
)


def test_family_registered_for_one_destination_is_not_used_for_another():
    remote = dumps({"x": RemoteOnly(1)}, REMOTE)
    same_host = dumps({"x": RemoteOnly(1)}, SAME_HOST)
    assert table_of(remote)[0][0] == "test-protocol-remote-only"
    # same-host values use the default there: pickle that maps shared-memory buffers
    assert table_of(same_host)[0][0] == "shoal.same-host"
    assert loads(remote)["x"] == RemoteOnly(1001)
    assert loads(same_host)["x"] == RemoteOnly(1)
    assert serialize(RemoteOnly(1), SAME_PROCESS).family == "pickle"
    assert serialize(RemoteOnly(1), REMOTE).family == "test-protocol-remote-only"


def test_unknown_family_on_receipt():
    s = Serialized("no-such-family", {}, [b""])
    with pytest.raises(KeyError, match="no-such-family"):
        deserialize(s)


# ------------------------------------------------------------------------ function cache


def module_level(x):
    return x + 1


def test_function_cache_same_bytes_same_object():
    clear_function_cache()
    data = dumps_function(lambda x: x * 2)
    first = loads_function(data)
    assert first(4) == 8
    for _ in range(999):
        assert loads_function(data) is first
    info = function_cache_info()
    assert info["misses"] == 1
    assert info["hits"] == 999
    assert info["size"] == 1
    # bytes-like inputs with the same contents hit the same entry
    assert loads_function(bytearray(data)) is first
    assert loads_function(memoryview(data)) is first


def test_function_cache_by_reference_and_different_functions():
    clear_function_cache()
    assert loads_function(dumps_function(module_level)) is module_level
    f = loads_function(dumps_function(lambda: 1))
    g = loads_function(dumps_function(lambda: 2))
    assert f is not g and (f(), g()) == (1, 2)
    assert function_cache_info()["misses"] == 3


def test_function_cache_errors_propagate():
    bad = pickle.dumps(module_level).replace(b"module_level", b"nowhere_func")
    with pytest.raises(AttributeError):
        loads_function(bad)
    with pytest.raises(Exception):
        dumps_function(threading.Lock())


def test_function_cache_is_bounded():
    from shoal import config

    clear_function_cache()
    with config.set(function_cache_size=3):
        funcs = [loads_function(dumps_function(eval(f"lambda: {i}"))) for i in range(10)]
        assert [f() for f in funcs] == list(range(10))
        assert function_cache_info()["size"] == 3


# ------------------------------------------------------------------------ properties

scalars = (
    st.none()
    | st.booleans()
    | st.integers()  # unbounded: includes ints beyond 64 bits
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
    | st.binary(max_size=40)
)
bytes_like = (
    st.binary(max_size=40).map(bytearray)
    | st.binary(max_size=40).map(memoryview)
    | st.integers((1 << 16) + 1, (1 << 16) + 64).map(lambda n: b"\x07" * n)
)
arrays = hnp.arrays(
    dtype=hnp.integer_dtypes() | hnp.floating_dtypes() | hnp.unsigned_integer_dtypes() | hnp.byte_string_dtypes(max_len=3),
    shape=hnp.array_shapes(min_dims=0, max_dims=3, max_side=4),
)
hashable = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=10) | st.binary(max_size=10),
    lambda inner: st.lists(inner, max_size=3).map(tuple),
    max_leaves=5,
)
messages = st.recursive(
    scalars | bytes_like | arrays,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=4).map(tuple)
        | st.dictionaries(hashable, inner, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages, st.sampled_from([REMOTE, SAME_HOST]))
def test_property_messages_roundtrip(msg, destination):
    assert_same(roundtrip(msg, destination), msg)


@settings(max_examples=100, deadline=None)
@given(messages)
def test_property_forwarding_keeps_frames(msg):
    frames = dumps({"payload": to_serialize(msg), "copy": msg})
    forwarded = dumps(loads(frames, deserialize=False))
    assert [bytes(f) for f in forwarded] == [bytes(f) for f in frames]
    assert_same(loads(forwarded), {"payload": msg, "copy": msg})
