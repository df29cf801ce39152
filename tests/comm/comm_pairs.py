"""Both ends of one connection on any transport, for the transport tests."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from shoal.comm import connect, listen
from shoal.comm.core import Comm

__all__ = ["comm_pair", "is_inproc"]


def is_inproc(address: str) -> bool:
    return address.startswith("inproc")


@contextlib.asynccontextmanager
async def comm_pair(address: str, deserialize: bool = True, server_deserialize: bool = True) -> AsyncIterator[tuple[Comm, Comm]]:
    """(client end, server end) of one connection; both closed on exit."""
    accepted: asyncio.Queue[Comm] = asyncio.Queue()
    release = asyncio.Event()

    async def handler(comm: Comm) -> None:
        await accepted.put(comm)
        await release.wait()

    listener = await listen(address, handler, deserialize=server_deserialize)
    client = server = None
    try:
        client = await connect(listener.contact_address, deserialize=deserialize)
        server = await asyncio.wait_for(accepted.get(), 10)
        yield client, server
    finally:
        release.set()
        for comm in (client, server):
            if comm is not None:
                comm.abort()
        listener.stop()
