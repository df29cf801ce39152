"""The benchmark harness runs end to end (``bench/run.py --quick``). No timing assertions:
only that every workload produces a result row and the harness exits cleanly."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN = os.path.join(ROOT, "bench", "run.py")
WORKLOADS = {
    "rpc_latency": ["tcp_process_rpc", "inproc_same_loop_rpc", "inproc_thread_comm"],
    "tcp_bandwidth": ["shoal", "plain_fresh", "plain_warm", "shoal_vs_plain_fresh"],
}


@pytest.mark.timeout(240)
def test_bench_quick_runs_every_workload(tmp_path):
    out_json = tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, RUN, "--systems", "shoal", "--workloads", ",".join(WORKLOADS), "--quick",
         "--json", str(out_json)],
        capture_output=True, text=True, timeout=220, cwd=ROOT,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    rows = [line.split() for line in proc.stdout.splitlines()]
    for workload, metrics in WORKLOADS.items():
        for metric in metrics:
            assert any(r[:2] == [workload, metric] and "shoal" in r for r in rows), (
                f"no result row for {workload}/{metric} in:\n{proc.stdout}"
            )
    data = json.loads(out_json.read_text())
    assert {r["workload"] for r in data["results"]} == set(WORKLOADS)
    assert all(r["runs"] and not r["errors"] for r in data["results"])


def test_bench_lists_workloads():
    proc = subprocess.run([sys.executable, RUN, "--list"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    for workload in WORKLOADS:
        assert workload in proc.stdout
