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


def moved_by_path(destination: str, nbytes: int, values: Any = ()) -> dict[str, int]:
    """``nbytes`` of ``values`` that crossed a comm to ``destination``, by path: the
    buffers of values in shared memory were mapped, the rest went in frames."""
    if destination == SAME_PROCESS:
        return {"inproc": nbytes}
    mapped = sum(shm_family.shm_bytes(v) for v in values) if destination == SAME_HOST else 0
    return {"shm": mapped, "tcp": max(nbytes - mapped, 0)}


def path_of(destination: str, values: Any) -> str:
    """How values that came over a comm to ``destination`` travelled (one word)."""
    if destination == SAME_PROCESS:
        return "inproc"
    if destination == SAME_HOST and any(shm_family.shm_bytes(v) for v in values):
        return "shm"
    return "tcp"


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

    def pushed(self, destination: str, nbytes: int, values: Any = ()) -> None:
        self._add(self.moved, moved_by_path(destination, nbytes, values))

    def served(self, destination: str, nbytes: int, values: Any = ()) -> None:
        moved = moved_by_path(destination, nbytes, values)
        self._add(self.moved, moved)
        self._add(self.sent, moved)

    def fetched(self, destination: str, nbytes: dict[Any, int], values: Any, source: str, start: float,
                stop: float) -> None:
        self._add(self.received, moved_by_path(destination, sum(nbytes.values()), values))
        self.arrivals.note(nbytes, source, path_of(destination, values), start, stop)

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
