"""Coordination primitives the scheduler holds for clients and tasks: named variables,
queues, semaphores (locks are semaphores of one lease), events, pub/sub channels and
published datasets.

Theory of operation
-------------------
:class:`Coordination` is the state, without IO: the named objects, who waits on them
and which task keys they keep alive. Nothing waits inside it: a request that cannot be
answered now leaves a *waiter* (anything with ``done()`` and ``set_result()``; on the
scheduler an asyncio future on its loop) and the state answers it when it can. Each
waiting call returns :data:`PENDING` when it left its waiter (or, without one, when it
could not be answered now); a waiter that timed out is taken back with
:meth:`Coordination.forget`. A waiter that reports ``done()`` before its turn (its
request's connection closed) is skipped, so nothing is granted to a request nobody
reads.

Values stay opaque (the client serialized them; the scheduler stores and forwards them).
Futures are stored by key, and their keys are kept alive through the scheduler's state
machine, never by writing its fields: each object is a pseudo-client (``variable:'x'``,
``queue:'q'``, ``dataset:'d'``) that wants the keys it holds, counted per key (a queue
may hold one future twice). :class:`Host` stands for the state machine: ``hold`` and
``release`` become its ``UpdateGraphEvent`` (only ``wanted``) and ``ReleaseKeysEvent``,
``forget_holder`` its ``RemoveClientEvent``. A key handed to a client (a variable read,
an item taken from a queue) is wanted by that client before the answer leaves, so it
cannot be forgotten between the answer and the client's own future.

Leases, subscriptions and waiters belong to the client that made them. When its stream
closes (:meth:`Coordination.client_removed`) its leases are released, its subscriptions
dropped and its waiters answered with :data:`GONE`; leases and subscriptions are made
only for clients the scheduler has a stream from (:meth:`Host.connected`).

Bounds: a subscriber keeps at most ``subscriber_buffer`` unread messages (the oldest go
first, counted), the flush markers seen and not yet asked for are at most
``flush_markers``. What users put in queues and variables is theirs to bound.

The IO side is :class:`~.coordination_server.CoordinationServer`: the rpc handlers,
timeouts on the loop, and the ``coordination-flush`` markers of client streams (a
request that passes futures waits until the client's stream has brought their graphs).
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..protocol.messages import Key

__all__ = ["Coordination", "Host", "Value", "Waiter", "PENDING", "GONE"]

#: unread messages a subscriber keeps (the oldest are dropped beyond)
SUBSCRIBER_BUFFER = 10_000
#: flush markers remembered before a request asks for them
FLUSH_MARKERS = 10_000


class _Sentinel:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


#: returned by a waiting call that could not answer now
PENDING: Any = _Sentinel("PENDING")
#: given to a waiter whose client left (or whose scheduler closes)
GONE: Any = _Sentinel("GONE")


class Waiter(Protocol):
    """What waits for an answer: done once answered (or once nobody reads it)."""

    def done(self) -> bool: ...

    def set_result(self, result: Any, /) -> None: ...


class Host(Protocol):
    """The scheduler as the state sees it."""

    def hold(self, holder: str, keys: list[Key]) -> None:
        """``holder`` wants ``keys`` (all known to the scheduler)."""

    def release(self, holder: str, keys: list[Key]) -> None:
        """``holder`` no longer wants ``keys``."""

    def forget_holder(self, holder: str) -> None:
        """``holder`` is gone: it wants nothing."""

    def knows(self, key: Key) -> bool:
        """Whether the scheduler has a task for ``key``."""

    def connected(self, client: str) -> bool:
        """Whether ``client`` has a stream to the scheduler."""


@dataclass(frozen=True)
class Value:
    """A stored value: a future's key, or opaque ``data``."""

    key: Key | None = None
    data: Any = None


@dataclass(eq=False)
class _Pending:
    waiter: Waiter
    client: str
    where: list[_Pending]
    #: what it waits with: a queue item to put, a count to take, a lease id
    arg: Any = None


@dataclass
class _Queue:
    maxsize: int
    items: deque[Value] = field(default_factory=deque)
    getters: list[_Pending] = field(default_factory=list)
    putters: list[_Pending] = field(default_factory=list)

    def full(self) -> bool:
        return 0 < self.maxsize <= len(self.items)


