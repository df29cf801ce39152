"""The ``shoal`` command line."""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from typing import Any

from ._signals import CLOSE_TIMEOUT, Signals as _Signals, closing as _closing, leaving as _leaving

__all__ = ["main", "CLOSE_TIMEOUT"]


def _demo(args: argparse.Namespace) -> int:
    from . import demo

    return demo.main(n=args.n, block=args.block, chunks=args.chunks, chunk_size=args.chunk_size,
                     arg_mb=args.arg_mb, progress=args.progress)


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
    if not any(tls.values()):
        tls = {**tls, **security.tls_from_environment()}  # (SHOAL_TLS_*: a deployment's)
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
    from . import config
    from .comm import security, shm
    from .scheduler.server import Scheduler

    sec = _security_from(args, None)
    scheme = "tls" if sec.tls else "tcp"
    dashboard = None if args.no_dashboard else args.dashboard_address
    if dashboard is not None and dashboard.startswith(":"):
        dashboard = _hostport(args.host, 0).rpartition(":")[0] + dashboard  # the scheduler's host
    # who may read the dashboard without login (read by the dashboard when it starts)
    settings = {name: 1 for name in ("dashboard_open", "metrics_public") if getattr(args, name)}
    if dashboard is not None:
        from .dashboard import check_exposure, parse_dashboard_address

        try:  # (refused before anything starts)
            check_exposure(parse_dashboard_address(dashboard)[0], sec.auth,
                           bool(args.dashboard_open or config.get("dashboard-open")))
        except ValueError as exc:
            print(f"shoal scheduler: {exc}", file=sys.stderr, flush=True)
            return 2

    async def run() -> None:
        scheduler = Scheduler(security=sec, dashboard_address=dashboard)
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
            # last: scripts that read the first lines keep working. The link carries the
            # token that logs a browser in (derived from the secret: see docs/dashboard.md)
            if scheduler.dashboard is not None:
                print(f"shoal dashboard at {scheduler.dashboard.login_link}", flush=True)
            await signals.wait()
        finally:
            await _closing(scheduler.close(), "the scheduler")
            if auth_address:
                security.remove_auth_file(auth_address, sec)

    try:
        with config.set(**settings):
            signals.run(run)
    finally:
        # what it kept in shared memory (clients' task arguments, its pool) goes now,
        # not at interpreter exit
        shm.unlink_all()
        _leaving()
    return 0


