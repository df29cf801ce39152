"""Who may talk to a cluster: its secret, TLS material, and where processes find them.

A cluster has a *secret*. Every tcp connection proves it in the handshake by
challenge-response (:func:`proof`: an HMAC-SHA256 over both ends' nonces and the
prover's role), before anything else the peer sends is read; the secret never crosses
the wire. ``tls://`` connections are also encrypted (mutual TLS with the
:class:`Security`'s certificates) and prove the secret inside the TLS session.

A process that is not handed a :class:`Security` finds one for an address in this
order (:func:`for_address`): the ``SHOAL_AUTH`` environment variable (the secret
itself), ``SHOAL_AUTH_FILE`` (a file holding it), a listener of this process there (a
scheduler's), and the auth file that ``shoal scheduler`` wrote for its port in this
user's auth directory (``SHOAL_AUTH_DIR``, default ``~/.shoal/auth``; readable by its
user only). TLS files come from ``SHOAL_TLS_CA_FILE``, ``SHOAL_TLS_CERT`` and
``SHOAL_TLS_KEY`` when they are not given. Nothing found means no secret: a peer that requires one refuses the connection
with an error that says how to pass it.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets as _secrets
import shutil
import ssl
import stat
import threading
import weakref
from typing import Any

__all__ = [
    "Security",
    "proof",
    "check_proof",
    "warn_if_exposed",
    "for_address",
    "from_environment",
    "tls_from_environment",
    "register",
    "unregister",
    "auth_dir",
    "auth_file_for",
    "write_auth_file",
    "read_secret",
    "dashboard_token",
]

logger = logging.getLogger("shoal.comm.security")

NONCE_BYTES = 32
_PROOF_LABEL = b"shoal-auth-1"
_DASHBOARD_LABEL = b"shoal-dashboard-1"


class Security:
    """The credentials of one cluster.

    ``Security(secret=None, *, ca_file=None, cert=None, key=None,
    require_encryption=False, auth=True)``:

    - ``secret``: the cluster's shared secret (bytes or text); ``None`` with ``auth``
      true makes a random one (:meth:`new` says so explicitly).
    - ``ca_file``, ``cert``, ``key``: PEM files for ``tls://`` (mutual TLS: both ends
      present a certificate signed by the CA, and check the other's).
    - ``require_encryption``: refuse plain ``tcp://`` (listening and connecting).
    - ``auth=False``: no secret at all (``--no-auth``); such an end neither proves nor
      asks for one, and ends that have a secret refuse it.

    Raises ``ValueError`` for an empty secret, a ``cert`` without ``key`` (or the
    reverse), or TLS files that do not exist.
    """

    __slots__ = ("secret", "ca_file", "cert", "key", "require_encryption", "_contexts", "_tempdir", "__weakref__")

    def __init__(
        self,
        secret: bytes | str | None = None,
        *,
        ca_file: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        require_encryption: bool = False,
        auth: bool = True,
    ):
        if isinstance(secret, str):
            secret = secret.strip().encode("utf-8", "surrogateescape")
        if secret is not None and not isinstance(secret, bytes):
            raise TypeError(f"a secret is bytes or str, got {type(secret).__name__}")
        if secret is not None and not secret:
            raise ValueError("a cluster secret cannot be empty (use auth=False for none)")
        if not auth:
            secret = None
        elif secret is None:
            secret = _secrets.token_hex(32).encode()
        if (cert is None) != (key is None):
            raise ValueError("TLS needs both cert= and key= (or neither)")
        for what, path in (("ca_file", ca_file), ("cert", cert), ("key", key)):
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{what}={path!r} is not a file")
        self.secret: bytes | None = secret
        self.ca_file = ca_file
        self.cert = cert
        self.key = key
        self.require_encryption = require_encryption
        self._contexts: dict[bool, ssl.SSLContext] = {}
        self._tempdir: Any = None

    @classmethod
    def new(cls) -> Security:
        """A fresh random secret, no TLS."""
        return cls(_secrets.token_hex(32))

    @classmethod
    def disabled(cls) -> Security:
        """No authentication (what ``--no-auth`` gives)."""
        return cls(auth=False)

    @classmethod
    def from_file(cls, path: str, **tls: Any) -> Security:
        """The secret held in ``path`` (see :func:`read_secret`); raises ``OSError``
        if it cannot be read and ``ValueError`` if it is empty or other users may
        read it."""
        return cls(read_secret(path), **tls)

    @classmethod
    def temporary(cls, secret: bytes | str | None = None) -> Security:
        """A throw-away CA and one certificate it signed (for ``localhost``,
        ``127.0.0.1`` and ``::1``), used by both ends, plus a random secret: for tests
        and single-host clusters. Needs the ``cryptography`` package. The files live in
        a private temporary directory, removed when this object is garbage (or at exit)."""
        from ._tls_certs import make_temporary

        tmp, ca, cert, key = make_temporary()
        sec = cls(secret, ca_file=ca, cert=cert, key=key, require_encryption=True)
        sec._tempdir = weakref.finalize(sec, shutil.rmtree, tmp, ignore_errors=True)
        return sec

    @property
    def auth(self) -> bool:
        """Whether this end proves a secret and asks peers for it."""
        return self.secret is not None

    @property
    def tls(self) -> bool:
        """Whether this has the certificates ``tls://`` needs."""
        return self.cert is not None

    def ssl_context(self, server: bool) -> ssl.SSLContext:
        """The TLS context for a listener (``server``) or a connecting end; both
        verify the other end's certificate against ``ca_file``. Raises ``ValueError``
        without certificates."""
        ctx = self._contexts.get(server)
        if ctx is not None:
            return ctx
        if self.cert is None or self.key is None:
            raise ValueError("tls:// needs a Security with cert= and key= (and ca_file=)")
        purpose = ssl.Purpose.CLIENT_AUTH if server else ssl.Purpose.SERVER_AUTH
        ctx = ssl.create_default_context(purpose, cafile=self.ca_file)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.cert, self.key)
        ctx.verify_mode = ssl.CERT_REQUIRED
        if not server:
            # cluster members are addressed by IP and port more often than by name: the
            # CA of the cluster is what is checked (mutual TLS), not the host name
            ctx.check_hostname = False
        self._contexts[server] = ctx
        return ctx

    def to_env(self, inline: bool = False) -> dict[str, str]:
        """Environment variables that hand these credentials to a child process: the
        TLS files' paths, or with ``inline`` their contents (``SHOAL_TLS_*_PEM``, for a
        process on another host; :mod:`shoal.deploy.remote` writes them to files
        there). Raises ``OSError`` when a TLS file cannot be read."""
        env = {} if self.secret is None else {"SHOAL_AUTH": self.secret.decode("utf-8", "surrogateescape")}
        for var, path in (("SHOAL_TLS_CA_FILE", self.ca_file), ("SHOAL_TLS_CERT", self.cert),
                          ("SHOAL_TLS_KEY", self.key)):
            if path is None:
                continue
            if inline:
                with open(path, encoding="ascii") as f:
                    env[INLINE_TLS[var]] = f.read()
            else:
                env[var] = path
        return env

    def __repr__(self) -> str:
        # never the secret itself
        parts = ["auth" if self.auth else "no auth"]
        if self.tls:
            parts.append("tls")
        if self.require_encryption:
            parts.append("encryption required")
        return f"<Security {', '.join(parts)}>"


