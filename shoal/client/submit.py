"""``submit`` and ``map`` for the client (a mixin of :class:`~shoal.Client`), and
the ``update-graph`` messages every submission ends in (a big graph's in parts).

The keywords dask.distributed reserves are taken here and never reach the user's
function: ``key``, ``workers``, ``allow_other_workers``, ``resources``, ``retries``,
``priority``, ``pure``, ``fifo_timeout``, ``actor`` and (``map``) ``batch_size``.
Arguments that will have to be pickled (a worker or the scheduler is in another
process) are checked at submit, so an unpicklable one fails there, naming itself.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, cast

from .. import config
from ..errors import SerializationError, short_repr
from ..protocol import Serialize, sizeof, to_serialize
from ..protocol.core import prepare
from ..foreign_tasks import ForeignCall, ForeignFunction
from ..taskspec import (RunSpec, check_serializable, key_name, raise_serialization_error, tokenize, unique_token,
                        validate_key)
from . import graphs
from .future import Future
from .options import TaskOptions, call_options, context_annotations
from .structure import replace_futures

if TYPE_CHECKING:
    from .client import Client

__all__ = ["Submitting"]

logger = logging.getLogger("shoal.client")

_warned_large: set[str] = set()


class Submitting:
    """The submitting methods of :class:`~shoal.Client` (a mixin)."""

    @property
    def _self(self) -> Client:
        return cast("Client", self)

    def submit(self, func: Callable[..., Any], *args: Any, key: Any = None, workers: Any = None,
               resources: dict[str, float] | None = None, retries: int | None = None, priority: int = 0,
               fifo_timeout: Any = "100 ms", allow_other_workers: bool = False, actor: bool = False,
               actors: bool = False, pure: bool | None = None, **kwargs: Any) -> Future:
        """Run ``func(*args, **kwargs)`` on the cluster; returns a :class:`Future`.

        Futures among the arguments (also inside lists, tuples and dicts) are
        dependencies: the task receives their values. ``workers`` (addresses, names or
        hosts) restricts where it may run (a preference with
        ``allow_other_workers=True``); ``resources={"GPU": 1}`` runs it only where that
        much is free, holding it while it runs; higher ``priority`` runs first;
        ``retries`` reruns it when it raises; ``pure=False`` gives it a unique key.
        ``fifo_timeout`` is accepted for dask's sake (ties of priority keep submission
        order here). ``actor=True`` creates an actor. Raises ``TypeError`` for a
        non-callable ``func``, a bad key or option, or an argument that cannot be
        serialized for where it must go (:class:`~shoal.SerializationError`).
        """
        if not callable(func):
            raise TypeError(f"submit() needs a callable, got {type(func).__name__}")
        if actor or actors:
            return self._submit_actor(func, args, kwargs, key=key, workers=workers)
        pure = True if pure is None else pure
        if key is None:
            key = f"{key_name(func)}-{tokenize(func, args, kwargs) if pure else unique_token()}"
        validate_key(key)
        options = call_options(workers, resources, priority, retries, allow_other_workers, key)
        task = self._make_task(key, func, args, kwargs, options)
        future = Future(key, self._self)
        self._self._submit_tasks([task], [key])
        return future

    def map(self, func: Callable[..., Any], *iterables: Iterable[Any], key: Any = None, workers: Any = None,
            retries: int | None = None, resources: dict[str, float] | None = None, priority: int = 0,
            allow_other_workers: bool = False, fifo_timeout: Any = "100 ms", actor: bool = False,
            actors: bool = False, pure: bool | None = None, batch_size: int | None = None,
            **kwargs: Any) -> list[Future]:
        """``submit(func, *items)`` for each tuple of items from ``iterables`` (the
        same keywords); ``key`` may be a list of keys or a prefix. Tasks go to the
        scheduler in messages of ``batch_size`` tasks (default: all in one)."""
        if not callable(func):
            raise TypeError(f"map() needs a callable, got {type(func).__name__}")
        if not iterables:
            raise TypeError("map() needs at least one iterable")
        if isinstance(iterables[0], dict) or any(isinstance(it, (str, bytes)) for it in iterables):
            raise TypeError("map() takes iterables of arguments (lists, tuples, ...), not a dict or a string")
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                       or batch_size < 1):
            raise ValueError(f"batch_size= must be a positive int, got {batch_size!r}")
        if actor or actors:
            return [self._submit_actor(func, args, kwargs, workers=workers) for args in zip(*iterables)]
        pure = True if pure is None else pure
        arg_tuples = list(zip(*iterables))
        if isinstance(key, (list, tuple)):
            keys = list(key)
            if len(keys) != len(arg_tuples):
                raise ValueError(f"map() got {len(keys)} keys for {len(arg_tuples)} tasks")
        else:
            prefix = key if isinstance(key, str) else key_name(func)
            if pure:
                base = tokenize(func, kwargs)
                keys = [f"{prefix}-{tokenize(base, args)}" for args in arg_tuples]
            else:
                keys = [f"{prefix}-{unique_token()}" for _ in arg_tuples]
        context = context_annotations()
        per_key = any(callable(v) for v in context.values())
        options = None if per_key else call_options(workers, resources, priority, retries, allow_other_workers,
                                                    None, context)
        tasks = []
        futures = []
        for k, args in zip(keys, arg_tuples):
            validate_key(k)
            opts = options if options is not None else call_options(
                workers, resources, priority, retries, allow_other_workers, k, context)
            tasks.append(self._make_task(k, func, args, kwargs, opts))
            futures.append(Future(k, self._self))
        step = batch_size or len(tasks) or 1
        for i in range(0, len(tasks), step):
            self._self._submit_tasks(tasks[i:i + step], keys[i:i + step])
        return futures

    def _make_task(self, key: Any, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                   options: TaskOptions) -> dict[str, Any]:
        deps: set[Any] = set()
        args2 = replace_futures(args, deps, self)
        kwargs2 = replace_futures(kwargs, deps, self)
        self._check_payload_size(fn, args, kwargs)
        if isinstance(fn, ForeignFunction):
            # for a worker of another language: its arguments checked now (what has no
            # meaning there raises SerializationError here, before anything is sent)
            call = ForeignCall(fn, args2, kwargs2)
            call.frames()
            task = {"key": key, "payload": to_serialize(call), "deps": list(deps), "language": fn.language}
            task.update(options.fields)
            return task
        spec = RunSpec(fn, args2, kwargs2)
        if self._self._pickles_tasks:
            check_serializable(spec)
        task = {"key": key, "payload": to_serialize(spec), "deps": list(deps)}
        task.update(options.fields)
        return task

    def _check_payload_size(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        limit = config.get("large-payload-bytes")
        client_id = self._self.id
        if not limit or client_id in _warned_large:
            return
        size = sum(sizeof(a) for a in args) + sum(sizeof(v) for v in kwargs.values())
        if size > limit:
            _warned_large.add(client_id)
            warnings.warn(
                f"a task of {key_name(fn)} carries about {size / 1e6:.1f} MB of arguments; "
                "consider client.scatter(data) and passing the future instead",
                UserWarning,
                stacklevel=4,
            )

    def _submit_actor(self, cls: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                      key: Any = None, workers: Any = None) -> Future:
        """A task that makes ``cls(*args, **kwargs)`` on one worker, where it stays: its
        future's result is an :class:`~shoal.client.actor.Actor`."""
        from ..worker.actor import make_actor

        if not isinstance(cls, type):
            raise TypeError(f"actor=True takes a class, got {type(cls).__name__}")
        if key is None:
            key = f"{key_name(cls)}-{unique_token()}"  # every actor is its own object
        validate_key(key)
        options = call_options(workers, key=key)
        task = self._make_task(key, make_actor, (cls, *args), kwargs, options)
        future = Future(key, self._self)
        self._self._submit_tasks([task], [key])
        return future

    # -- what every submission ends in

    def _submit_tasks(self, tasks: list[dict[str, Any]], wanted: list[Any]) -> None:
        """Send ``tasks`` to the scheduler (one ``update-graph``, or a big graph's
        parts), ``wanted`` being the keys this client holds futures for."""
        self._check_running()
        parts, held = graphs.split_graph(tasks, wanted)
        self._send_parts(((part, part_wanted, []) for part, part_wanted in parts), held)

    def _submit_parts(self, parts: Iterable[tuple[list[dict[str, Any]], list[Any], list[Any]]]) -> None:
        """Send a big graph's parts (:meth:`.graphs.Graph.parts`: ``(tasks, wanted,
        held)`` each) as they are made."""
        self._check_running()
        self._send_parts(parts, [])

    def _check_running(self) -> None:
        c = self._self
        if c.status == "disconnected":
            raise RuntimeError(f"the client lost its connection to the scheduler at {c.scheduler_address}")
        if c.status != "running":
            raise RuntimeError(f"the client is {c.status}")

    def _send_parts(self, parts: Iterable[tuple[list[dict[str, Any]], list[Any], list[Any]]],
                    held: list[Any]) -> None:
        c = self._self
        try:
            for part, part_wanted, part_held in parts:
                if c._hand_over:
                    for t in part:
                        spec = t.get("payload")
                        spec = spec.data if isinstance(spec, Serialize) else spec
                        if isinstance(spec, RunSpec):
                            spec.handoff = True
                c._enqueue({"op": "update-graph", "tasks": part, "wanted": part_wanted})
                held.extend(part_held)
        finally:
            if held:
                # the parts are sent (or a part could not be made: the scheduler keeps
                # nothing for the rest): the dependents of these keys are known to the
                # scheduler now, so it keeps their values as long as they are needed
                with c._lock:
                    held = [k for k in held if c._refcount.get(k, 0) == 0]
                c._enqueue({"op": "release-keys", "keys": held}, lazy=True)

    def _unsendable(self, msg: Any, error: SerializationError) -> Any:
        """An ``update-graph`` that cannot be serialized for the scheduler: a task's
        arguments hold a value that does not pickle. Each such task is sent with a
        payload that raises the error instead (so it, and what depends on it, err as
        any failing task does, and the connection and the other tasks carry on)."""
        comm = self._self._comm
        if not (isinstance(msg, dict) and msg.get("op") == "update-graph" and comm is not None):
            logger.error("dropped a message to the scheduler that cannot be serialized: %s", error)
            return None
        destination = comm.destination
        tasks = []
        for task in msg.get("tasks") or ():
            try:
                prepare({"payload": task.get("payload")}).frames(destination, leases=False)
            except SerializationError as exc:
                text = f"the arguments of task {short_repr(task.get('key'))} cannot be sent to the scheduler: {exc}"
                logger.warning("%s", text)
                task = {**task, "deps": [], "payload": to_serialize(RunSpec(raise_serialization_error, (text,), {}))}
            tasks.append(task)
        return {**msg, "tasks": tasks}
