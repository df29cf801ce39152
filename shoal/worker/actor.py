"""Actors on a worker: an object made by a task that stays where it was made, whose
methods run there, in the order called, off the worker's event loop.

``client.submit(Cls, *args, actor=True)`` submits :func:`make_actor`: the task builds
the instance and its value is an :class:`ActorRef` holding it. The ref travels (to the
client, to other tasks) without the instance: a pickled ref names the class, the key and
the worker. Clients call methods and read attributes with the worker requests
``actor-execute`` and ``actor-attribute``; each actor has one thread of its own, so its
methods never run at once and never block the event loop (coroutine methods run on the
loop). The actor lives while its key does: the worker drops the ref, and with it the
instance, when the scheduler frees the key.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from ..protocol import to_serialize
from . import context

if TYPE_CHECKING:
    from .server import Worker

__all__ = ["ActorRef", "make_actor", "actor_execute", "actor_attribute"]


class ActorRef:
    """The value of an actor's key: the class's name, the key, the worker; and, on that
    worker only, the instance and its thread."""

    __slots__ = ("cls_name", "key", "worker", "instance", "_thread")

    def __init__(self, cls_name: str, key: Hashable, worker: str, instance: Any = None):
        self.cls_name = cls_name
        self.key = key
        self.worker = worker
        self.instance = instance
        self._thread: ThreadPoolExecutor | None = None

    def __reduce__(self) -> Any:
        return (ActorRef, (self.cls_name, self.key, self.worker))  # the instance stays

    def __sizeof__(self) -> int:
        return 64

    def __repr__(self) -> str:
        return f"<ActorRef {self.cls_name} {self.key!r} on {self.worker}>"

    def thread(self) -> ThreadPoolExecutor:
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"shoal-actor-{self.cls_name}")
        return self._thread

    def __del__(self) -> None:
        thread = self._thread
        if thread is not None:
            thread.shutdown(wait=False)


def make_actor(cls: Callable[..., Any], *args: Any, **kwargs: Any) -> ActorRef:
    """The task of ``submit(cls, ..., actor=True)``: the instance, held by its ref."""
    worker = context.get_worker()
    instance = cls(*args, **kwargs)
    return ActorRef(getattr(cls, "__name__", type(instance).__name__), context.task_key(), worker.address, instance)


def _instance_of(worker: Worker, key: Hashable) -> ActorRef:
    state = worker.state
    ref = state.data.get(key) if state is not None else None
    if not isinstance(ref, ActorRef) or ref.instance is None:
        raise ValueError(f"no actor {key!r} on worker {worker.address} (it was released, or lives elsewhere)")
    return ref


async def actor_execute(worker: Worker, comm: Any, key: Hashable, method: str, args: Any = (), kwargs: Any = None,
                        **_: Any) -> Any:
    """Call ``method`` of actor ``key`` with ``args``/``kwargs``; its result (its
    exception is raised, and travels back as a task's would)."""
    ref = _instance_of(worker, key)
    if method.startswith("_"):
        raise AttributeError(f"actor methods starting with '_' are private: {method!r}")
    func = getattr(ref.instance, method)
    if inspect.iscoroutinefunction(func):
        return to_serialize(await func(*(args or ()), **(kwargs or {})))
    loop = asyncio.get_running_loop()
    return to_serialize(await loop.run_in_executor(ref.thread(), lambda: func(*(args or ()), **(kwargs or {}))))


async def actor_attribute(worker: Worker, comm: Any, key: Hashable, attribute: str, **_: Any) -> dict[str, Any]:
    """``{"callable": True}`` for a method of actor ``key``, else ``{"callable":
    False, "value": <the attribute>}`` (read in its thread, after the calls before)."""
    ref = _instance_of(worker, key)
    if attribute.startswith("_"):
        raise AttributeError(f"actor attributes starting with '_' are private: {attribute!r}")
    loop = asyncio.get_running_loop()
    value = await loop.run_in_executor(ref.thread(), getattr, ref.instance, attribute)
    if callable(value):
        return {"callable": True}
    return {"callable": False, "value": to_serialize(value)}