def proof(secret: bytes, role: bytes, nonce_connector: bytes, nonce_acceptor: bytes,
          binding: bytes | None = None) -> bytes:
    """What an end sends to prove it knows ``secret``: HMAC-SHA256 of a label, its
    ``role`` (``b"connector"`` or ``b"acceptor"``), both nonces and, over tls, the TLS
    session's channel binding (``binding``). The role keeps a peer from passing our own
    proof back to us; the binding, a proof from being relayed into another TLS session."""
    parts = [_PROOF_LABEL, role, nonce_connector, nonce_acceptor]
    if binding is not None:
        parts.append(binding)
    return hmac.new(secret, b"|".join(parts), hashlib.sha256).digest()


def check_proof(secret: bytes, role: bytes, nonce_connector: bytes, nonce_acceptor: bytes, got: Any,
                binding: bytes | None = None) -> bool:
    """Whether ``got`` is the proof of ``role`` for these nonces (constant time)."""
    if not isinstance(got, bytes):
        return False
    return hmac.compare_digest(proof(secret, role, nonce_connector, nonce_acceptor, binding), got)


def dashboard_token(secret: bytes) -> str:
    """The token that logs a browser or a script into the dashboard of the cluster
    whose secret is ``secret``: HMAC-SHA256 of a fixed label, in hex. Whoever holds the
    secret can make it; it does not give the secret away."""
    return hmac.new(secret, _DASHBOARD_LABEL, hashlib.sha256).hexdigest()


def warn_if_exposed(listen_address: str, security: Security | None) -> bool:
    """Warn (and return True) when ``listen_address`` is reachable from other hosts
    over plain tcp, or with no authentication at all."""
    scheme, _, location = listen_address.rpartition("://")
    host = location.rpartition(":")[0].strip("[]")
    if scheme == "inproc" or host in ("127.0.0.1", "::1", "localhost") or host.startswith("127."):
        return False
    if security is None or not security.auth:
        logger.warning("listening on %s with NO authentication: anyone who can reach it can run code here", listen_address)
        return True
    if scheme == "tcp":
        logger.warning(
            "listening on %s over plain tcp: messages (and the task payloads in them) cross the network "
            "unencrypted; use a tls:// address with shoal.Security(ca_file=, cert=, key=)", listen_address
        )
        return True
    return False


# --------------------------------------------------------------- finding a secret

_registry: dict[str, Security] = {}
_registry_lock = threading.Lock()


def register(address: str, security: Security) -> None:
    """Make ``security`` the one this process uses for ``address`` (a scheduler of
    this process registers its own addresses)."""
    with _registry_lock:
        _registry[address] = security