@dataclass
class _Semaphore:
    max_leases: int
    #: lease id -> the client that holds it
    leases: dict[str, str] = field(default_factory=dict)
    waiters: list[_Pending] = field(default_factory=list)


@dataclass
class _Event:
    flag: bool = False
    waiters: list[_Pending] = field(default_factory=list)


@dataclass
class _Subscriber:
    name: str
    client: str
    buffer: deque[Any]
    waiters: list[_Pending] = field(default_factory=list)
    #: messages dropped because the buffer was full
    dropped: int = 0


@dataclass
class _Dataset:
    data: Any
    keys: list[Key]


def _holder(kind: str, name: Any) -> str:
    return f"{kind}:{name!r}"


class Coordination:
    """The named objects and their waiters; see the module's docstring."""

    def __init__(self, host: Host, subscriber_buffer: int = SUBSCRIBER_BUFFER, flush_markers: int = FLUSH_MARKERS):
        self.host = host
        self.subscriber_buffer = subscriber_buffer
        self.flush_markers = flush_markers
        self.variables: dict[str, Value] = {}
        self.queues: dict[str, _Queue] = {}
        self.semaphores: dict[str, _Semaphore] = {}
        self.events: dict[str, _Event] = {}
        self.subscribers: dict[str, _Subscriber] = {}
        self.datasets: dict[Key, _Dataset] = {}
        self._variable_waiters: dict[str, list[_Pending]] = {}
        self._channels: dict[str, set[str]] = {}
        self._flushed: OrderedDict[str, None] = OrderedDict()
        self._flush_waiters: dict[str, list[_Pending]] = {}
        self._holds: dict[str, Counter[Key]] = {}
        self._pending: dict[Waiter, _Pending] = {}

    # -- waiters

    def _wait(self, where: list[_Pending], waiter: Waiter | None, client: str, arg: Any = None) -> Any:
        if waiter is not None:
            p = _Pending(waiter, client, where, arg)
            where.append(p)
            self._pending[waiter] = p
        return PENDING

    def _head(self, where: list[_Pending]) -> _Pending | None:
        """The first waiter of ``where`` still waiting (those that stopped are dropped)."""
        while where:
            p = where[0]
            if not p.waiter.done():
                return p
            self._unregister(p)
            p.waiter.set_result(GONE)  # a no-op for a waiter answered already
        return None

    def _unregister(self, p: _Pending) -> None:
        p.where.remove(p)
        self._pending.pop(p.waiter, None)

    def _answer(self, p: _Pending, result: Any) -> None:
        self._unregister(p)
        p.waiter.set_result(result)

    def forget(self, waiter: Waiter) -> None:
        """Take back ``waiter`` (it timed out): it is answered by nothing now."""
        p = self._pending.pop(waiter, None)
        if p is not None:
            p.where.remove(p)

    def waiting(self) -> int:
        """How many waiters wait."""
        return len(self._pending)

    # -- keys kept alive

    def _hold(self, holder: str, keys: Iterable[Key]) -> None:
        counts = self._holds.setdefault(holder, Counter())
        new = []
        for key in keys:
            if counts[key] == 0:
                if not self.host.knows(key):
                    continue  # forgotten already: nothing to keep alive
                new.append(key)
            counts[key] += 1
        if new:
            self.host.hold(holder, new)

    def _release(self, holder: str, keys: Iterable[Key]) -> None:
        counts = self._holds.get(holder)
        if counts is None:
            return
        gone = []
        for key in keys:
            if counts[key] <= 0:
                continue
            counts[key] -= 1
            if counts[key] == 0:
                del counts[key]
                gone.append(key)
        if gone:
            self.host.release(holder, gone)

    def _drop_holder(self, holder: str) -> None:
        if self._holds.pop(holder, None) is not None:
            self.host.forget_holder(holder)

    def _hand_over(self, value: Value, client: str) -> None:
        """``client`` is about to receive ``value``: it wants the key first."""
        if value.key is not None and self.host.connected(client) and self.host.knows(value.key):
            self.host.hold(client, [value.key])

    def held(self, holder: str) -> dict[Key, int]:
        """The keys ``holder`` keeps alive, with their counts."""
        return dict(self._holds.get(holder, {}))

    # -- flush markers of client streams

    def flush_seen(self, uid: str) -> None:
        """The marker ``uid`` came on a client's stream."""
        waiting = self._flush_waiters.pop(uid, [])
        if waiting:
            for p in list(waiting):
                self._answer(p, True)
            return
        self._flushed[uid] = None
        while len(self._flushed) > self.flush_markers:
            self._flushed.popitem(last=False)

    def wait_flush(self, uid: str, client: str, waiter: Waiter | None) -> Any:
        """True once the marker ``uid`` of ``client``'s stream was seen (at once when
        that client has no stream: nothing more will come)."""
        if uid in self._flushed:
            del self._flushed[uid]
            return True
        if not self.host.connected(client):
            return True
        where = self._flush_waiters.setdefault(uid, [])
        return self._wait(where, waiter, client)

    def forget_flush(self, uid: str) -> None:
        """Nobody waits for ``uid`` any more (its list of waiters goes if empty)."""
        if uid in self._flush_waiters and not self._flush_waiters[uid]:
            del self._flush_waiters[uid]

    # -- variables

    def variable_set(self, name: str, value: Value) -> None:
        """Set variable ``name``; those waiting to read it get ``value``."""
        holder = _holder("variable", name)
        old = self.variables.get(name)
        self.variables[name] = value
        # the new key first: a variable set to the future it holds keeps it
        if value.key is not None:
            self._hold(holder, [value.key])
        if old is not None and old.key is not None:
            self._release(holder, [old.key])
        where = self._variable_waiters.get(name, [])
        while (p := self._head(where)) is not None:
            self._hand_over(value, p.client)
            self._answer(p, value)
        self._variable_waiters.pop(name, None)

    def variable_get(self, name: str, client: str, waiter: Waiter | None) -> Any:
        """The value of variable ``name``, or :data:`PENDING` until it is set."""
        value = self.variables.get(name)
        if value is not None:
            self._hand_over(value, client)
            return value
        if waiter is None:
            return PENDING
        return self._wait(self._variable_waiters.setdefault(name, []), waiter, client)

    def variable_delete(self, name: str) -> None:
        """Delete variable ``name`` (its future is no longer kept alive)."""
        self.variables.pop(name, None)
        self._drop_holder(_holder("variable", name))

    # -- queues

    def _queue(self, name: str, maxsize: int) -> _Queue:
        q = self.queues.get(name)
        if q is None:
            q = self.queues[name] = _Queue(max(maxsize, 0))
        return q

    def queue_put(self, name: str, maxsize: int, value: Value, client: str, waiter: Waiter | None) -> Any:
        """Put ``value`` in queue ``name`` (made with ``maxsize`` if new): True, or
        :data:`PENDING` while the queue is full."""
        q = self._queue(name, maxsize)
        if not q.full() and self._head(q.putters) is None:
            self._enqueue(name, q, value)
            return True
        return self._wait(q.putters, waiter, client, value)

    def _enqueue(self, name: str, q: _Queue, value: Value) -> None:
        q.items.append(value)
        if value.key is not None:
            self._hold(_holder("queue", name), [value.key])
        self._serve_queue(name, q)

    def queue_get(self, name: str, maxsize: int, batch: bool | int, client: str, waiter: Waiter | None) -> Any:
        """Take from queue ``name``: one value (``batch`` False), every value there
        now (True, never waits), or a list of ``batch`` values once that many are
        there; :data:`PENDING` until then."""
        q = self._queue(name, maxsize)
        if batch is True:
            return self._take(name, q, len(q.items), client)
        count = 1 if batch is False or batch == 0 else int(batch)
        if self._head(q.getters) is None and len(q.items) >= count:
            taken = self._take(name, q, count, client)
            return taken if batch else taken[0]
        return self._wait(q.getters, waiter, client, (count, bool(batch)))

    def _take(self, name: str, q: _Queue, count: int, client: str) -> list[Value]:
        taken = [q.items.popleft() for _ in range(count)]
        keys = []
        for value in taken:
            if value.key is not None:
                self._hand_over(value, client)
                keys.append(value.key)
        self._release(_holder("queue", name), keys)
        self._serve_queue(name, q)
        return taken

    def _serve_queue(self, name: str, q: _Queue) -> None:
        """Let waiting getters take and waiting putters put while they can."""
        moved = True
        while moved:
            moved = False
            p = self._head(q.getters)
            if p is not None and len(q.items) >= p.arg[0]:
                count, many = p.arg
                self._unregister(p)
                taken = [q.items.popleft() for _ in range(count)]
                for value in taken:
                    self._hand_over(value, p.client)
                self._release(_holder("queue", name), [v.key for v in taken if v.key is not None])
                p.waiter.set_result(taken if many else taken[0])
                moved = True
            p = self._head(q.putters)
            if p is not None and not q.full():
                self._unregister(p)
                q.items.append(p.arg)
                if p.arg.key is not None:
                    self._hold(_holder("queue", name), [p.arg.key])
                p.waiter.set_result(True)
                moved = True

    def queue_size(self, name: str, maxsize: int) -> int:
        """How many values queue ``name`` holds."""
        return len(self._queue(name, maxsize).items)

    # -- semaphores and locks

    def semaphore_acquire(self, name: str, max_leases: int, lease: str, client: str, waiter: Waiter | None) -> Any:
        """Grant ``lease`` of semaphore ``name`` to ``client``: True, or
        :data:`PENDING` while all ``max_leases`` are taken. Raises ``ValueError`` for a
        client without a stream and for a ``max_leases`` other than the semaphore's."""
        if not self.host.connected(client):
            raise ValueError(f"a lease needs a client connected to the scheduler; {client!r} is not")
        sem = self._semaphore(name, max_leases)
        if lease in sem.leases:
            return True
        if len(sem.leases) < sem.max_leases and self._head(sem.waiters) is None:
            sem.leases[lease] = client
            return True
        return self._wait(sem.waiters, waiter, client, lease)

    def _semaphore(self, name: str, max_leases: int) -> _Semaphore:
        if max_leases < 1:
            raise ValueError(f"max_leases must be at least 1, got {max_leases}")
        sem = self.semaphores.get(name)
        if sem is None:
            sem = self.semaphores[name] = _Semaphore(max_leases)
        elif sem.max_leases != max_leases:
            raise ValueError(f"Inconsistent max leases: {max_leases}, expected: {sem.max_leases}")
        return sem

    def semaphore_release(self, name: str, lease: str) -> bool:
        """Give ``lease`` back; False if it is not held (released, or its client left)."""
        sem = self.semaphores.get(name)
        if sem is None or sem.leases.pop(lease, None) is None:
            return False
        self._grant(sem)
        return True

    def _grant(self, sem: _Semaphore) -> None:
        while len(sem.leases) < sem.max_leases and (p := self._head(sem.waiters)) is not None:
            sem.leases[p.arg] = p.client
            self._answer(p, True)

    def semaphore_value(self, name: str, max_leases: int = 0) -> int:
        """How many leases of semaphore ``name`` are held; with ``max_leases`` the
        semaphore is made (or checked) as by an acquire."""
        if max_leases:
            self._semaphore(name, max_leases)
        sem = self.semaphores.get(name)
        return 0 if sem is None else len(sem.leases)

    # -- events

    def event_wait(self, name: str, client: str, waiter: Waiter | None) -> Any:
        """True if event ``name`` is set, else :data:`PENDING` until it is."""
        ev = self.events.get(name)
        if ev is not None and ev.flag:
            return True
        if waiter is None:
            return PENDING
        if ev is None:
            ev = self.events[name] = _Event()
        return self._wait(ev.waiters, waiter, client)

    def event_set(self, name: str) -> None:
        """Set event ``name``: every waiter is answered True."""
        ev = self.events.setdefault(name, _Event())
        ev.flag = True
        while (p := self._head(ev.waiters)) is not None:
            self._answer(p, True)

    def event_clear(self, name: str) -> None:
        """Clear event ``name`` (an event cleared and waited for by nobody is dropped)."""
        ev = self.events.get(name)
        if ev is None:
            return
        ev.flag = False
        if self._head(ev.waiters) is None:
            del self.events[name]

    def event_is_set(self, name: str) -> bool:
        ev = self.events.get(name)
        return ev is not None and ev.flag

    # -- pub/sub

    def subscribe(self, name: str, sub: str, client: str) -> None:
        """Subscriber ``sub`` of ``client`` gets the messages published on ``name``
        from now on (ignored for a client without a stream, or a known ``sub``)."""
        if sub in self.subscribers or not self.host.connected(client):
            return
        self.subscribers[sub] = _Subscriber(name, client, deque(maxlen=self.subscriber_buffer))
        self._channels.setdefault(name, set()).add(sub)

    def unsubscribe(self, sub: str, client: str | None = None) -> None:
        """Drop subscriber ``sub`` (only ``client``'s, when given); its waiters get GONE."""
        s = self.subscribers.get(sub)
        if s is None or (client is not None and s.client != client):
            return
        del self.subscribers[sub]
        channel = self._channels.get(s.name, set())
        channel.discard(sub)
        if not channel:
            self._channels.pop(s.name, None)
        while (p := self._head(s.waiters)) is not None:
            self._answer(p, GONE)

    def publish(self, name: str, data: Any) -> None:
        """Give ``data`` to every subscriber of ``name``."""
        for sub in sorted(self._channels.get(name, ())):
            s = self.subscribers[sub]
            if len(s.buffer) == s.buffer.maxlen:
                s.dropped += 1
            s.buffer.append(data)
            p = self._head(s.waiters)
            if p is not None:
                out = list(s.buffer)
                s.buffer.clear()
                self._answer(p, out)

    def subscriber_get(self, name: str, sub: str, client: str, waiter: Waiter | None) -> Any:
        """The messages subscriber ``sub`` has not read (made now if unknown), or
        :data:`PENDING` until one comes. Raises ``ValueError`` for a client without
        a stream or a subscriber of another client."""
        self.subscribe(name, sub, client)
        s = self.subscribers.get(sub)
        if s is None or s.client != client:
            raise ValueError(f"no subscriber {sub!r} of client {client!r} (is the client connected?)")
        if s.buffer:
            out = list(s.buffer)
            s.buffer.clear()
            return out
        return self._wait(s.waiters, waiter, client)

    # -- datasets

    def publish_put(self, names: list[Key], keys: list[list[Key]], data: list[Any], override: bool) -> None:
        """Publish ``data[i]`` as ``names[i]``, keeping ``keys[i]`` alive. Raises
        ``KeyError`` (nothing published) if one exists already and not ``override``,
        ``ValueError`` when the lists differ in length."""
        if not len(names) == len(keys) == len(data):
            raise ValueError(f"{len(names)} names, {len(keys)} key lists and {len(data)} values")
        if not override:
            for name in names:
                if name in self.datasets:
                    raise KeyError(f"Dataset {name} already exists")
        for name, ks, d in zip(names, keys, data):
            holder = _holder("dataset", name)
            old = self.datasets.get(name)
            self._hold(holder, ks)
            if old is not None:
                self._release(holder, old.keys)
            self.datasets[name] = _Dataset(d, list(ks))

    def publish_get(self, names: list[Key]) -> list[Any]:
        """The data published under each of ``names`` (None where nothing is)."""
        return [ds.data if (ds := self.datasets.get(name)) is not None else None for name in names]

    def publish_delete(self, names: list[Key]) -> None:
        """Unpublish ``names`` (unknown ones are ignored)."""
        for name in names:
            if self.datasets.pop(name, None) is not None:
                self._drop_holder(_holder("dataset", name))

    def publish_list(self) -> list[Key]:
        return sorted(self.datasets, key=str)

    # -- clients

    def client_removed(self, client: str) -> None:
        """``client``'s stream closed: its leases are released, its subscribers
        dropped, its waiters answered with :data:`GONE`."""
        for p in [p for p in self._pending.values() if p.client == client]:
            self._answer(p, GONE)
        for sub in [sub for sub, s in self.subscribers.items() if s.client == client]:
            self.unsubscribe(sub)
        for sem in self.semaphores.values():
            mine = [lease for lease, holder in sem.leases.items() if holder == client]
            for lease in mine:
                del sem.leases[lease]
            if mine:
                self._grant(sem)

    def close(self) -> None:
        """Answer every waiter with :data:`GONE` (the scheduler closes)."""
        for p in list(self._pending.values()):
            self._answer(p, GONE)
