"""Structures of futures for the client: futures inside arguments become key
references, gathered values go back into the caller's structure, and error reports
become exceptions."""

from __future__ import annotations

from typing import Any

from ..errors import GraphError, KilledWorker, LostDataError, RemoteError, SerializationError
from ..taskspec import Ref
from .future import Future, _unwrap

__all__ = ["collect_futures", "futures_of", "rebuild", "rebuild_exception", "replace_futures", "worker_restrictions"]



def worker_restrictions(workers: Any) -> list[str] | None:
    """``workers=`` as a list of addresses (``None``: anywhere)."""
    if workers is None:
        return None
    if isinstance(workers, str):
        return [workers]
    out = list(workers)
    if not all(isinstance(w, str) for w in out):
        raise TypeError(f"workers= takes worker addresses (strings), got {workers!r}")
    return out


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
    """The futures in ``obj``: a future, containers of them, or a dask collection
    whose graph holds them (a persisted one), each once, in the order found."""
    found: list[Future] = []
    collect_futures(obj, found)
    graph = getattr(obj, "__dask_graph__", None)
    if graph is not None and not isinstance(obj, type):
        try:
            values: list[Any] = list(dict(graph() or {}).values())
        except Exception:  # not a dask collection after all
            values = []
        for v in values:
            collect_futures(v, found)
    elif isinstance(obj, (list, tuple, set)):
        for item in obj:
            if hasattr(item, "__dask_graph__"):
                found.extend(futures_of(item))
    seen: set[int] = set()
    out = []
    for f in found:
        if id(f) not in seen:
            seen.add(id(f))
            out.append(f)
    return out
