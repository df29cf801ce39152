"""Coordination primitives held by the scheduler, as dask.distributed names them:
:class:`Variable`, :class:`Queue`, :class:`Lock`, :class:`Semaphore`, :class:`Event`,
:class:`Pub` / :class:`Sub`, and the client's dataset methods
(:class:`PublishedDatasets`, mixed into :class:`~shoal.Client`).

Each object is a name on the scheduler: two objects of the same kind and name, in any
clients or tasks, are the same primitive. They pickle by name, so a task that receives
one (or makes one) uses it through its worker's client (``shoal.get_client()``); an
object made without ``client=`` finds its client on first use the same way. On an
asynchronous client the methods return awaitables.

Values are serialized by the transport (by reference in one process) and stay opaque
on the scheduler. A :class:`~shoal.Future` stored in a variable or queue is stored by
key and kept alive by the scheduler while it is stored; reading it gives a future of the
reader's client. Requests that pass futures first put a ``coordination-flush`` marker on
the client's stream, which the scheduler waits for: the futures' graphs, sent on that
stream, have arrived by then. Waiting (``get``, ``acquire``, ``wait``) happens on the
scheduler, up to ``timeout`` seconds; ``TimeoutError`` where dask raises one, ``False``
where dask returns it.
"""

from __future__ import annotations

import re
import threading
import uuid
import weakref
from collections import deque
from collections.abc import AsyncIterator, Iterator, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any, cast

from ..protocol import to_serialize
from .future import Future, _unwrap

if TYPE_CHECKING:
    from .client import Client

__all__ = ["Variable", "Queue", "Lock", "Semaphore", "Event", "Pub", "Sub", "PublishedDatasets", "Datasets"]

_NO_DEFAULT: Any = object()


# ------------------------------------------------------------------------------ helpers


def _current_client() -> Client:
    """The client a primitive made without ``client=`` uses: the worker's inside a
    task, else the default client. Raises ``ValueError`` when there is none."""
    from .default import get_client

    return get_client()


_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "sec": 1.0, "second": 1.0, "seconds": 1.0, "m": 60.0, "min": 60.0,
          "minute": 60.0, "minutes": 60.0, "h": 3600.0, "hour": 3600.0, "hours": 3600.0}
_DURATION = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-z]*)\s*")


def _seconds(timeout: Any) -> float | None:
    """``timeout`` in seconds: a number, a timedelta, a string as dask takes them
    (``"200ms"``, ``"30 s"``, ``"1.5 minutes"``) or None. Raises ``ValueError``."""
    if timeout is None:
        return None
    if isinstance(timeout, str):
        m = _DURATION.fullmatch(timeout.lower())
        if m is None or m.group(2) not in ("", *_UNITS):
            raise ValueError(f"not a duration: {timeout!r} (a number of seconds, or e.g. '200ms', '30 s')")
        return float(m.group(1)) * _UNITS.get(m.group(2), 1.0)
    if hasattr(timeout, "total_seconds"):
        return float(timeout.total_seconds())
    return float(timeout)


def _flush(client: Client) -> str:
    """Put a marker on ``client``'s stream, after what it queued so far (its graphs);
    returns the marker's id, for a request to wait for."""
    uid = uuid.uuid4().hex
    client._enqueue({"op": "coordination-flush", "uid": uid})
    return uid


def _adopt(client: Client, key: Any) -> Future:
    """A future of ``client`` for ``key``, a key another client (or an object on the
    scheduler) handed over; the scheduler is asked to report on it when ``client`` did
    not hold it (it wants the key already: the scheduler made sure before answering)."""
    return client._future_for_key(key)


def _received(client: Client, out: dict[str, Any]) -> Any:
    """The value a reply carries (``{"key": k}`` or ``{"data": d}``)."""
    if "key" in out:
        return _adopt(client, out["key"])
    return _unwrap(out.get("data"))


def _value_fields(value: Any, client: Client) -> dict[str, Any]:
    """The request fields that carry ``value``: a future by key (after a flush of its
    client's stream), anything else serialized."""
    if isinstance(value, Future):
        owner = value.client
        return {"keys": [value.key], "client": owner.id, "flush": _flush(owner)}
    return {"data": to_serialize(value), "client": client.id}


