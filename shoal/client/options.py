"""Where and how a task may run, as the client takes it from the user: the reserved
keywords of ``submit``/``map``/``compute``/``persist`` (``workers``, ``resources``,
``priority``, ``retries``, ``allow_other_workers``) and dask's annotations
(``with dask.annotate(priority=...)``, and per-key annotations of a collection's
graph). They become fields of a task of ``update-graph``; they never reach the
function."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from typing import Any

from ..protocol.resources import check_resources as checked_resources

__all__ = ["TaskOptions", "apply_annotations", "call_options", "context_annotations", "worker_restrictions"]

#: the annotations the scheduler acts on (dask's names); others are kept by dask only
_KNOWN = ("priority", "resources", "workers", "retries", "allow_other_workers")


class TaskOptions:
    """Checked task options: ``fields`` are the ``update-graph`` task fields they set
    (only those that differ from the default). Raises ``TypeError``/``ValueError`` for a
    bad option, naming it."""

    __slots__ = ("fields",)

    def __init__(self, workers: Any = None, resources: Any = None, priority: Any = 0, retries: Any = 0,
                 allow_other_workers: Any = False):
        fields: dict[str, Any] = {}
        restrictions = worker_restrictions(workers)
        if restrictions is not None:
            fields["workers"] = restrictions
        if allow_other_workers not in (True, False, None):
            raise TypeError(f"allow_other_workers= must be True, False or None, got {allow_other_workers!r}")
        if allow_other_workers:
            if restrictions is None:
                raise ValueError("allow_other_workers=True needs workers= (the workers to prefer)")
            fields["allow_other_workers"] = True
        if resources:
            checked = check_resources(resources)
            if checked:
                fields["resources"] = checked
        if priority:
            fields["priority"] = check_int("priority", priority)
        if retries:
            n = check_int("retries", retries)
            if n < 0:
                raise ValueError(f"retries= must be >= 0, got {n}")
            fields["retries"] = n
        self.fields = fields

    @classmethod
    def of(cls, annotations: Mapping[str, Any]) -> TaskOptions:
        """The options dask annotations ask for (unknown annotations are ignored)."""
        return cls(**{k: annotations[k] for k in _KNOWN if k in annotations})

    def merged(self, explicit: TaskOptions) -> TaskOptions:
        """These options with ``explicit``'s on top."""
        out = TaskOptions()
        out.fields = {**self.fields, **explicit.fields}
        return out


def worker_restrictions(workers: Any) -> list[str] | None:
    """``workers=`` (an address, worker name or host, or a collection of them) as a
    list (``None``: anywhere)."""
    if workers is None:
        return None
    if isinstance(workers, str):
        return [workers]
    if isinstance(workers, Iterable) and not isinstance(workers, (bytes, Mapping)):
        out = list(workers)
        if all(isinstance(w, str) for w in out):
            return sorted(out) if isinstance(workers, (set, frozenset)) else out
    raise TypeError(f"workers= takes worker addresses, names or hosts (strings), got {workers!r:.100}")


def check_resources(resources: Any) -> dict[str, float]:
    """``resources=`` as ``{name: amount}``, less the resources asked for none of (no
    restriction); raises ``TypeError``/``ValueError``."""
    return {name: amount for name, amount in checked_resources(resources, "resources=").items() if amount > 0}


def check_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}= must be an int, got {value!r:.60}")
    if not -(1 << 62) < value < (1 << 62):
        raise ValueError(f"{name}= is out of range: {value}")
    return value


def context_annotations() -> dict[str, Any]:
    """The annotations of the enclosing ``with dask.annotate(...)`` blocks (none
    without dask)."""
    dask = sys.modules.get("dask")
    if dask is None:
        return {}
    get = getattr(dask, "get_annotations", None)
    return dict(get()) if get is not None else {}


def apply_annotations(tasks: list[dict[str, Any]], per_key: Mapping[str, Mapping[Any, Any]],
                      explicit: TaskOptions) -> None:
    """Set the fields of graph ``tasks`` from dask annotations: the graph's per-key ones
    (``per_key``: annotation -> {key: value}, as ``__dask_annotations__()`` gives them)
    over the options of the call (``explicit``, from :func:`call_options`: they hold
    the context's annotations, less those that are callables)."""
    base = explicit.fields
    per_key = {k: v for k, v in per_key.items() if k in _KNOWN and v}
    for task in tasks:
        fields = base
        if per_key:
            own = {name: values[task["key"]] for name, values in per_key.items() if task["key"] in values}
            if own:
                fields = {**base, **TaskOptions.of(own).fields}
        if fields:
            task.update(fields)


def call_options(workers: Any = None, resources: Any = None, priority: Any = 0, retries: Any = 0,
                 allow_other_workers: Any = False, key: Any = None,
                 context: dict[str, Any] | None = None) -> TaskOptions:
    """A call's options over those of the enclosing ``with dask.annotate(...)``
    (``context``: those annotations, when the caller has them already). Annotations
    that are callables of the key are called with ``key``; without one (a graph's
    options, shared by its tasks) they are left out."""
    if context is None:
        context = context_annotations()
    if (workers is None and not resources and not priority and not retries and not allow_other_workers
            and not context):
        return _NONE  # the common call: nothing to check
    explicit = TaskOptions(workers, resources, priority, retries or 0, allow_other_workers)
    if not context:
        return explicit
    if key is None:
        context = {k: v for k, v in context.items() if not callable(v)}
    else:
        context = {k: (v(key) if callable(v) else v) for k, v in context.items()}
    return TaskOptions.of(context).merged(explicit) if context else explicit


#: the options of a call that sets none (shared: nobody changes a TaskOptions' fields)
_NONE = TaskOptions()
