"""Workloads across test hosts (network namespaces of this machine, each with its own
/dev/shm, :mod:`shoal.testhosts`; root only): the scheduler and the client on host 0,
workers on hosts 1 and 2, every process started with its system's command line, as on
several machines. Values between hosts go over tcp through a veth pair and a bridge.

- ``hosts_transfer``: an array of ``mb`` MB made by the worker on host 1, read by a task
  on host 2's worker: the consumer step's bandwidth, the producer step's time, and the
  same bytes over a plain socket between the same two hosts (``vs_socket``: the
  system's bandwidth over the socket's; the issue's target for shoal is 0.9).
- ``hosts_tiny_tasks``: 10,000 ``inc(i)`` on 2 workers x 1 thread on each worker host.
- ``hosts_tree_reduce``: the binary-tree sum of ``tree_reduce`` (4,096 leaves) on the same.
- ``hosts_df_shuffle``: ``df_shuffle``'s four operations (shuffle, merge, set_index,
  groupby with split_out) on 2 workers x 1 thread on each of two hosts, and on 4
  workers of one host (``_1x4``, the issue's reference), every result checked against
  pandas; ``_cross_mb``: the bytes between the two worker hosts during the operation
  (nftables counters in host 1's namespace, IP headers included), and for shuffle and
  set_index, whose output rows are the input rows, ``_must_mb``: the bytes of the rows
  whose output partition is on another host than the one they were made on (each row
  carries the identity of the namespace it was made in; an output partition's bytes
  per row as pandas counts them) and ``_cross_vs_must``, their ratio.

Each takes ``delay_ms`` and ``loss`` (default 0): every packet that comes in to a worker
host waits ``delay_ms`` (:meth:`shoal.testhosts.Host.delay`), and ``loss`` % of the
packets to and from it are dropped, e.g. ``--set delay_ms=20 --set loss=1``.

dask.distributed: ``dask scheduler --no-dashboard`` and ``dask worker --nworkers N
--nthreads 1 --memory-limit 0 --no-dashboard``, its default configuration (root-task
queuing on). shoal: ``shoal scheduler --no-dashboard`` and ``shoal worker --nworkers N
--memory-limit 0`` with a shared auth file. Ray is not measured here: a Ray cluster
across namespaces needs its head's ports and object manager set up by hand.
"""

from __future__ import annotations

import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from ..registry import Workload
from .cluster import _register, add, consume, inc, make_array

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_perf = time.perf_counter
SYSTEMS = ("shoal", "dask")

hosts_transfer = Workload(
    "hosts_transfer",
    "An array of `mb` MB made on test host 1's worker and read by a task on host 2's "
    "(tcp between network namespaces): consumer-step bandwidth (median of `rounds`), "
    "producer-step time, and a plain socket's bandwidth between the same two hosts",
    metrics={"bandwidth": "GB/s", "vs_socket": "x", "socket": "GB/s", "producer": "ms"},
    params={"mb": 64, "rounds": 5, "delay_ms": 0, "loss": 0},
    quick={"mb": 8, "rounds": 2},
    timeout=600,
)
hosts_tiny_tasks = Workload(
    "hosts_tiny_tasks",
    "10,000 inc(i) (map, then gather) on 2 workers x 1 thread on each of two test hosts; "
    "client and scheduler on a third",
    metrics={"throughput": "tasks/s"},
    params={"n": 10_000, "delay_ms": 0, "loss": 0},
    quick={"n": 200},
    timeout=600,
)
hosts_tree_reduce = Workload(
    "hosts_tree_reduce",
    "Binary-tree sum of `leaves` inc(i) leaves (8,191 tasks at 4,096) on 2 workers x 1 "
    "thread on each of two test hosts; client and scheduler on a third",
    metrics={"throughput": "tasks/s"},
    params={"leaves": 4096, "delay_ms": 0, "loss": 0},
    quick={"leaves": 64},
    timeout=600,
)