def _worker(args: argparse.Namespace) -> int:
    if args.host == "auto":
        from .comm.core import route_address

        try:
            args.host = route_address(args.address)
        except (OSError, ValueError) as exc:
            _say(f"--host auto: no route to the scheduler at {args.address}: {exc}")
            return 1
    if not args.no_nanny and not args.nanny_address:
        return _nannies(args)
    if args.nworkers > 1:
        return _worker_group(args)
    signals = _Signals()
    from .comm import shm
    from .comm.core import parse_address
    from .errors import ShoalError
    from .worker.memory import parse_memory_limit
    from .worker.monitor import keep_heap_small
    from .worker.nanny import EXIT_GAVE_UP, die_with_parent
    from .worker.reconnect import keep_joined
    from .worker.server import Worker

    keep_heap_small()
    if args.nanny_address:
        die_with_parent()  # (after _Signals: a SIGTERM from the kernel closes it cleanly)
    if args.work_dir:
        # its nanny removes it after the process exits; this process does if it leaves
        # at once on a second signal while its nanny is gone too
        signals.at_exit_now(shutil.rmtree, args.work_dir, True)
    memory_limit = parse_memory_limit(args.memory_limit, args.nworkers)
    scheme = parse_address(args.address)[0]
    # found again for each connection: a scheduler that comes back made a new secret
    explicit = args.no_auth or args.auth_file or os.environ.get("SHOAL_AUTH") or os.environ.get("SHOAL_AUTH_FILE")

    def security() -> Any:
        return _security_from(args, args.address)

    first = _security_from(args, args.address)  # (warns once about --no-auth)
    # a scheduler that leaves on purpose removes its auth file, even when it leaves in a
    # hurry without telling its workers; one that crashes leaves it
    from .comm.security import auth_file_for

    auth_path = None if explicit else auth_file_for(args.address)
    had_file = [False]

    def shut_down() -> bool:
        return had_file[0] and auth_path is not None and not os.path.exists(auth_path)

    made: list[Worker] = []

    def make_worker() -> Worker:
        had_file[0] = auth_path is not None and os.path.exists(auth_path)
        made[:] = [Worker(args.address, nthreads=args.nthreads, name=args.name or "",
                          listen_address=f"{scheme}://{_hostport(args.host, 0)}",
                          security=first if explicit else security(), resources=args.resources,
                          memory_limit=memory_limit, local_directory=args.local_directory or None,
                          work_dir=args.work_dir or None, nanny=args.nanny_address)]
        return made[0]

    async def serve(worker: Worker) -> bool:
        try:
            signalled = await signals.wait(worker.finished())  # a signal, or the worker closed itself
        finally:
            await _closing(worker.close(), "the worker")
        return signals.rearm() or signalled

    def joined(worker: Worker) -> None:
        _write_line(1, f"shoal worker at {worker.address}")

    result: list[int] = []

    async def run() -> None:
        result.append(await keep_joined(make_worker, args.address, args.death_timeout, serve,
                                        (lambda: first) if explicit else security, _say, joined, shut_down))

    code = 0
    try:
        signals.run(run)
        code = result[0] if result else 0
        if code == 1 and args.nanny_address and not (made and made[0].broken):
            code = EXIT_GAVE_UP  # no scheduler (any more): its nanny does not start it again
    except (ShoalError, OSError) as exc:
        # the expected ways to fail (no scheduler, a refused secret, a taken port): one line
        _say(f"{type(exc).__name__}: {exc}")
        code = EXIT_GAVE_UP if args.nanny_address else 1
    except Exception:
        traceback.print_exc()  # a bug: what the interpreter would print, without its exit (below)
        code = 1
    if args.work_dir:
        shutil.rmtree(args.work_dir, ignore_errors=True)  # (its nanny sees from this that it closed as asked)
    # every segment the worker owns goes now: results, scattered and fetched values kept
    # in the segments they came in, its pool, transfers not taken yet by their peers
    # (some only a finalizer would have removed, and none runs below)
    shm.unlink_all()
    # tasks still running in executor threads must not keep a closed worker alive: the
    # interpreter's exit would wait for them
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _say(line: str) -> None:
    """A line for the user of ``shoal worker`` (on stderr: stdout has the address)."""
    _write_line(2, f"shoal worker: {line}")


