"""A stream that coalesces small messages over a short interval into one write."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

from .. import config
from ..comm import Comm
from ..errors import CommClosedError, CommError, DeserializationError, ProtocolError, SerializationError

__all__ = ["BatchedSend", "read_batch", "send_heartbeats", "without_values"]

logger = logging.getLogger("shoal.rpc.batched")


class BatchedSend:
    """Send messages on ``comm`` in batches: each write carries a list of messages.

    ``send(msg)`` never blocks. While the stream is quiet (fewer than ``burst``
    writes in the last ``interval`` seconds; defaults: the ``batched-burst`` and
    ``batched-interval`` settings, 8 and 2 ms) a message goes out at the next turn of
    the event loop, together with whatever else was sent in the same turn. Under load,
    messages are coalesced over the interval, so a busy stream pays a few writes per
    interval, not one per message, and a quiet one adds no delay.
    ``send(msg, lazy=True)`` is for housekeeping that no one waits on (releases): it
    waits up to ``lazy_delay`` (the ``batched-lazy-delay`` setting, 10 ms) and goes out
    with the next message that must go now, in the order sent, costing no write or
    wake-up of its own.
    ``send(msg, alone=True)`` is for a big message (a part of a big graph): it goes in
    a write of its own, after what was sent before it, so the peer can start on it
    while the next is serialized, and no small message waits for it.
    The reader receives lists. ``close()`` flushes what is pending, then closes the comm.

    A message that cannot be serialized for the peer (a user's value in it does not
    pickle) costs that message, not the stream: the batch it was in is sent again one
    message at a time, and each message that fails is handed to ``on_unsendable(msg,
    error)``, which returns what to send instead (the message without the value, say)
    or ``None``; the others go out, in order. Without ``on_unsendable`` the message is
    dropped with an error in the log.
    """

    def __init__(self, interval: float | None = None, name: str = "", burst: int | None = None,
                 lazy_delay: float | None = None,
                 on_unsendable: Callable[[Any, SerializationError], Any] | None = None):
        self.on_unsendable = on_unsendable
        self.interval = config.get("batched-interval") if interval is None else interval
        self.burst = config.get("batched-burst") if burst is None else burst
        self.lazy_delay = config.get("batched-lazy-delay") if lazy_delay is None else lazy_delay
        self._lazy_timer: asyncio.TimerHandle | None = None
        self.name = name
        self.comm: Comm | None = None
        self.buffer: list[Any] = []
        self.message_count = 0
        self.batch_count = 0
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._idle = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._recent: deque[float] = deque()
        #: the ids of the messages in ``buffer`` sent with ``alone``
        self._alone: set[int] = set()

    def start(self, comm: Comm) -> None:
        """Begin sending on ``comm`` (call on the loop that owns it)."""
        self.comm = comm
        self._wake = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.ensure_future(self._run())
        if self.buffer:
            self._wake.set()

    def send(self, *msgs: Any, lazy: bool = False, alone: bool = False) -> None:
        """Queue messages (call on the stream's loop); raises
        :class:`~shoal.errors.CommClosedError` once closed."""
        if self._closing or (self.comm is not None and self.comm.closed()):
            raise CommClosedError(f"batched stream {self.name} is closed")
        if alone:
            self._alone.update(map(id, msgs))
            self.buffer.extend(msgs)
            if self._wake is not None:
                self._wake.set()
            return
        if lazy:
            self.buffer.extend(msgs)
            if self._lazy_timer is None and self._loop is not None:
                self._lazy_timer = self._loop.call_later(self.lazy_delay, self._lazy_due)
            return
        if self._idle and not self._alone and self._write_now(self.buffer + list(msgs) if self.buffer else list(msgs)):
            self.buffer = []
            self._cancel_lazy()
            return
        self.buffer.extend(msgs)
        if self._wake is not None:
            self._wake.set()

    def _lazy_due(self) -> None:
        self._lazy_timer = None
        if self.buffer and self._wake is not None:
            self._wake.set()

    def _cancel_lazy(self) -> None:
        if self._lazy_timer is not None:
            self._lazy_timer.cancel()
            self._lazy_timer = None

    def _write_now(self, batch: list[Any]) -> bool:
        """A quiet stream hands a batch to the comm at once, without waiting for the
        next turn of the loop, when the comm can take it synchronously."""
        if self.comm is None or self._loop is None:
            return False
        now = self._loop.time()
        recent = self._recent
        while recent and recent[0] <= now - self.interval:
            recent.popleft()
        if len(recent) >= self.burst:
            return False
        try:
            if not self.comm.write_nowait(batch):
                return False
        except (CommError, SerializationError):
            # the background task sees the same error: it stops the stream (a comm
            # error) or sends the batch a message at a time (a value that does not
            # serialize)
            return False
        except Exception:
            logger.exception("batched stream %s: cannot send a batch; aborting the stream", self.name)
            self._closing = True
            self.comm.abort()
            return True
        recent.append(now)
        self.message_count += len(batch)
        self.batch_count += 1
        return True

    async def _run(self) -> None:
        assert self._wake is not None and self.comm is not None
        loop = asyncio.get_running_loop()
        recent = self._recent
        try:
            while True:
                # parked: a send() may write at once, taking what is buffered with it
                self._idle = True
                await self._wake.wait()
                self._idle = False
                now = loop.time()
                while recent and recent[0] <= now - self.interval:
                    recent.popleft()
                if len(recent) >= self.burst and not self._closing:
                    # busy: gather what arrives until the interval has passed
                    await asyncio.sleep(recent[0] + self.interval - now)
                self._wake.clear()
                if not self.buffer:
                    if self._closing:
                        return
                    continue
                batch, self.buffer = self._next_batch()
                if self.buffer:
                    self._wake.set()  # (what follows a message sent alone)
                self._cancel_lazy()
                self.message_count += len(batch)
                self.batch_count += 1
                recent.append(loop.time())
                try:
                    await self.comm.write(batch)
                except SerializationError:
                    await self._send_one_by_one(batch)
                if self._closing and not self.buffer:
                    return
        except CommError as exc:
            logger.info("batched stream %s stopped: %s", self.name, exc)
        except asyncio.CancelledError:
            pass
        except Exception:
            # e.g. a message that cannot be serialized: the batch is lost, so the peer
            # must not think the stream is fine; later send() raise CommClosedError
            logger.exception("batched stream %s: cannot send a batch; aborting the stream", self.name)
            self._closing = True
            self.comm.abort()

    def _next_batch(self) -> tuple[list[Any], list[Any]]:
        """(the next write, what stays in the buffer): all of it, unless a message
        sent alone is in it (it goes by itself, after what came before it)."""
        buffer, alone = self.buffer, self._alone
        if not alone:
            return buffer, []
        for i, msg in enumerate(buffer):
            if id(msg) in alone:
                if i:
                    return buffer[:i], buffer[i:]
                alone.discard(id(msg))
                return [msg], buffer[1:]
        alone.clear()  # (not in the buffer any more: dropped by abort)
        return buffer, []

    async def _send_one_by_one(self, batch: list[Any]) -> None:
        """Send ``batch`` a message at a time; what does not serialize goes to
        ``on_unsendable`` (nothing was written of a message whose serialization failed)."""
        assert self.comm is not None
        for msg in batch:
            try:
                await self.comm.write([msg])
                continue
            except SerializationError as exc:
                error = exc
            op = msg.get("op") if isinstance(msg, dict) else None
            instead = None
            if self.on_unsendable is not None:
                instead = self.on_unsendable(msg, error)
            else:
                logger.error("batched stream %s: dropped a %r message that cannot be serialized: %s",
                             self.name, op, error)
            if instead is not None:
                try:
                    await self.comm.write([instead])
                except SerializationError as exc:
                    logger.error("batched stream %s: dropped a %r message that cannot be serialized, even "
                                 "without its values: %s", self.name, op, exc)

    async def close(self, timeout: float = 5.0) -> None:
        """Flush pending messages (waiting at most ``timeout``) and close the comm."""
        if self._closing:
            return
        self._closing = True
        self._cancel_lazy()
        if self._wake is not None:
            self._wake.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout)
            except (asyncio.TimeoutError, CommError):
                self._task.cancel()
        if self.comm is not None:
            await self.comm.close()

    def abort(self) -> None:
        """Stop at once, dropping pending messages."""
        self._closing = True
        self._cancel_lazy()
        if self._task is not None:
            self._task.cancel()
        if self.comm is not None:
            self.comm.abort()


def without_values(msg: Any, error: SerializationError) -> Any:
    """An ``on_unsendable`` for streams of reports (``task-finished``,
    ``key-in-memory``, ``task-erred``): the message without the value that came along
    (the receiver fetches it from its holder, and hears then why it cannot travel)
    and without the exception object (the receiver rebuilds the error from its type
    and text); ``None`` for a message that has neither."""
    if not isinstance(msg, dict) or not (msg.get("value") is not None or msg.get("exception") is not None
                                         or not isinstance(msg.get("traceback"), (str, type(None)))):
        logger.error("dropped a %r message that cannot be serialized: %s", msg.get("op") if isinstance(msg, dict)
                     else type(msg).__name__, error)
        return None
    instead = {k: v for k, v in msg.items() if k != "value"}
    if "exception" in instead:
        instead["exception"] = None
    if not isinstance(instead.get("traceback"), (str, type(None))):
        instead["traceback"] = None
    return instead


async def read_batch(comm: Comm) -> list[Any]:
    """The next batch of messages a :class:`BatchedSend` sent on ``comm`` (a lone
    message comes back as a list of one). Raises :class:`~shoal.errors.CommError` when
    the stream ends, and :class:`~shoal.errors.ProtocolError` for a batch that cannot be
    decoded (stream readers keep values opaque, so only a broken or hostile peer sends
    one; dropping it silently would lose the ops in it)."""
    try:
        batch = await comm.read()
    except DeserializationError as exc:
        raise ProtocolError(f"a batch from {comm.peer_address} cannot be decoded: {exc}") from exc
    return batch if isinstance(batch, list) else [batch]


async def send_heartbeats(stream: BatchedSend, interval: float) -> None:
    """Send ``{"op": "heartbeat"}`` on ``stream`` every ``interval`` seconds until the
    stream fails, so that a peer that watches for silence (the scheduler's
    ``worker-ttl``) keeps us while we have nothing else to say. Lazily: it rides along
    with the next message, or goes alone after ``batched-lazy-delay``."""
    while True:
        await asyncio.sleep(interval)
        try:
            stream.send({"op": "heartbeat"}, lazy=True)
        except CommError:
            return  # the stream is gone; its reader notices
