"""The ``shoal`` command line."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
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


def _run(coro: Any) -> Any:
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shoal", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run a demonstration workload")
    demo.add_argument("--size-mb", type=int, default=64)
    demo.set_defaults(func=_demo)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