def _write_line(fd: int, line: str) -> None:
    """``line`` to ``fd`` in one write: the workers of ``--nworkers`` share their
    parent's stdout and stderr, and a line written in parts could interleave with
    another's."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.write(fd, (line + "\n").encode())


def _worker_group(args: argparse.Namespace) -> int:
    """``shoal worker --nworkers N``: N worker processes (named ``NAME-0``, ... with
    ``--name``), each a ``shoal worker`` of its own in a process group of its own, so
    that this process alone gets a Ctrl-C and stops them in order. A first SIGINT or
    SIGTERM is passed on to them as SIGTERM (they close), another one kills them.
    Returns 0 when every one exited with 0, else 1; a worker that exits is not
    replaced (``--no-nanny``)."""
    from .worker.memory import parse_memory_limit

    limit = parse_memory_limit(args.memory_limit, args.nworkers)
    argv = [*_child_argv(args), "--memory-limit", str(limit or 0)]
    children: list[subprocess.Popen[bytes]] = []
    signalled = 0

    def on_signal(signum: int, frame: Any) -> None:
        nonlocal signalled
        signalled += 1
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM if signalled == 1 else signal.SIGKILL)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    for i in range(args.nworkers):
        if signalled:
            break
        name = ["--name", f"{args.name}-{i}"] if args.name else []
        children.append(subprocess.Popen([*argv, *name], stdin=subprocess.DEVNULL, process_group=0))
    codes = [child.wait() for child in children]  # (a signal's handler runs meanwhile)
    _leaving()
    return 0 if all(c == 0 for c in codes) else 1


def _child_argv(args: argparse.Namespace) -> list[str]:
    """``python -m shoal worker ADDRESS --no-nanny`` with the options of ``args`` that
    each worker process takes as they are (not its name, memory limit or directories)."""
    argv = [sys.executable, "-m", "shoal", "worker", args.address, "--no-nanny", "--nthreads", str(args.nthreads),
            "--host", args.host, "--death-timeout", repr(args.death_timeout)]
    if args.local_directory:
        argv += ["--local-directory", args.local_directory]
    if args.resources:
        from .deploy.processes import format_resources

        argv += ["--resources", format_resources(args.resources)]
    for flag in ("auth_file", "tls_ca_file", "tls_cert", "tls_key"):
        if getattr(args, flag):
            argv += ["--" + flag.replace("_", "-"), getattr(args, flag)]
    if args.no_auth:
        argv.append("--no-auth")
    return argv


def _nannies(args: argparse.Namespace) -> int:
    """``shoal worker`` (without ``--no-nanny``): this process is the nanny of
    ``--nworkers`` worker processes (:class:`~shoal.worker.nanny.Nanny`: restarted when
    they die or pass their memory limit), each with its part of ``--memory-limit``. A
    SIGTERM or SIGINT stops them and then this process. Returns 0 when it stopped as
    asked (a signal, or the workers were told to close), 1 when a nanny gave up or the
    workers found no scheduler."""
    signals = _Signals()
    from .comm.security import Security
    from .worker.memory import parse_memory_limit
    from .worker.nanny import Nanny

    limit = parse_memory_limit(args.memory_limit, args.nworkers)
    explicit = args.no_auth or args.auth_file or os.environ.get("SHOAL_AUTH") or os.environ.get("SHOAL_AUTH_FILE")
    tls = {"ca_file": args.tls_ca_file, "cert": args.tls_cert, "key": args.tls_key}
    if args.no_auth:
        sec: Any = Security(auth=False, **tls)  # (the worker processes warn about it)
    elif explicit:
        sec = _security_from(args, args.address)
    else:
        # the scheduler's auth file for this port, looked at again: a scheduler that
        # comes back writes a new one
        def sec() -> Any:
            return _security_from(args, args.address)
    argv = _child_argv(args)
    codes: list[int] = []

    async def all_finished(nannies: list[Nanny]) -> None:
        for n in nannies:
            await n.finished()

    async def run() -> None:
        started: list[Nanny] = []
        try:
            for i in range(args.nworkers):
                name = f"{args.name}-{i}" if args.name and args.nworkers > 1 else args.name
                nanny = Nanny([*argv, *(["--name", name] if name else [])], scheduler_address=args.address,
                              name=name, memory_limit=limit, directory=args.local_directory or None,
                              host=args.host, security=sec, say=_say)
                await nanny.start()
                started.append(nanny)
            await signals.wait(all_finished(started))
        finally:
            await asyncio.gather(*(n.close() for n in started))
            codes.extend([await n.finished() for n in started])

    try:
        signals.run(run)
    except OSError as exc:  # a taken port, a local directory that cannot be made
        _say(f"{type(exc).__name__}: {exc}")
        return 1
    finally:
        _leaving()
    return 0 if signals.received or all(c == 0 for c in codes) else 1


def _dashboard_argument(text: str) -> str:
    from .dashboard import parse_dashboard_address

    try:
        parse_dashboard_address(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


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


#: ``shoal scheduler``'s default port: not dask's 8786, so that a dask scheduler and a
#: shoal scheduler run side by side on one host (shoal's workers listen on a free port)
DEFAULT_SCHEDULER_PORT = 8686
#: ``shoal worker --death-timeout``'s default, in seconds
DEFAULT_DEATH_TIMEOUT = 60.0


def parse_resources(text: str) -> dict[str, float]:
    """``"GPU=2,MEM=10e9"`` (items separated by commas or spaces) -> ``{"GPU": 2.0,
    "MEM": 1e10}``. Raises ``ValueError`` saying which item is wrong: not
    ``NAME=AMOUNT``, an amount that is not a finite number >= 0, a name given twice."""
    out: dict[str, float] = {}
    for item in text.replace(",", " ").split():
        name, sep, amount = item.partition("=")
        if not sep or not name or not amount:
            raise ValueError(f"{item!r} is not NAME=AMOUNT (e.g. GPU=2,MEM=10e9)")
        try:
            value = float(amount)
        except ValueError:
            raise ValueError(f"{name}: {amount!r} is not a number") from None
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name}: the amount must be a finite number >= 0, got {amount}")
        if name in out:
            raise ValueError(f"{name} is given twice")
        out[name] = value
    return out


def _resources_argument(text: str) -> dict[str, float]:
    try:
        return parse_resources(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"bad --resources {text!r}: {exc}") from None


def _memory_limit_argument(text: str) -> str:
    from .worker.memory import parse_memory_limit

    try:
        parse_memory_limit(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"bad --memory-limit {text!r}: {exc}") from None
    return text


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"seconds must be a finite number >= 0, got {text}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Says an option's default where there is one worth saying."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False, "", {}, argparse.SUPPRESS) or "default" in text:
            return text
        return super()._get_help_string(action) or text


def parser() -> argparse.ArgumentParser:
    """The ``shoal`` command line's parser (every option has a help text; a test checks)."""
    from . import __version__

    p = argparse.ArgumentParser(prog="shoal", description="shoal's command line: a scheduler, workers, checks",
                                formatter_class=_HelpFormatter)
    p.add_argument("--version", action="version", version=f"shoal {__version__}",
                   help="print shoal's version and exit")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND",
                         help="what to run ('shoal COMMAND --help' says more)")

    def command(name: str, text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=text, description=text,
                              formatter_class=_HelpFormatter)

    demo = command("demo", "run a demonstration workload on a local cluster (both kinds)")
    demo.add_argument("--n", type=int, default=2000, help="size of the square matrices multiplied")
    demo.add_argument("--block", type=int, default=500, help="tile size of those matrices")
    demo.add_argument("--chunks", type=int, default=16, help="chunks of the array that is summed")
    demo.add_argument("--chunk-size", type=int, default=1_000_000, help="elements per chunk of that array")
    demo.add_argument("--arg-mb", type=int, default=64, help="size (MB) of the array passed as a task argument")
    demo.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                      help="show progress bars while the workloads run (default: when stdout is a terminal)")
    demo.set_defaults(func=_demo)
    check = command("selfcheck", "check the transports: round trips and a large array, over inproc and tcp")
    check.add_argument("--size-mb", type=int, default=64, help="size (MB) of the array sent there and back")
    check.set_defaults(func=_selfcheck)
    sched = command("scheduler", "run a scheduler; prints its address (and its auth file) on stdout")
    sched.add_argument("--host", default="127.0.0.1",
                       help="interface to listen on (0.0.0.0: all of them; without TLS, a warning)")
    sched.add_argument("--port", type=int, default=DEFAULT_SCHEDULER_PORT,
                       help="port to listen on (0: a free one). Not dask's 8786: both schedulers run side by side")
    sched.add_argument("--dashboard-address", default=":8790", metavar="[HOST]:PORT", type=_dashboard_argument,
                       help="where to serve the dashboard (no HOST: the scheduler's --host; a port that is "
                            "taken: a free one). Not dask's 8787. It needs a login: the link printed on stdout "
                            "carries a token derived from the cluster's secret, which sets a cookie; "
                            "client.dashboard_link gives the same link")
    sched.add_argument("--no-dashboard", action="store_true", help="serve no dashboard")
    sched.add_argument("--dashboard-open", action="store_true",
                       help="serve the dashboard without login, on a loopback address only (warns): users of "
                            "this host see the workers and the counts by key prefix, but no task key or error "
                            "unless they log in with the token (setting dashboard-open). Without a secret "
                            "(--no-auth) the dashboard is always served so, on loopback only, showing everything")
    sched.add_argument("--metrics-public", action="store_true",
                       help="serve /metrics without login (counts by state, key prefix and worker; never a "
                            "key or an error; setting metrics-public). Otherwise a scraper sends "
                            "'Authorization: Bearer TOKEN'")
    _security_arguments(sched)
    sched.set_defaults(func=_scheduler)
    worker = command("worker", "run a worker (or --nworkers of them) that joins the scheduler at ADDRESS; "
                               "prints its address on stdout")
    worker.add_argument("address", metavar="ADDRESS",
                        help=f"the scheduler's address, e.g. tcp://127.0.0.1:{DEFAULT_SCHEDULER_PORT}")
    worker.add_argument("--nthreads", type=_positive, default=1, help="threads running tasks, per worker")
    worker.add_argument("--nworkers", type=_positive, default=1,
                        help="worker processes to start (named NAME-0, NAME-1, ... with --name)")
    worker.add_argument("--name", default="", help="the worker's name (default: its address)")
    worker.add_argument("--resources", type=_resources_argument, default={}, metavar="NAME=AMOUNT,...",
                        help="abstract resources each worker offers, e.g. \"GPU=2,MEM=10e9\": a task "
                             "submitted with resources={'GPU': 1} runs only where that much is free")
    worker.add_argument("--death-timeout", type=_seconds, default=DEFAULT_DEATH_TIMEOUT, metavar="SECONDS",
                        help="how long to wait for the scheduler: when started before it, and after losing it "
                             "(it is joined again when it comes back at ADDRESS); a scheduler that tells its "
                             "workers to close is obeyed at once. 0: no waiting")
    worker.add_argument("--host", default="127.0.0.1",
                        help="interface to listen on for peers (a free port); auto: the one that routes to "
                             "the scheduler")
    worker.add_argument("--memory-limit", type=_memory_limit_argument, default="auto", metavar="LIMIT",
                        help="memory of each worker: a size (4GiB, 500MB, bytes), a fraction of the host's "
                             "memory (0.5), auto (the host's memory, or its cgroup's limit, divided among "
                             "--nworkers) or 0 (none). Values beyond 60%% of it spill to disk, past 80%% the "
                             "worker pauses, past 95%% its nanny restarts it")
    worker.add_argument("--local-directory", default="", metavar="DIR",
                        help="where each worker makes its own directory for spilled values (default: "
                             "SHOAL_LOCAL_DIRECTORY, else the system's temporary directory)")
    worker.add_argument("--no-nanny", action="store_true",
                        help="run the worker in this process, without a nanny that restarts it when it dies "
                             "or passes its memory limit")
    worker.add_argument("--work-dir", default="", metavar="DIR",
                        help="the worker's own directory, made by its nanny (set by the nanny; not for users)")
    worker.add_argument("--nanny-address", default="", metavar="ADDRESS",
                        help="the address of the nanny that started this worker (set by the nanny)")
    _security_arguments(worker)
    worker.set_defaults(func=_worker)
    ssh = command("ssh", "run a cluster on HOSTS through ssh: the scheduler on the first, workers on the others; "
                         "prints the addresses, runs until Ctrl-C")
    ssh.add_argument("hosts", metavar="HOST", nargs="+",
                     help="[USER@]HOST: the scheduler's host first, then one per group of workers (a host may "
                          "be named twice; name the first again for workers there too)")
    ssh.add_argument("--nworkers", type=_positive, default=1, help="worker processes per worker host")
    ssh.add_argument("--nthreads", type=_positive, default=1, help="threads running tasks, per worker")
    ssh.add_argument("--memory-limit", type=_memory_limit_argument, default="auto", metavar="LIMIT",
                     help="memory of each worker, as for 'shoal worker --memory-limit'")
    ssh.add_argument("--scheduler-port", type=int, default=DEFAULT_SCHEDULER_PORT,
                     help="the scheduler's port on its host (0: a free one)")
    ssh.add_argument("--dashboard-address", default=":8790", metavar="[HOST]:PORT", type=_dashboard_argument,
                     help="where the scheduler serves its dashboard (no HOST: the scheduler's host)")
    ssh.add_argument("--no-dashboard", action="store_true", help="serve no dashboard")
    ssh.add_argument("--ssh-user", default="", help="user to log in as (default: ssh's: its config, or yours)")
    ssh.add_argument("--ssh-port", type=int, default=0, help="port of the hosts' sshd (default: ssh's, 22)")
    ssh.add_argument("--ssh-key", action="append", default=[], metavar="FILE",
                     help="a private key to log in with (repeatable; default: ssh's, and its agent)")
    ssh.add_argument("--known-hosts", default="", metavar="FILE",
                     help="known-hosts file the hosts' keys are checked against (default: ssh's)")
    ssh.add_argument("--ssh-config", default="", metavar="FILE", help="an ssh_config file for ssh's -F")
    ssh.add_argument("--ssh-option", action="append", default=[], metavar="NAME=VALUE",
                     help="more options for ssh's -o (repeatable)")
    ssh.add_argument("--remote-python", default=sys.executable, metavar="PATH",
                     help="the Python with shoal installed on the hosts (default: this one's path)")
    tls = ssh.add_argument_group("TLS (the files' contents go to the hosts, with the secret, over ssh)")
    tls.add_argument("--tls-ca-file", default=None, help="CA certificate (PEM): the cluster is tls://")
    tls.add_argument("--tls-cert", default=None, help="the cluster's certificate (PEM)")
    tls.add_argument("--tls-key", default=None, help="its private key (PEM)")
    ssh.set_defaults(func=_ssh)
    return p


