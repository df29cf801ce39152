"""Transport interfaces, the scheme registry, ``connect()`` and ``listen()``.

A :class:`Comm` moves *messages* (see :mod:`shoal.protocol`) between two endpoints; how
a message crosses is the comm's business: ``inproc://`` hands over the object itself,
``tcp://`` sends frames. Every comm starts with a handshake that tells each side who the
other is (protocol version, pid, host identity) and so which serialization destination
applies: ``same-process``, ``same-host`` or ``remote``.

Backends register by scheme with :func:`register_backend`; third-party ones are found
through the ``shoal.comm.backends`` entry-point group.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import os
import socket
import threading
from collections.abc import Awaitable, Callable
from importlib.metadata import entry_points
from typing import Any

from .. import config
from ..errors import AuthenticationError
from ..protocol import PROTOCOL_VERSION, REMOTE
from . import security as _security
from .security import Security

__all__ = [
    "Comm",
    "Listener",
    "Backend",
    "register_backend",
    "get_backend",
    "connect",
    "listen",
    "parse_address",
    "route_address",
    "local_info",
    "host_identity",
    "Handler",
]

logger = logging.getLogger("shoal.comm")

Handler = Callable[["Comm"], Awaitable[None]]


def _host_identity() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    # the device of /dev/shm: processes of one machine that mount a /dev/shm of their
    # own (containers, the test hosts of shoal.testhosts) share no segments either
    try:
        shm_dev = format(os.stat("/dev/shm").st_dev, "x")
    except OSError:
        shm_dev = ""
    return f"{socket.gethostname()}/{boot}/{shm_dev}"


_HOST_ID = _host_identity()


def host_identity() -> str:
    """This host's identity as the handshake carries it: ``<hostname>/<boot id>/<device
    of /dev/shm>`` (processes with the same identity share shared memory)."""
    return _HOST_ID


def local_info() -> dict[str, Any]:
    """The handshake this process sends: protocol version, pid, host identity."""
    return {"op": "handshake", "protocol": PROTOCOL_VERSION, "pid": os.getpid(), "host": _HOST_ID}


class Comm(abc.ABC):
    """One end of a bidirectional message channel.

    ``deserialize`` decides what a receiver gets for serialized values in a message:
    the objects (``True``) or :class:`~shoal.protocol.Serialized` values to forward
    untouched (``False``, what the scheduler uses).
    """

    local_address: str = ""
    peer_address: str = ""
    peer_info: dict[str, Any]
    destination: str = REMOTE
    #: the credentials this end proved when it connected (None: none, or inproc)
    security: Security | None = None

    def __init__(self, deserialize: bool = True):
        self.deserialize = deserialize
        self.peer_info = {}
        self.name: str = ""

    @abc.abstractmethod
    async def read(self) -> Any:
        """Return the next message.

        Raises :class:`~shoal.errors.CommClosedError` if this side closed the comm,
        :class:`~shoal.errors.CommBrokenError` if the peer closed or broke it,
        :class:`~shoal.errors.ProtocolError` if the peer sent bytes that are not a
        message (the comm is then aborted), and
        :class:`~shoal.errors.DeserializationError` if a well-framed message holds a
        value that cannot be deserialized here (the comm stays usable).
        """

    @abc.abstractmethod
    async def write(self, msg: Any) -> int:
        """Send one message; return the number of payload bytes sent.

        Raises :class:`~shoal.errors.SerializationError` before sending anything if a
        value cannot be serialized, :class:`~shoal.errors.CommClosedError` if this side
        closed the comm, :class:`~shoal.errors.CommBrokenError` if the peer broke it.
        """

    def write_nowait(self, msg: Any) -> bool:
        """Send one message without awaiting, if this transport can now: ``True`` when
        it took the message, ``False`` (and nothing done) when the caller must
        :meth:`write` instead. Raises like :meth:`write`. This default never can."""
        return False

    @abc.abstractmethod
    async def close(self) -> None:
        """Close gracefully: queued outgoing data is sent first. Never raises."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Close at once, dropping whatever is not yet sent. Never raises."""

    @abc.abstractmethod
    def closed(self) -> bool:
        """Whether this comm can no longer be used."""

    def set_idle_timeout(self, seconds: float) -> None:
        """Close this comm once a reader has waited ``seconds`` for a message that did
        not come (0: never). Transports whose peers cannot hold resources here (inproc)
        ignore it."""

    def receive_large_frames_into(self, allocate: Any, min_bytes: int) -> None:
        """Receive the out-of-band frames of at least ``min_bytes`` of later messages
        into buffers made by ``allocate(nbytes)`` (a writable buffer, or ``None`` for
        the usual one): a worker lands values from another host in shared memory this
        way. Transports that receive no frames (inproc) ignore it."""

    def __repr__(self) -> str:
        state = "closed" if self.closed() else "open"
        return f"<{type(self).__name__} {self.name} {self.local_address} -> {self.peer_address} {state}>"


class Listener(abc.ABC):
    """Accepts connections and runs ``handler(comm)`` for each, after the handshake."""

    #: the address this listener's own secret is registered under (see :func:`listen`)
    registered: str = ""
    #: what this listener tells connecting peers it is ("scheduler", "worker", ...)
    role: str = ""

    @abc.abstractmethod
    async def start(self) -> None:
        """Start listening. Raises ``OSError`` if the address cannot be bound."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop accepting connections. Comms already handed to the handler stay open."""

    @property
    @abc.abstractmethod
    def listen_address(self) -> str:
        """The address listened on, e.g. ``tcp://0.0.0.0:8786``."""

    @property
    @abc.abstractmethod
    def contact_address(self) -> str:
        """An address peers can connect to, e.g. ``tcp://127.0.0.1:8786``."""

    async def __aenter__(self) -> Listener:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.stop()


