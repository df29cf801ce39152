"""The cluster workloads of the benchmark harness (``bench/workloads/cluster.py``,
``args.py``, ``arrays.py``) run end to end for shoal with ``--quick``. No timing assertions; dask and ray are optional extras
(the ``bench`` extra) and are neither required nor run here: only their registration is
checked, which imports neither."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN = os.path.join(ROOT, "bench", "run.py")
WORKLOADS = {
    "startup": ["startup", "import", "shutdown"],
    "tiny_tasks": ["throughput"],
    "tiny_tasks_inprocess": ["throughput"],
    "latency": ["latency", "latency_p90"],
    "tree_reduce": ["throughput"],
    "transfer_64MB": ["consumer", "producer", "memcpy", "consumer_vs_memcpy"],
    "transfer_512MB": ["consumer", "producer", "memcpy", "consumer_vs_memcpy"],
    "busy_owner": ["busy_owner", "idle_owner", "busy_task"],
    "task_args_64MB": ["seconds", "first", "GBps"],
    "task_args_64MB_cli": ["seconds", "first", "GBps"],
    "scatter_64MB": ["scatter", "use"],
}


def _run_quick(workloads: dict[str, list[str]], tmp_path) -> tuple[str, dict[str, dict]]:
    """Run ``workloads`` for shoal with ``--quick``; returns (stdout, results by workload)."""
    out_json = tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, RUN, "--systems", "shoal", "--workloads", ",".join(workloads), "--quick",
         "--json", str(out_json)],
        capture_output=True, text=True, timeout=280, cwd=ROOT, check=False,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    results = {r["workload"]: r for r in json.loads(out_json.read_text())["results"]}
    assert set(results) == set(workloads)
    return proc.stdout, results


def _registered_systems(names) -> dict[str, list[str]]:
    """The systems each workload registers, read without importing dask or ray."""
    code = (
        "import sys, json; sys.path.insert(0, sys.argv[1]); from bench import registry; "
        "w = registry.load_all(); "
        "print(json.dumps({n: sorted(w[n].systems) for n in sys.argv[2:]})); "
        "assert 'ray' not in sys.modules and 'distributed' not in sys.modules"
    )
    proc = subprocess.run([sys.executable, "-c", code, ROOT, *names], capture_output=True, text=True, check=False,
                          timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.timeout(300)
def test_bench_quick_runs_cluster_workloads_for_shoal(tmp_path):
    stdout, results = _run_quick(WORKLOADS, tmp_path)
    rows = [line.split() for line in stdout.splitlines()]
    for workload, metrics in WORKLOADS.items():
        for metric in metrics:
            assert any(r[:2] == [workload, metric] and "shoal" in r for r in rows), (
                f"no result row for {workload}/{metric} in:\n{stdout}"
            )
    assert all(r["runs"] and not r["errors"] for r in results.values())
    for name in ("transfer_64MB", "transfer_512MB"):
        info = results[name]["runs"][0]["info"]
        assert info["consumer_writeable"] in ("yes", "no")
    for name in ("task_args_64MB", "task_args_64MB_cli"):
        info = results[name]["runs"][0]["info"]
        # the arguments went through shared memory, and the task could write into them
        assert info["arg_writeable"] == "yes" and "shm=0.0MB" not in info["shoal_bytes_served"], info


#: workloads that also run on shoal over tls://
TLS_WORKLOADS = {"startup", "tiny_tasks", "latency", "tree_reduce", "transfer_64MB", "transfer_512MB", "busy_owner"}


def test_cluster_workloads_register_all_systems():
    systems = _registered_systems(WORKLOADS)
    for name in WORKLOADS:
        expected = ["dask", "shoal"] if name in ("tiny_tasks_inprocess", "task_args_64MB_cli") else ["dask", "ray", "shoal"]
        if name in TLS_WORKLOADS:
            expected.append("shoal-tls")
        assert systems[name] == expected, (name, systems[name])


@pytest.mark.timeout(200)
def test_bench_quick_runs_the_tls_variant(tmp_path):
    out_json = tmp_path / "tls.json"
    proc = subprocess.run(
        [sys.executable, RUN, "--systems", "shoal-tls", "--workloads", "latency,transfer_64MB", "--quick",
         "--json", str(out_json)],
        capture_output=True, text=True, timeout=180, cwd=ROOT, check=False,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    results = {r["workload"]: r for r in json.loads(out_json.read_text())["results"]}
    assert all(r["runs"] and not r["errors"] for r in results.values()), results
    # over tls as over tcp, the 64 MB value went through shared memory
    assert "shm=0.0MB" not in results["transfer_64MB"]["runs"][0]["info"]["shoal_bytes_served"]


ARRAY_WORKLOADS = {"matmul": ["seconds", "numpy", "vs_numpy"], "dask_array_mix": ["seconds"]}


@pytest.mark.timeout(300)
def test_bench_quick_runs_array_workloads_for_shoal(tmp_path):
    _, results = _run_quick(ARRAY_WORKLOADS, tmp_path)
    for name, metrics in ARRAY_WORKLOADS.items():
        run = results[name]["runs"][0]  # each result was checked against numpy / dask in the child
        assert not results[name]["errors"] and all(m in run["metrics"] for m in metrics), results[name]
    assert _registered_systems(ARRAY_WORKLOADS) == {name: ["dask", "shoal"] for name in ARRAY_WORKLOADS}