def _ssh(args: argparse.Namespace) -> int:
    """``shoal ssh HOST...``: an :class:`~shoal.deploy.ssh.SSHCluster` until SIGINT or
    SIGTERM. The secret goes to an auth file of this user here, so clients on this
    machine find it for the scheduler's address; it is removed at the end."""
    from .comm import security
    from .deploy.spec import DeployError
    from .deploy.ssh import SSHCluster

    connect: dict[str, Any] = {}
    if args.ssh_user:
        connect["username"] = args.ssh_user
    if args.ssh_port:
        connect["port"] = args.ssh_port
    if args.ssh_key:
        connect["client_keys"] = args.ssh_key
    if args.known_hosts:
        connect["known_hosts"] = args.known_hosts
    if args.ssh_config:
        connect["config"] = args.ssh_config
    options = {}
    for item in args.ssh_option:
        name, sep, value = item.partition("=")
        if not sep or not name:
            print(f"shoal ssh: --ssh-option wants NAME=VALUE, got {item!r}", file=sys.stderr)
            return 2
        options[name] = value
    if options:
        connect["options"] = options
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        sec = None
        if args.tls_ca_file or args.tls_cert or args.tls_key:
            sec = security.Security(ca_file=args.tls_ca_file, cert=args.tls_cert, key=args.tls_key)
        cluster = SSHCluster(args.hosts, connect_options=connect, remote_python=args.remote_python, security=sec,
                             worker_options={"n_workers": args.nworkers, "nthreads": args.nthreads,
                                             "memory_limit": args.memory_limit},
                             scheduler_options={"port": args.scheduler_port,
                                                "dashboard_address": None if args.no_dashboard
                                                else args.dashboard_address})
    except (DeployError, ValueError, TypeError) as exc:
        print(f"shoal ssh: {exc}", file=sys.stderr, flush=True)
        return 1
    written = ""
    try:
        print(f"shoal scheduler at {cluster.scheduler_address}", flush=True)
        for addresses in cluster.worker_addresses.values():
            for address in addresses:
                print(f"shoal worker at {address}", flush=True)
        if cluster.security.auth:
            written = security.write_auth_file(cluster.scheduler_address, cluster.security)
            print(f"shoal scheduler auth file {written}", flush=True)
        stop.wait()
    finally:
        cluster.close()
        if written:
            security.remove_auth_file(cluster.scheduler_address, cluster.security)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the command ``argv`` (default: the process's arguments); returns its exit
    code (``shoal worker`` leaves the process itself, see :func:`_worker`)."""
    args = parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
