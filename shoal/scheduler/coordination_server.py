"""The scheduler's coordination requests: the IO side of :mod:`.coordination`.

:class:`CoordinationServer` serves the rpc ops and client-stream ops of the named
primitives (docs/protocol.md §9.4) on the scheduler's loop: a request that must wait
leaves an asyncio future as its waiter, with a timer for its ``timeout``, so the loop
never blocks; a request that passes futures first waits for its client's
``coordination-flush`` marker (the graphs of those futures came on the client's stream
before it). It is the state's :class:`~.coordination.Host`: keys are kept alive by
feeding the scheduler's state machine events, as a client's messages do.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..comm import Comm
from ..protocol import REMOTE, Serialized
from ..protocol.coordination_msgs import (
    COORDINATION_STREAM,
    CoordinationFlushMsg,
    PubSubPublishMsg,
    PubSubSubscribeMsg,
    PubSubUnsubscribeMsg,
)
from ..protocol.messages import Key, Msg, key_problem
from ..protocol.serialize import forwarded
from .coordination import GONE, PENDING, Coordination, Value
from .events import ReleaseKeysEvent, RemoveClientEvent, UpdateGraphEvent

if TYPE_CHECKING:
    from .server import Scheduler

__all__ = ["CoordinationServer"]

#: seconds a request waits for its client's flush marker before going on without it
FLUSH_WAIT = 30.0


class _Waiter:
    """An asyncio future that counts as done once its request's connection closed."""

    __slots__ = ("future", "comm")

    def __init__(self, future: asyncio.Future[Any], comm: Comm | None):
        self.future = future
        self.comm = comm

    def done(self) -> bool:
        return self.future.done() or (self.comm is not None and self.comm.closed())

    def set_result(self, result: Any, /) -> None:
        if not self.future.done():
            self.future.set_result(result)


class _TimedOut(Exception):
    pass


def _timeout(timeout: float | None) -> float | None:
    """``timeout`` as seconds to wait (None: for ever). Raises ``ValueError`` for NaN."""
    if timeout is None or timeout == math.inf:
        return None
    if math.isnan(timeout):
        raise ValueError("a timeout must be a number of seconds, not NaN")
    return max(timeout, 0.0)


