"""dask's own tests, with a cluster as dask's default scheduler: shoal's and
dask.distributed's side by side, so a change is judged by how many pass on each.

    python bench/dask_suite.py                                   # shoal and distributed, the shuffle files
    python bench/dask_suite.py --systems shoal --shuffle-method shoal
    python bench/dask_suite.py --files dataframe/tests/test_multi.py -- -k merge   # pytest options after --

Each system runs the files in a fresh pytest process (the installed dask's tests, its
own conftest) with a cluster of ``--workers`` worker processes x 1 thread made the
default scheduler before the first test (``--shuffle-method``: dask's
``dataframe.shuffle.method`` for the whole run; default: each system's own choice).
Tests that call ``compute(scheduler=...)`` themselves (dask's ``assert_eq`` asks for
``"sync"``) run their graphs on that scheduler, with the shuffle method the cluster's
client picked. Prints passed/failed/errors/skipped by file and system, then the tests
that pass on one system and not on the other.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

FILES = ["dataframe/tests/test_shuffle.py", "dataframe/tests/test_multi.py", "array/tests/test_rechunk.py"]
SYSTEMS = ("shoal", "distributed")

#: the pytest plugin each run loads (written next to the junit file; env says what to start)
PLUGIN = '''
import os

import dask

_client = None
_cluster = None


def pytest_configure(config):
    global _client, _cluster
    system = os.environ["DASK_SUITE_SYSTEM"]
    workers = int(os.environ["DASK_SUITE_WORKERS"])
    if system == "shoal":
        import shoal

        _client = shoal.Client(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None)
    else:
        from distributed import Client, LocalCluster

        _cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                                dashboard_address=None, host="127.0.0.1")
        _client = Client(_cluster)
    method = os.environ.get("DASK_SUITE_SHUFFLE_METHOD")
    if method:
        dask.config.set({"dataframe.shuffle.method": method})


def pytest_unconfigure(config):
    if _client is not None:
        _client.close()
    if _cluster is not None:
        _cluster.close()
'''


def run(system: str, files: list[str], args: argparse.Namespace, scratch: Path) -> dict[str, dict[str, str]]:
    """``{file: {test id: outcome}}`` of one system's run."""
    import dask

    root = Path(dask.__file__).parent
    junit = scratch / f"{system}.xml"
    (scratch / "dask_suite_plugin.py").write_text(PLUGIN)
    env = dict(os.environ, DASK_SUITE_SYSTEM=system, DASK_SUITE_WORKERS=str(args.workers),
               PYTHONPATH=os.pathsep.join(p for p in (str(scratch), os.environ.get("PYTHONPATH", "")) if p))
    if args.shuffle_method:
        env["DASK_SUITE_SHUFFLE_METHOD"] = args.shuffle_method
    command = [sys.executable, "-m", "pytest", "-p", "dask_suite_plugin", "-p", "no:cacheprovider", "-q",
               "-W", "ignore", f"--timeout={args.timeout}", f"--junitxml={junit}", "--rootdir", str(root),
               *[str(root / f) for f in files], *args.pytest]
    print(f"{system}: {' '.join(command[1:])}", flush=True)
    subprocess.run(command, env=env, cwd=scratch, stdout=subprocess.DEVNULL if not args.verbose else None)
    outcomes: dict[str, dict[str, str]] = {}
    if not junit.exists():
        return outcomes
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        tags = {child.tag for child in case}
        outcome = ("failed" if "failure" in tags else "error" if "error" in tags
                   else "skipped" if "skipped" in tags else "passed")
        parts = (case.get("classname") or "?").split(".")
        ends = [i for i, part in enumerate(parts) if part.startswith("test_")]
        module = ".".join(parts[: ends[0] + 1] if ends else parts).removeprefix("dask.")
        outcomes.setdefault(module, {})[name] = outcome
    return outcomes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--files", default=",".join(FILES), help="paths under the installed dask package")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--shuffle-method", default="")
    parser.add_argument("--timeout", type=int, default=60, help="seconds per test")
    parser.add_argument("-v", "--verbose", action="store_true", help="show pytest's output")
    parser.add_argument("pytest", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args()
    systems = [s for s in args.systems.split(",") if s]
    files = [f for f in args.files.split(",") if f]
    results: dict[str, dict[str, str]] = {}
    with tempfile.TemporaryDirectory(prefix="dask-suite-") as scratch:
        for system in systems:
            merged: dict[str, str] = {}
            for module, tests in run(system, files, args, Path(scratch)).items():
                counts = Counter(tests.values())
                print(f"  {system:12} {module:45} " + " ".join(f"{k} {counts[k]}" for k in
                                                               ("passed", "failed", "error", "skipped")), flush=True)
                merged.update(tests)
            total = Counter(merged.values())
            print(f"  {system:12} {'all':45} " + " ".join(f"{k} {total[k]}" for k in
                                                          ("passed", "failed", "error", "skipped")), flush=True)
            results[system] = merged
    if len(systems) == 2:
        a, b = systems
        for first, second in ((a, b), (b, a)):
            only = sorted(t for t, o in results[first].items() if o == "passed" and results[second].get(t) not in
                          (None, "passed", "skipped"))
            print(f"pass on {first}, not on {second}: {len(only)}")
            for test in only:
                print(f"  {test}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
