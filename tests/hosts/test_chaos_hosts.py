"""Never a wrong answer across hosts: shoal.chaos's mixed graphs on workers of two test
hosts (each with a scratch disk of its own), a random worker process killed (-9) every
2-5 s and restarted by its nanny, each graph checked against pandas/numpy/plain Python."""

from __future__ import annotations

import pytest
from hostcluster import host_cluster, on_client_host

pytestmark = pytest.mark.timeout(300)


def test_graphs_stay_right_while_workers_of_two_hosts_are_killed(tmp_path) -> None:
    env = {"SHOAL_NANNY_MAX_RESTARTS": "10000"}
    with host_cluster(tmp_path, env=env, scratch=True) as cluster:
        out = on_client_host(cluster, """
import random
from shoal.chaos import kill_a_worker, run_chaos
report = run_chaos(c, kill_a_worker(c, random.Random(3)), graphs=8, seed=3, kill_every=(2.0, 5.0),
                   deadline=60)
out = {"summary": report.summary(), "wrong": report.wrong, "hangs": report.hangs, "errors": report.errors,
       "unexplained": report.unexplained, "kills": report.kills, "total": report.total}
""")
    assert not out["wrong"], out
    assert not out["hangs"], out
    assert not out["unexplained"], out
    assert out["total"] == 8 and out["kills"] >= 1, out
