"""Structures of futures for the client: futures inside arguments become key
references, gathered values go back into the caller's structure, and error reports
become exceptions."""

from __future__ import annotations

from typing import Any

from ..errors import GraphError, KilledWorker, LostDataError, RemoteError, RunOnceError, SerializationError
from ..taskspec import Ref
from .future import Future, _unwrap

__all__ = ["collect_futures", "futures_of", "rebuild", "rebuild_exception", "replace_futures"]



def replace_futures(obj: Any, deps: set[Any], client: Any) -> Any:
    """``obj`` with this client's futures (also inside lists, tuples and dicts) turned into
    key references; their keys are added to ``deps``."""
    typ = type(obj)
    if typ is Future:
        if obj.client is not client:
            raise ValueError(f"{obj!r} belongs to another client")
        deps.add(obj.key)
        return Ref(obj.key)
    if typ is list:
        return [replace_futures(v, deps, client) for v in obj]
    if typ is tuple:
        return tuple(replace_futures(v, deps, client) for v in obj)
    if typ is dict:
        return {k: replace_futures(v, deps, client) for k, v in obj.items()}
    return obj


def collect_futures(obj: Any, out: list[Future]) -> None:
    """Append the futures inside ``obj`` (nested containers too) to ``out``."""
    if isinstance(obj, Future):
        out.append(obj)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for v in obj:
            collect_futures(v, out)
    elif isinstance(obj, dict):
        for v in obj.values():
            collect_futures(v, out)


def rebuild(obj: Any, values: dict[Any, Any], drop: frozenset[Any] = frozenset()) -> Any:
    """``obj`` with its futures replaced by their values (same structure); futures of
    the keys in ``drop`` are left out of lists (``gather(errors="skip")``, as dask)."""
    if isinstance(obj, Future):
        return values[obj.key]
    if isinstance(obj, list):
        return [rebuild(v, values, drop) for v in obj if not (drop and isinstance(v, Future) and v.key in drop)]
    if isinstance(obj, tuple):
        return tuple(rebuild(v, values, drop) for v in obj)
    if isinstance(obj, (set, frozenset)):
        return type(obj)(rebuild(v, values, drop) for v in obj)
    if isinstance(obj, dict):
        return {k: rebuild(v, values, drop) for k, v in obj.items()}
    return obj


def rebuild_exception(msg: dict[str, Any]) -> BaseException:
    """The exception a ``task-erred`` report stands for: the task's own when it can be
    deserialized here, else a shoal error of the reported kind; the worker's traceback
    as a note."""
    text = str(msg.get("text") or "")
    kind = msg.get("kind") or ""
    exc: Any = msg.get("exception")
    try:
        exc = _unwrap(exc) if exc is not None else None
    except Exception as e:  # the exception's class is not importable here
        exc = RemoteError(f"{text} (and it could not be deserialized here: {e!r})", text.split(":")[0], "")
    if not isinstance(exc, BaseException):
        if kind == "KilledWorker":
            exc = KilledWorker(text.removeprefix("KilledWorker: "))
        elif kind == "GraphError":
            exc = GraphError(text.removeprefix("GraphError: "))
        elif kind == "LostData":
            exc = LostDataError(text.removeprefix("LostData: "))
        elif kind == "RunOnce":
            exc = RunOnceError(text.removeprefix("RunOnce: "))
        elif kind == "ValueError":
            exc = ValueError(text.removeprefix("ValueError: "))
        elif kind == "KeyError":
            exc = KeyError(text.removeprefix("KeyError: "))
        elif text.startswith("SerializationError: "):  # a value of the task's that could not travel
            exc = SerializationError(text.removeprefix("SerializationError: "))
        else:
            exc = RemoteError(text or f"task {msg.get('key')!r} failed", text.split(":")[0], str(msg.get("traceback") or ""))
    tb = msg.get("traceback")
    if isinstance(tb, str) and tb and hasattr(exc, "add_note"):
        note = "traceback on the worker:\n" + tb
        if note not in getattr(exc, "__notes__", ()):
            exc.add_note(note)
    return exc




def futures_of(obj: Any) -> list[Future]:
    """The futures in ``obj``: futures themselves, inside lists, tuples, sets and dict
    values, and in the graphs of dask collections (a persisted collection's graph
    holds its futures). Each key once, in the order found."""
    out: dict[Any, Future] = {}
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, Future):
            out.setdefault(x.key, x)
        elif isinstance(x, (list, tuple, set, frozenset)):
            stack.extend(reversed(list(x)) if isinstance(x, (list, tuple)) else x)
        elif isinstance(x, dict):
            stack.extend(reversed(list(x.values())))
        elif hasattr(x, "__dask_graph__") and not isinstance(x, type):
            graph = x.__dask_graph__()
            if graph is not None:
                stack.extend(reversed(list(graph.values())))
    return list(out.values())
