"""What a task's outcome and a failed fetch become for the worker's reports: the
failure event of a task (its exception as it can travel, its traceback and text), a
small result sent inline with ``task-finished``, and whether a failed fetch is worth
another try."""

from __future__ import annotations

import errno
import traceback
from typing import Any

from ..errors import (
    AuthenticationError,
    CommBrokenError,
    CommError,
    CorruptedDataError,
    DeserializationError,
    HandshakeError,
    Reschedule,
    SerializationError,
    describe,
)
from ..comm.admission import OUT_OF_DESCRIPTORS
from ..protocol import SAME_PROCESS, serialize, to_serialize
from .events import ExecuteFailureEvent

__all__ = ["INLINE_MAX_BYTES", "MAX_RETRY_DELAY", "UNSENDABLE", "inline_value", "failure_event", "exception_for",
           "may_pass", "fetch_error", "nbytes_of"]


#: results up to this size travel to the scheduler (and on to the waiting client) with
#: the task-finished report: no second round trip to fetch them
INLINE_MAX_BYTES = 1024


def inline_value(value: Any, nbytes: int, destination: str) -> Any:
    if destination == SAME_PROCESS:
        return to_serialize(value)  # by reference: costs nothing, whatever its size
    if nbytes > 16 * INLINE_MAX_BYTES:  # a rough estimate: do not even try to pickle it
        return None
    try:
        s = serialize(value, destination)
    except Exception:
        return None  # the client will ask for it, and get the error then
    return s if s.nbytes <= 4 * INLINE_MAX_BYTES else None


def failure_event(stimulus_id: str, key: Any, exc: BaseException, destination: str) -> ExecuteFailureEvent:
    """The event of a task that raised ``exc`` (its function, or anything shoal did
    with its result): the exception as it can travel, its traceback and text, made
    whatever the exception's ``__str__`` or ``__reduce__`` do."""
    if isinstance(exc, Reschedule):  # nothing wrong with the task: it goes back
        return ExecuteFailureEvent(stimulus_id, key, None, "", describe(exc), reschedule=True)
    try:
        tb = "".join(traceback.format_exception(exc))
    except BaseException:  # noqa: BLE001 - formatting calls the exception's methods
        tb = ""
    return ExecuteFailureEvent(stimulus_id, key, exception_for(exc, destination), tb, describe(exc))


def exception_for(exc: BaseException, destination: str) -> Any:
    """The exception as it can travel to the client: the object in-process, else
    serialized now (so an unpicklable exception does not break the stream); ``None``
    when it cannot be (the client rebuilds it from its type name and text)."""
    if destination == SAME_PROCESS:
        return to_serialize(exc)
    try:
        return serialize(exc, destination)
    except Exception:
        return None


#: the longest pause between two attempts of one fetch
MAX_RETRY_DELAY = 2.0
#: errnos of a process out of resources: the operation that hit one may work later
_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})


def raised_while_importing(exc: BaseException) -> bool:
    """Whether ``exc`` came out of Python's import machinery (a module's import failed
    or ran into another's half-done initialization). Two threads of one process that
    import modules of a package with circular imports at the same moment (a task's
    thread unpickling its payload, the offload thread unpickling a fetched value, in a
    worker just started) can see each other's modules half initialized: Python breaks
    the deadlock that way, and the import raises ``ImportError: ... partially
    initialized module`` or a stray ``KeyError``. Done again a moment later, it works."""
    if isinstance(exc, ImportError) and "partially initialized module" in str(exc):
        return True
    # raised by a module's own code while it was imported (Python takes its import
    # machinery's frames out of tracebacks; the module's body stays)
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name == "<module>":
            return True
        tb = tb.tb_next
    return False


def may_pass(exc: BaseException) -> bool:
    """Whether a fetch that failed with ``exc`` may work if tried again soon: this
    process (or the peer, which then refuses the connection saying so, or drops it during
    its handshake) ran out of descriptors or memory, or the answer's bytes failed their
    checksums on the way (the peer's copy is likely fine), or unpickling it met another
    thread's half-done import (:func:`raised_while_importing`). Another refusal, a timeout
    (connecting waited already), a peer that broke off a request or a bad answer are not
    tried again."""
    if isinstance(exc, AuthenticationError):
        return False
    if isinstance(exc, HandshakeError) and OUT_OF_DESCRIPTORS in str(exc):
        return True
    if isinstance(exc, CorruptedDataError):
        return True
    if isinstance(exc, DeserializationError) and exc.__cause__ is not None and raised_while_importing(exc.__cause__):
        return True  # the value's module was half imported by another thread: done by the next try
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, MemoryError) or (isinstance(e, OSError) and e.errno in _OUT_OF_RESOURCES):
            return True
        e = e.__cause__ or e.__context__
    return isinstance(exc, HandshakeError) and isinstance(exc.__cause__, (CommBrokenError, ConnectionError))


def fetch_error(exc: BaseException, text: str) -> CommError:
    """The error the tasks that needed a fetched value see if this worker gives up on
    the fetch: of the fetch's own type (a :class:`CommError`), saying what was fetched."""
    cls = type(exc) if isinstance(exc, CommError) else CommError
    try:
        return cls(text)
    except Exception:  # a subclass with another signature
        return CommError(text)


#: the error type of a get-data answer whose values could not be serialized
UNSENDABLE = f"{SerializationError.__module__}.{SerializationError.__qualname__}"


def nbytes_of(frame: Any) -> int:
    return frame.nbytes if isinstance(frame, memoryview) else len(frame)
