"""A worker's values: in its own memory, or in shared-memory segments it owns.

``WorkerStore`` is the mapping the worker state machine reads and writes. A value the
worker placed in shared memory is kept as its segment-backed copy (so its memory is
counted once, in the segment) and the segment is unlinked when the key is deleted.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import Any

from ..comm import shm
from ..protocol.messages import Key

__all__ = ["WorkerStore"]


class WorkerStore(MutableMapping[Key, Any]):
    def __init__(self) -> None:
        self._data: dict[Key, Any] = {}
        #: key -> the segment this worker placed the value in
        self.segments: dict[Key, shm.Segment] = {}
        self._expected: dict[Key, shm.Segment] = {}

    def __getitem__(self, key: Key) -> Any:
        return self._data[key]

    def __setitem__(self, key: Key, value: Any) -> None:
        self._drop_segment(key)
        self._data[key] = value
        seg = self._expected.pop(key, None)
        if seg is not None:
            self.segments[key] = seg

    def expect(self, key: Key, segment: shm.Segment) -> None:
        """The next value stored under ``key`` lives in ``segment``: own it from then."""
        self._expected[key] = segment

    def unexpect(self, key: Key) -> None:
        """The value announced by :meth:`expect` was not stored: remove its segment."""
        seg = self._expected.pop(key, None)
        if seg is not None:
            seg.unlink()

    def __delitem__(self, key: Key) -> None:
        del self._data[key]
        self._drop_segment(key)

    def _drop_segment(self, key: Key) -> None:
        seg = self.segments.pop(key, None)
        if seg is not None:
            seg.retire()  # reused for a later value once nobody maps it

    def __iter__(self) -> Iterator[Key]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def clear(self) -> None:
        self._data.clear()
        for seg in [*self.segments.values(), *self._expected.values()]:
            seg.unlink()
        self.segments.clear()
        self._expected.clear()
        shm.drain_pool()

    def segment_info(self, key: Key) -> list[Any] | None:
        seg = self.segments.get(key)
        return None if seg is None else seg.info
