"""Tasks as the client builds them and workers run them.

``Task(key, func, args, kwargs)`` calls ``func``; arguments may hold constants,
``Ref(key)`` (the value of another task) and nested ``Task``\\ s (run inline). The client
normalizes each submitted task into its key, its dependency keys and one opaque payload
(:class:`RunSpec`: function plus arguments with ``Ref`` placeholders); the scheduler
reads keys and dependencies only, and never deserializes a payload.

A :class:`RunSpec` is serialized by its own family: the function through the function
cache (``dumps_function``/``loads_function``) and the arguments with pickle protocol 5,
so a worker that receives the same function a thousand times unpickles it once. Over an
in-process comm a RunSpec is not serialized at all. To a worker on the same host, its
large argument buffers (1 MiB or more) travel in shared memory: copied once into a
segment the sending process keeps while the RunSpec lives (so a resend copies nothing),
mapped copy-on-write by the worker.

Dask graphs (dicts of legacy tuple tasks, key references and nested containers, and
dask's task-spec classes) convert to this spec with :func:`convert_dask_graph`.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .errors import GraphError, InvalidKeyError, SerializationError, short_repr
from .protocol import (
    SAME_HOST,
    Serialize,
    Serialized,
    dumps_function,
    loads_function,
    register_serializer,
    unwrap,
)
from .protocol.serialize import pickle_dumps, sizeof
from .protocol.messages import Key, key_problem

__all__ = [
    "Ref",
    "Task",
    "RunSpec",
    "tokenize",
    "key_name",
    "find_refs",
    "substitute",
    "run",
    "validate_key",
    "GraphError",
]


logger = logging.getLogger("shoal.taskspec")


class Ref:
    """A placeholder for the value of the task ``key``."""

    __slots__ = ("key",)

    def __init__(self, key: Key):
        self.key = key

    def __repr__(self) -> str:
        return f"Ref({self.key!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Ref) and other.key == self.key

    def __hash__(self) -> int:
        return hash(("Ref", self.key))

    def __reduce__(self) -> Any:
        return (Ref, (self.key,))


class Task:
    """``func(*args, **kwargs)`` with ``Ref``\\ s and nested tasks inside the arguments."""

    __slots__ = ("key", "func", "args", "kwargs")

    def __init__(self, key: Key, func: Callable[..., Any], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None):
        if not callable(func):
            raise TypeError(f"a task's function must be callable, got {type(func).__name__}")
        self.key = key
        self.func = func
        self.args = tuple(args)
        self.kwargs = dict(kwargs or {})

    def __repr__(self) -> str:
        return f"Task({self.key!r}, {getattr(self.func, '__name__', self.func)!r})"

    def __reduce__(self) -> Any:
        return (Task, (self.key, self.func, self.args, self.kwargs))

    def dependencies(self) -> set[Key]:
        deps: set[Key] = set()
        find_refs(self.args, deps)
        find_refs(self.kwargs, deps)
        return deps


class RunSpec:
    """What a worker runs for one task: ``func(*args, **kwargs)`` after ``Ref``\\ s are
    replaced by dependency values. The scheduler carries it opaque."""

    __slots__ = ("func", "args", "kwargs", "handoff", "_nbytes", "_placed", "_pickled")

    def __init__(self, func: Callable[..., Any], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None):
        self.func = func
        self.args = args
        self.kwargs = kwargs or {}
        #: this process does not keep the payload once sent (a client whose scheduler
        #: is another process): large arguments go in transfer segments the receiver
        #: takes over, instead of segments this process keeps for resending
        self.handoff = False
        self._nbytes: int | None = None
        #: the large argument buffers copied into shared memory for same-host workers
        #: (:func:`shoal.comm.shm_family.place_buffers`), once for every send
        self._placed: Any = None
        #: the arguments pickled (bytes, out-of-band buffers), once for every send:
        #: made where they are checked (:func:`check_serializable`) or at the first send
        self._pickled: tuple[bytes, list[Any]] | None = None

    @property
    def nbytes(self) -> int:
        """About how many bytes the arguments hold (top level only; decides whether a
        transport serializes the payload off its event loop)."""
        if self._nbytes is None:
            self._nbytes = sum(sizeof(a) for a in self.args) + sum(sizeof(v) for v in self.kwargs.values())
        return self._nbytes

    def __repr__(self) -> str:
        return f"RunSpec({getattr(self.func, '__name__', self.func)!r})"

    def __reduce__(self) -> Any:
        return (RunSpec, (self.func, self.args, self.kwargs))

    def __serialization_parts__(self) -> list[tuple[str, Any]]:
        """Where a serialization error looks for the part that failed (it names
        ``args[1]``, not the whole task)."""
        return [("function", self.func), ("args", self.args), ("kwargs", self.kwargs)]


_function_bytes: dict[Any, bytes] = {}


def _dumps_function_cached(func: Callable[..., Any]) -> bytes:
    try:
        data = _function_bytes.get(func)
    except TypeError:  # unhashable callable
        return dumps_function(func)
    if data is None:
        data = dumps_function(func)
        if len(_function_bytes) > 1000:
            _function_bytes.clear()
        try:
            _function_bytes[func] = data
        except TypeError:
            pass
    return data


def _pickled_args(spec: RunSpec) -> tuple[bytes, list[Any]]:
    """``(args, kwargs)`` of ``spec`` pickled (protocol 5, buffers out of band), once."""
    if spec._pickled is None:
        buffers: list[Any] = []
        spec._pickled = (pickle_dumps((spec.args, spec.kwargs), buffer_callback=buffers.append), buffers)
    return spec._pickled


def _runspec_dumps(spec: RunSpec, destination: str) -> tuple[dict[str, Any], list[Any]]:
    args, buffers = _pickled_args(spec)
    raws = [b.raw() for b in buffers]
    func = _dumps_function_cached(spec.func)
    if destination == SAME_HOST and raws:
        placed = _handed_over(raws) if spec.handoff else _placed(spec, raws)
        if placed is not None:
            # large arguments wait in shared memory; the worker maps them
            rest = [r for r, ref in zip(raws, placed.refs) if ref is None]
            return {"refs": placed.refs}, [func, args, *rest]
    return {}, [func, args, *raws]


def _handed_over(raws: list[memoryview]) -> Any:
    """The large buffers in a transfer segment for the receiver to take over (the
    scheduler adopts it; a worker would map it and remove the name)."""
    from .comm import shm_family
    from .protocol import leases

    if not leases.active():
        return None
    try:
        return shm_family.hand_over_buffers(raws)
    except shm_family.ShmUnavailable as exc:
        _warn_once(exc)
        return None


def _placed(spec: RunSpec, raws: list[memoryview]) -> Any:
    """The spec's large buffers in shared memory, copied on its first same-host send
    and kept with the spec (a resend, to another worker after a loss, copies nothing)."""
    from .comm import shm_family

    with _placing:  # two sends at once (threads of a transport) place it once
        placed = spec._placed
        if placed is not None and len(placed.refs) == len(raws):
            return placed
        try:
            placed = shm_family.place_buffers(raws)
        except shm_family.ShmUnavailable as exc:
            _warn_once(exc)
            return None
        spec._placed = placed
        return placed


_placing = threading.Lock()
_shm_warned: list[bool] = []


def _warn_once(exc: Exception) -> None:
    """Shared memory cannot take task arguments (full, say): they travel as frames."""
    if not _shm_warned:
        _shm_warned.append(True)
        logger.warning("task arguments: %s", exc)


def _runspec_loads(header: dict[str, Any], frames: Any) -> RunSpec:
    import pickle

    func = loads_function(frames[0])
    refs = header.get("refs")
    buffers = frames[2:]
    if refs:
        from .comm.shm_family import map_refs

        if not isinstance(refs, list):
            raise ValueError(f"malformed task payload header: refs {refs!r:.200}")
        try:
            # mappings of this run's own: a task that writes into an argument changes
            # nothing another run of the same payload (a retry) would see
            buffers = map_refs(refs, buffers, own=True)
        except FileNotFoundError as exc:
            raise FileNotFoundError(
                f"an argument of this task was in shared memory that is gone ({exc}); "
                "the process that sent the task released it or exited") from exc
    args, kwargs = pickle.loads(frames[1], buffers=buffers)
    return RunSpec(func, args, kwargs)


register_serializer(RunSpec, _runspec_dumps, _runspec_loads, name="shoal.runspec")


# --------------------------------------------------------------------------- helpers


def find_refs(obj: Any, out: set[Key]) -> None:
    """Add the keys of every ``Ref`` inside ``obj`` (and nested tasks) to ``out``."""
    typ = type(obj)
    if typ is Ref:
        out.add(obj.key)
    elif typ is Task:
        find_refs(obj.args, out)
        find_refs(obj.kwargs, out)
    elif typ in (list, tuple, set, frozenset):
        for v in obj:
            find_refs(v, out)
    elif typ is dict:
        for v in obj.values():
            find_refs(v, out)


def substitute(obj: Any, values: Mapping[Key, Any]) -> Any:
    """``obj`` with every ``Ref`` replaced by its value and nested tasks run."""
    typ = type(obj)
    if typ is Ref:
        return values[obj.key]
    if typ is Task:
        return obj.func(*substitute(obj.args, values), **substitute(obj.kwargs, values))
    if typ is list:
        return [substitute(v, values) for v in obj]
    if typ is tuple:
        return tuple(substitute(v, values) for v in obj)
    if typ is dict:
        return {k: substitute(v, values) for k, v in obj.items()}
    if typ in (set, frozenset):
        return typ(substitute(v, values) for v in obj)
    if typ is Serialize or typ is Serialized:
        return unwrap(obj)
    return obj


def run(spec: RunSpec, values: Mapping[Key, Any]) -> Any:
    """Run a task's spec with its dependencies' values."""
    args = substitute(spec.args, values)
    kwargs = substitute(spec.kwargs, values)
    return spec.func(*args, **kwargs)


def check_serializable(spec: RunSpec) -> None:
    """Raise :class:`SerializationError` (a ``TypeError``) naming the argument, or the
    function, of ``spec`` that does not pickle; what will have to travel is checked
    before it is accepted. The pickled arguments are kept for the sends (buffers are
    not copied: they go out of band)."""
    from .protocol.serialize import unserializable

    try:
        _dumps_function_cached(spec.func)
        _pickled_args(spec)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - a user's __reduce__ may raise anything
        raise unserializable(spec, exc) from exc


def takes_parameter(function: Callable[..., Any], name: str) -> bool:
    """Whether ``function`` has a parameter called ``name`` (False for a callable
    without a signature, such as some builtins): dask passes ``dask_worker`` and
    ``dask_scheduler`` to the functions that ask for them."""
    import inspect

    try:
        return name in inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False


def raise_serialization_error(text: str) -> None:
    """The function of a task whose own payload could not be sent (a client puts it
    in that payload's place): running it raises the error that sending met, so the
    task, and its dependents, err as for any task that raises."""
    raise SerializationError(text)


def validate_key(key: Any) -> Key:
    """Keys are str (valid Unicode), bytes, int (64-bit), finite float or tuples of
    these, nested at most :data:`~shoal.protocol.messages.MAX_KEY_DEPTH` deep (what the
    wire carries as a key); raise :class:`~shoal.errors.InvalidKeyError` (a
    ``TypeError`` and a ``ValueError``) saying what is wrong otherwise."""
    problem = key_problem(key)
    if problem is not None:
        raise InvalidKeyError(f"bad task key {short_repr(key)}: {problem}")
    return key


def key_name(func: Callable[..., Any]) -> str:
    name = getattr(func, "__name__", None) or type(func).__name__
    return "lambda" if name == "<lambda>" else name


# ------------------------------------------------------------------------ tokenizing

_unique = itertools.count()
_PROCESS_TOKEN = uuid.uuid4().hex


def tokenize(*parts: Any) -> str:
    """A deterministic hex token for values, computed without pickling them.

    Plain data, numpy arrays and futures hash by content; an object of another type
    hashes by identity (same object, same token), which keeps unpicklable arguments
    (locks, open files) usable with ``pure=True``.
    """
    h = _hasher()
    _feed(h, parts, 0)
    return h.hexdigest()[:32]


def _sha1() -> Any:
    # a token, not a signature: sha1 is about twice blake2b's speed over large buffers
    return hashlib.sha1(usedforsecurity=False)


_hasher: Callable[[], Any]
try:  # xxh3 hashes large buffers ~13x faster than sha1 here (scatter of big arrays)
    from xxhash import xxh3_128 as _hasher
except ImportError:  # an optional dependency (the numpy extra)
    _hasher = _sha1


def _feed(h: Any, obj: Any, depth: int) -> None:
    typ = type(obj)
    if obj is None or typ in (bool, int, float, complex, str):
        h.update(f"{typ.__name__}:{obj!r};".encode())
    elif typ is bytes:
        h.update(b"b%d:" % len(obj))
        h.update(obj)
    elif typ in (list, tuple, set, frozenset, dict) and depth < 100:
        h.update(f"{typ.__name__}[{len(obj)}".encode())
        items: Iterable[Any] = obj.items() if typ is dict else (sorted(obj, key=repr) if typ in (set, frozenset) else obj)
        for item in items:
            _feed(h, item, depth + 1)
        h.update(b"]")
    elif hasattr(obj, "__dask_tokenize__"):
        _feed(h, obj.__dask_tokenize__(), depth + 1)
    elif typ.__module__ == "numpy" and typ.__name__ == "ndarray" and obj.dtype.hasobject is False:
        h.update(f"ndarray:{obj.dtype.str}:{obj.shape}:".encode())
        import numpy as np

        # numpy's stubs give ndarray __buffer__ only on Python >= 3.12; it is a buffer on all
        h.update(memoryview(np.ascontiguousarray(obj)).cast("B"))  # type: ignore[arg-type]
    elif getattr(typ, "__shoal_future__", False):
        h.update(f"future:{obj.key!r};".encode())
    elif callable(obj) and hasattr(obj, "__module__") and hasattr(obj, "__qualname__") and "<" not in obj.__qualname__:
        h.update(f"fn:{obj.__module__}.{obj.__qualname__};".encode())
    else:
        # by identity: deterministic for the same object within this process
        h.update(f"id:{_PROCESS_TOKEN}:{id(obj)}:{typ.__qualname__};".encode())


def unique_token() -> str:
    return uuid.uuid4().hex
