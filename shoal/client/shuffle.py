"""shoal's shuffle in dask's planner: the method ``"shoal"``.

dask lowers every all-to-all exchange of a dataframe (``shuffle``, a merge on columns,
``set_index``/``sort_values``, a groupby's ``split_out``, ``drop_duplicates``) to a
``Shuffle`` expression, whose ``_lower`` picks the graph by the method's name. dask's
own names are "tasks", "disk", "p2p" (dask.distributed's) and "simple"; :func:`install`
teaches it one more, ``"shoal"`` (``shuffle_method="shoal"``, or
``dask.config.set({"dataframe.shuffle.method": "shoal"})``), lowered to
:class:`ShoalShuffle`. Installing changes nothing for the other names.

:class:`ShoalShuffle` makes ``2n + 1`` tasks for ``n`` partitions in and out (dask's
task shuffle makes ``n log n`` at best, its simple one ``n²``): a split per input
partition, one barrier that the scheduler runs without moving any data
(``locate``), an assembly per output partition (see :mod:`shoal.worker.shuffle`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.util
import inspect
import logging
import sys
import threading
from typing import Any

from ..worker.shuffle import LOCATE_PREFIX, SPLIT_PREFIX, assemble, locate, split

__all__ = ["METHOD", "install", "watch", "ShoalShuffle", "is_locate"]

logger = logging.getLogger(__name__)

#: the method's name in dask's config and its ``shuffle_method=`` arguments
METHOD = "shoal"

_lock = threading.RLock()
_installed = False


def is_locate(func: Any) -> bool:
    """Whether ``func`` is the function of a shuffle's barrier (a ``locate`` task)."""
    return func is locate


#: the module of dask's planner that :func:`install` changes
_PLANNER = "dask.dataframe.dask_expr._shuffle"
#: dask's bags: their groupby takes the dataframes' method name too (:func:`install_bags`)
_BAGS = "dask.bag.core"


class _InstallOnImport(importlib.abc.MetaPathFinder):
    """Installs the method right after dask's planner (and bags) are imported
    (without importing dask.dataframe, and pandas, before a user does)."""

    def __init__(self, pending: dict[str, Any]) -> None:
        self.pending = pending  # module name -> what to install once it is imported

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        then = self.pending.pop(fullname, None)  # (so the search below does not come back here)
        if then is None:
            return None
        if not self.pending:
            with contextlib.suppress(ValueError):
                sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            then()

        loader.exec_module = exec_module
        return spec


_watcher: _InstallOnImport | None = None


def watch() -> None:
    """Have the method installed: now where dask's planner (bags) are imported, else
    as soon as they are."""
    global _watcher
    installers = {_PLANNER: install, _BAGS: install_bags}
    for name, then in installers.items():
        if name in sys.modules:
            then()
    with _lock:
        if _watcher is None:
            _watcher = _InstallOnImport({n: f for n, f in installers.items() if n not in sys.modules})
            if _watcher.pending:
                sys.meta_path.insert(0, _watcher)


_bags_installed = False


def install_bags() -> bool:
    """Have a bag's ``groupby`` take the name ``"shoal"`` (given, or dask's default
    while a shoal client is open) for dask's ``"tasks"``: shoal's shuffle moves
    dataframes' rows, a bag's groupby is not a dataframe's. Once; False when dask's
    bags cannot be imported."""
    global _bags_installed
    with _lock:
        if _bags_installed:
            return True
        try:
            from dask.bag import core
        except ImportError:
            return False
        original = core.Bag.groupby
        signature = inspect.signature(original)

        @functools.wraps(original)
        def groupby(*args: Any, **kwargs: Any) -> Any:
            given = signature.bind(*args, **kwargs)
            shuffle = given.arguments.get("shuffle")
            if shuffle is None and given.arguments.get("method") is None:
                from dask.utils import get_default_shuffle_method

                with contextlib.suppress(ImportError):
                    shuffle = get_default_shuffle_method()
            if shuffle == METHOD:
                given.arguments["shuffle"] = "tasks"
            return original(*given.args, **given.kwargs)

        setattr(core.Bag, "groupby", groupby)  # noqa: B010 - (a method replaced)
        _bags_installed = True
        return True


def install() -> bool:
    """Teach dask's planner the method ``"shoal"`` (once; later calls do nothing).
    Returns False when dask.dataframe cannot be imported (nothing to teach)."""
    global _installed
    with _lock:
        if _installed:
            return True
        try:
            from dask.dataframe.dask_expr import _shuffle
        except ImportError:
            return False
        try:
            _define(_shuffle)
            original = _shuffle.Shuffle._lower
        except Exception as exc:  # noqa: BLE001 - a dask whose planner changed
            from .dask_methods import use_instead

            logger.warning("shoal's shuffle cannot join this dask's planner (%r); "
                           "dask's 'tasks' shuffle is used instead", exc)
            use_instead("dataframe.shuffle.method", "tasks")
            return False

        @functools.wraps(original)
        def _lower(self: Any) -> Any:
            from dask.utils import get_default_shuffle_method

            if (self.method or get_default_shuffle_method()) != METHOD:
                return original(self)
            # (no repartition to fewer inputs first, as dask's task shuffle does to keep
            # its n x m tasks down: this one has n + 1 + m, and joining inputs would
            # move them before the shuffle moves their rows again)
            return ShoalShuffle(self.frame, self.partitioning_index, self.npartitions_out, self.ignore_index,
                                self.options, self.original_partitioning_index)

        setattr(_shuffle.Shuffle, "_lower", _lower)  # noqa: B010 - (a method replaced)
        _installed = True
        return True


ShoalShuffle: Any = None


def _define(_shuffle: Any) -> None:
    """Define :class:`ShoalShuffle` on dask's ``SimpleShuffle`` (imported late: dask is
    an optional dependency)."""
    global ShoalShuffle
    from dask._task_spec import Task, TaskRef

    class _ShoalShuffle(_shuffle.SimpleShuffle):
        """A shuffle in ``2n + 1`` tasks: split each input partition where it is, find
        where the splits are, assemble each output partition from them (module
        docstring)."""

        def _layer(self) -> dict[Any, Any]:
            token = self._name.split("-")[-1]
            split_name = f"{SPLIT_PREFIX}-{token}"
            locate_key = f"{LOCATE_PREFIX}-{token}"
            on = self.partitioning_index
            n_out = self.npartitions_out
            dsk: dict[Any, Any] = {}
            refs = []
            for i in range(self.frame.npartitions):
                t = Task((split_name, i), split, TaskRef((self.frame._name, i)), on, n_out)
                dsk[t.key] = t
                refs.append(t.ref())
            barrier = Task(locate_key, locate, *refs)
            dsk[barrier.key] = barrier
            meta = self.frame._meta
            parts_out = self._partitions if self._filtered else range(n_out)
            for j, part in enumerate(parts_out):
                t = Task((self._name, j), assemble, barrier.ref(), part, meta, bool(self.ignore_index))
                dsk[t.key] = t
            return dsk

    _ShoalShuffle.__name__ = _ShoalShuffle.__qualname__ = "ShoalShuffle"
    ShoalShuffle = _ShoalShuffle