def _futures_in(obj: Any) -> list[Future]:
    """The futures inside ``obj``: in lists, tuples, sets and dicts, and in the graphs
    of dask collections (a persisted collection's graph holds futures)."""
    out: list[Future] = []
    stack = [obj]
    seen: dict[int, Any] = {}  # by id, holding each object so that no id is reused meanwhile
    while stack:
        x = stack.pop()
        if id(x) in seen:
            continue
        seen[id(x)] = x
        typ = type(x)
        if isinstance(x, Future):
            out.append(x)
        elif typ in (list, tuple, set, frozenset):
            stack.extend(x)
        elif typ is dict:
            stack.extend(x.values())
        elif hasattr(x, "__dask_graph__"):
            try:
                graph = x.__dask_graph__()
            except Exception:  # noqa: BLE001 - a collection that cannot say: it holds no futures we see
                continue
            if isinstance(graph, Mapping):
                stack.extend(graph.values())
    return out


def _rebind(obj: Any, client: Client) -> Any:
    """``obj`` with futures of other clients (or not bound to any yet: unpickled here),
    in lists, tuples, sets and dicts, replaced by futures of ``client`` for the same
    keys; ``obj`` itself where nothing changes."""
    typ = type(obj)
    if isinstance(obj, Future):
        # read without binding: an unpickled future has no client until first used
        return obj if obj.__dict__.get("client") is client else _adopt(client, obj.key)
    if typ in (list, tuple, set, frozenset):
        items = [_rebind(v, client) for v in obj]
        return obj if all(a is b for a, b in zip(items, obj)) else typ(items)
    if typ is dict:
        values = {k: _rebind(v, client) for k, v in obj.items()}
        return obj if all(values[k] is v for k, v in obj.items()) else values
    return obj


class _Named:
    """A primitive known by name on the scheduler, used through a client."""

    _kind = "object"

    def __init__(self, name: str | None = None, client: Client | None = None):
        if name is not None and not isinstance(name, str):
            raise TypeError(f"a {type(self).__name__}'s name is a str, got {type(name).__name__}")
        self.name = name if name is not None else f"{self._kind}-{uuid.uuid4().hex}"
        self._client = client

    @property
    def client(self) -> Client:
        """The client this object talks through (found on first use if not given)."""
        if self._client is None:
            self._client = _current_client()
        return self._client

    def _sync(self, fn: Any, *args: Any) -> Any:
        return self.client._sync(fn, *args)

    def _rpc(self) -> Any:
        return self.client._scheduler_rpc()

    def __await__(self) -> Any:
        async def ready() -> Any:
            return self

        return ready().__await__()

    def __reduce__(self) -> Any:
        return type(self), (self.name,)

    def __repr__(self) -> str:
        return f"<{type(self).__name__}: {self.name}>"


# ------------------------------------------------------------------------------ Variable


class Variable(_Named):
    """A named value on the scheduler that any client or task can set and read
    (``Variable(name=None, client=None)``). A future set in it is kept alive while it
    is set; ``get()`` returns a future of the reader's client."""

    _kind = "variable"

    def set(self, value: Any, timeout: Any = "30 s") -> Any:
        """Set the value (a future, or any value the transport carries). ``timeout``
        bounds the wait for a future's graph to reach the scheduler."""
        return self._sync(self._set, value, _seconds(timeout))

    async def _set(self, value: Any, timeout: float | None) -> None:
        await self._rpc().variable_set(name=self.name, timeout=timeout, **_value_fields(value, self.client))

    def get(self, timeout: Any = None) -> Any:
        """The value, waiting until one is set; ``TimeoutError`` after ``timeout``
        seconds."""
        return self._sync(self._get, _seconds(timeout))

    async def _get(self, timeout: float | None) -> Any:
        client = self.client
        out = await self._rpc().variable_get(name=self.name, client=client.id, timeout=timeout)
        if out is None:
            raise TimeoutError(f"variable {self.name!r} was not set within {timeout}s")
        return _received(client, out)

    def delete(self) -> Any:
        """Delete the variable (for every client): its future is no longer kept alive."""
        return self._sync(self._delete)

    async def _delete(self) -> None:
        await self._rpc().variable_delete(name=self.name)


# ------------------------------------------------------------------------------ Queue


