"""shoal's one error hierarchy.

::

    ShoalError
    ├── CommError                  a transport failed
    │   ├── CommClosedError        we closed this comm (or it was closed by our side)
    │   ├── CommBrokenError        the peer or the network broke it
    │   ├── CommConnectError       could not connect (refused, no listener, timed out)
    │   ├── ProtocolError          the peer sent bytes that break the wire protocol
    │   └── HandshakeError         the peer is not a compatible shoal endpoint
    │       └── AuthenticationError  the ends do not share the cluster's secret
    ├── SerializationError         a value cannot be serialized (raised before sending)
    ├── DeserializationError       received bytes cannot be turned back into a value
    │   └── CorruptedDataError     a value's bytes do not match the checksum written with
    │                              them (a spill file, a frame, a segment): not used
    ├── GraphError (ValueError)    a task graph is malformed (cycle, unknown key), or
    │                              cannot be right on this cluster (dask's "disk"
    │                              shuffle on workers of several hosts)
    ├── InvalidKeyError            a task key the wire cannot carry (TypeError and
    │                              ValueError: wrong type, NaN, out of range, too deep)
    ├── KilledWorker               a task was running on too many workers that died
    ├── LostDataError              a value that cannot be recomputed was lost
    │   └── RunOnceError           a task that may run only once would have had to run
    │                              again (dask's "disk" shuffle after a worker was lost)
    ├── CancelledError             the future's task was cancelled (also a
    │                              concurrent.futures.CancelledError)
    ├── ShuffleError               shoal's shuffle cannot go on (a split's value is
    │                              gone from a worker that should hold it, bad output
    │                              numbers)
    ├── Reschedule                 raised by a task: not an error; the task goes back
    │                              to the scheduler, which runs it again
    └── RemoteError                a remote handler failed and its exception could not
                                   be reconstructed as its own type

Errors raised by a backend (``OSError``, ``msgpack`` exceptions, ...) are translated at
the boundary into one of these, with the original kept as ``__cause__``.

User objects may raise anywhere, also while an error about them is being written:
:func:`describe` and :func:`short_repr` make text of an exception or an object whatever
their ``__str__``/``__repr__`` do.
"""

from __future__ import annotations

import concurrent.futures

__all__ = [
    "ShoalError",
    "CommError",
    "CommClosedError",
    "CommBrokenError",
    "CommConnectError",
    "ProtocolError",
    "HandshakeError",
    "AuthenticationError",
    "SerializationError",
    "DeserializationError",
    "CorruptedDataError",
    "RemoteError",
    "GraphError",
    "InvalidKeyError",
    "KilledWorker",
    "LostDataError",
    "RunOnceError",
    "CancelledError",
    "ShuffleError",
    "Reschedule",
    "describe",
    "short_repr",
]


class ShoalError(Exception):
    """Base class of every error shoal raises on its own account."""


class CommError(ShoalError):
    """A transport failed; the comm it happened on is unusable."""


class CommClosedError(CommError):
    """The comm was closed by our own side (``close()``/``abort()``) before or during use."""


class CommBrokenError(CommError):
    """The peer closed the connection or the network broke it."""


class CommConnectError(CommError):
    """No connection could be made (nothing listens there, refused, or timed out)."""


class ProtocolError(CommError):
    """The peer sent data that violates the wire protocol (garbage, oversized lengths...)."""


class HandshakeError(CommError):
    """The peer did not complete a compatible handshake (e.g. another protocol version)."""


class AuthenticationError(HandshakeError):
    """The two ends do not share the cluster's secret (or one of them has none)."""


class SerializationError(ShoalError, TypeError):
    """A value cannot be serialized for its destination.

    The message names the value's type and where it sits in the message, for example
    ``cannot serialize '_thread.lock' at args[1]['lock']``.
    """


class DeserializationError(ShoalError):
    """Received bytes could not be turned back into a value (the cause is attached)."""


class CorruptedDataError(DeserializationError):
    """The bytes of a value are not those that were written: a spill file, a frame
    received over tcp or a shared-memory segment does not match the checksum written
    with it, or a spill file is cut short or unreadable. The value is never used: it is
    fetched again or computed again, and this error reaches a caller only when neither
    can be done. The message names the value's key or its file where they are known."""


class RemoteError(ShoalError):
    """A remote call failed with an exception that could not be rebuilt locally.

    ``remote_type`` names the remote exception's type and ``remote_traceback`` holds the
    formatted traceback from the remote side.
    """

    def __init__(self, message: str, remote_type: str = "", remote_traceback: str = ""):
        super().__init__(message)
        self.remote_type = remote_type
        self.remote_traceback = remote_traceback


class GraphError(ShoalError, ValueError):
    """A task graph is malformed (a cycle, a reference to an unknown key, a bad key),
    or would not be right on this cluster (dask's "disk" shuffle on workers of several
    hosts)."""


class KilledWorker(ShoalError):
    """A task was running on workers that died, too many times; it is not retried."""


class LostDataError(ShoalError):
    """A value placed on workers directly (``scatter``) was lost with its last worker."""


class RunOnceError(LostDataError):
    """A task that may run only once (its graph said so, and why) would have had to run
    again: its worker died or left while it ran, or its value was lost and is needed
    again. It errs instead, and so does everything built on it; the error says why the
    task may not run twice (dask's "disk" shuffle: a split run again would append its
    rows again)."""


class CancelledError(ShoalError, concurrent.futures.CancelledError):
    """The task of this future was cancelled."""


class ShuffleError(ShoalError):
    """shoal's shuffle cannot go on: a worker that should hold a split of its input
    does not, or a row's output partition is out of range."""


class Reschedule(ShoalError):
    """Raised by a task to give itself back to the scheduler, which runs it again
    (where and when it decides): what a task does when something it needs is not
    ready yet and will be (shoal's shuffle, when a worker holding its input is gone)."""


class InvalidKeyError(ShoalError, TypeError, ValueError):
    """A task key the wire cannot carry: not a str, bytes, int, float or tuple of these
    (a ``TypeError``), or a value of those types that is no key (a ``ValueError``: a
    NaN or infinite float, an int beyond 64 bits, a str that is not valid Unicode, tuples
    nested too deep). Both bases, so that either ``except`` catches it."""


def describe(exc: BaseException) -> str:
    """``"Type: message"`` of ``exc``, even when its ``__str__`` raises or returns no str."""
    try:
        text = str(exc)
    except BaseException as inner:  # noqa: BLE001 - a user's __str__ may raise anything
        text = f"<str() of the exception raised {type(inner).__name__}>"
    name = type(exc).__qualname__
    return f"{name}: {text}" if text else name


def short_repr(obj: object, limit: int = 80) -> str:
    """``repr(obj)``, cut to ``limit`` characters, even when the object's ``__repr__``
    raises or recurses forever."""
    try:
        text = repr(obj)
    except BaseException as exc:  # noqa: BLE001 - a user's __repr__ may raise anything
        return f"<{type(obj).__qualname__} whose repr raised {type(exc).__name__}>"
    if not isinstance(text, str):
        return f"<{type(obj).__qualname__}>"
    return text if len(text) <= limit else text[:limit] + "..."
