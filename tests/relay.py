"""A stranger in the middle: a tcp (or TLS) proxy that passes the bytes of shoal
connections on message by message, and may edit, drop, repeat or inject them."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from typing import Any

from shoal.comm import session
from shoal.comm.security import Security

#: (direction, index of the message in that direction, its bytes) -> the bytes to pass on
Edit = Callable[[str, int, bytes], bytes]


class Relay:
    """Accepts on a port of its own and passes each connection's bytes on to ``target``
    and back, message by message (after the two untagged handshake messages of each
    direction, every message is followed by its 16-byte tag when ``tagged``). ``edit``
    may change what passes. With ``tls`` (a :class:`Security`), it ends a TLS session
    on each side, so both ends talk TLS to the relay instead of to each other."""

    def __init__(self, target: str, edit: Edit | None = None, tagged: bool = True, tls: Security | None = None,
                 port: int = 0):
        host, target_port = target.split("://")[1].rsplit(":", 1)
        self.target = (host, int(target_port))
        self.edit = edit or (lambda direction, index, data: data)
        self.tagged = tagged
        self.tls = tls
        self.listener = socket.create_server(("127.0.0.1", port))
        self._peers: dict[str, list[socket.socket]] = {"up": [], "down": []}
        self.address = f"{'tls' if tls else 'tcp'}://127.0.0.1:{self.listener.getsockname()[1]}"
        self.seen: dict[str, list[bytes]] = {"up": [], "down": []}
        self.errors: list[BaseException] = []
        self._socks: list[socket.socket] = [self.listener]
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                near, _ = self.listener.accept()
            except OSError:
                return
            far = socket.create_connection(self.target, timeout=10)
            if self.tls is not None:
                near = self.tls.ssl_context(server=True).wrap_socket(near, server_side=True)
                far = self.tls.ssl_context(server=False).wrap_socket(far, server_hostname="localhost")
            self._socks += [near, far]
            self._peers["up"].append(far)
            self._peers["down"].append(near)
            for args in ((near, far, "up"), (far, near, "down")):
                t = threading.Thread(target=self._pump, args=args, daemon=True)
                self._threads.append(t)
                t.start()

    def _pump(self, src: socket.socket, dst: socket.socket, direction: str) -> None:
        index = 0
        try:
            while True:
                head = _read(src, 8)
                (n,) = struct.unpack("<Q", head)
                head += _read(src, 8 * n)
                data = head + _read(src, sum(struct.unpack_from(f"<{n}Q", head, 8)))
                if self.tagged and index >= 2:
                    data += _read(src, session.TAG_BYTES)
                self.seen[direction].append(data)
                dst.sendall(self.edit(direction, index, data))
                index += 1
        except (EOFError, OSError):
            pass
        except BaseException as exc:  # a bug in the relay: the test says so
            self.errors.append(exc)
        finally:
            # one side ended: so does the other (on the descriptors: a TLS socket's own
            # shutdown would pull its session from under the other direction's thread)
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    socket.socket.shutdown(s, socket.SHUT_RDWR)

    def inject(self, direction: str, data: bytes) -> None:
        """Say ``data`` in ``direction`` ("up": to the target; "down": to the end that
        connected) on the newest connection."""
        self._peers[direction][-1].sendall(data)

    def join_pumps(self, timeout: float) -> None:
        """Wait until every connection passed on has ended on both sides."""
        for t in self._threads[1:]:
            t.join(timeout)
            assert not t.is_alive(), "a relayed connection did not end"

    def close(self) -> None:
        for s in self._socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        for t in self._threads:
            t.join(10)
        assert not self.errors, self.errors


def _read(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise EOFError
        out += chunk
    return out


@contextlib.contextmanager
def relay(target: str, **kwargs: Any) -> Iterator[Relay]:
    r = Relay(target, **kwargs)
    try:
        yield r
    finally:
        r.close()


