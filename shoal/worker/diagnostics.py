"""What a worker notes for the dashboard and the task stream: the bytes moved by path
(by reference in this process, mapped from shared memory, over tcp), the inputs that
moved here (from which peer, by which path, how many bytes, when), handed to the first
task that uses them, and the process's CPU use between two reports.

An input that arrived is noted once, and taken by the first task to run with it: the
task stream draws each transfer once, before the task that waited for it. Arrivals
that no task takes (the task was cancelled) are dropped oldest first past
:data:`KEEP`, so the notes stay bounded.
"""

from __future__ import annotations

from typing import Any

from .. import config
from ..comm import shm_family
from ..protocol.messages import SegmentRef
from ..protocol import SAME_HOST, SAME_PROCESS, Serialize, Serialized
from .outcomes import nbytes_of
from ..taskspec import RunSpec

__all__ = ["Arrivals", "CpuMeter", "Traffic", "KEEP", "PATHS", "key_text"]

#: the paths a value moves by
PATHS = ("inproc", "shm", "tcp")

#: arrivals kept for tasks yet to run, at most
KEEP = 10_000
#: the longest key text sent for the task stream (a key is shown, never looked up by it)
KEY_TEXT = 200


def key_text(key: Any) -> str:
    """``key`` as the dashboard shows it (bounded)."""
    text = key if type(key) is str else str(key)
    return text if len(text) <= KEY_TEXT else text[: KEY_TEXT - 3] + "..."


class Arrivals:
    """Inputs moved to this worker, until a task takes them (see the module)."""

    def __init__(self, keep: int = KEEP) -> None:
        self.keep = keep
        self._notes: dict[Any, tuple[str, str, int, str, float, float]] = {}

    def note(self, nbytes: dict[Any, int], source: str, path: str, start: float, stop: float) -> None:
        """Keys of ``nbytes`` arrived from ``source`` by ``path`` between ``start`` and
        ``stop`` (epoch seconds)."""
        notes = self._notes
        for key, n in nbytes.items():
            notes[key] = (key_text(key), source, int(n), path, start, stop)
        while len(notes) > self.keep:
            del notes[next(iter(notes))]

    def take(self, keys: Any) -> list[tuple[str, str, int, str, float, float]]:
        """The arrivals of ``keys`` (forgotten here: they are reported once)."""
        notes = self._notes
        if not notes:
            return []
        return [n for k in keys if (n := notes.pop(k, None)) is not None]

    def __len__(self) -> int:
        return len(self._notes)


def mapped_bytes(destination: str, values: dict[Any, Any], nbytes: dict[Any, int]) -> int:
    """Bytes of the buffers of ``values`` (by key; ``nbytes``: their sizes) that lie in
    shared memory, which a comm to ``destination`` has a same-host peer map.

    Finding them pickles a value (its buffers out of band), so only values of at least
    ``shm-threshold`` (or 64 KiB) bytes are looked into, as the store does: nothing
    smaller is placed in a segment, nor sent through one. Pickling every value a
    worker served or fetched cost a shuffle's small frames as much as sending them."""
    if destination != SAME_HOST:
        return 0
    least = min(int(config.get("shm-threshold")), 1 << 16)
    return sum(shm_family.shm_bytes(v) for k, v in values.items() if nbytes.get(k, least) >= least)


def moved_by_path(destination: str, nbytes: int, mapped: int = 0) -> dict[str, int]:
    """``nbytes`` that crossed a comm to ``destination``, by path: ``mapped`` of them
    (:func:`mapped_bytes`) were mapped from shared memory, the rest went in frames."""
    if destination == SAME_PROCESS:
        return {"inproc": nbytes}
    return {"shm": mapped, "tcp": max(nbytes - mapped, 0)}


def path_of(destination: str, mapped: int) -> str:
    """How values that came over a comm to ``destination`` travelled (one word),
    ``mapped`` bytes of them from shared memory."""
    if destination == SAME_PROCESS:
        return "inproc"
    return "shm" if mapped else "tcp"


