"""The ``shoal`` command line."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
import traceback
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, NoReturn

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
    from . import demo

    return demo.main(n=args.n, block=args.block, chunks=args.chunks, chunk_size=args.chunk_size,
                     arg_mb=args.arg_mb)


def _selfcheck(args: argparse.Namespace) -> int:
    """A transport self-check: RPC round trips and a large array over inproc and tcp."""
    import numpy as np

    from .protocol import to_serialize
    from .rpc import Server, rpc

    async def run() -> None:
        def echo(comm: Any, x: Any = None) -> Any:
            return x

        for address in ("inproc://", "tcp://127.0.0.1:0"):
            server = Server({"echo": echo})
            await server.listen(address)
            try:
                async with rpc(server.address) as r:
                    n = 2000
                    t0 = time.perf_counter()
                    for _ in range(n):
                        await r.echo(x=1)
                    rt = (time.perf_counter() - t0) / n * 1e6
                    arr = np.random.default_rng(0).random(args.size_mb * (1 << 20) // 8)
                    t0 = time.perf_counter()
                    out = await r.echo(x=to_serialize(arr))
                    dt = time.perf_counter() - t0
                    same = "the same object" if out is arr else "an equal copy" if np.array_equal(out, arr) else "WRONG"
                    scheme = address.split(":")[0]
                    print(
                        f"{scheme:7s} round trip {rt:7.1f} us; {arr.nbytes >> 20} MB array there "
                        f"and back in {dt * 1e3:7.1f} ms, got {same}"
                    )
            finally:
                await server.close()

    _run(run())
    return 0


def _security_from(args: argparse.Namespace, address: str | None) -> Any:
    """The Security the command line asks for: ``--no-auth``, ``--auth-file``, the
    environment, or (``address`` None: a scheduler) a fresh secret; TLS files with it."""
    from .comm import security

    tls = {"ca_file": args.tls_ca_file, "cert": args.tls_cert, "key": args.tls_key}
    if args.no_auth:
        print("shoal: WARNING: --no-auth: any process that can reach this one may run code in it",
              file=sys.stderr, flush=True)
        return security.Security(auth=False, **tls)
    if args.auth_file:
        return security.Security.from_file(args.auth_file, **tls)
    found = security.for_address(address) if address is not None else None
    if found is None and address is None:
        env = os.environ.get("SHOAL_AUTH")
        found = security.Security(env) if env else security.Security.new()
    if found is not None and any(tls.values()):
        found = security.Security(found.secret, **tls)
    return found


def _scheduler(args: argparse.Namespace) -> int:
    signals = _Signals()
    from .comm import security, shm
    from .scheduler.server import Scheduler

    sec = _security_from(args, None)
    scheme = "tls" if sec.tls else "tcp"

    async def run() -> None:
        scheduler = Scheduler(security=sec)
        auth_address = ""
        try:
            share = sec.auth and not args.auth_file
            if share and args.port:
                # processes of this user on this host find the secret without being told
                # (written before listening: a peer that connects at once finds it)
                auth_address = f"tcp://{_hostport(args.host, args.port)}"
                signals.at_exit_now(security.remove_auth_file, auth_address, sec)
                written = security.write_auth_file(auth_address, sec)
            await scheduler.start(f"{scheme}://{_hostport(args.host, args.port)}")
            if share and not auth_address:
                auth_address = scheduler.address
                signals.at_exit_now(security.remove_auth_file, auth_address, sec)
                written = security.write_auth_file(auth_address, sec)
            print(f"shoal scheduler at {scheduler.address}", flush=True)
            if auth_address:
                print(f"shoal scheduler auth file {written}", flush=True)
            await signals.wait()
        finally:
            await _closing(scheduler.close(), "the scheduler")
            if auth_address:
                security.remove_auth_file(auth_address, sec)

    try:
        signals.run(run)
    finally:
        # what it kept in shared memory (clients' task arguments, its pool) goes now,
        # not at interpreter exit
        shm.unlink_all()
    return 0


def _worker(args: argparse.Namespace) -> int:
    signals = _Signals()
    from .comm import shm
    from .comm.core import parse_address
    from .worker.server import Worker

    sec = _security_from(args, args.address)
    scheme = parse_address(args.address)[0]

    async def run() -> None:
        worker = Worker(args.address, nthreads=args.nthreads, name=args.name or "",
                        listen_address=f"{scheme}://{_hostport(args.host, 0)}", security=sec)
        try:
            await worker.start()
            print(f"shoal worker at {worker.address}", flush=True)
            await signals.wait(worker.finished())  # a signal, or the worker closed itself
        finally:
            await _closing(worker.close(), "the worker")

    code = 0
    try:
        signals.run(run)
    except Exception:
        traceback.print_exc()  # what the interpreter would print, without its exit (below)
        code = 1
    # every segment the worker owns goes now: results, scattered and fetched values kept
    # in the segments they came in, its pool, transfers not taken yet by their peers
    # (some only a finalizer would have removed, and none runs below)
    shm.unlink_all()
    # tasks still running in executor threads must not keep a closed worker alive: the
    # interpreter's exit would wait for them
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


#: how long a closing scheduler or worker may take to say goodbye to its peers before
#: it leaves anyway (its segments are removed after that, whatever happened)
CLOSE_TIMEOUT = 5.0


async def _closing(close: Coroutine[Any, Any, None], what: str) -> None:
    """Await ``close`` (of ``what``), for :data:`CLOSE_TIMEOUT` seconds at most."""
    try:
        await asyncio.wait_for(close, CLOSE_TIMEOUT)
    except asyncio.TimeoutError:
        print(f"shoal: {what} did not close within {CLOSE_TIMEOUT}s; leaving anyway", file=sys.stderr, flush=True)


class _Signals:
    """SIGTERM and SIGINT of a ``shoal scheduler`` or ``shoal worker`` process, for its
    whole life. The first asks it to close: :meth:`wait` returns, or, while it still
    starts (a worker waiting for its scheduler), the start is given up. Another one
    while it closes makes it leave at once (:func:`_exit_now`). Either way the process
    removes every shared-memory segment it owns before it exits, and exits with 0: it
    stopped as it was asked.

    Python-level handlers, not the event loop's: those go with the loop, and then a
    SIGTERM (default action) during the last clean-up, after the loop, would kill the
    process with its segments left in /dev/shm. uvloop wakes up for them (it watches
    the signal wake-up fd), so a signal is seen at once while the loop waits; asyncio's
    own loop, when the main thread gets it (Linux gives it that thread first).
    """

    def __init__(self) -> None:
        self.received = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._main: asyncio.Future[Any] | None = None
        self._stop: asyncio.Future[None] | None = None
        self._at_exit_now: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)

    def at_exit_now(self, fn: Callable[..., Any], *args: Any) -> None:
        """Have ``fn(*args)`` called should the process leave at once (it must take no
        lock: it runs in a signal handler)."""
        self._at_exit_now.append((fn, args))

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.received += 1
        if self.received > 1:
            _exit_now(f"a second signal ({signal.Signals(signum).name}) while closing", self._at_exit_now)
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._stop_now)
            except RuntimeError:
                pass  # the loop has closed: the clean-up after it runs already

    def _stop_now(self) -> None:
        if self._stop is not None:
            if not self._stop.done():
                self._stop.set_result(None)
        elif self._main is not None:
            self._main.cancel()  # still starting: give up

    def run(self, main: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run ``main()`` on a new event loop until it returns, or a signal ended its
        start. Raises what it raises."""

        async def run() -> None:
            self._loop = asyncio.get_running_loop()
            self._main = asyncio.current_task()
            if not self.received:  # not signalled before the loop ran
                await main()

        try:
            _run(run())
        except asyncio.CancelledError:
            if not self.received:
                raise

    async def wait(self, *also: Awaitable[Any]) -> None:
        """Wait for a signal, or until one of ``also`` is done."""
        self._stop = asyncio.get_running_loop().create_future()
        if self.received:  # before this was waited for
            return
        others = {asyncio.ensure_future(a) for a in also}
        try:
            await asyncio.wait({self._stop, *others}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for other in others:
                other.cancel()


def _exit_now(why: str, cleanups: list[tuple[Callable[..., Any], tuple[Any, ...]]]) -> NoReturn:
    """Leave at once (from a signal handler): this process's segments are removed by
    their names (:func:`.shm.sweep` takes no lock: the handler may have interrupted
    code that holds one), then ``cleanups`` run."""
    from .comm import shm

    shm.sweep(os.getpid())
    for fn, args in cleanups:
        try:
            fn(*args)
        except Exception:
            pass
    os.write(2, f"shoal: {why}: exiting now\n".encode())
    os._exit(0)


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _run(coro: Any) -> Any:
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


def _security_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("security")
    group.add_argument("--auth-file", default=None,
                       help="file holding the cluster's secret (mode 600); default: SHOAL_AUTH, SHOAL_AUTH_FILE, "
                            "or the scheduler's auth file for this port (~/.shoal/auth)")
    group.add_argument("--no-auth", action="store_true", help="no authentication at all (warns)")
    group.add_argument("--tls-ca-file", default=None, help="CA certificate (PEM) for tls:// peers")
    group.add_argument("--tls-cert", default=None, help="this process's certificate (PEM)")
    group.add_argument("--tls-key", default=None, help="this process's private key (PEM)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shoal", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run a demonstration workload on a local cluster")
    demo.add_argument("--n", type=int, default=2000, help="matrix size")
    demo.add_argument("--block", type=int, default=500, help="tile size")
    demo.add_argument("--chunks", type=int, default=16)
    demo.add_argument("--chunk-size", type=int, default=1_000_000)
    demo.add_argument("--arg-mb", type=int, default=64, help="size of the array passed as a task argument")
    demo.set_defaults(func=_demo)
    check = sub.add_parser("selfcheck", help="check the transports: round trips and a large array")
    check.add_argument("--size-mb", type=int, default=64)
    check.set_defaults(func=_selfcheck)
    sched = sub.add_parser("scheduler", help="run a scheduler; prints its address")
    sched.add_argument("--host", default="127.0.0.1")
    sched.add_argument("--port", type=int, default=8786)
    _security_arguments(sched)
    sched.set_defaults(func=_scheduler)
    worker = sub.add_parser("worker", help="run a worker that joins the scheduler at ADDRESS")
    worker.add_argument("address")
    worker.add_argument("--nthreads", type=int, default=1)
    worker.add_argument("--name", default="")
    worker.add_argument("--host", default="127.0.0.1", help="interface to listen on for peers")
    _security_arguments(worker)
    worker.set_defaults(func=_worker)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
