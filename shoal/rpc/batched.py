"""A stream that coalesces small messages over a short interval into one write."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from .. import config
from ..comm import Comm
from ..errors import CommClosedError, CommError

__all__ = ["BatchedSend"]

logger = logging.getLogger("shoal.rpc.batched")


class BatchedSend:
    """Send messages on ``comm`` in batches: each write carries a list of messages.

    ``send(msg)`` never blocks; a background task writes what accumulated at most every
    ``interval`` seconds (default: the ``batched-interval`` setting, 2 ms). The reader
    receives lists. ``close()`` flushes what is pending, then closes the comm.
    """

    def __init__(self, interval: float | None = None, name: str = ""):
        self.interval = config.get("batched-interval") if interval is None else interval
        self.name = name
        self.comm: Comm | None = None
        self.buffer: list[Any] = []
        self.message_count = 0
        self.batch_count = 0
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    def start(self, comm: Comm) -> None:
        """Begin sending on ``comm`` (call on the loop that owns it)."""
        self.comm = comm
        self._wake = asyncio.Event()
        self._task = asyncio.ensure_future(self._run())
        if self.buffer:
            self._wake.set()

    def send(self, *msgs: Any) -> None:
        """Queue messages; raises :class:`~shoal.errors.CommClosedError` once closed."""
        if self._closing or (self.comm is not None and self.comm.closed()):
            raise CommClosedError(f"batched stream {self.name} is closed")
        self.buffer.extend(msgs)
        if self._wake is not None:
            self._wake.set()

    async def _run(self) -> None:
        assert self._wake is not None and self.comm is not None
        try:
            while True:
                await self._wake.wait()
                if self.interval and not self._closing:
                    await asyncio.sleep(self.interval)  # gather what arrives meanwhile
                self._wake.clear()
                if not self.buffer:
                    if self._closing:
                        return
                    continue
                batch, self.buffer = self.buffer, []
                self.message_count += len(batch)
                self.batch_count += 1
                await self.comm.write(batch)
                if self._closing and not self.buffer:
                    return
        except CommError as exc:
            logger.info("batched stream %s stopped: %s", self.name, exc)
        except asyncio.CancelledError:
            pass

    async def close(self, timeout: float = 5.0) -> None:
        """Flush pending messages (waiting at most ``timeout``) and close the comm."""
        if self._closing:
            return
        self._closing = True
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
        if self._task is not None:
            self._task.cancel()
        if self.comm is not None:
            self.comm.abort()