def unregister(address: str) -> None:
    with _registry_lock:
        _registry.pop(address, None)


def auth_dir() -> str:
    """This user's directory of auth files (``SHOAL_AUTH_DIR``, default ``~/.shoal/auth``)."""
    return os.environ.get("SHOAL_AUTH_DIR") or os.path.join(os.path.expanduser("~"), ".shoal", "auth")


def auth_file_for(address: str) -> str | None:
    """The auth file ``shoal scheduler`` writes for ``address``'s port, or None when
    the address has no port."""
    port = _port_of(address)
    return None if port is None else os.path.join(auth_dir(), f"port-{port}")


def _port_of(address: str) -> int | None:
    _, _, location = address.rpartition("://")
    host, sep, port = location.rpartition(":")
    if not sep:
        return None
    try:
        return int(port)
    except ValueError:
        return None


def write_auth_file(address: str, security: Security) -> str:
    """Write ``security``'s secret where processes of this user on this host look for
    ``address``'s (a file only this user can read, in a directory only this user can
    enter); returns its path. Raises ``ValueError`` for an address without a port or a
    security without a secret."""
    path = auth_file_for(address)
    if path is None:
        raise ValueError(f"no auth file for an address without a port: {address!r}")
    if security.secret is None:
        raise ValueError("this Security has no secret to write")
    write_secret(path, security.secret)
    return path


def write_secret(path: str, secret: bytes) -> None:
    """Write ``secret`` to ``path`` atomically, mode 0600 (its directory made 0700)."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, mode=0o700, exist_ok=True)
    tmp = os.path.join(directory, f".tmp-{os.getpid()}-{_secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(secret + b"\n")
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def remove_auth_file(address: str, security: Security) -> None:
    """Remove ``address``'s auth file if it still holds ``security``'s secret."""
    path = auth_file_for(address)
    if path is None or security.secret is None:
        return
    try:
        if read_secret(path) == security.secret:
            os.unlink(path)
    except (OSError, ValueError):
        pass


def read_secret(path: str) -> bytes:
    """The secret in ``path`` (surrounding white space stripped). Raises ``OSError``
    if it cannot be opened (a link or something other than a regular file included)
    and ``ValueError`` if it is empty, larger than 4 KiB, or readable by other users."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"auth file {path} is not a regular file")
        if st.st_mode & 0o077:
            raise ValueError(
                f"auth file {path} may be read by other users (mode {stat.S_IMODE(st.st_mode):o}); "
                "chmod 600 it"
            )
        if st.st_size > 4096:
            raise ValueError(f"auth file {path} is larger than 4 KiB: not a secret")
        data = os.read(fd, 4097).strip()
    finally:
        os.close(fd)
    if not data:
        raise ValueError(f"auth file {path} is empty")
    return data


def from_environment() -> Security | None:
    """The secret this process was given: ``SHOAL_AUTH`` (the secret itself) or
    ``SHOAL_AUTH_FILE`` (a file holding it); None when neither is set. A broken
    ``SHOAL_AUTH_FILE`` raises (``OSError``/``ValueError``)."""
    env = os.environ.get("SHOAL_AUTH")
    if env:
        return Security(env, **tls_from_environment())
    path = os.environ.get("SHOAL_AUTH_FILE")
    if path:
        return Security.from_file(path, **tls_from_environment())
    return None


#: the variable of a TLS file's path -> the one of its contents (``Security.to_env(inline=True)``)
INLINE_TLS = {"SHOAL_TLS_CA_FILE": "SHOAL_TLS_CA_PEM", "SHOAL_TLS_CERT": "SHOAL_TLS_CERT_PEM",
              "SHOAL_TLS_KEY": "SHOAL_TLS_KEY_PEM"}


def tls_from_environment() -> dict[str, Any]:
    """TLS files this process was given: ``SHOAL_TLS_CA_FILE``, ``SHOAL_TLS_CERT``,
    ``SHOAL_TLS_KEY`` (as keyword arguments of :class:`Security`)."""
    names = {"ca_file": "SHOAL_TLS_CA_FILE", "cert": "SHOAL_TLS_CERT", "key": "SHOAL_TLS_KEY"}
    return {k: os.environ[v] for k, v in names.items() if os.environ.get(v)}


def for_address(address: str) -> Security | None:
    """The Security this process uses to reach ``address`` when none is given (see
    the module's docstring for the order), or None: no secret known. A broken
    ``SHOAL_AUTH_FILE`` raises (``OSError``/``ValueError``): being told where the
    secret is and not finding it is an error, not a reason to go without."""
    given = from_environment()
    if given is not None:
        return given
    with _registry_lock:
        found = _registry.get(address)
    if found is not None:
        return found
    path = auth_file_for(address)
    if path is not None and os.path.exists(path):
        try:
            return Security.from_file(path, **tls_from_environment())
        except (OSError, ValueError) as exc:
            logger.warning("ignoring auth file %s: %s", path, exc)
    return None
