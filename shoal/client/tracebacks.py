"""Traceback objects for tasks that erred in another process.

A worker sends the text of a failed task's traceback (``traceback.format_exception``);
``Future.traceback()`` returns a traceback object, as dask's does, so that
``traceback.format_tb``, ``traceback.print_tb`` and debuggers' frame walks work. In this
process the exception's own traceback is used; from elsewhere one is made from the text:
each frame is a frame of a tiny code object that carries the remote file name, function
name and line number (source lines show where the file exists here too). Frames made so
hold no local variables of the task.
"""

from __future__ import annotations

import linecache
import re
import sys
from types import TracebackType

__all__ = ["traceback_from_text"]

_HEADER = "Traceback (most recent call last):"
_FRAME = re.compile(r'^  File "(?P<file>.*)", line (?P<line>\d+), in (?P<name>.+)$')
#: frames beyond these are left out (the innermost are kept)
MAX_FRAMES = 200


class _Marker(Exception):
    """Raised by the code objects that stand for remote frames."""


def traceback_from_text(text: str | None) -> TracebackType | None:
    """A traceback object with the frames of the last traceback in ``text`` (the
    exception itself, not those it was raised while handling), or ``None`` when the
    text holds no frame."""
    if not text:
        return None
    block = text.rsplit(_HEADER, 1)[-1] if _HEADER in text else ""
    frames = []
    for line in block.splitlines():
        m = _FRAME.match(line)
        if m is not None:
            frames.append((m.group("file"), int(m.group("line")), m.group("name")))
    if not frames:
        return None
    head: TracebackType | None = None
    for filename, lineno, name in reversed(frames[-MAX_FRAMES:]):
        head = _one_frame(filename, lineno, name, head)
    return head


def _one_frame(filename: str, lineno: int, name: str, tb_next: TracebackType | None) -> TracebackType | None:
    """A traceback entry at ``filename:lineno`` in ``name``, followed by ``tb_next``."""
    # the raise sits on line ``lineno`` of a code object compiled as ``filename``; it is
    # as long as that line where the file exists here, so that the line is shown
    # without carets (they would point at columns of this raise, not of the line)
    marker = "__shoal_marker__"
    marker += "_" * max(len(linecache.getline(filename, lineno)) - len(marker), 0)
    source = "\n" * max(lineno - 1, 0) + "raise " + marker
    try:
        code = compile(source, filename, "exec").replace(co_name=name)
    except (SyntaxError, ValueError, OverflowError):  # a name or line it cannot stand for
        return tb_next
    try:
        exec(code, {marker: _Marker(), "__name__": "<remote>"})
    except _Marker:
        tb = sys.exc_info()[2]
    else:  # pragma: no cover - the code always raises
        return tb_next
    entry = tb.tb_next if tb is not None else None  # skip this function's own frame
    if entry is None:
        return tb_next
    entry.tb_next = tb_next
    return entry