class Traffic:
    """The bytes a worker moved, by path. ``moved``: what it served to others and
    what was pushed to it (scatter, task arguments, mapped inputs), the figures of
    ``transfer_stats``; ``sent``: the part of ``moved`` it served; ``received``: what
    it fetched from peers (counted in their ``moved``)."""

    def __init__(self) -> None:
        self.moved = dict.fromkeys(PATHS, 0)
        self.sent = dict.fromkeys(PATHS, 0)
        self.received = dict.fromkeys(PATHS, 0)
        self.arrivals = Arrivals()

    @staticmethod
    def _add(counts: dict[str, int], moved: dict[str, int]) -> None:
        for path, n in moved.items():
            counts[path] += n

    def pushed(self, destination: str, nbytes: dict[Any, int], values: dict[Any, Any]) -> None:
        """``values`` (by key, of sizes ``nbytes``) were pushed here (scattered)."""
        mapped = mapped_bytes(destination, values, nbytes)
        self._add(self.moved, moved_by_path(destination, sum(nbytes.values()), mapped))

    def served(self, destination: str, nbytes: dict[Any, int], values: dict[Any, Any]) -> None:
        """Values of sizes ``nbytes`` (by key) were served to a peer; ``values``: those
        of them whose buffers may lie in shared memory (the others went in frames)."""
        moved = moved_by_path(destination, sum(nbytes.values()), mapped_bytes(destination, values, nbytes))
        self._add(self.moved, moved)
        self._add(self.sent, moved)

    def fetched(self, destination: str, nbytes: dict[Any, int], values: dict[Any, Any], source: str,
                start: float, stop: float) -> None:
        """``values`` (by key, of sizes ``nbytes``) came from peer ``source``."""
        mapped = mapped_bytes(destination, values, nbytes)
        self._add(self.received, moved_by_path(destination, sum(nbytes.values()), mapped))
        self.arrivals.note(nbytes, source, path_of(destination, mapped), start, stop)

    def mapped(self, nbytes: dict[Any, int], now: float) -> None:
        """Inputs mapped from same-host peers' segments (no peer involved)."""
        self.moved["shm"] += sum(nbytes.values())
        self.arrivals.note(nbytes, "", "shm", now, now)

    def payload(self, payload: Any) -> None:
        """A task's arguments count as moved: by reference (in this process), or their
        buffers mapped, or in frames over tcp."""
        if type(payload) is Serialize and type(payload.data) is RunSpec:
            self.moved["inproc"] += payload.data.nbytes
            return
        if type(payload) is not Serialized or payload.family != "shoal.runspec":
            return
        refs = payload.header.get("refs") if isinstance(payload.header, dict) else None
        if isinstance(refs, list):
            for ref in refs:
                if ref is not None:
                    try:
                        self.moved["shm"] += SegmentRef.parse(ref).length
                    except ValueError:
                        pass  # running the task says what is wrong with it
        self.moved["tcp"] += sum(nbytes_of(f) for f in payload.frames[2:])

    def report(self) -> dict[str, dict[str, int]]:
        """Bytes moved into and out of this worker so far, by path."""
        return {"transfers_in": {p: self.moved[p] - self.sent[p] + self.received[p] for p in PATHS},
                "transfers_out": dict(self.sent)}


class CpuMeter:
    """Percent of one core this process used since the last reading."""

    def __init__(self) -> None:
        self._process: Any = None
        try:
            import psutil

            self._process = psutil.Process()
            self._process.cpu_percent(None)  # the first reading starts the interval
        except Exception:  # noqa: BLE001 - no psutil reading here: report 0
            self._process = None

    def read(self) -> float:
        if self._process is None:
            return 0.0
        try:
            return float(self._process.cpu_percent(None))
        except Exception:  # noqa: BLE001 - the reading failed (out of descriptors): 0 this time
            return 0.0
