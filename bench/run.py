"""shoal's benchmark harness.

    python bench/run.py --systems shoal,dask,ray --workloads rpc_latency,tcp_bandwidth
    python bench/run.py --list
    python bench/run.py --workloads rpc_latency --quick
    python bench/run.py --workloads tcp_bandwidth --repeat 7 --set mb=256 --json out.json

Every measurement runs in a fresh interpreter (``bench/_child.py``), ``--repeat`` times
(default 5; 1 with ``--quick``). The table shows, per workload, metric and system, the
median over repeats and the spread (min-max), and, when several systems ran, the ratio
``system / shoal`` of the medians. Workloads live in ``bench/workloads/``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
if _ROOT not in sys.path:
    # appended: a PYTHONPATH entry may supply another shoal to measure (e.g. a baseline)
    sys.path.append(_ROOT)

from bench import registry  # noqa: E402
from bench._child import MARKER  # noqa: E402

CHILD = os.path.join(_HERE, "_child.py")


def run_child(workload: registry.Workload, system: str, params: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One measurement in a fresh interpreter; returns the child's result dict."""
    cmd = [sys.executable, CHILD, workload.name, system, json.dumps(params)]
    t0 = time.perf_counter()
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=_ROOT) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except BaseException as exc:
            # SIGINT first: the child's context managers (clusters, test hosts) clean up
            proc.send_signal(signal.SIGINT)
            try:
                _, stderr = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, stderr = proc.communicate()
            if not isinstance(exc, subprocess.TimeoutExpired):
                raise
            return {"error": f"timed out after {timeout:.0f}s", "stderr": _text(stderr)[-4000:]}
    result: dict[str, Any] | None = None
    for line in stdout.splitlines():
        if line.startswith(MARKER):
            result = json.loads(line[len(MARKER):])
    if result is None:
        result = {"error": f"child exited with status {proc.returncode} without a result"}
    if "error" in result or proc.returncode != 0:
        result.setdefault("error", f"child exited with status {proc.returncode}")
        result["stderr"] = stderr[-4000:]
    result["process_s"] = time.perf_counter() - t0
    return result


def _text(data: Any) -> str:
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data


def summarize(runs: list[dict[str, Any]], workload: registry.Workload) -> dict[str, dict[str, Any]]:
    summary: dict[str, dict[str, Any]] = {}
    names = list(workload.metrics) + sorted(
        {m for r in runs for m in r.get("metrics", {}) if m not in workload.metrics}
    )
    for metric in names:
        values = [r["metrics"][metric] for r in runs if metric in r.get("metrics", {})]
        if not values:
            continue
        summary[metric] = {
            "unit": workload.metrics.get(metric, ""),
            "median": statistics.median(values),
            "min": min(values),
            "max": max(values),
            "n": len(values),
            "values": values,
        }
    return summary


def _fmt(x: float) -> str:
    a = abs(x)
    if a >= 1000:
        return f"{x:,.0f}"
    if a >= 100:
        return f"{x:.1f}"
    if a >= 1:
        return f"{x:.2f}"
    return f"{x:.3f}"