class Backend(abc.ABC):
    """A transport: how to connect to and listen on addresses of one scheme."""

    @abc.abstractmethod
    async def connect(self, location: str, deserialize: bool, timeout: float,
                      security: Security | None = None, *, role: str = "client",
                      expect: str | None = None) -> Comm:
        """Return a connected comm whose handshake is done, or raise
        :class:`~shoal.errors.CommConnectError` / :class:`~shoal.errors.HandshakeError`.
        ``security``: the credentials to prove (None: none known); ``role``: what this
        end tells the peer it is; ``expect``: the role the peer must prove (None: any)."""

    @abc.abstractmethod
    def listener(self, location: str, handler: Handler, deserialize: bool,
                 security: Security | None = None) -> Listener:
        """Return an unstarted listener for ``location`` that admits only peers that
        prove ``security``'s secret (``Security.disabled()``: anyone)."""


_backends: dict[str, Backend] = {}
_backends_lock = threading.Lock()


def register_backend(scheme: str, backend: Backend) -> None:
    """Make ``scheme://`` addresses use ``backend``."""
    with _backends_lock:
        _backends[scheme] = backend


def get_backend(scheme: str) -> Backend:
    """The backend for ``scheme``, loading ``shoal.comm.backends`` entry points if
    needed. Raises ``ValueError`` for a scheme nobody provides."""
    with _backends_lock:
        backend = _backends.get(scheme)
    if backend is not None:
        return backend
    for ep in entry_points(group="shoal.comm.backends"):
        if ep.name == scheme:
            obj = ep.load()
            backend = obj() if isinstance(obj, type) else obj
            register_backend(scheme, backend)
            return backend
    raise ValueError(f"unknown comm scheme {scheme!r}; known: {sorted(_backends)}")


def parse_address(address: str) -> tuple[str, str]:
    """``"tcp://host:port"`` -> ``("tcp", "host:port")``; no scheme means ``tcp``."""
    if not isinstance(address, str):
        raise TypeError(f"an address is a string, got {type(address).__name__}")
    scheme, sep, location = address.partition("://")
    if not sep:
        return "tcp", address
    return scheme, location


def route_address(address: str) -> str:
    """The address of this host's interface that routes to ``address``'s host (a
    datagram socket's connect looks the route up: nothing is sent). Raises ``OSError``
    when there is no route, ``ValueError`` for an address without a host."""
    location = parse_address(address)[1]
    host, _, port = location.rpartition(":")
    host = host.strip("[]")
    if not host:
        raise ValueError(f"no host in address {address!r}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, int(port) if port.isdigit() else 9))
        return str(s.getsockname()[0])


async def connect(address: str, timeout: float | None = None, deserialize: bool = True,
                  security: Security | None = None, *, role: str = "client", expect: str | None = None) -> Comm:
    """Connect to ``address`` and complete the handshake, proving ``security``'s
    secret (default: what :func:`shoal.comm.security.for_address` finds), as a
    ``role`` (``"client"``, ``"worker"``, ...) to a peer that must prove to be
    ``expect`` (``"scheduler"``, ...; None: any role).

    Retries refused connections until ``timeout`` (default: the ``connect-timeout``
    setting). Raises :class:`~shoal.errors.CommConnectError` when it gives up and
    :class:`~shoal.errors.HandshakeError` for a peer that refuses us or that we refuse
    (another protocol version, a secret that does not match).
    """
    scheme, location = parse_address(address)
    backend = get_backend(scheme)
    timeout = config.get("connect-timeout") if timeout is None else timeout
    if security is not None or scheme == "inproc":
        comm = await backend.connect(location, deserialize, timeout, security, role=role, expect=expect)
        comm.security = security
        return comm
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    delay = 0.01
    while True:
        found = _security.for_address(address)  # looked for again at each try
        try:
            comm = await backend.connect(location, deserialize, max(deadline - loop.time(), 0.001), found,
                                         role=role, expect=expect)
        except AuthenticationError:
            # a scheduler that is starting writes its auth file just after it listens:
            # look again until the deadline
            if found is not None or loop.time() + delay >= deadline:
                raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.25)
            continue
        comm.security = found
        return comm


async def listen(address: str, handler: Handler, deserialize: bool = True,
                 security: Security | None = None, *, role: str = "") -> Listener:
    """Listen on ``address`` (``tcp://127.0.0.1:0`` and ``inproc://`` pick a free one)
    and run ``await handler(comm)`` for every connection, after its handshake.

    Only peers that prove ``security``'s secret get through. With ``security=None``:
    the secret this process was given (``SHOAL_AUTH`` / ``SHOAL_AUTH_FILE``), else a
    random one, known to this process only; either is registered for the listener's
    address, so that this process's own connections find it. ``Security.disabled()``
    admits anyone.

    ``role`` is what the listener tells connecting peers it is (``"scheduler"``, ...).

    Returns the started :class:`Listener`. Raises ``OSError`` if the address is taken.
    """
    scheme, location = parse_address(address)
    own = security is None and scheme != "inproc"
    if own:
        security = _security.from_environment() or Security(None, **_security.tls_from_environment())
    listener = get_backend(scheme).listener(location, handler, deserialize, security)
    listener.role = role
    await listener.start()
    if own:
        assert security is not None
        _security.register(listener.contact_address, security)
        listener.registered = listener.contact_address
    return listener


async def run_handler(handler: Handler, comm: Comm) -> None:
    """Run a listener's handler; log what it raises and make sure the comm is closed."""
    try:
        await handler(comm)
    except asyncio.CancelledError:
        comm.abort()
        raise
    except Exception:
        logger.exception("handler for %r failed", comm)
        comm.abort()
