"""Tasks for workers of other languages (shoal.foreign_tasks): the descriptor, the
``shoal.call`` payload every language can read, and the ``shoal.array`` family."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

import shoal
from shoal.errors import SerializationError
from shoal.foreign_tasks import EXT_ARRAY, EXT_REF, ForeignCall, NeutralArray
from shoal.protocol import dumps, loads, to_serialize
from shoal.taskspec import Ref


def test_a_foreign_function_names_its_language_module_and_function() -> None:
    fn = shoal.foreign("js", "stats", "scale")
    assert (fn.language, fn.module, fn.function) == ("js", "stats", "scale")
    assert fn == shoal.foreign("js", "stats", "scale") and len({fn, shoal.foreign("js", "stats", "scale")}) == 1
    with pytest.raises(TypeError, match="runs on a js worker"):
        fn(1)
    for bad in [("JS", "m", "f"), ("", "m", "f"), ("js", "", "f"), ("js", "m", 3), ("python", "m", "f")]:
        with pytest.raises(ValueError):
            shoal.foreign(*bad)


def test_the_call_payload_is_msgpack_with_refs_and_arrays_out_of_band() -> None:
    arr = np.arange(12, dtype=">i4").reshape(3, 4)  # big-endian: sent little-endian
    call = ForeignCall(shoal.foreign("js", "stats", "scale"), (Ref(("x", 1)), arr, [1, 2.5, "s", b"b", None, True]),
                       {"factor": 2.0})
    header, frames = call.frames()
    assert header == {"language": "js", "module": "stats", "function": "scale"}
    assert len(frames) == 2 and bytes(frames[1]) == np.arange(12, dtype="<i4").tobytes()
    seen = []

    def hook(code: int, data: bytes) -> object:
        seen.append(code)
        return msgpack.unpackb(data, raw=False, ext_hook=hook) if code in (EXT_REF, EXT_ARRAY, 1) else None

    args, kwargs = msgpack.unpackb(frames[0], raw=False, ext_hook=hook)
    assert seen == [EXT_REF, 1, EXT_ARRAY]  # the key ("x", 1) is a tuple (ext 1) inside the ref
    assert args[1] == ["<i4", [3, 4], 1] and args[2] == [1, 2.5, "s", b"b", None, True]
    assert kwargs == {"factor": 2.0}
    # a whole message and back: the family decodes it again
    back = loads(dumps({"payload": to_serialize(call)}))["payload"]
    assert back.fn == call.fn and back.args[0] == Ref(("x", 1)) and back.kwargs == {"factor": 2.0}
    assert back.args[1].dtype == np.dtype("<i4") and (back.args[1] == arr).all()


@pytest.mark.parametrize("value, named", [
    (object(), "builtins.object"), ({1: 2}, "map key"), (np.array(["a"]), "dtype <U1"),
    (1 << 70, "bits"), (np.array([1 + 2j]), "complex128"), ({"s": {3}}, "builtins.set"),
])
def test_what_another_language_cannot_read_is_refused_naming_its_type(value: object, named: str) -> None:
    with pytest.raises(SerializationError, match=named.replace("<", ".")):
        ForeignCall(shoal.foreign("js", "m", "f"), (value,)).frames()


def test_a_neutral_array_reads_back_as_numpy_without_a_copy() -> None:
    arr = np.linspace(0, 1, 1 << 16)
    frames = dumps({"v": NeutralArray(arr)})
    back = loads(frames)["v"]
    assert back.dtype == np.float64 and back.shape == (1 << 16,) and (back == arr).all()
    assert not back.flags.owndata  # a view over the received frame
    for bad in ({"dtype": "<c16", "shape": [1]}, {"dtype": "<f8", "shape": [3]}, {"dtype": "<f8", "shape": "x"}):
        from shoal.protocol.neutral import _array_loads

        with pytest.raises(ValueError):
            _array_loads(bad, [b"\0" * 16])


def test_a_foreign_task_waits_until_a_worker_of_its_language_joins() -> None:
    with shoal.LocalCluster(n_workers=1, processes=False, dashboard_address=None) as cluster, \
            shoal.Client(cluster) as client:
        x = client.submit(abs, -3)
        fut = client.submit(shoal.foreign("js", "stats", "scale"), x, 2.0)
        assert fut.key.startswith("scale-")
        with pytest.raises(TimeoutError):
            fut.result(timeout=0.5)
        assert client.gather(x) == 3  # the rest of the cluster goes on
        story = cluster.scheduler.state.tasks[fut.key]
        assert story.state == "queued" and story.language == "js"
        info = client.scheduler_info()["workers"]
        assert [w["languages"] for w in info.values()] == [["python"]]
        with pytest.raises(SerializationError, match="builtins.object"):
            client.submit(shoal.foreign("js", "stats", "scale"), object())