class Queue(_Named):
    """A named first-in first-out queue on the scheduler (``Queue(name=None,
    client=None, maxsize=0)``; 0: unbounded). Futures put in it are kept alive until
    taken."""

    _kind = "queue"

    def __init__(self, name: str | None = None, client: Client | None = None, maxsize: int = 0):
        super().__init__(name, client)
        if not isinstance(maxsize, int) or maxsize < 0:
            raise ValueError(f"maxsize must be an int >= 0, got {maxsize!r}")
        self.maxsize = maxsize

    def put(self, value: Any, timeout: Any = None) -> Any:
        """Put ``value`` in (waits while the queue is full; ``TimeoutError`` after
        ``timeout`` seconds)."""
        return self._sync(self._put, value, _seconds(timeout))

    async def _put(self, value: Any, timeout: float | None) -> None:
        ok = await self._rpc().queue_put(name=self.name, maxsize=self.maxsize, timeout=timeout,
                                         **_value_fields(value, self.client))
        if not ok:
            raise TimeoutError(f"queue {self.name!r} stayed full for {timeout}s")

    def get(self, timeout: Any = None, batch: bool | int = False) -> Any:
        """Take one value (waits for one), or with ``batch=True`` the list of all
        values there now (maybe empty), or with ``batch=n`` a list of ``n`` values
        (waits for them). ``TimeoutError`` after ``timeout`` seconds (nothing taken)."""
        if not isinstance(batch, (bool, int)) or (batch is not True and batch < 0):
            raise ValueError(f"batch must be True, False or a count >= 0, got {batch!r}")
        return self._sync(self._get, _seconds(timeout), batch)

    async def _get(self, timeout: float | None, batch: bool | int) -> Any:
        client = self.client
        out = await self._rpc().queue_get(name=self.name, maxsize=self.maxsize, batch=batch, client=client.id,
                                          timeout=timeout)
        if out is None:
            raise TimeoutError(f"queue {self.name!r} had nothing to take within {timeout}s")
        if isinstance(out, list):
            return [_received(client, o) for o in out]
        return _received(client, out)

    def qsize(self) -> Any:
        """How many values the queue holds."""
        return self._sync(self._qsize)

    async def _qsize(self) -> int:
        return int(await self._rpc().queue_size(name=self.name, maxsize=self.maxsize))

    def __reduce__(self) -> Any:
        return type(self), (self.name, None, self.maxsize)


# ------------------------------------------------------------------------------ Semaphore, Lock


class Semaphore(_Named):
    """A named semaphore of ``max_leases`` leases (``Semaphore(max_leases=1,
    name=None)``). Each ``acquire`` takes a lease of this object's; ``release`` gives
    back its oldest. Leases of a client that disconnects (or of a worker that dies,
    through its client) are released by the scheduler. ``register`` is taken for
    dask's sake: the scheduler makes the semaphore on its first use either way."""

    _kind = "semaphore"

    def __init__(self, max_leases: int = 1, name: str | None = None, register: bool = True,
                 client: Client | None = None):
        super().__init__(name, client)
        if isinstance(max_leases, bool) or not isinstance(max_leases, int) or max_leases < 1:
            raise ValueError(f"max_leases must be an int >= 1, got {max_leases!r}")
        self.max_leases = max_leases
        self._leases: deque[str] = deque()
        self._guard = threading.Lock()

    def acquire(self, timeout: Any = None) -> Any:
        """Take a lease: True, or False if none came free within ``timeout`` seconds.
        Raises ``ValueError`` if the name is a semaphore of another ``max_leases``."""
        return self._sync(self._acquire, _seconds(timeout))

    async def _acquire(self, timeout: float | None) -> bool:
        client = self.client
        lease = uuid.uuid4().hex
        ok = await self._rpc().semaphore_acquire(name=self.name, max_leases=self.max_leases, lease=lease,
                                                 client=client.id, timeout=timeout)
        if ok:
            with self._guard:
                self._leases.append(lease)
        return bool(ok)

    def release(self) -> Any:
        """Give back this object's oldest lease; returns whether the scheduler still
        counted it. Raises ``RuntimeError`` ("Released too often") if it holds none."""
        with self._guard:
            if not self._leases:
                raise RuntimeError("Released too often")
            lease = self._leases.popleft()
        return self._sync(self._release, lease)

    async def _release(self, lease: str) -> bool:
        return bool(await self._rpc().semaphore_release(name=self.name, lease=lease))

    def get_value(self) -> Any:
        """How many leases are held (by anyone)."""
        return self._sync(self._get_value)

    async def _get_value(self) -> int:
        return int(await self._rpc().semaphore_value(name=self.name, max_leases=self.max_leases))

    def __enter__(self) -> Semaphore:
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    async def __aenter__(self) -> Semaphore:
        await self.acquire()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.release()

    def __reduce__(self) -> Any:
        return type(self), (self.max_leases, self.name)

    def __repr__(self) -> str:
        return f"<{type(self).__name__}: {self.name} max_leases={self.max_leases}>"


