"""The file rules of shoal's shared-memory segments (``/dev/shm``), for :mod:`.shm` and
the modules next to it.

A segment is a regular file of this user named ``shoal-<pid>-<kind><n>-<random>``
(:func:`new_name`); it starts with a header (:func:`segment_header`): a magic and a
token naming this generation of its contents. A *transfer* segment, made to be handed
over to one receiver, has a magic of its own (``SHOALTRN``, a value's is ``SHOALSEG``):
a receiver takes over (renames or removes) only a segment that says it is a transfer,
so that a peer that learnt a value segment's name and token (any client of its owner
does) cannot make a receiver take that segment from its owner.

Names come from peers, and ``/dev/shm`` is writable by every process of the host: a
name is turned into a path only if it looks like one of shoal's (:func:`segment_path`),
and an existing file is used only through :func:`open_segment`, which neither follows a
symlink nor waits on a FIFO and takes nothing but a regular file of this user.

Whoever finds a dead process's segments (its ``LocalCluster``, its scheduler) removes
them with :func:`sweep`; it takes no lock (a signal handler calls it).
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import mmap
import os
import secrets
import stat
import time
from typing import Any

__all__ = [
    "SHM_DIR",
    "PREFIX",
    "HEADER",
    "DATA_OFFSET",
    "segment_path",
    "open_segment",
    "is_own_file",
    "new_name",
    "segment_header",
    "pwrite_all",
    "owner_mapping",
    "close_writer",
    "buffer_address",
    "align",
    "free_bytes",
    "segments_of",
    "sweep",
    "sweep_when_gone",
    "process_gone",
]

#: where segments live: a tmpfs shared by the processes of this host (``SHOAL_SHM_DIR``
#: for another one, e.g. a small tmpfs of a test; every process of a cluster on this
#: host must use the same one: the handshake's probe finds out whether they do)
SHM_DIR = os.environ.get("SHOAL_SHM_DIR") or "/dev/shm"
PREFIX = "shoal-"
_ALIGN = 64
_MAGIC = b"SHOALSEG"
_TRANSFER_MAGIC = b"SHOALTRN"
#: bytes of a segment's header (magic and token, NUL-padded)
HEADER = 64
#: where a value's buffers start in its segment (room for the header and the pickle
#: stream of an ordinary value before them), so that one segment size fits a value
#: copied in and an array born in the segment alike, and either can reuse the other's
DATA_OFFSET = 4096
#: the longest file name tmpfs takes (NAME_MAX)
_MAX_NAME = 255
#: opening a name someone else may have made: never follow a symlink out of /dev/shm,
#: never wait for a writer (a FIFO), never leak the descriptor into a child's exec
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
#: whose files this process takes for segments (read once: checking costs no syscall;
#: refreshed in a forked child)
_euid = os.geteuid()
_counter = itertools.count()


def segment_path(name: str) -> str:
    """``/dev/shm/<name>`` for a name in shoal's form (``shoal-...``, at most 255
    characters, no ``/``, no ``..``, no NUL). Raises ``ValueError`` for any other name,
    e.g. one a peer made up to reach a file outside ``/dev/shm``."""
    if (
        type(name) is not str
        or not name.startswith(PREFIX)
        or len(name) <= len(PREFIX)
        or len(name) > _MAX_NAME
        or "/" in name
        or ".." in name
        or "\0" in name
    ):
        raise ValueError(f"not a shoal segment name: {name!r:.300}")
    return f"{SHM_DIR}/{name}"


def is_own_file(st: os.stat_result) -> bool:
    """Whether ``st`` (a ``stat``/``lstat``/``fstat`` result) is a regular file of this
    user: the only kind of file taken for a segment."""
    return stat.S_ISREG(st.st_mode) and st.st_uid == _euid


def open_segment(name: str, flags: int) -> tuple[int, os.stat_result]:
    """Open the segment file ``name`` (``flags``: its access mode) and return the
    descriptor and its ``fstat``.

    Raises ``ValueError`` for a name not in shoal's form (:func:`segment_path`), and
    ``FileNotFoundError`` when there is no file by that name or what is there is no
    segment: a symlink, a FIFO, a device, a directory, another user's file (also one
    this process may not open). Any other ``OSError`` propagates.
    """
    try:
        fd = os.open(segment_path(name), flags | _OPEN_FLAGS)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.EACCES, errno.EPERM):
            # a symlink (O_NOFOLLOW), a FIFO without reader (O_NONBLOCK), a directory,
            # another user's file that a non-root process may not open
            raise FileNotFoundError(f"{SHM_DIR}/{name} is not a shoal segment ({exc.strerror})") from None
        raise
    try:
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if not is_own_file(st):
        os.close(fd)
        what = f"a file of uid {st.st_uid}" if stat.S_ISREG(st.st_mode) else "not a regular file"
        raise FileNotFoundError(f"{SHM_DIR}/{name} is not a shoal segment of this user ({what})")
    return fd, st


def new_name(kind: str = "", pid: int | None = None) -> str:
    """A fresh segment name of process ``pid`` (this one by default); ``kind`` says
    what it is for (``""`` a value or transfer, ``"pool"``, ``"probe"``, ``"ret"``)."""
    return f"{PREFIX}{os.getpid() if pid is None else pid}-{kind}{next(_counter)}-{secrets.token_hex(4)}"


def segment_header(token: str, transfer: bool = False) -> bytes:
    """The header of a segment holding generation ``token``: a value segment's, or
    with ``transfer`` a transfer segment's (module docstring)."""
    return ((_TRANSFER_MAGIC if transfer else _MAGIC) + token.encode()).ljust(HEADER, b"\0")


