import numpy as np
import pytest

from shoal.protocol import to_serialize
from shoal.rpc import Server, rpc

ADDRESSES = ["inproc://", "tcp://127.0.0.1:0"]


@pytest.mark.parametrize("address", ADDRESSES)
async def test_rpc_echo_and_error(address):
    def echo(comm, x):
        return x

    def fail(comm):
        raise ZeroDivisionError("boom")

    server = Server({"echo": echo, "fail": fail})
    await server.listen(address)
    try:
        async with rpc(server.address) as r:
            arr = np.arange(10)
            out = await r.echo(x=to_serialize(arr))
            assert np.array_equal(out, arr)
            with pytest.raises(ZeroDivisionError, match="boom") as info:
                await r.fail()
            assert any("remote traceback" in n for n in info.value.__notes__)
            assert await r.echo(x=(1, [2, (3,)])) == (1, [2, (3,)])
    finally:
        await server.close()


@pytest.mark.parametrize("address", ADDRESSES)
async def test_a_served_value_is_not_kept_while_the_connection_idles(address):
    """The server holds no reference to its last answer: a value it served is free to
    go (and its memory with it) as soon as its owner drops it, though the requester
    keeps the connection open for later requests."""
    import gc
    import weakref

    class Value:
        def __reduce__(self):
            return (Value, ())

    held = {"v": Value()}
    ref = weakref.ref(held["v"])

    def get(comm):
        return to_serialize(held["v"])

    server = Server({"get": get})
    await server.listen(address)
    try:
        async with rpc(server.address) as r:
            got = await r.get()
            assert isinstance(got, Value)
            del got
            held.clear()  # the owner lets go; the connection stays open
            gc.collect()
            assert ref() is None
    finally:
        await server.close()
