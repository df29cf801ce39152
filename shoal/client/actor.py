"""Actor handles for the client: ``client.submit(Cls, actor=True).result()`` is an
:class:`Actor`; its method calls return :class:`ActorFuture`\\ s, its attributes are
read from the worker that holds it (see :mod:`shoal.worker.actor`)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from ..protocol import to_serialize
from ..rpc import PooledRPC
from ..worker.actor import ActorRef
from ..worker.context import waiting
from .future import _unwrap

if TYPE_CHECKING:
    from .client import Client

__all__ = ["Actor", "ActorFuture", "BaseActorFuture"]


class BaseActorFuture:
    """What an actor's method call returns (dask's name)."""


class ActorFuture(BaseActorFuture):
    """The result of one method call of an actor: ``result(timeout=None)``, ``done()``;
    awaitable on an asynchronous client."""

    def __init__(self, client: Client, call: Any):
        self._client = client
        loop = client.loop
        assert loop is not None, "the client is not running"
        self._future: Any = asyncio.ensure_future(call) if client.asynchronous \
            else asyncio.run_coroutine_threadsafe(call, loop)

    def result(self, timeout: float | None = None) -> Any:
        """The method's return value; raises what it raised, ``TimeoutError``."""
        if self._client.asynchronous:
            return self._future
        with waiting():
            return self._future.result(timeout)

    def done(self) -> bool:
        return bool(self._future.done())

    def __await__(self) -> Any:
        return self._future.__await__()

    def __repr__(self) -> str:
        return f"<ActorFuture {'done' if self.done() else 'pending'}>"


class Actor:
    """A handle on an object that lives on one worker. ``actor.method(*args)`` runs it
    there (calls run one at a time, in order) and returns an :class:`ActorFuture`;
    ``actor.attribute`` reads it (blocking; awaitable on an asynchronous client)."""

    __shoal_handle__ = True

    def __init__(self, cls_name: str, worker: str, key: Any, client: Client | None, cls: Any = None):
        self._cls_name = cls_name
        self._address = worker
        self._key = key
        self._cls = cls
        self._order: asyncio.Lock | None = None
        self._bound: Client | None = None
        self._future: Any = None
        if client is not None:
            self._bind(client)

    def _bind(self, client: Client) -> None:
        self._bound = client
        #: the actor lives while its key does: a handle holds it
        self._future = client._future_for_key(self._key)

    @property
    def _client(self) -> Client:
        """Its client; a handle unpickled where there was none yet (a task's
        arguments being read) binds to the client of where it is first used."""
        if self._bound is None:
            from .default import get_client

            self._bind(get_client())
        assert self._bound is not None
        return self._bound

    @classmethod
    def of(cls, ref: ActorRef, client: Client) -> Actor:
        instance = ref.instance  # here when the actor lives in this process
        return cls(ref.cls_name, ref.worker, ref.key, client, type(instance) if instance is not None else None)

    @property
    def key(self) -> Any:
        return self._key

    @property
    def worker(self) -> str:
        return self._address

    def _rpc(self) -> PooledRPC:
        pool = self._client._pool
        assert pool is not None
        return PooledRPC(pool, self._address)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if self._cls is not None:
            is_method = callable(getattr(self._cls, name, None))
            value: Any = None
        else:
            reply = self._client._sync(self._attribute, name)
            is_method, value = reply["callable"], reply.get("value")
        if is_method:
            def method(*args: Any, **kwargs: Any) -> ActorFuture:
                return ActorFuture(self._client, self._execute(name, args, kwargs))
            method.__name__ = name
            return method
        if self._cls is None:
            return _unwrap(value)
        if self._client.asynchronous:
            return self._read(name)
        return self._client._sync(self._read, name)

    async def _attribute(self, name: str) -> dict[str, Any]:
        return await self._rpc().actor_attribute(key=self._key, attribute=name)

    async def _read(self, name: str) -> Any:
        reply = await self._attribute(name)
        if reply["callable"]:
            raise TypeError(f"{self._cls_name}.{name} is a method")
        return _unwrap(reply.get("value"))

    async def _execute(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # calls through one handle reach the worker in the order made: one at a time
        if self._order is None:
            self._order = asyncio.Lock()
        async with self._order:
            result = await self._rpc().actor_execute(key=self._key, method=method, args=to_serialize(args),
                                                     kwargs=to_serialize(kwargs))
        return _unwrap(result)

    def __repr__(self) -> str:
        return f"<Actor: {self._cls_name}, key={self._key!r}>"

    def __reduce__(self) -> Any:
        return (_actor_in_this_process, (self._cls_name, self._address, self._key))


def _actor_in_this_process(cls_name: str, worker: str, key: Any) -> Actor:
    return Actor(cls_name, worker, key, None)