class Lock(Semaphore):
    """A named lock (``Lock(name=None, client=None)``): a semaphore of one lease."""

    _kind = "lock"

    def __init__(self, name: str | None = None, client: Client | None = None):
        super().__init__(1, name, client=client)

    # dask's Lock: blocking comes first, unlike a Semaphore's acquire
    def acquire(self, blocking: bool = True, timeout: Any = None) -> Any:  # type: ignore[override]
        """Take the lock: True, or False if it was not free (``blocking=False``) or did
        not come free within ``timeout`` seconds."""
        if not blocking:
            if timeout is not None:
                raise ValueError("can't specify a timeout for a non-blocking call")
            timeout = 0
        return super().acquire(timeout)

    def locked(self) -> Any:
        """Whether someone holds the lock."""
        return self._sync(self._locked)

    async def _locked(self) -> bool:
        return await self._get_value() == 1

    def __reduce__(self) -> Any:
        return type(self), (self.name,)

    def __repr__(self) -> str:
        return f"<Lock: {self.name}>"


# ------------------------------------------------------------------------------ Event


class Event(_Named):
    """A named event (``Event(name=None, client=None)``): ``set``, ``clear``,
    ``is_set``, ``wait``."""

    _kind = "event"

    def wait(self, timeout: Any = None) -> Any:
        """Wait until the event is set: True, or False after ``timeout`` seconds."""
        return self._sync(self._wait, _seconds(timeout))

    async def _wait(self, timeout: float | None) -> bool:
        return bool(await self._rpc().event_wait(name=self.name, client=self.client.id, timeout=timeout))

    def set(self) -> Any:
        """Set the event: every waiter wakes."""
        return self._sync(self._set)

    async def _set(self) -> None:
        await self._rpc().event_set(name=self.name)

    def clear(self) -> Any:
        """Clear the event: waiters wait again."""
        return self._sync(self._clear)

    async def _clear(self) -> None:
        await self._rpc().event_clear(name=self.name)

    def is_set(self) -> Any:
        return self._sync(self._is_set)

    async def _is_set(self) -> bool:
        return bool(await self._rpc().event_is_set(name=self.name))


# ------------------------------------------------------------------------------ Pub, Sub


def _running(client: Client) -> Client:
    if client.status != "running":
        raise RuntimeError(f"the client is {client.status}")
    return client


class Pub(_Named):
    """Publishes messages on channel ``name`` (``Pub(name)``): each goes to every
    :class:`Sub` of that name that exists when it reaches the scheduler."""

    _kind = "pub"

    def put(self, msg: Any) -> None:
        """Publish ``msg`` (returns at once; messages of one client keep their order)."""
        _running(self.client)._enqueue({"op": "pubsub-publish", "name": self.name, "data": to_serialize(msg)})


def _unsubscribe(client: Client, sub: str) -> None:
    if client.status == "running":
        client._enqueue({"op": "pubsub-unsubscribe", "sub": sub})


class Sub(_Named):
    """Receives the messages published on channel ``name`` from its creation on
    (``Sub(name)``): ``get(timeout=None)``, or iterate (``for msg in sub``)."""

    _kind = "sub"

    def __init__(self, name: str | None = None, client: Client | None = None):
        super().__init__(name, client)
        self.id = f"sub-{uuid.uuid4().hex}"
        #: messages received and not yet read
        self.buffer: deque[Any] = deque()
        self._subscribed = False
        try:
            self._subscribe()
        except ValueError:
            pass  # no client here yet: subscribed on first use

    def _subscribe(self) -> Client:
        client = self.client
        if not self._subscribed:
            # on the stream: in order with this client's later publications
            _running(client)._enqueue({"op": "pubsub-subscribe", "name": self.name, "sub": self.id})
            weakref.finalize(self, _unsubscribe, client, self.id)
            self._subscribed = True
        return client

    def get(self, timeout: Any = None) -> Any:
        """The next message; ``TimeoutError`` if none comes within ``timeout`` seconds."""
        client = self._subscribe()
        if self.buffer and not client.asynchronous:
            return self.buffer.popleft()
        return client._sync(self._get, _seconds(timeout))

    async def _get(self, timeout: float | None) -> Any:
        if self.buffer:
            return self.buffer.popleft()
        client = self._subscribe()
        out = await client._scheduler_rpc().pubsub_get(name=self.name, sub=self.id, client=client.id,
                                                       timeout=timeout)
        if out is None:
            raise TimeoutError(f"no message on {self.name!r} within {timeout}s")
        self.buffer.extend(_unwrap(d) for d in out)
        return self.buffer.popleft()

    def __iter__(self) -> Iterator[Any]:
        while True:
            yield self.get()

    def __aiter__(self) -> AsyncIterator[Any]:
        return self

    async def __anext__(self) -> Any:
        return await self._get(None)


