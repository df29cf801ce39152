"""Request/response over comms: a server dispatching on ``op``, proxies, errors.

Request: ``{"op": NAME, "reply": True, **arguments}``.
Response: ``{"status": "OK", "result": value}`` or ``{"status": "error", "type":
"module.Name", "message": str, "traceback": str, "exception": <serialized exception or
None>}``.

A connection carries one request at a time; concurrency comes from the pool opening more
connections. A handler listed in ``stream_handlers`` takes the comm over for good (a
long-lived stream of batched messages, e.g. worker to scheduler).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import traceback
from collections.abc import Callable
from typing import Any

from .. import config
from ..comm import Comm, Listener, listen
from ..comm.security import Security
from ..errors import (
    ProtocolError,
    CommBrokenError,
    CommClosedError,
    CommError,
    DeserializationError,
    RemoteError,
    SerializationError,
    describe,
)
from ..protocol import Serialize, Serialized, to_serialize
from ..protocol.messages import Msg, decode

__all__ = ["Server", "error_message", "raise_error_message", "request", "result_of", "send_recv"]

logger = logging.getLogger("shoal.rpc")

HandlerFn = Callable[..., Any]

_PLAIN_RESULTS = frozenset({type(None), bool, int, float, str, bytes, list, tuple, dict})


def error_message(exc: BaseException, with_exception: bool = True) -> dict[str, Any]:
    """The response that carries ``exc`` (its type, text, traceback, and the object)."""
    typ = type(exc)
    try:
        tb = "".join(traceback.format_exception(exc))
    except BaseException:  # noqa: BLE001 - formatting calls the exception's own methods
        tb = ""
    text = describe(exc)
    return {
        "status": "error",
        "type": f"{typ.__module__}.{typ.__qualname__}",
        "message": text.partition(": ")[2] if text.startswith(typ.__qualname__ + ": ") else text,
        "traceback": tb,
        "exception": to_serialize(exc) if with_exception else None,
    }


def raise_error_message(msg: dict[str, Any]) -> None:
    """Raise the exception an error response carries: the original type when it could
    be rebuilt here, else :class:`RemoteError`; the remote traceback is added as a note."""
    exc = msg.get("exception")
    if isinstance(exc, Serialize):
        exc = exc.data
    tb = msg.get("traceback") or ""
    if not isinstance(exc, BaseException) or isinstance(exc, Serialized):
        exc = RemoteError(f"{msg.get('type')}: {msg.get('message')}", str(msg.get("type")), tb)
    if tb and hasattr(exc, "add_note"):
        note = "remote traceback:\n" + tb
        if note not in getattr(exc, "__notes__", ()):
            exc.add_note(note)
    raise exc


async def request(comm: Comm, op: str, **kwargs: Any) -> dict[str, Any]:
    """Send one request on ``comm`` and return the raw response map."""
    await comm.write({"op": op, "reply": True, **kwargs})
    response = await comm.read()
    if not isinstance(response, dict) or "status" not in response:
        comm.abort()
        raise CommBrokenError(f"malformed response from {comm.peer_address}: {_short(response)}")
    return response


def result_of(response: dict[str, Any]) -> Any:
    """The result a response carries, or raise the error it carries."""
    if response.get("status") == "OK":
        return response.get("result")
    raise_error_message(response)


async def send_recv(comm: Comm, op: str, **kwargs: Any) -> Any:
    """Send one request on ``comm`` and return the result (or raise the remote error)."""
    return result_of(await request(comm, op, **kwargs))


class Server:
    """Serves handlers by op name on one or more listeners.

    ``handlers[op](comm, **arguments)`` returns the result (sync or async).
    ``stream_handlers[op](comm, **arguments)`` takes the comm over; the server stops
    reading it.
    """

    def __init__(
        self,
        handlers: dict[str, HandlerFn],
        stream_handlers: dict[str, HandlerFn] | None = None,
        deserialize: bool = True,
        name: str = "",
        security: Security | None = None,
        schemas: dict[str, type[Msg]] | None = None,
        role: str = "",
    ):
        self.handlers = dict(handlers)
        #: what the listeners tell connecting peers this is ("scheduler", ...)
        self.role = role
        #: op -> the struct its requests must decode as (see :mod:`shoal.protocol.messages`)
        self.schemas = dict(schemas or {})
        #: who may connect (see :func:`shoal.comm.listen`)
        self.security = security
        self.stream_handlers = dict(stream_handlers or {})
        self.deserialize = deserialize
        self.name = name or type(self).__name__
        self.listeners: list[Listener] = []
        self.comms: set[Comm] = set()
        self._closed = False

    @property
    def address(self) -> str:
        """The contact address of the first listener."""
        if not self.listeners:
            raise ValueError(f"{self.name} is not listening")
        return self.listeners[0].contact_address

    async def listen(self, address: str) -> Listener:
        """Start serving on ``address``; returns the listener."""
        listener = await listen(address, self.handle_comm, deserialize=self.deserialize, security=self.security,
                                role=self.role)
        self.listeners.append(listener)
        return listener

    async def handle_comm(self, comm: Comm) -> None:
        """Serve requests on ``comm`` until it closes."""
        self.comms.add(comm)
        try:
            await self._serve(comm)
        finally:
            self.comms.discard(comm)

    async def _serve(self, comm: Comm) -> None:
        idle = config.get("idle-timeout")
        while not self._closed:
            try:
                msg = await comm.read()
            except DeserializationError as exc:
                logger.error("%s: bad request from %s: %s", self.name, comm.peer_address, exc)
                if not await self._reply(comm, error_message(exc, with_exception=False)):
                    return
                continue
            except CommError:
                return
            if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
                logger.error(
                    "%s: closing connection from %s: a request must be a map with an 'op' "
                    "string, got %r",
                    self.name, comm.peer_address, _short(msg),
                )
                comm.abort()
                return
            op = msg["op"]
            if op in self.schemas:
                # the request's fields are checked here, completely; a malformed one
                # is answered with the error (the connection serves on)
                try:
                    msg = _fields(decode(self.schemas, msg, f"{self.name}: "))
                except ProtocolError as exc:
                    logger.error("%s: bad request from %s: %s", self.name, comm.peer_address, exc)
                    if msg.get("reply", True) is False or not await self._reply(
                        comm, error_message(exc, with_exception=False)
                    ):
                        return
                    if op in self.stream_handlers:
                        comm.abort()  # a stream that could not start
                        return
                    continue
            else:
                msg.pop("op")
            reply = msg.pop("reply", True)
            if op in self.stream_handlers:
                await self._call(self.stream_handlers[op], comm, msg, op)
                return
            if idle:
                # a request connection: one that idles long is closed (a stream is not)
                comm.set_idle_timeout(idle)
                idle = 0.0
            handler = self.handlers.get(op)
            if handler is None:
                logger.error(
                    "%s: closing connection from %s: unknown op %r", self.name, comm.peer_address, op
                )
                if reply:
                    err = ValueError(f"{self.name} has no handler for op {op!r}")
                    await self._reply(comm, error_message(err))
                comm.abort()
                return
            response: dict[str, Any] | None  # None between requests (below)
            try:
                result = await self._call(handler, comm, msg, op)
                response = {"status": "OK", "result": result}
            except (CommClosedError, asyncio.CancelledError):
                raise
            except (Exception, SystemExit) as exc:  # a user object's __reduce__ may raise SystemExit
                response = error_message(exc)
            if reply and not await self._reply(comm, response):
                return
            # the connection may now idle for long: hold no request or value meanwhile
            # (a released value would live on here, and its shared memory with it)
            msg = result = response = None

    async def _call(self, handler: HandlerFn, comm: Comm, msg: dict[str, Any], op: str) -> Any:
        try:
            result = handler(comm, **msg)
        except TypeError as exc:
            if not _accepts(handler, msg):
                raise TypeError(f"bad arguments for op {op!r}: {exc}") from exc
            raise
        # (plain results skip isawaitable's costly ABC check)
        if type(result) not in _PLAIN_RESULTS and inspect.isawaitable(result):
            result = await result
        return result

    async def _reply(self, comm: Comm, response: dict[str, Any]) -> bool:
        try:
            await comm.write(response)
        except SerializationError as exc:
            if response.get("status") == "error":
                response = {**response, "exception": None}
            else:
                response = error_message(exc)
            try:
                try:
                    await comm.write(response)
                except SerializationError:
                    # the error itself cannot travel (a peer that reads no pickle): its words can
                    await comm.write({**response, "exception": None})
            except (CommError, SerializationError):
                return False
        except CommError:
            return False
        return True

    async def close(self) -> None:
        """Stop listening and close every open comm."""
        self._closed = True
        for listener in self.listeners:
            listener.stop()
        for comm in list(self.comms):
            comm.abort()
        self.comms.clear()


def _fields(msg: Msg) -> dict[str, Any]:
    """A checked request's fields, for its handler (keyword arguments)."""
    return {name: getattr(msg, name) for name in msg.__struct_fields__}


def _accepts(handler: HandlerFn, msg: dict[str, Any]) -> bool:
    try:
        inspect.signature(handler).bind(None, **msg)
        return True
    except TypeError:
        return False


def _short(obj: Any) -> str:
    text = repr(obj)
    return text if len(text) <= 200 else text[:200] + "..."