def print_table(results: list[dict[str, Any]], out: Any = sys.stdout) -> None:
    header = ["workload", "metric", "unit", "system", "median", "spread (min-max)", "n", "vs shoal"]
    rows: list[list[str]] = []
    by_workload: dict[str, list[dict[str, Any]]] = {}
    for res in results:
        by_workload.setdefault(res["workload"], []).append(res)
    for name, entries in by_workload.items():
        shoal = next((e for e in entries if e["system"] == "shoal"), None)
        metrics: list[str] = []
        for e in entries:
            metrics += [m for m in e["summary"] if m not in metrics]
        for e in entries:
            if not e["summary"]:
                rows.append([name, "-", "", e["system"], "FAILED", e["errors"][0][:60] if e["errors"] else "", "0", ""])
        for metric in metrics:
            for e in entries:
                s = e["summary"].get(metric)
                if s is None:
                    continue
                ratio = ""
                if e["system"] != "shoal" and shoal is not None and metric in shoal["summary"]:
                    base = shoal["summary"][metric]["median"]
                    ratio = f"{s['median'] / base:.2f}x" if base else ""
                better = {True: "lower better", False: "higher better"}.get(registry.UNITS.get(s["unit"]))
                unit = s["unit"] + (f" ({better.split()[0]})" if better else "")
                fails = len(e["errors"])
                rows.append([
                    name, metric, unit, e["system"], _fmt(s["median"]),
                    f"{_fmt(s['min'])} - {_fmt(s['max'])}", str(s["n"]) + (f" ({fails} failed)" if fails else ""), ratio,
                ])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths))
    print(line, file=out)
    print("-" * len(line), file=out)
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)), file=out)


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": platform.node(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=_ROOT, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                               cwd=_ROOT, timeout=10)
        if head.returncode == 0:
            info["git"] = head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    from importlib.metadata import PackageNotFoundError, version

    for pkg in ("shoal", "uvloop", "numpy", "msgpack", "dask", "distributed", "ray"):
        try:
            info[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return info


def _parse_set(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise SystemExit(f"--set expects key=value, got {item!r}")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default="shoal", help="comma-separated: shoal,dask,ray (default shoal)")
    parser.add_argument("--workloads", default="", help="comma-separated workload names, or 'all'")
    parser.add_argument("--repeat", type=int, default=None, help="fresh processes per measurement (default 5, --quick 1)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and 1 repeat (smoke test)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a workload parameter (JSON value), e.g. --set mb=256 --set loop=asyncio")
    parser.add_argument("--json", metavar="PATH", help="write all results (every repeat) to PATH")
    parser.add_argument("--list", action="store_true", help="list workloads and the systems they support")
    parser.add_argument("-v", "--verbose", action="store_true", help="print each repeat as it finishes")
    args = parser.parse_args(argv)

    workloads = registry.load_all()
    if args.list or not args.workloads:
        for w in workloads.values():
            print(f"{w.name:18s} systems: {', '.join(w.systems):18s} params: {w.params}")
            print(f"{'':18s} {w.description}\n")
        return 0 if args.list else 2

    names = list(workloads) if args.workloads == "all" else [n.strip() for n in args.workloads.split(",") if n.strip()]
    unknown = [n for n in names if n not in workloads]
    if unknown:
        parser.error(f"unknown workload(s) {unknown}; known: {', '.join(workloads)}")
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    repeat = args.repeat if args.repeat is not None else (1 if args.quick else 5)
    overrides = _parse_set(args.set)
    unused = [k for k in overrides if not any(k in workloads[n].params for n in names)]
    if unused:
        parser.error(f"--set {', '.join(unused)}: no selected workload has such a parameter")

    info = machine_info()
    print(f"# {info['date']}  {info['host']}  {info['cpus']} cpus  {info.get('cpu', '')}  python {info['python']}"
          f"  load {info['loadavg'][0]}  git {info.get('git', '?')}")
    print(f"# repeat={repeat} quick={args.quick} systems={','.join(systems)}", flush=True)

    results: list[dict[str, Any]] = []
    failed = False
    for name in names:
        w = workloads[name]
        params = w.resolve_params(args.quick, {k: v for k, v in overrides.items() if k in w.params})
        for system in systems:
            if system not in w.systems:
                print(f"# {name}: no {system} implementation, skipped", flush=True)
                continue
            runs, errors = [], []
            for i in range(repeat):
                r = run_child(w, system, params, w.timeout)
                if "error" in r:
                    errors.append(r["error"])
                    failed = True
                    print(f"# {name}/{system} run {i + 1}: FAILED: {r['error']}\n{r.get('traceback', '')}{r.get('stderr', '')}",
                          file=sys.stderr, flush=True)
                else:
                    runs.append(r)
                    if args.verbose:
                        print(f"# {name}/{system} run {i + 1}: {r['metrics']} {r['info']}", flush=True)
            infos = [r["info"] for r in runs]
            results.append({
                "workload": name, "system": system, "params": params, "runs": runs, "errors": errors,
                "summary": summarize(runs, w), "info": infos[-1] if infos else {},
            })
            extra = {k: v for k, v in (infos[-1] if infos else {}).items() if isinstance(v, str)}
            loads = [i["load1_before"] for i in infos if "load1_before" in i]
            if loads:
                extra["load1"] = f"{min(loads)}-{max(loads)}"
            print(f"# {name}/{system}: {len(runs)}/{repeat} ok" + (f"  {extra}" if extra else ""), flush=True)

    print()
    print_table(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "argv": sys.argv, "repeat": repeat, "quick": args.quick, "results": results},
                      f, indent=1, default=str)
        print(f"\n# wrote {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
