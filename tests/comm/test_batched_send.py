"""The batched stream (``BatchedSend``) on every transport: coalescing, order, lazy
messages, messages sent alone, and messages that cannot be serialized."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import pytest

from comm_pairs import comm_pair, is_inproc
from shoal.errors import CommBrokenError, CommClosedError, SerializationError
from shoal.rpc import BatchedSend


async def test_batched_send_coalesces_and_keeps_order(address):
    async with comm_pair(address) as (client, server):
        stream = BatchedSend(interval=0.01, name="test")
        stream.start(client)
        n = 1000
        for i in range(n):
            stream.send({"i": i})
        received: list[Any] = []
        reads = 0
        while len(received) < n:
            batch = await server.read()
            assert isinstance(batch, list)
            received.extend(batch)
            reads += 1
        assert [m["i"] for m in received] == list(range(n))
        assert reads == stream.batch_count
        assert stream.batch_count <= 5, f"{n} sends took {stream.batch_count} writes"

        # what is pending at close() is flushed, then the comm is closed
        stream.send({"last": 1}, {"last": 2})
        await stream.close()
        tail: list[Any] = []
        with pytest.raises(CommBrokenError):
            while True:
                tail.extend(await server.read())
        assert tail == [{"last": 1}, {"last": 2}]
        assert stream.message_count == n + 2
        with pytest.raises(CommClosedError):
            stream.send({"too": "late"})


async def test_batched_send_coalesces_messages_sent_over_time(address):
    async with comm_pair(address) as (client, server):
        # an interval long enough for all the sends below, even on a slow machine
        stream = BatchedSend(interval=0.2, name="spread")
        stream.start(client)
        n = 500
        received: list[Any] = []

        async def reader() -> None:
            while len(received) < n:
                received.extend(await server.read())

        reading = asyncio.ensure_future(reader())
        for i in range(n):
            stream.send(i)
            await asyncio.sleep(0)  # one message per turn of the loop
        await asyncio.wait_for(reading, 10)
        assert received == list(range(n))
        assert stream.batch_count <= n // 10, f"{n} sends took {stream.batch_count} writes"
        await stream.close()


async def test_batched_send_lazy_messages_ride_with_the_next_urgent_one(address):
    async with comm_pair(address) as (client, server):
        # a lazy delay far longer than the test: only an urgent message can send them
        stream = BatchedSend(interval=0.01, name="lazy", lazy_delay=3600)
        stream.start(client)
        await asyncio.sleep(0)  # the stream parks, idle
        stream.send({"release": 1}, lazy=True)
        stream.send({"release": 2}, lazy=True)
        assert stream.batch_count == 0  # nothing written for housekeeping alone
        stream.send({"task": 3})
        assert await asyncio.wait_for(server.read(), 10) == [{"release": 1}, {"release": 2}, {"task": 3}]
        assert stream.batch_count == 1
        # lazy messages pending at close() are flushed too
        stream.send({"release": 4}, lazy=True)
        await stream.close()
        assert await asyncio.wait_for(server.read(), 10) == [{"release": 4}]


async def test_batched_send_lazy_messages_alone_go_after_the_delay(address):
    async with comm_pair(address) as (client, server):
        stream = BatchedSend(interval=0.01, name="lazy", lazy_delay=0.001)
        stream.start(client)
        stream.send({"release": 1}, lazy=True)
        assert await asyncio.wait_for(server.read(), 10) == [{"release": 1}]
        await stream.close()


async def test_batched_send_writes_a_message_sent_alone_by_itself(address):
    """A big message (a part of a big graph) goes in a write of its own, in order:
    what came before it first, what comes after it next."""
    async with comm_pair(address) as (client, server):
        stream = BatchedSend(interval=0.01, name="alone")
        stream.start(client)
        await asyncio.sleep(0)  # the stream parks, idle
        stream.send({"a": 1}, {"a": 2})
        stream.send({"part": 1}, alone=True)
        stream.send({"part": 2}, alone=True)
        stream.send({"b": 3}, {"b": 4})
        reads = [await asyncio.wait_for(server.read(), 10) for _ in range(4)]
        assert reads == [[{"a": 1}, {"a": 2}], [{"part": 1}], [{"part": 2}], [{"b": 3}, {"b": 4}]]
        stream.send({"part": 3}, alone=True)
        await stream.close()  # flushed on close too
        assert await asyncio.wait_for(server.read(), 10) == [{"part": 3}]


async def test_batched_send_with_an_unserializable_message(address, caplog):
    lock = threading.Lock()
    async with comm_pair(address) as (client, server):
        stream = BatchedSend(interval=0.01, name="bad")
        stream.start(client)
        stream.send({"ok": 1}, {"lock": lock}, {"ok": 2})
        if is_inproc(address):  # by reference: nothing to serialize
            assert await server.read() == [{"ok": 1}, {"lock": lock}, {"ok": 2}]
            await stream.close()
            return
        # the message costs itself, not the stream: the others go, one at a time, in order
        assert await asyncio.wait_for(server.read(), 10) == [{"ok": 1}]
        assert await asyncio.wait_for(server.read(), 10) == [{"ok": 2}]
        stream.send({"ok": 3})
        assert await asyncio.wait_for(server.read(), 10) == [{"ok": 3}]
        await stream.close()
        assert any("dropped a None message that cannot be serialized" in r.getMessage()
                   and r.levelno == logging.ERROR for r in caplog.records)


async def test_batched_send_hands_an_unserializable_message_to_on_unsendable(address):
    lock = threading.Lock()
    seen = []

    def instead(msg, error):
        seen.append((msg, error))
        return {"op": msg["op"], "value": None}

    async with comm_pair(address) as (client, server):
        stream = BatchedSend(interval=0.01, name="bad", on_unsendable=instead)
        stream.start(client)
        stream.send({"op": "a"}, {"op": "b", "value": lock}, {"op": "c"})
        got = []
        while len(got) < 3:
            got.extend(await asyncio.wait_for(server.read(), 10))
        if is_inproc(address):
            assert got == [{"op": "a"}, {"op": "b", "value": lock}, {"op": "c"}] and seen == []
        else:
            assert got == [{"op": "a"}, {"op": "b", "value": None}, {"op": "c"}]
            [(msg, error)] = seen
            assert msg["value"] is lock and isinstance(error, SerializationError) and "lock" in str(error)
        await stream.close()


# ------------------------------------------------------------------------ backend registry