def pwrite_all(fd: int, data: Any, offset: int) -> None:
    """Write all of ``data`` at ``offset`` (the GIL is released while the kernel copies).
    Raises ``OSError``."""
    view = memoryview(data).cast("B")
    done = 0
    while done < view.nbytes:
        done += os.pwrite(fd, view[done:], offset + done)


def owner_mapping(name: str, size: int) -> mmap.mmap:
    """The owner's shared mapping of a segment. Made through a descriptor of its own:
    mmap keeps a duplicate of the descriptor it is given, and a duplicate of the
    locked one would hold the exclusive lock for as long as the mapping lives. Raises
    ``OSError`` (``FileNotFoundError`` if the file is gone or no segment any more)."""
    fd, _ = open_segment(name, os.O_RDWR)
    try:
        # MAP_POPULATE maps every page in one call: far cheaper here than a fault per page
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    finally:
        os.close(fd)


def close_writer(writer: mmap.mmap) -> None:
    """Close an owner's mapping; one that a view still exports goes with that view."""
    try:
        writer.close()
    except BufferError:
        pass


def buffer_address(view: memoryview) -> int | None:
    """The address of ``view``'s first byte, or ``None`` when it cannot be told
    (numpy missing, a buffer numpy does not take)."""
    try:
        import numpy as np

        return int(np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0])
    except Exception:
        return None


def align(n: int) -> int:
    """``n`` rounded up to the alignment of a segment's buffers (64 bytes)."""
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def free_bytes() -> int:
    """Bytes free in ``/dev/shm`` (0 when that cannot be told)."""
    try:
        st = os.statvfs(SHM_DIR)
        return st.f_bavail * st.f_frsize
    except OSError:
        return 0


def segments_of(pid: int) -> list[str]:
    """Names of existing segments created by process ``pid``."""
    prefix = f"{PREFIX}{pid}-"
    try:
        return [n for n in os.listdir(SHM_DIR) if n.startswith(prefix)]
    except OSError:
        return []


def sweep(pid: int) -> int:
    """Remove the segments of a process that is gone; returns how many. Only this
    user's regular files go: the pid may come from a peer, and a file another user
    made under that name is not ours to remove."""
    removed = 0
    for name in segments_of(pid):
        try:
            path = segment_path(name)
            if is_own_file(os.lstat(path)):
                os.unlink(path)
                removed += 1
        except (OSError, ValueError):
            pass
    return removed


async def sweep_when_gone(pid: int, wait: float = 1.0) -> int:
    """Remove the segments of process ``pid`` once it has exited; a connection to it
    may close a moment before the process is gone, so look for up to ``wait`` seconds.
    Returns how many went (0 when it lives on: it removes its own when it exits)."""
    deadline = time.monotonic() + wait
    while not process_gone(pid):
        if time.monotonic() >= deadline:
            return 0
        await asyncio.sleep(0.05)  # polling: nothing signals another process's exit
    return sweep(pid)


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie counts as exited)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except Exception:  # includes NameError for open() during interpreter shutdown
        return False


def _refresh_euid() -> None:
    global _euid
    _euid = os.geteuid()


os.register_at_fork(after_in_child=_refresh_euid)