class CoordinationServer:
    """The rpc handlers and stream ops of :class:`Coordination`, on ``scheduler``'s loop."""

    def __init__(self, scheduler: Scheduler):
        self._scheduler = scheduler
        self.state = Coordination(self)

    # -- Host

    def hold(self, holder: str, keys: list[Key]) -> None:
        s = self._scheduler
        s._apply(UpdateGraphEvent(s._stimulus("coordination-hold"), holder, [], list(keys)))

    def release(self, holder: str, keys: list[Key]) -> None:
        s = self._scheduler
        s._apply(ReleaseKeysEvent(s._stimulus("coordination-release"), holder, list(keys)))

    def forget_holder(self, holder: str) -> None:
        s = self._scheduler
        s._apply(RemoveClientEvent(s._stimulus("coordination-forget"), holder))

    def knows(self, key: Key) -> bool:
        return key in self._scheduler.state.tasks

    def connected(self, client: str) -> bool:
        return client in self._scheduler.client_streams

    # -- plumbing

    def handlers(self) -> dict[str, Callable[..., Any]]:
        """The rpc handlers, by op."""
        return {
            "variable-set": self.variable_set, "variable-get": self.variable_get,
            "variable-delete": self.variable_delete,
            "queue-put": self.queue_put, "queue-get": self.queue_get, "queue-size": self.queue_size,
            "semaphore-acquire": self.semaphore_acquire, "semaphore-release": self.semaphore_release,
            "semaphore-value": self.semaphore_value,
            "event-wait": self.event_wait, "event-set": self.event_set, "event-clear": self.event_clear,
            "event-is-set": self.event_is_set,
            "pubsub-get": self.pubsub_get,
            "publish-put": self.publish_put, "publish-get": self.publish_get,
            "publish-delete": self.publish_delete, "publish-list": self.publish_list,
        }

    def stream_msg(self, client: str, msg: Msg) -> None:
        """One of :data:`~shoal.protocol.messages.COORDINATION_STREAM` from ``client``."""
        assert isinstance(msg, COORDINATION_STREAM)
        if type(msg) is CoordinationFlushMsg:
            self.state.flush_seen(msg.uid)
        elif type(msg) is PubSubSubscribeMsg:
            self.state.subscribe(msg.name, msg.sub, client)
        elif type(msg) is PubSubUnsubscribeMsg:
            self.state.unsubscribe(msg.sub, client)
        elif type(msg) is PubSubPublishMsg:
            self.state.publish(msg.name, msg.data)

    def client_removed(self, client: str) -> None:
        self.state.client_removed(client)

    def close(self) -> None:
        self.state.close()

    async def _wait(self, comm: Comm | None, start: Callable[[Any], Any], timeout: float | None) -> Any:
        """What ``start(waiter)`` answers, now or later. Raises :class:`_TimedOut`
        after ``timeout`` seconds, ``RuntimeError`` if the waiter's client left."""
        seconds = _timeout(timeout)
        if seconds == 0:
            result = start(None)
        else:
            loop = asyncio.get_running_loop()
            waiter = _Waiter(loop.create_future(), comm)
            result = start(waiter)
            if result is PENDING:
                timer = None if seconds is None else loop.call_later(seconds, self._expire, waiter)
                try:
                    result = await waiter.future
                finally:
                    if timer is not None:
                        timer.cancel()
                    if not waiter.future.done():  # cancelled: the scheduler closes
                        self.state.forget(waiter)
        if result is PENDING:
            raise _TimedOut
        if result is GONE:
            raise RuntimeError("the request's client left or the scheduler closes")
        return result

    def _expire(self, waiter: _Waiter) -> None:
        if not waiter.future.done():
            self.state.forget(waiter)
            waiter.future.set_result(PENDING)

    async def _flushed(self, comm: Comm | None, uid: str, client: str, timeout: float | None) -> None:
        """Wait until ``client``'s stream brought marker ``uid`` (its graphs came
        before it); after ``FLUSH_WAIT`` seconds (or ``timeout``) go on without it."""
        if not uid:
            return
        seconds = FLUSH_WAIT if timeout is None else min(_timeout(timeout) or 0.0, FLUSH_WAIT)
        try:
            await self._wait(comm, lambda w: self.state.wait_flush(uid, client, w), max(seconds, 1e-3))
        except _TimedOut:
            pass
        finally:
            self.state.forget_flush(uid)

    @staticmethod
    def _wire(comm: Comm | None, value: Value) -> dict[str, Any]:
        """``value`` as a reply carries it: ``{"key": k}`` or ``{"data": d}``."""
        if value.key is not None:
            return {"key": value.key}
        data = value.data
        if type(data) is Serialized and comm is not None and comm.destination == REMOTE:
            data = forwarded(data, REMOTE)  # shared-memory references a remote peer cannot map
        return {"data": data}

    @staticmethod
    def _value(keys: list[Any], data: Any) -> Value:
        if len(keys) > 1:
            raise ValueError(f"one future at most, got {len(keys)} keys")
        return Value(keys[0]) if keys else Value(data=data)

    @staticmethod
    def _check_keys(keys: list[list[Any]]) -> None:
        for ks in keys:
            for key in ks:
                problem = key_problem(key)
                if problem is not None:
                    raise ValueError(f"not a key: {key!r:.100} ({problem})")

    # -- handlers (fields as in shoal.protocol.messages)

    async def variable_set(self, comm: Comm | None, name: str, keys: list[Any], data: Any, client: str, flush: str,
                           timeout: float | None) -> None:
        value = self._value(keys, data)
        await self._flushed(comm, flush, client, timeout)
        self.state.variable_set(name, value)

    async def variable_get(self, comm: Comm | None, name: str, client: str, timeout: float | None) -> Any:
        try:
            value = await self._wait(comm, lambda w: self.state.variable_get(name, client, w), timeout)
        except _TimedOut:
            return None
        return self._wire(comm, value)

    def variable_delete(self, comm: Comm | None, name: str) -> None:
        self.state.variable_delete(name)

    async def queue_put(self, comm: Comm | None, name: str, maxsize: int, keys: list[Any], data: Any, client: str,
                        flush: str, timeout: float | None) -> bool:
        value = self._value(keys, data)
        await self._flushed(comm, flush, client, timeout)
        try:
            return bool(await self._wait(comm, lambda w: self.state.queue_put(name, maxsize, value, client, w),
                                         timeout))
        except _TimedOut:
            return False

    async def queue_get(self, comm: Comm | None, name: str, maxsize: int, batch: bool | int, client: str,
                        timeout: float | None) -> Any:
        if batch is not True and batch is not False and batch < 0:
            raise ValueError(f"batch must be True, False or a count >= 0, got {batch}")
        try:
            out = await self._wait(comm, lambda w: self.state.queue_get(name, maxsize, batch, client, w), timeout)
        except _TimedOut:
            return None
        if isinstance(out, list):
            return [self._wire(comm, v) for v in out]
        return self._wire(comm, out)

    def queue_size(self, comm: Comm | None, name: str, maxsize: int) -> int:
        return self.state.queue_size(name, maxsize)

    async def semaphore_acquire(self, comm: Comm | None, name: str, max_leases: int, lease: str, client: str,
                                timeout: float | None) -> bool:
        try:
            await self._wait(comm, lambda w: self.state.semaphore_acquire(name, max_leases, lease, client, w),
                             timeout)
        except _TimedOut:
            return False
        if comm is not None and comm.closed():
            self.state.semaphore_release(name, lease)  # nobody will hear of it
            return False
        return True

    def semaphore_release(self, comm: Comm | None, name: str, lease: str) -> bool:
        return self.state.semaphore_release(name, lease)

    def semaphore_value(self, comm: Comm | None, name: str, max_leases: int) -> int:
        return self.state.semaphore_value(name, max_leases)

    async def event_wait(self, comm: Comm | None, name: str, client: str, timeout: float | None) -> bool:
        try:
            return bool(await self._wait(comm, lambda w: self.state.event_wait(name, client, w), timeout))
        except _TimedOut:
            return False

    def event_set(self, comm: Comm | None, name: str) -> None:
        self.state.event_set(name)

    def event_clear(self, comm: Comm | None, name: str) -> None:
        self.state.event_clear(name)

    def event_is_set(self, comm: Comm | None, name: str) -> bool:
        return self.state.event_is_set(name)

    async def pubsub_get(self, comm: Comm | None, name: str, sub: str, client: str, timeout: float | None) -> Any:
        try:
            out = await self._wait(comm, lambda w: self.state.subscriber_get(name, sub, client, w), timeout)
        except _TimedOut:
            return None
        return [self._wire(comm, Value(data=d))["data"] for d in out]

    async def publish_put(self, comm: Comm | None, names: list[Any], keys: list[list[Any]], data: list[Any],
                          override: bool, client: str, flush: str) -> None:
        self._check_keys(keys)
        await self._flushed(comm, flush, client, None)
        self.state.publish_put(names, keys, data, override)

    def publish_get(self, comm: Comm | None, names: list[Any]) -> list[Any]:
        return [None if d is None else self._wire(comm, Value(data=d))
                for d in self.state.publish_get(names)]

    async def publish_delete(self, comm: Comm | None, names: list[Any], client: str, flush: str) -> None:
        await self._flushed(comm, flush, client, None)
        self.state.publish_delete(names)

    def publish_list(self, comm: Comm | None) -> list[Any]:
        return self.state.publish_list()
