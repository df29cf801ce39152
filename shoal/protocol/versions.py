"""What a process of the cluster runs: its host, Python, shoal and the packages whose
versions must agree between clients, scheduler and workers (``Client.get_versions``).

Versions are read from the installed distributions' metadata: nothing is imported,
so a scheduler asked about any package name runs no code of it.
"""

from __future__ import annotations

import functools
import os
import platform
import struct
import sys
from collections.abc import Iterable, Mapping
from importlib import metadata
from typing import Any

__all__ = ["PACKAGES", "REQUIRED", "SCHEDULER_RELEVANT", "get_versions", "mismatches"]

#: reported by every process, besides Python and what the caller names
PACKAGES = ("shoal", "msgpack", "msgspec", "cloudpickle", "numpy", "dask")
#: a mismatch of these between a client and the workers breaks the cluster (task
#: payloads are pickles of the client's, messages are msgspec's)
REQUIRED = ("python", "shoal", "cloudpickle", "msgspec")
#: what the scheduler's versions are compared for: it never unpickles anything, so
#: only the wire and shoal itself matter there
SCHEDULER_RELEVANT = frozenset({"python", "shoal", "msgpack", "msgspec"})
#: the most package names one request may ask about
MAX_PACKAGES = 100


def get_versions(packages: Iterable[str] = ()) -> dict[str, dict[str, Any]]:
    """``{"host": {...}, "packages": {name: version or None}}`` of this process, as
    dask's: ``packages`` adds names to :data:`PACKAGES` (a package that is not
    installed reports None). Raises ``ValueError`` for more than :data:`MAX_PACKAGES`
    names, ``TypeError`` for a name that is not a str."""
    names = list(packages)
    if len(names) > MAX_PACKAGES:
        raise ValueError(f"at most {MAX_PACKAGES} package names, got {len(names)}")
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"package names are str, got {type(name).__name__}")
    found: dict[str, Any] = {"python": _python()}
    for name in dict.fromkeys([*PACKAGES, *names]):
        found[name] = _version(name)
    return {"host": _host(), "packages": found}


def mismatches(client: Mapping[str, Any], scheduler: Mapping[str, Any],
               workers: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, Any, Any, Any]]:
    """The packages whose versions differ: ``[(package, client's, scheduler's,
    workers')]`` (the workers' is one version when they agree, else a sorted list),
    from results of :func:`get_versions`. The scheduler counts only for
    :data:`SCHEDULER_RELEVANT` packages."""
    mine = client.get("packages") or {}
    theirs = scheduler.get("packages") or {}
    by_worker = {w: (v.get("packages") or {}) for w, v in workers.items()}
    names = set(mine) | set(theirs)
    for packages in by_worker.values():
        names.update(packages)
    out = []
    for name in sorted(names):
        seen = {mine.get(name, "MISSING")}
        worker_versions = {packages.get(name, "MISSING") for packages in by_worker.values()}
        seen |= worker_versions
        if name in SCHEDULER_RELEVANT:
            seen.add(theirs.get(name, "MISSING"))
        if len(seen) > 1:
            shown: Any = next(iter(worker_versions)) if len(worker_versions) == 1 else sorted(map(str, worker_versions))
            out.append((name, mine.get(name, "MISSING"), theirs.get(name, "MISSING"), shown))
    return out


def _python() -> str:
    return "%d.%d.%d.%s.%s" % sys.version_info  # noqa: UP031 - dask's spelling of it


@functools.lru_cache(maxsize=256)
def _version(name: str) -> str | None:
    if name == "shoal":
        from .. import __version__

        return __version__
    try:
        return metadata.version(name)
    except Exception:  # noqa: BLE001 - not installed, or metadata that does not parse
        return None


def _host() -> dict[str, Any]:
    uname = platform.uname()
    return {
        "python": _python(),
        "python-bits": struct.calcsize("P") * 8,
        "OS": uname.system,
        "OS-release": uname.release,
        "machine": uname.machine,
        "processor": uname.processor,
        "byteorder": sys.byteorder,
        "LC_ALL": os.environ.get("LC_ALL", "None"),
        "LANG": os.environ.get("LANG", "None"),
    }
