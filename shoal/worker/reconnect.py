"""A worker process that waits for its scheduler, and joins it again after losing it.

``shoal worker`` runs one :class:`~.server.Worker` at a time under :func:`keep_joined`:

- started before its scheduler listens, it waits for it, up to ``death_timeout``
  seconds, and says so once;
- when its connection breaks without the scheduler having told it to close (the
  scheduler crashed or was killed, the network failed), it waits up to
  ``death_timeout`` seconds for a scheduler at the same address and joins it as a
  new worker (same name, threads and resources), saying so in one line;
- a scheduler that tells it to close (it shuts down, or retires this worker) is
  obeyed: no reconnection; nor when the scheduler left on purpose in a hurry (a second
  signal), which ``shoal worker`` sees by its auth file being gone.

A closed :class:`~.server.Worker` is not started again: a fresh one joins. Nothing of
the old one's tasks is worth keeping: a scheduler that comes back knows none of them.
With ``death_timeout`` 0 there is no waiting at all: one start (the ``connect-timeout``
setting applies, as for any connection), and the process leaves when its scheduler
does (a :class:`~shoal.LocalCluster` starts its workers so: the cluster replaces them).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from ..comm import connect
from ..comm.security import Security
from ..errors import AuthenticationError, CommConnectError, CommError, HandshakeError
from .server import Worker

__all__ = ["keep_joined", "wait_for_scheduler"]

#: the first attempt to reach the scheduler waits this long (seconds) before the
#: worker says it is waiting: a scheduler that is there answers well within it
FIRST_TRY = 0.5
#: pause between two attempts that met a stale secret (a scheduler that came back wrote
#: its new one to the auth file before listening: the next look finds it)
AUTH_RETRY_DELAY = 0.1


async def wait_for_scheduler(address: str, timeout: float, security: Callable[[], Security | None],
                             on_wait: Callable[[], None], stale_secret_ok: bool = False) -> None:
    """Return once a scheduler at ``address`` completes a handshake with this process,
    within ``timeout`` seconds; ``on_wait()`` is called once if it does not at once.
    ``security()`` gives the credentials at each attempt (an auth file may appear or
    change meanwhile). With ``stale_secret_ok``, a refused secret is tried again until
    the deadline (a scheduler that came back made a new one).

    Raises :class:`~shoal.errors.CommConnectError` when the time is up, and
    :class:`~shoal.errors.HandshakeError` (or its
    :class:`~shoal.errors.AuthenticationError`) for a peer that refuses us.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    told = False
    while True:
        left = deadline - loop.time()
        try:
            comm = await connect(address, timeout=max(left if told else min(left, FIRST_TRY), 0.01),
                                 deserialize=False, security=security(), role="worker", expect="scheduler")
        except AuthenticationError:
            if not stale_secret_ok or loop.time() + AUTH_RETRY_DELAY >= deadline:
                raise
            await asyncio.sleep(AUTH_RETRY_DELAY)
        except (CommConnectError, HandshakeError) as exc:
            if not _not_there(exc):
                raise  # a peer that refuses us: not a shoal scheduler, another protocol version
            if loop.time() >= deadline:
                raise CommConnectError(f"could not connect to the scheduler at {address} within {timeout:g}s") from None
            if isinstance(exc, HandshakeError):
                await asyncio.sleep(AUTH_RETRY_DELAY)  # it went while it accepted us: not again at once
        else:
            comm.abort()  # a probe: the worker makes its own connection
            return
        if not told:
            told = True
            on_wait()


def _not_there(exc: Exception) -> bool:
    """Whether ``exc``, from connecting, says the scheduler is not there (now): nobody
    listens, or the peer broke the connection off during the handshake (a scheduler
    that dies while it accepts it), rather than refusing us."""
    if isinstance(exc, CommConnectError):
        return True
    return (isinstance(exc, HandshakeError) and not isinstance(exc, AuthenticationError)
            and isinstance(exc.__cause__, (CommError, ConnectionError)))


async def keep_joined(make_worker: Callable[[], Worker], address: str, death_timeout: float,
                      serve: Callable[[Worker], Awaitable[bool]], security: Callable[[], Security | None],
                      say: Callable[[str], None], joined: Callable[[Worker], None],
                      shut_down: Callable[[], bool] = lambda: False) -> int:
    """Keep a worker made by ``make_worker()`` joined to the scheduler at ``address``
    (see the module). ``serve(worker)`` waits while the worker runs, closes it and
    returns whether this process was asked to stop; ``joined(worker)`` is called when a
    worker has joined for the first time, ``say(line)`` for what the user should hear
    (waiting, reconnected, giving up). ``security()`` gives the credentials to probe
    with. ``shut_down()`` tells, once the connection is lost, whether the scheduler
    left on purpose without saying so (a second signal made it leave at once; it
    removed its auth file): the worker leaves too.

    Returns the process's exit code: 0 when it stopped as asked (a signal, or its
    scheduler told it to close), 1 when the scheduler could not be reached within
    ``death_timeout`` or the worker broke (an internal error). Raises what starting a
    worker raises otherwise (a refused secret, a scheduler that refuses the worker).
    """
    lost = False

    def waiting() -> None:
        if not lost:  # (after a loss, the line that said so said it waits)
            say(f"waiting for the scheduler at {address} (up to {death_timeout:g}s, --death-timeout)")

    while True:
        if death_timeout > 0:
            try:
                await wait_for_scheduler(address, death_timeout, security, waiting, stale_secret_ok=lost)
            except CommConnectError:
                say(f"no scheduler at {address} within {death_timeout:g}s (--death-timeout); exiting")
                return 1
        worker = make_worker()
        try:
            await worker.start()
        except BaseException as exc:
            await worker.close(report=False)
            if death_timeout > 0 and isinstance(exc, Exception) and _not_there(exc):
                continue  # it went away again between the probe and the start
            raise
        if lost:
            say(f"reconnected to the scheduler at {address} (this worker is now at {worker.address})")
        else:
            joined(worker)
        if await serve(worker):
            return 0
        if worker.broken:
            return 1
        if not worker.scheduler_lost:
            return 0  # the scheduler told it to close
        if shut_down():
            say(f"the scheduler at {address} shut down; exiting")
            return 0
        lost = True
        if death_timeout <= 0:
            say(f"lost the scheduler at {address}; exiting (--death-timeout 0)")
            return 1
        say(f"lost the scheduler at {address}; waiting up to {death_timeout:g}s for it to come back")
