"""Side-channel families and leases: a resource lives exactly until the receiver has it."""

from __future__ import annotations

import asyncio
import os

import pytest

from shoal.comm import connect, listen
from shoal.examples import device_array
from shoal.examples.device_array import DeviceArray
from shoal.protocol import to_serialize

device_array.register()


async def _pair(deserialize: bool = True):
    accepted: asyncio.Queue = asyncio.Queue()

    async def handler(comm):
        await accepted.put(comm)
        await asyncio.Event().wait()  # hold the comm open; the test drives it

    listener = await listen("tcp://127.0.0.1:0", handler)
    client = await connect(listener.contact_address, deserialize=deserialize)
    server = await asyncio.wait_for(accepted.get(), 10)
    return listener, server, client


def _events_for(handle: str) -> list[str]:
    return [what for what, h in device_array.events() if h == handle]


async def test_export_freed_once_after_the_receiver_has_it_and_not_before():
    listener, sender, receiver = await _pair()
    try:
        arr = DeviceArray(b"x" * 10_000)
        await sender.write({"x": to_serialize(arr)})
        [handle] = device_array.live_exports()
        assert _events_for(handle) == ["exported"]  # held while the receiver has not read it
        assert os.path.exists(f"/dev/shm/{handle}")
        got = await receiver.read()
        assert got["x"] == arr
        # the acknowledgement travels ahead of the receiver's next message
        await receiver.write({"op": "next"})
        assert await sender.read() == {"op": "next"}
        assert _events_for(handle) == ["exported", "imported", "freed"]
        assert not os.path.exists(f"/dev/shm/{handle}")
        assert not device_array.live_exports()
    finally:
        await receiver.close()
        await sender.close()
        listener.stop()


async def test_export_freed_when_the_connection_breaks_before_the_receiver_reads():
    listener, sender, receiver = await _pair()
    try:
        await sender.write({"x": to_serialize(DeviceArray(b"y" * 100))})
        [handle] = device_array.live_exports()
        receiver.abort()  # the receiver goes away without reading
        with pytest.raises(Exception):
            await asyncio.wait_for(sender.read(), 10)
        assert _events_for(handle) == ["exported", "freed"]
        assert not os.path.exists(f"/dev/shm/{handle}")
    finally:
        await sender.close()
        listener.stop()


async def test_export_freed_when_the_lease_times_out(monkeypatch):
    monkeypatch.setattr(device_array, "LEASE_TIMEOUT", 0.05)
    listener, sender, receiver = await _pair()
    try:
        await sender.write({"x": to_serialize(DeviceArray(b"z" * 100))})
        [handle] = device_array.live_exports()
        while handle in device_array.live_exports():  # ended by the loop's timer
            await asyncio.sleep(0.01)
        assert _events_for(handle) == ["exported", "freed"]
        # a late reader cannot import any more, and says so
        with pytest.raises(Exception, match="No such file|cannot deserialize"):
            await receiver.read()
    finally:
        await receiver.close()
        await sender.close()
        listener.stop()


async def test_a_middle_hop_that_does_not_deserialize_does_not_acknowledge():
    listener, sender, receiver = await _pair(deserialize=False)
    try:
        await sender.write({"x": to_serialize(DeviceArray(b"w" * 100))})
        [handle] = device_array.live_exports()
        got = await receiver.read()
        assert type(got["x"]).__name__ == "Serialized"
        await receiver.write({"op": "next"})
        assert await sender.read() == {"op": "next"}
        assert handle in device_array.live_exports()  # still held: nobody has imported it
    finally:
        await receiver.close()
        await sender.close()
        listener.stop()
    assert handle not in device_array.live_exports()  # closing ended it


async def test_no_lease_for_remote_destinations():
    listener, sender, receiver = await _pair()
    try:
        sender.destination = "remote"  # as if the peer were on another host
        await sender.write({"x": to_serialize(DeviceArray(b"v" * 100))})
        assert not device_array.live_exports()
        assert (await receiver.read())["x"] == DeviceArray(b"v" * 100)
    finally:
        await receiver.close()
        await sender.close()
        listener.stop()


def test_lease_outside_a_transport_is_an_error():
    from shoal.protocol import lease

    with pytest.raises(RuntimeError, match="only valid inside"):
        lease(lambda: None)


