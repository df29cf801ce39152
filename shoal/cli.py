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


def _scheduler(args: argparse.Namespace) -> int:
    from .scheduler.server import Scheduler

    async def run() -> None:
        scheduler = Scheduler()
        await scheduler.start(f"tcp://{_hostport(args.host, args.port)}")
        print(f"shoal scheduler at {scheduler.address}", flush=True)
        await _until_signalled()
        await scheduler.close()

    _run(run())
    return 0


def _worker(args: argparse.Namespace) -> int:
    from .worker.server import Worker

    async def run() -> None:
        worker = Worker(args.address, nthreads=args.nthreads, name=args.name or "",
                        listen_address=f"tcp://{_hostport(args.host, 0)}")
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
    stop = loop.create_future()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: stop.done() or stop.set_result(None))
    await stop


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _run(coro: Any) -> Any:
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


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
    sched.set_defaults(func=_scheduler)
    worker = sub.add_parser("worker", help="run a worker that joins the scheduler at ADDRESS")
    worker.add_argument("address")
    worker.add_argument("--nthreads", type=int, default=1)
    worker.add_argument("--name", default="")
    worker.add_argument("--host", default="127.0.0.1", help="interface to listen on for peers")
    worker.set_defaults(func=_worker)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
