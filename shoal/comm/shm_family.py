"""The ``shoal.same-host`` serializer family: to a peer that maps this host's shared
memory, a buffer that already lies in a segment travels as a reference to it, and a
large private buffer through a transfer segment made for that one message (with a
lease, unlinked by the receiver). Registered when :mod:`shoal.comm` is imported.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Sequence
from typing import Any

from .shm import (
    _HEADER,
    ShmUnavailable,
    _align,
    _fill_segment,
    _path,
    enabled,
    locate,
    map_segment,
    unlink,
)

__all__ = ["TRANSFER_MIN_BYTES", "shm_bytes"]


#: private buffers at least this large cross to a same-host peer through a new segment
TRANSFER_MIN_BYTES = 1 << 20


def _same_host_dumps(obj: Any, destination: str) -> tuple[dict[str, Any], list[Any]]:
    """Pickle 5. A buffer that already lives in a segment travels as (name, size,
    offset, length). A large private buffer is copied into a segment of its own that the
    receiver maps and then unlinks (flag 1); a lease removes it should the receiver never
    get it. Small buffers travel as frames."""
    from ..protocol import leases
    from ..protocol.serialize import pickle_dumps

    buffers: list[pickle.PickleBuffer] = []
    data = pickle_dumps(obj, buffer_callback=buffers.append)
    refs: list[Any] = []
    frames: list[Any] = [data]
    use = enabled()
    for b in buffers:
        raw = b.raw()
        where = locate(raw) if use else None
        if where is not None and not os.path.exists(_path(where[0])):
            where = None  # its name was removed: a receiver could not map it
        if where is not None:
            name, size, offset, length, token = where
            refs.append([name, size, offset, length, 0, token])
        elif use and raw.nbytes >= TRANSFER_MIN_BYTES and leases.active():
            try:
                name, size, token = _segment_for_buffer(raw)
            except ShmUnavailable:
                refs.append(None)
                frames.append(raw)
                continue
            leases.lease(lambda name=name: unlink(name))
            refs.append([name, size, _HEADER, raw.nbytes, 1, token])
        else:
            refs.append(None)
            frames.append(raw)
    return ({"refs": refs} if any(r is not None for r in refs) else {}), frames


def _segment_for_buffer(raw: memoryview) -> tuple[str, int, str]:
    """A new segment holding a copy of ``raw``; returns (name, size, token)."""
    # the receiver unlinks it: the owner keeps no mapping of it
    return _fill_segment(_align(_HEADER + raw.nbytes), [(_HEADER, raw)], keep=False)


def _same_host_loads(header: dict[str, Any], frames: Sequence[Any]) -> Any:
    refs = header.get("refs")
    if not refs:
        return pickle.loads(frames[0], buffers=frames[1:])
    buffers: list[Any] = []
    it = iter(frames[1:])
    for ref in refs:
        if ref is None:
            buffers.append(next(it))
        else:
            name, size, offset, length, flag, token = ref
            view = map_segment(name, int(size), str(token))
            buffers.append(view[int(offset) : int(offset) + int(length)])
            if flag == 1:
                # a transfer: the mapping is ours now; the name is not needed any more
                try:
                    os.unlink(_path(name))
                except FileNotFoundError:
                    pass
    return pickle.loads(frames[0], buffers=buffers)


def shm_bytes(obj: Any) -> int:
    """Bytes of ``obj``'s buffers that live in segments (what a same-host peer maps)."""
    buffers: list[pickle.PickleBuffer] = []
    try:
        pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    except Exception:
        return 0
    total = 0
    for b in buffers:
        raw = b.raw()
        if locate(raw) is not None:
            total += raw.nbytes
    return total


def _register_family() -> None:
    from ..protocol import SAME_HOST, register_serializer

    register_serializer(object, _same_host_dumps, _same_host_loads, destinations=[SAME_HOST],
                        name="shoal.same-host")


_register_family()
