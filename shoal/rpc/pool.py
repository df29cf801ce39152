"""Connection pool and ``rpc(address).op(**kwargs)`` proxies."""

from __future__ import annotations

import asyncio
import functools
import time
from collections import defaultdict, deque
from typing import Any

from .. import config
from ..comm import Comm, connect
from ..comm.security import Security
from ..errors import CommClosedError
from .core import request, result_of

__all__ = ["ConnectionPool", "rpc", "fetch_deadline"]


class ConnectionPool:
    """Reusable comms per address, at most ``limit`` open at once.

    ``await pool.connect(address)`` hands out an idle comm or opens one; give it back
    with ``pool.reuse(address, comm)`` (or drop a broken one with ``comm.abort()`` and
    ``pool.reuse``, which discards closed comms). ``pool(address).op(**kw)`` is the
    convenient form.
    """

    def __init__(self, limit: int | None = None, deserialize: bool = True, timeout: float | None = None,
                 security: Security | None = None, role: str = "client"):
        self.limit = config.get("pool-limit") if limit is None else limit
        #: what this end tells the peers it connects to it is
        self.role = role
        if self.limit < 1:
            raise ValueError("a connection pool needs a limit of at least 1")
        self.deserialize = deserialize
        self.timeout = timeout
        #: the credentials every connection proves (None: found per address)
        self.security = security
        self.available: dict[str, set[Comm]] = defaultdict(set)
        self.occupied: dict[str, set[Comm]] = defaultdict(set)
        self._opening = 0
        # callers waiting for a free slot, woken one at a time (first come, first served)
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._closed = False
        # idle comms are not reused after half the servers' idle-timeout
        self._max_idle = config.get("idle-timeout") / 2
        self._returned: dict[Comm, float] = {}

    @property
    def open(self) -> int:
        return self._opening + sum(map(len, self.available.values())) + sum(map(len, self.occupied.values()))

    def _wake(self, n: int = 1) -> None:
        """Let up to ``n`` waiting callers look again for a free slot."""
        while n > 0 and self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                n -= 1

    async def connect(self, address: str, timeout: float | None = None) -> Comm:
        """An open comm to ``address``; raises :class:`~shoal.errors.CommConnectError`."""
        if self._closed:
            raise CommClosedError("the connection pool is closed")
        while True:
            idle = self.available.get(address)
            while idle:
                comm = idle.pop()
                returned = self._returned.pop(comm, 0.0)
                if comm.closed():
                    continue
                if self._max_idle and time.monotonic() - returned > self._max_idle:
                    # its server closes it soon (idle-timeout): a request now could
                    # cross that close
                    comm.abort()
                    continue
                self.occupied[address].add(comm)
                return comm
            if self.open < self.limit:
                break
            if not self._close_one_idle():
                # registered without awaiting in between: no wake-up can be missed
                fut = asyncio.get_running_loop().create_future()
                self._waiters.append(fut)
                try:
                    await fut
                except BaseException:
                    if fut.done() and not fut.cancelled():
                        self._wake()  # woken but cancelled: pass the turn on
                    raise
                if self._closed:
                    raise CommClosedError("the connection pool is closed")
        self._opening += 1
        try:
            comm = await connect(address, timeout=self.timeout if timeout is None else timeout,
                                 deserialize=self.deserialize, security=self.security, role=self.role)
        except BaseException:
            self._wake()  # the slot we held is free again
            raise
        finally:
            self._opening -= 1
        if self._closed:
            comm.abort()
            raise CommClosedError("the connection pool is closed")
        self.occupied[address].add(comm)
        return comm

    def _close_one_idle(self) -> bool:
        for comms in self.available.values():
            if comms:
                comm = comms.pop()
                self._returned.pop(comm, None)
                comm.abort()
                return True
        return False

    def reuse(self, address: str, comm: Comm) -> None:
        """Return a comm taken with :meth:`connect`."""
        self.occupied[address].discard(comm)
        if comm.closed() or self._closed:
            comm.abort()
        else:
            self.available[address].add(comm)
            if self._max_idle:
                self._returned[comm] = time.monotonic()
        self._wake()

    def remove(self, address: str) -> None:
        """Close every comm to ``address`` (e.g. when that peer is gone)."""
        comms = self.available.pop(address, set()) | self.occupied.pop(address, set())
        for comm in comms:
            self._returned.pop(comm, None)
            comm.abort()
        self._wake(len(comms))

    async def close(self) -> None:
        self._closed = True
        for address in list(self.available) + list(self.occupied):
            self.remove(address)
        self._wake(len(self._waiters))  # they raise CommClosedError

    def __call__(self, address: str) -> PooledRPC:
        return PooledRPC(self, address)


class PooledRPC:
    """``await PooledRPC(pool, address).some_op(**kwargs)``: sends op ``some-op``."""

    def __init__(self, pool: ConnectionPool, address: str):
        self.pool = pool
        self.address = address

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return functools.partial(self.call, name.replace("_", "-"))

    async def call(self, op: str, **kwargs: Any) -> Any:
        """Send ``op`` with ``kwargs``; return the result or raise the remote error."""
        comm = await self.pool.connect(self.address)
        try:
            response = await request(comm, op, **kwargs)
        except BaseException:
            comm.abort()  # the exchange was cut short: the comm's state is unknown
            raise
        finally:
            self.pool.reuse(self.address, comm)
        return result_of(response)

    async def close(self) -> None:
        """Close the connections this proxy's pool holds to its address."""
        self.pool.remove(self.address)

    async def __aenter__(self) -> PooledRPC:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


#: a fetch of values is allowed one second more per this many bytes it expects
FETCH_BYTES_PER_SECOND = 10_000_000


def fetch_deadline(nbytes: int = 0) -> float | None:
    """The seconds a ``get-data`` for ``nbytes`` (as expected) may take before it counts
    as failed: ``fetch-timeout``, and a second per :data:`FETCH_BYTES_PER_SECOND`, so
    that a large value on a slow network is not cut off; None when ``fetch-timeout``
    is 0 (no deadline)."""
    base = config.get("fetch-timeout")
    if not base or base <= 0:
        return None
    return base + max(nbytes, 0) / FETCH_BYTES_PER_SECOND


def rpc(address: str, deserialize: bool = True, timeout: float | None = None,
        security: Security | None = None) -> PooledRPC:
    """A proxy for calls to ``address``: ``async with rpc(addr) as r: await r.ping()``.

    It owns a pool of one connection, closed by ``close()`` (or leaving the ``async
    with``); share a :class:`ConnectionPool` for calls to many peers.
    """
    pool = ConnectionPool(limit=1, deserialize=deserialize, timeout=timeout, security=security)
    return PooledRPC(pool, address)
