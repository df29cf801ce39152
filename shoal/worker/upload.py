"""Files a client uploads to the workers (``Client.upload_file``): a ``.py`` module, or a
``.zip``/``.egg`` archive of modules and packages.

Each process keeps one directory of uploads (workers of one process share it, as they
share ``sys.path``): a file is written there (under a temporary name, then renamed, so
that no import reads half of it), the directory (for a module) or the archive is put at
the front of ``sys.path``, and with ``load`` its modules are imported, or reloaded if
they were imported before. The directory is removed when the process exits normally;
the directories of processes that are gone are removed by the next upload on the host.
"""

from __future__ import annotations

import asyncio
import atexit
import importlib
import os
import shutil
import sys
import tempfile
import threading
import zipfile
from types import ModuleType
from typing import Any

__all__ = ["SUFFIXES", "check_filename", "install", "remove_stale", "upload_file"]

#: the kinds of file that can be uploaded
SUFFIXES = (".py", ".zip", ".egg")

_PREFIX = "shoal-uploads-"
_lock = threading.Lock()
_directory: str | None = None


def check_filename(filename: str) -> str:
    """The name ``filename`` is stored under (its base name). Raises ``ValueError``
    for a name that is not a ``.py``, ``.zip`` or ``.egg`` file name."""
    name = os.path.basename(str(filename))
    stem, suffix = os.path.splitext(name)
    if suffix not in SUFFIXES or not stem or stem.startswith(".") or "\x00" in name:
        raise ValueError(f"upload_file() takes a .py, .zip or .egg file, got {filename!r}")
    if suffix == ".py" and not stem.isidentifier():
        raise ValueError(f"{name!r} is no module name: it could not be imported")
    return name


def install(filename: str, data: bytes, load: bool = True) -> list[ModuleType]:
    """Write ``data`` as ``filename`` into this process's directory of uploads, put it
    on ``sys.path`` and, with ``load``, import (or reload) its modules; returns them.
    Raises ``ValueError`` for a bad name or an archive that is not a zip file, and
    whatever importing the modules raises."""
    name = check_filename(filename)
    with _lock:
        path = os.path.join(_uploads(), name)
        partial = f"{path}.{os.getpid()}.{threading.get_ident()}.part"
        with open(partial, "wb") as f:
            f.write(data)
        os.replace(partial, path)
        if name.endswith(".py"):
            entry, modules = os.path.dirname(path), [name[:-3]]
            # bytecode cached from an earlier upload of the same size in the same
            # second would pass as up to date
            shutil.rmtree(os.path.join(entry, "__pycache__"), ignore_errors=True)
        else:
            entry, modules = path, _archive_modules(path)
            # a zip read before is cached by its path: the new one must be read again
            sys.path_importer_cache.pop(path, None)
            _forget_zip(path)
        if entry in sys.path:
            sys.path.remove(entry)
        sys.path.insert(0, entry)
        importlib.invalidate_caches()
        if not load:
            return []
        loaded = []
        for module in modules:
            old = sys.modules.get(module)
            # reload finds the module again on sys.path: the upload is first there
            loaded.append(importlib.reload(old) if old is not None else importlib.import_module(module))
        return loaded


async def upload_file(comm: Any, filename: str, data: bytes, load: bool = True) -> None:
    """The worker's ``upload-file`` handler: :func:`install`, in a thread (importing
    runs the module's code, which must not hold up the worker's event loop)."""
    await asyncio.to_thread(install, filename, bytes(data), load)


def _uploads() -> str:
    """This process's directory of uploads (made on first use)."""
    global _directory
    if _directory is None or not os.path.isdir(_directory):
        remove_stale()
        _directory = tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-")
        atexit.register(shutil.rmtree, _directory, True)
    return _directory


def remove_stale() -> None:
    """Remove the directories of uploads of processes that are gone (a worker process
    may end without running ``atexit``)."""
    root = tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        if not name.startswith(_PREFIX):
            continue
        pid = name[len(_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and _gone(int(pid)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # someone else's process: not ours to judge
    return False


def _archive_modules(path: str) -> list[str]:
    """The top-level modules and packages inside the archive at ``path``. Raises
    ``ValueError`` if it is not a zip file."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except zipfile.BadZipFile as exc:
        raise ValueError(f"{os.path.basename(path)!r} is not a zip archive: {exc}") from None
    modules: dict[str, None] = {}
    for entry in names:
        parts = entry.split("/")
        if len(parts) == 1 and parts[0].endswith(".py"):
            modules[parts[0][:-3]] = None
        elif len(parts) == 2 and parts[1] == "__init__.py":
            modules[parts[0]] = None
    return [m for m in modules if m.isidentifier()]


def _forget_zip(path: str) -> None:
    """Drop zipimport's cached table of contents of the archive at ``path``."""
    import zipimport

    cache = getattr(zipimport, "_zip_directory_cache", None)
    if isinstance(cache, dict):
        cache.pop(path, None)