hosts_df_shuffle = Workload(
    "hosts_df_shuffle",
    "df_shuffle's operations (8M rows in 32 partitions: shuffle('k'), merge with a frame a "
    "quarter the size, set_index('k'), groupby('k').sum(split_out=8)) on 2 workers x 1 thread "
    "on each of two test hosts and on 4 workers of one (`_1x4`): seconds (median of `rounds` "
    "after one untimed round), bytes between the worker hosts (`_cross_mb`), and for shuffle and set_index the "
    "bytes whose rows must cross (`_must_mb`, `_cross_vs_must`); every result checked "
    "against pandas. shoal: its own shuffle; dask: P2P and tasks",
    metrics={f"{op}_{m}{tail}": unit for op in ("shuffle", "merge", "set_index", "groupby")
             for m in ("shoal", "p2p", "tasks")
             for tail, unit in (("", "s"), ("_1x4", "s"), ("_vs_1x4", "x ref"), ("_cross_mb", "MB"),
                                ("_must_mb", "MB"), ("_cross_vs_must", "x ref"))},
    params={"rows": 8_000_000, "partitions": 32, "ops": "shuffle,merge,set_index,groupby", "methods": "",
            "rounds": 3},
    quick={"rows": 200_000, "partitions": 8, "ops": "shuffle,set_index", "rounds": 1},
    timeout=2400,
)

_PORT = {"shoal": 8686, "dask": 8786}
_DF_METHODS = {"shoal": {"shoal": "shoal"}, "dask": {"p2p": "p2p", "tasks": "tasks"}}


def _namespace() -> int:
    """The identity of the network namespace (test host) this process runs in."""
    return os.stat("/proc/self/ns/net").st_ino


def make_part_here(i: int, rows: int, keys: int, seed: int) -> Any:
    """``df_shuffle``'s partition ``i``, each row marked with the test host it was made
    on (column ``h``)."""
    from .dataframes import make_part

    part = make_part(i, rows, keys, seed)
    part["h"] = _namespace()
    return part


def summarize_here(part: Any, column: str | None = None) -> Any:
    """``df_shuffle``'s line of an output partition, with its bytes (pandas' count, index
    included) and how many of its rows were made on the host it is on."""
    from .dataframes import summarize

    line = summarize(part, column)
    line["bytes"] = int(part.memory_usage(index=True, deep=True).sum())
    line["here"] = int((part["h"] == _namespace()).sum()) if "h" in part else -1
    return line


