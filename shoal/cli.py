"""The ``shoal`` command line."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from typing import Any

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
    from .comm import security
    from .scheduler.server import Scheduler

    sec = _security_from(args, None)
    scheme = "tls" if sec.tls else "tcp"

    async def run() -> None:
        scheduler = Scheduler(security=sec)
        written = None
        share = sec.auth and not args.auth_file
        if share and args.port:
            # processes of this user on this host find the secret without being told
            # (written before listening: a peer that connects at once finds it)
            written = security.write_auth_file(f"tcp://{_hostport(args.host, args.port)}", sec)
        await scheduler.start(f"{scheme}://{_hostport(args.host, args.port)}")
        if share and written is None:
            written = security.write_auth_file(scheduler.address, sec)
        print(f"shoal scheduler at {scheduler.address}", flush=True)
        if written is not None:
            print(f"shoal scheduler auth file {written}", flush=True)
        try:
            await _until_signalled()
        finally:
            await scheduler.close()
            if written is not None:
                security.remove_auth_file(scheduler.address, sec)

    _run(run())
    return 0


def _worker(args: argparse.Namespace) -> int:
    from .comm.core import parse_address
    from .worker.server import Worker

    sec = _security_from(args, args.address)
    scheme = parse_address(args.address)[0]

    async def run() -> None:
        worker = Worker(args.address, nthreads=args.nthreads, name=args.name or "",
                        listen_address=f"{scheme}://{_hostport(args.host, 0)}", security=sec)
        await worker.start()
        print(f"shoal worker at {worker.address}", flush=True)
        stop = asyncio.ensure_future(_until_signalled())
        done = asyncio.ensure_future(worker.finished())
        await asyncio.wait({stop, done}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        await worker.close()

    _run(run())
    # tasks still running in executor threads must not keep a closed worker alive
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


async def _until_signalled() -> None:
    import signal

    loop = asyncio.get_running_loop()
    stop: asyncio.Future[None] = loop.create_future()

    def on_signal() -> None:
        if not stop.done():
            stop.set_result(None)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    await stop


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
