"""bench/run.py's multi-host workloads run end to end on test hosts (``--quick``, shoal
only). No timing assertions: each produces its figures and the harness exits cleanly."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from hostcluster import require_hosts

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
METRICS = {"hosts_transfer": {"bandwidth", "vs_socket", "socket", "producer"},
           "hosts_tiny_tasks": {"throughput"}, "hosts_tree_reduce": {"throughput"},
           "hosts_df_shuffle": {"shuffle_shoal", "shuffle_shoal_1x4", "shuffle_shoal_cross_mb",
                                "shuffle_shoal_must_mb", "set_index_shoal", "set_index_shoal_cross_mb"}}


@pytest.mark.timeout(480)
def test_bench_quick_runs_the_multi_host_workloads(tmp_path):
    require_hosts()
    out_json = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "run.py"), "--systems", "shoal",
                           "--workloads", ",".join(METRICS), "--quick", "--json", str(out_json)],
                          capture_output=True, text=True, timeout=460, cwd=ROOT)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    data = json.loads(out_json.read_text())
    assert {r["workload"] for r in data["results"]} == set(METRICS)
    for r in data["results"]:
        assert r["runs"] and not r["errors"], r
        figures = {k for run in r["runs"] for k, v in run["metrics"].items() if isinstance(v, (int, float))}
        assert METRICS[r["workload"]] <= figures, (r["workload"], figures)
        assert all(run["metrics"][m] > 0 for run in r["runs"] for m in METRICS[r["workload"]])
