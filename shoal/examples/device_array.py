"""A serializer family that moves a device array through a side channel, with a lease.

``DeviceArray`` stands for memory on an accelerator: its bytes live in a "device"
allocation, not in host memory a pickle could reference. How it crosses depends on the
destination, as a real GPU array's family would do it:

- ``same-process``: nothing is serialized (in-process comms pass the object).
- ``same-host``: the sender *exports* the allocation (here: into a shared-memory segment,
  standing in for a CUDA IPC handle) and sends only the handle; the receiver *imports*
  it into an allocation of its own. The exported handle must live until the receiver
  has imported it, and no longer: the family takes a :func:`shoal.protocol.lease` whose
  release frees the export. The transport ends the lease when the receiver acknowledges
  the value, or when the connection goes, or after ``LEASE_TIMEOUT`` seconds.
- ``remote``: the bytes themselves, as a frame.

Use it as a template: ``register()`` installs the family in this process; both ends
must call it. The handle comes from the wire: the receiver checks that it names an
export in shoal's form before it opens anything, and opens only a regular file of its
own user, without following a symlink or waiting on a FIFO.
"""

from __future__ import annotations

import itertools
import os
import secrets
import stat
import threading
from typing import Any

from ..protocol import lease, register_serializer

__all__ = ["DeviceArray", "register", "events", "live_exports", "LEASE_TIMEOUT"]

#: seconds an exported handle waits for the receiver at most
LEASE_TIMEOUT = 30.0

_lock = threading.Lock()
_events: list[tuple[str, str]] = []
_exports: dict[str, str] = {}
_ids = itertools.count()


def events() -> list[tuple[str, str]]:
    """``(what, handle)`` in the order they happened in this process: ``exported``,
    ``imported``, ``freed``."""
    with _lock:
        return list(_events)


def live_exports() -> set[str]:
    """Handles exported by this process and not freed yet."""
    with _lock:
        return set(_exports)


def _record(what: str, handle: str) -> None:
    with _lock:
        _events.append((what, handle))


class DeviceArray:
    """A byte buffer "on the device"."""

    def __init__(self, data: bytes):
        self._device = bytearray(data)  # the device allocation

    def to_host(self) -> bytes:
        return bytes(self._device)

    def __len__(self) -> int:
        return len(self._device)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DeviceArray) and other._device == self._device

    def __repr__(self) -> str:
        return f"DeviceArray({len(self)} bytes)"


def _export(arr: DeviceArray) -> str:
    """Make the allocation reachable by another process of this host; returns the handle."""
    handle = f"shoal-{os.getpid()}-dev{next(_ids)}-{secrets.token_hex(4)}"
    fd = os.open(f"/dev/shm/{handle}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        os.write(fd, arr._device)
    finally:
        os.close(fd)
    with _lock:
        _exports[handle] = handle
    _record("exported", handle)
    return handle


def _free_export(handle: str) -> None:
    with _lock:
        _exports.pop(handle, None)
    try:
        os.unlink(f"/dev/shm/{handle}")
    finally:
        _record("freed", handle)


#: the longest file name /dev/shm takes
_MAX_HANDLE = 255
#: whose files an export may be (read once: no syscall per import for it)
_EUID = os.geteuid()


def _handle_path(handle: Any) -> str:
    """The file of an export named ``handle``. Raises ``ValueError`` for a handle not
    in this family's form (``shoal-...``, no ``/``, no ``..``, no NUL, at most 255
    characters): one that would reach outside ``/dev/shm``, say."""
    if (
        type(handle) is not str
        or not handle.startswith("shoal-")
        or len(handle) > _MAX_HANDLE
        or "/" in handle
        or ".." in handle
        or "\0" in handle
    ):
        raise ValueError(f"not a device-array handle: {handle!r:.300}")
    return f"/dev/shm/{handle}"


def _import(handle: Any, nbytes: int) -> DeviceArray:
    """Copy the export ``handle`` into an allocation of this process. Raises
    ``ValueError`` for a bad handle or size, or a file that is no export (a symlink, a
    FIFO, another user's file, one shorter than ``nbytes``); ``FileNotFoundError`` if
    the export is gone."""
    if nbytes < 0:
        raise ValueError(f"device array of {nbytes} bytes")
    path = _handle_path(handle)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:  # ELOOP: a symlink; ENXIO: a FIFO nobody writes to
        raise ValueError(f"cannot import device array {handle!r:.300}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != _EUID:
            raise ValueError(f"{path!r:.300} is not a device-array export of this user")
        if st.st_size < nbytes:  # also keeps a made-up size from sizing the read buffer
            raise ValueError(f"{path!r:.300} holds {st.st_size} bytes, not the {nbytes} announced")
        data = os.read(fd, nbytes)
    finally:
        os.close(fd)
    _record("imported", handle)
    return DeviceArray(data)


def _dumps(arr: DeviceArray, destination: str) -> tuple[dict[str, Any], list[Any]]:
    if destination == "same-host":
        handle = _export(arr)
        lease_id = lease(lambda: _free_export(handle), timeout=LEASE_TIMEOUT)
        return {"handle": handle, "nbytes": len(arr), "lease": lease_id}, []
    return {}, [arr.to_host()]  # remote: the bytes travel


def _loads(header: dict[str, Any], frames: Any) -> DeviceArray:
    if "handle" in header:
        return _import(header["handle"], int(header["nbytes"]))
    return DeviceArray(bytes(frames[0]))


def register() -> None:
    """Install the family in this process (both ends need it)."""
    register_serializer(DeviceArray, _dumps, _loads, destinations=["same-host", "remote"],
                        name="shoal.examples.device-array")
