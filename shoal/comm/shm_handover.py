"""Shared-memory segments that change hands between processes of one host.

A process that keeps a received value serialized (a scheduler with a task's payload)
*adopts* the transfer segment the value came in (:func:`adopt_segment`: renamed to a
name of its own) and, when it drops the value, *gives it back* to the process that made
it if that process is one it serves (:data:`return_to`), which takes it into its pool
(:func:`reclaim_returned`) and reuses the pages for its next transfers. A worker that
keeps a scattered value's transfer segment turns it into a value segment that others
map without it (:func:`describe_kept`). The file rules are those of :mod:`.shm_files`,
and each step is one of the registry's (:class:`.shm_registry.SegmentRegistry`: adopt,
give back, reclaim); see docs/protocol.md, §4.8 *Adoption* and §8.2.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

from .shm import SegmentInfo, locate, registry, unlink
from .shm_files import (
    HEADER,
    PREFIX,
    SHM_DIR,
    is_own_file,
    open_segment,
    process_gone,
    pwrite_all,
    segment_header,
    segment_path,
)

__all__ = ["return_to", "adopt_segment", "give_back_later", "reclaim_returned", "describe_kept"]

#: processes of this host that may get back the transfer segments they handed over
#: to this one (the clients of a scheduler: :func:`give_back_later`)
return_to: set[int] = set()


def adopt_segment(name: str, token: str) -> str | None:
    """Make another process's transfer segment this process's own: rename it to a
    name of ours (its sender then cannot remove it) and mark it a value segment (no
    peer can hand it over again); the new name, or ``None`` if it is gone, holds
    something else than generation ``token`` of a transfer segment (a value segment's
    owner keeps it) or is no segment of this user (see :func:`.shm_files.open_segment`)."""
    try:
        fd, _ = open_segment(name, os.O_RDWR)
    except (OSError, ValueError):
        return None
    try:
        if os.pread(fd, HEADER, 0) != segment_header(token, transfer=True):
            return None
        new = registry.adopt(name)
        try:
            pwrite_all(fd, segment_header(token), 0)
        except OSError:
            unlink(new)
            raise
    except OSError:
        return None
    finally:
        os.close(fd)
    return new


def give_back_later(name: str, sender: int | None) -> None:
    """An adopted segment is not needed here any more: give it back to the process
    that made it (renamed ``shoal-<sender>-ret...``, for it to reuse) if that process
    is in :data:`return_to`, else remove it. Only queued (a finalizer calls it): done
    at the next call into the pool (:func:`.shm.later`)."""
    registry.later(_give_back, name, sender)


def _give_back(name: str, sender: int | None) -> None:
    if sender is not None and sender in return_to and not process_gone(sender) and registry.give_back(name, sender):
        return
    unlink(name)


def describe_kept(value: Any) -> SegmentInfo | None:
    """A value this process received in a transfer segment and kept (a worker's
    scattered value): when all its buffers lie in that one segment and its pickle
    stream fits in front of them, write the stream there (offset 64) and return the
    segment info that lets any same-host process map the value without this one;
    else ``None``."""
    buffers: list[pickle.PickleBuffer] = []
    try:
        data = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    except KeyboardInterrupt:
        raise
    except BaseException:  # noqa: BLE001 - a __reduce__ may raise anything: keep it as it is
        return None
    spans: list[list[int]] = []
    segment = None
    for b in buffers:
        where = locate(b.raw())
        if where is None or (segment is not None and where[0] != segment[0]):
            return None
        segment = where
        spans.append([where[2], where[3]])
    if segment is None or registry.state(segment[0]) is None or HEADER + len(data) > min(o for o, _ in spans):
        return None
    name, size, _, _, token = segment
    try:
        fd, _ = open_segment(name, os.O_WRONLY)
        try:
            pwrite_all(fd, data, HEADER)
        finally:
            os.close(fd)
    except OSError:
        return None
    return [name, size, len(data), spans, token]


def reclaim_returned() -> int:
    """Take the segments other processes gave back to this one into its pool (as
    retired segments: reused once nobody maps them); returns how many."""
    prefix = f"{PREFIX}{os.getpid()}-ret"
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith(prefix)]
    except OSError:
        return 0
    taken = 0
    for name in names:
        try:
            # anyone may make a file by such a name: take only this user's regular ones
            st = os.lstat(segment_path(name))
            if not is_own_file(st):
                continue
        except (OSError, ValueError):
            continue
        # into the pool, or removed if the pool is full
        taken += registry.reclaim(name, st.st_size)
    return taken


os.register_at_fork(after_in_child=return_to.clear)  # a forked child serves no one