def _df_measure(c: Any, system: str, args: dict[str, Any]) -> dict[str, Any]:
    import dask.dataframe as dd

    from shoal.testhosts import traffic_of

    from .dataframes import _check, _chosen, _expected, _lines

    rows, partitions, ops = args["rows"], args["partitions"], args["ops"]
    per, keys = rows // partitions, max(1, rows // 4)
    left = dd.from_map(make_part_here, range(partitions), rows=per, keys=keys, seed=1)
    right = dd.from_map(make_part_here, range(max(1, partitions // 4)), rows=per, keys=keys, seed=2)
    right = right.rename(columns={"g": "g2", "v": "w", "h": "h2"})
    want = _expected(rows, partitions, ops)
    methods = _chosen(_DF_METHODS[system], args["methods"])
    counted = args.get("count_in")
    out: dict[str, Any] = {}
    for op in ops.split(","):
        for name, method in methods.items():
            times = []
            for i in range(1 + args["rounds"]):  # the first round untimed
                before = traffic_of(counted) if counted else (0, 0)
                t0 = _perf()
                lines = c.compute(_lines(op, left, right, method, summarize_here)).result()
                times.append(_perf() - t0)
                after = traffic_of(counted) if counted else (0, 0)
                _check(op, lines, want[op])
            out[f"{op}_{name}"] = statistics.median(times[1:])
            if counted:
                out[f"{op}_{name}_cross_mb"] = (sum(after) - sum(before)) / 1e6
                if op in ("shuffle", "set_index"):
                    full = lines[lines["rows"] > 0]
                    must = float((full["bytes"] * (full["rows"] - full["here"]) / full["rows"]).sum())
                    out[f"{op}_{name}_must_mb"] = must / 1e6
                    out[f"{op}_{name}_cross_vs_must"] = out[f"{op}_{name}_cross_mb"] / max(out[f"{op}_{name}_must_mb"], 1e-9)
    return out

# ------------------------------------------------------------------ on the client host


def _measure(c: Any, lib: Any, system: str, by_host: dict[str, list[str]], args: dict[str, Any]) -> dict[str, Any]:
    kind = args["kind"]
    c.submit(inc, 0, pure=False).result()  # warm: connections, function caches
    if kind == "df":
        return _df_measure(c, system, args)
    h1, h2 = args["ips"][1], args["ips"][2]
    if kind == "transfer":
        nbytes = args["mb"] << 20
        producer, consumer = by_host[h1][0], by_host[h2][0]
        made, read = [], []
        for _ in range(args["rounds"]):
            t0 = _perf()
            x = c.submit(make_array, nbytes, workers=[producer], pure=False)
            lib.wait([x])
            t1 = _perf()
            y = c.submit(consume, x, workers=[consumer], pure=False)
            total, writeable, size = y.result()
            t2 = _perf()
            if size != nbytes:
                raise AssertionError(f"read {size} bytes, not {nbytes}")
            made.append(t1 - t0)
            read.append(t2 - t1)
            del x, y
        return {"bandwidth": nbytes / statistics.median(read) / 1e9, "producer": statistics.median(made) * 1e3}
    if kind == "tiny":
        n = args["n"]
        c.gather(c.map(inc, range(200)))
        t0 = _perf()
        out = c.gather(c.map(inc, range(n)))
        dt = _perf() - t0
        if sum(out) != n * (n + 1) // 2:
            raise AssertionError("wrong sum")
        return {"throughput": n / dt}
    leaves = args["leaves"]
    t0 = _perf()
    level = c.map(inc, range(leaves))
    tasks, held = len(level), [level]
    while len(level) > 1:
        level = c.map(add, level[0::2], level[1::2])
        tasks += len(level)
        held.append(level)
    total = level[0].result()
    dt = _perf() - t0
    if total != leaves * (leaves + 1) // 2:
        raise AssertionError("wrong tree sum")
    return {"throughput": tasks / dt}


def client_main() -> None:
    """The client's side, run on host 0: connects, waits for the workers, measures,
    prints ``RESULT`` and the JSON of the figures."""
    args = json.loads(sys.argv[1])
    system = args["system"]
    if system == "shoal":
        import shoal as lib

        c = lib.Client(args["address"], timeout=60)
    else:
        import distributed as lib

        c = lib.Client(args["address"], timeout=60)
    try:
        c.wait_for_workers(args["n_workers"], timeout=120)
        by_host: dict[str, list[str]] = {}
        for address in sorted(c.scheduler_info()["workers"]):
            by_host.setdefault(address.split("//")[1].rsplit(":", 1)[0], []).append(address)
        out = _measure(c, lib, system, by_host, args)
    finally:
        c.close()
    print("RESULT" + json.dumps(out), flush=True)


# ------------------------------------------------------------------ the plain socket

_SOCKET_SERVER = r"""
import socket, sys
ip, port, nbytes, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
srv = socket.create_server((ip, port))
print("READY", flush=True)
conn, _ = srv.accept()
buf = bytearray(nbytes)
view = memoryview(buf)
for _ in range(rounds):
    got = 0
    while got < nbytes:
        n = conn.recv_into(view[got:])
        if not n:
            raise SystemExit("closed early")
        got += n
    conn.sendall(b"k")
conn.close()
"""

_SOCKET_CLIENT = r"""
import json, socket, statistics, sys, time
ip, port, nbytes, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
data = bytearray(nbytes)
s = socket.create_connection((ip, port))
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
times = []
for _ in range(rounds):
    t0 = time.perf_counter()
    s.sendall(data)
    if s.recv(1) != b"k":
        raise SystemExit("no ack")
    times.append(time.perf_counter() - t0)
s.close()
print("RESULT" + json.dumps({"socket": nbytes / statistics.median(times) / 1e9}), flush=True)
"""


def _result(done: subprocess.CompletedProcess[str], what: str) -> dict[str, Any]:
    for line in done.stdout.splitlines():
        if line.startswith("RESULT"):
            return dict(json.loads(line[6:]))
    raise RuntimeError(f"{what} exited with {done.returncode} and no result:\n{done.stderr[-3000:]}")


def _plain_socket(hosts: Any, nbytes: int, rounds: int) -> float:
    h1, h2 = hosts[1], hosts[2]
    server = h2.popen([sys.executable, "-c", _SOCKET_SERVER, h2.ip, "9999", str(nbytes), str(rounds + 1)],
                      stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None and server.stdout.readline().strip() == "READY"
    done = h1.run([sys.executable, "-c", _SOCKET_CLIENT, h2.ip, "9999", str(nbytes), str(rounds + 1)], timeout=300)
    server.wait(timeout=60)
    return float(_result(done, "the socket client")["socket"])


# ------------------------------------------------------------------ the clusters


def _on_hosts(system: str, kind: str, per_host: int, delay_ms: float = 0, loss: float = 0,
              worker_hosts: int = 2, **params: Any) -> dict[str, Any]:
    from shoal.testhosts import TestHosts, available

    why = available()
    if why is not None:
        raise RuntimeError(why)
    base = tempfile.mkdtemp(prefix="shoal-bench-hosts-")
    secret = os.path.join(base, "secret")
    with open(secret, "w") as f:
        f.write(secrets.token_hex(32))
    os.chmod(secret, 0o600)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([_ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "SHOAL_AUTH_FILE": secret, "SHOAL_AUTH_DIR": os.path.join(base, "auth"), "HOME": base,
           "OMP_NUM_THREADS": "1"}
    try:
        with TestHosts(1 + worker_hosts, shm_size="2g") as hosts:
            h0 = hosts[0]
            address = f"tcp://{h0.ip}:{_PORT[system]}"
            if system == "shoal":
                s = h0.popen([sys.executable, "-m", "shoal", "scheduler", "--host", h0.ip, "--port",
                              str(_PORT[system]), "--no-dashboard", "--auth-file", secret], stdout=subprocess.PIPE,
                             text=True, env=env)
                assert s.stdout is not None and s.stdout.readline().startswith("shoal scheduler at ")
                worker = [sys.executable, "-m", "shoal", "worker", address, "--nworkers", str(per_host),
                          "--nthreads", "1", "--memory-limit", "0", "--auth-file", secret]
            else:
                h0.popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", h0.ip, "--port",
                          str(_PORT[system]), "--no-dashboard"], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, env=env)
                worker = [sys.executable, "-m", "distributed.cli.dask_worker", address, "--nworkers", str(per_host),
                          "--nthreads", "1", "--memory-limit", "0", "--no-dashboard"]
            for h in hosts[1:]:
                h.popen([*worker, "--host", h.ip], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
                if delay_ms:
                    h.delay(delay_ms)
                if loss:
                    h.lose(loss)
            args = {"system": system, "address": address, "kind": kind, "n_workers": worker_hosts * per_host,
                    "ips": [h.ip for h in hosts], **params}
            if worker_hosts == 2:  # the bytes between the worker hosts, read by the client
                hosts[1].count_traffic(hosts[2].ip)
                args["count_in"] = hosts[1].netns
            done = h0.run([sys.executable, "-c", "from bench.workloads.hosts import client_main; client_main()",
                           json.dumps(args)], timeout=2000 if kind == "df" else 500, env=env, cwd=_ROOT)
            out = _result(done, f"the {system} client")
            if kind == "transfer":
                out["socket"] = _plain_socket(hosts, params["mb"] << 20, params["rounds"])
                out["vs_socket"] = out["bandwidth"] / out["socket"]
            return out
    finally:
        import shutil

        shutil.rmtree(base, ignore_errors=True)


def _transfer(system: str, mb: int, rounds: int, delay_ms: float, loss: float) -> dict[str, Any]:
    return _on_hosts(system, "transfer", 1, delay_ms, loss, mb=mb, rounds=rounds)


def _tiny(system: str, n: int, delay_ms: float, loss: float) -> dict[str, Any]:
    return _on_hosts(system, "tiny", 2, delay_ms, loss, n=n)


def _tree(system: str, leaves: int, delay_ms: float, loss: float) -> dict[str, Any]:
    return _on_hosts(system, "tree", 2, delay_ms, loss, leaves=leaves)


def _df(system: str, rows: int, partitions: int, ops: str, methods: str, rounds: int) -> dict[str, Any]:
    params = {"rows": rows, "partitions": partitions, "ops": ops, "methods": methods, "rounds": rounds}
    out = _on_hosts(system, "df", 2, **params)
    one = _on_hosts(system, "df", 4, worker_hosts=1, **params)
    for key, seconds in one.items():
        out[f"{key}_1x4"] = seconds
        out[f"{key}_vs_1x4"] = out[key] / seconds
    return out


_register(hosts_transfer, SYSTEMS, _transfer)
_register(hosts_df_shuffle, SYSTEMS, _df)
_register(hosts_tiny_tasks, SYSTEMS, _tiny)
_register(hosts_tree_reduce, SYSTEMS, _tree)
