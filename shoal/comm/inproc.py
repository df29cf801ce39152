"""``inproc://``: comms between event loops of one process, by reference.

A message written on one end is the very object the other end reads: nothing is
pickled, so locks, open files and objects whose ``__reduce__`` raises travel fine. The
two ends may run on different event loops in different threads; a write to an end on
another loop is handed over with ``call_soon_threadsafe``.

For a receiver that deserializes, ``to_serialize`` wrappers are unwrapped to their
objects (the message container is rebuilt only when it holds one); a receiver with
``deserialize=False`` (the scheduler) keeps the wrappers, opaque, to forward them.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
from collections import deque
from typing import Any

from ..errors import CommBrokenError, CommClosedError, CommConnectError
from ..protocol import SAME_PROCESS, unwrap
from .core import Backend, Comm, Handler, Listener, local_info, register_backend, run_handler

__all__ = ["InprocComm", "InprocListener", "InprocBackend"]

_EOF = object()
_ids = itertools.count(1)
_registry: dict[str, InprocListener] = {}
_registry_lock = threading.Lock()


def _new_address() -> str:
    return f"inproc://{os.getpid()}/{next(_ids)}"


class _Inbox:
    """An unbounded queue read on one loop, written from any thread."""

    __slots__ = ("loop", "thread", "items", "waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop, thread: int | None = None):
        self.loop = loop
        self.thread = threading.get_ident() if thread is None else thread
        self.items: deque[Any] = deque()
        self.waiter: asyncio.Future[None] | None = None

    def put(self, item: Any) -> None:
        if threading.get_ident() == self.thread:
            self._put(item)
        else:
            try:
                self.loop.call_soon_threadsafe(self._put, item)
            except RuntimeError:  # the reader's loop is closed: nobody will read
                pass

    def _put(self, item: Any) -> None:
        self.items.append(item)
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def get(self) -> Any:
        while not self.items:
            self.waiter = self.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        return self.items.popleft()


class InprocComm(Comm):
    def __init__(self, local: str, peer: str, inbox: _Inbox, deserialize: bool):
        super().__init__(deserialize)
        self.local_address = local
        self.peer_address = peer
        self.peer_info = local_info()
        self.destination = SAME_PROCESS
        self._inbox = inbox
        self._peer: InprocComm | None = None
        self._closed = False
        self._broken = False

    async def read(self) -> Any:
        if self._closed:
            raise CommClosedError(f"{self!r} was closed")
        if self._broken and not self._inbox.items:
            raise CommBrokenError(f"peer {self.peer_address} closed the connection")
        msg = await self._inbox.get()
        if msg is _EOF:
            self._broken = True
            if self._closed:
                raise CommClosedError(f"{self!r} was closed")
            raise CommBrokenError(f"peer {self.peer_address} closed the connection")
        return unwrap(msg) if self.deserialize else msg

    async def write(self, msg: Any) -> int:
        self.write_nowait(msg)
        return 0

    def write_nowait(self, msg: Any) -> bool:
        """Hand ``msg`` to the peer without awaiting (same errors as :meth:`write`);
        always succeeds (returns ``True``)."""
        if self._closed:
            raise CommClosedError(f"{self!r} was closed")
        peer = self._peer
        if self._broken or peer is None or peer._closed:
            # a closed peer would never read it: say so instead of dropping it
            raise CommBrokenError(f"peer {self.peer_address} closed the connection")
        peer._inbox.put(msg)
        return True

    async def close(self) -> None:
        self.abort()

    def abort(self) -> None:
        if self._closed:
            return
        self._closed = True
        peer = self._peer
        if peer is not None:
            peer._inbox.put(_EOF)
        # wake our own reader, which then sees that we closed
        self._inbox.put(_EOF)

    def closed(self) -> bool:
        peer = self._peer
        return self._closed or self._broken or (peer is not None and peer._closed)


class InprocListener(Listener):
    def __init__(self, location: str, handler: Handler, deserialize: bool):
        self._address = f"inproc://{location}" if location else _new_address()
        self.handler = handler
        self.deserialize = deserialize
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread = 0
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.thread = threading.get_ident()
        with _registry_lock:
            if self._address in _registry:
                raise OSError(f"inproc address {self._address} is already in use")
            _registry[self._address] = self

    def stop(self) -> None:
        with _registry_lock:
            if _registry.get(self._address) is self:
                del _registry[self._address]

    @property
    def listen_address(self) -> str:
        return self._address

    @property
    def contact_address(self) -> str:
        return self._address

    def _accept(self, comm: InprocComm) -> None:
        task = asyncio.ensure_future(run_handler(self.handler, comm))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


class InprocBackend(Backend):
    # the two ends are one process: nothing to prove, ``security`` is not used
    async def connect(self, location: str, deserialize: bool, timeout: float,
                      security: Any = None, *, role: str = "client", expect: str | None = None) -> InprocComm:
        address = f"inproc://{location}"
        with _registry_lock:
            listener = _registry.get(address)
        if listener is None or listener.loop is None or listener.loop.is_closed():
            raise CommConnectError(f"no inproc listener at {address}")
        loop = asyncio.get_running_loop()
        client_address = _new_address()
        client = InprocComm(client_address, address, _Inbox(loop), deserialize)
        # the server end's inbox lives on the listener's loop
        server_inbox = _Inbox(listener.loop, listener.thread)
        server = InprocComm(address, client_address, server_inbox, listener.deserialize)
        client._peer, server._peer = server, client
        if listener.loop is loop:
            listener._accept(server)
        else:
            try:
                listener.loop.call_soon_threadsafe(listener._accept, server)
            except RuntimeError as exc:
                raise CommConnectError(f"inproc listener at {address} is gone") from exc
        return client

    def listener(self, location: str, handler: Handler, deserialize: bool,
                 security: Any = None) -> InprocListener:
        return InprocListener(location, handler, deserialize)


register_backend("inproc", InprocBackend())