# ------------------------------------------------------------------------------ datasets


class PublishedDatasets:
    """The dataset methods of :class:`~shoal.Client` (a mixin): named references to
    collections or futures, kept on the scheduler for any client to fetch."""

    @property
    def _me(self) -> Client:
        # only Client mixes this class in: self is always one
        return cast("Client", self)

    def publish_dataset(self, *args: Any, name: Any = None, override: bool = False, **kwargs: Any) -> Any:
        """Publish datasets: ``publish_dataset(x=df)``, ``publish_dataset(df,
        name="x")`` or ``publish_dataset({"x": df})``. Futures in them (also in the
        graphs of persisted collections) are kept alive while published. Raises
        ``KeyError`` for a name already published unless ``override``."""
        names: list[Any] = list(kwargs)
        data = list(kwargs.values())
        if name is not None:
            if not args:
                raise ValueError("If name is provided, expecting call signature like publish_dataset(df, name='ds')")
            names.append(name)
            data.append(args[0] if len(args) == 1 else args)
        elif args:
            if len(args) != 1 or not isinstance(args[0], Mapping):
                raise ValueError("If name is omitted, positional argument must be a {name: value} dict")
            names.extend(args[0])
            data.extend(args[0].values())
        return self._me._sync(self._publish_dataset, names, data, override)

    async def _publish_dataset(self, names: list[Any], data: list[Any], override: bool) -> None:
        me = self._me
        keys = [sorted({f.key for f in _futures_in(d)}, key=str) for d in data]
        flush = _flush(me) if any(keys) else ""
        await me._scheduler_rpc().publish_put(names=names, keys=keys, data=[to_serialize(d) for d in data],
                                              override=override, client=me.id, flush=flush)

    def get_dataset(self, name: Any, default: Any = _NO_DEFAULT) -> Any:
        """The dataset published as ``name`` (a list of names: a list of datasets),
        its futures bound to this client; ``default`` if given and there is none,
        else ``KeyError``."""
        return self._me._sync(self._get_dataset, name, default)

    async def _get_dataset(self, name: Any, default: Any) -> Any:
        me = self._me
        names = name if isinstance(name, list) else [name]
        outs = []
        for n, out in zip(names, await me._scheduler_rpc().publish_get(names=names)):
            if out is None:
                if default is _NO_DEFAULT:
                    raise KeyError(f"Dataset '{n}' not found")
                outs.append(default)
            else:
                outs.append(_rebind(_received(me, out), me))
        return outs if isinstance(name, list) else outs[0]

    def unpublish_dataset(self, name: Any) -> Any:
        """Remove the dataset ``name`` (or a list of names); unknown names are ignored."""
        return self._me._sync(self._unpublish_dataset, name)

    async def _unpublish_dataset(self, name: Any) -> None:
        me = self._me
        names = name if isinstance(name, list) else [name]
        # after this client's own requests for futures of it (get_dataset) have arrived
        await me._scheduler_rpc().publish_delete(names=names, client=me.id, flush=_flush(me))

    def list_datasets(self) -> Any:
        """The names of the published datasets."""
        return self._me._sync(self._list_datasets)

    async def _list_datasets(self) -> list[Any]:
        return list(await self._me._scheduler_rpc().publish_list())

    @property
    def datasets(self) -> Datasets:
        """The published datasets as a mapping (``client.datasets["x"] = df``)."""
        return Datasets(self._me)


class Datasets(MutableMapping[Any, Any]):
    """``client.datasets``: the dataset methods as a dict (synchronous clients)."""

    __slots__ = ("_client",)

    def __init__(self, client: Client):
        self._client = client

    def _sync_only(self, what: str) -> None:
        if self._client.asynchronous:
            raise TypeError(f"client.datasets {what} needs a synchronous client; use the dataset methods")

    def __getitem__(self, key: Any) -> Any:
        return self._client.get_dataset(key)

    def __setitem__(self, key: Any, value: Any) -> None:
        self._sync_only("assignment")
        self._client.publish_dataset(value, name=key)

    def __delitem__(self, key: Any) -> None:
        self._sync_only("deletion")
        self._client.unpublish_dataset(key)

    def __iter__(self) -> Iterator[Any]:
        self._sync_only("iteration")
        return iter(self._client.list_datasets())

    def __len__(self) -> int:
        self._sync_only("len()")
        return len(self._client.list_datasets())
