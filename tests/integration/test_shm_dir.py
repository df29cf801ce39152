"""``SHOAL_SHM_DIR``: a cluster whose segments live in another tmpfs than /dev/shm (here
a small one the test mounts): values still go through shared memory while it has room,
over tcp once it is full, every result is right, and nothing is left in it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from shoal_helpers import small_tmpfs

pytestmark = pytest.mark.timeout(120)

SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import shoal

    def make(i):
        return np.full(1 << 17, float(i))  # 1 MiB

    def total(*arrays):
        return float(sum(a.sum() for a in arrays))

    with shoal.LocalCluster(n_workers=2, processes=True) as cluster, shoal.Client(cluster) as client:
        a, b = sorted(client.scheduler_info()["workers"])
        parts = [client.submit(make, i, workers=[a]) for i in range(12)]
        result = client.submit(total, *parts, workers=[b]).result()
        stats = client.transfer_stats()
        # b mapped what a placed in shared memory; a served the rest over tcp
        print(json.dumps({"result": result, "shm": stats[b]["shm"], "tcp": stats[a]["tcp"]}))
""")


def test_a_cluster_uses_the_shared_memory_directory_it_is_given():
    with small_tmpfs("6m") as shm_dir:
        env = {**os.environ, "SHOAL_SHM_DIR": str(shm_dir)}
        p = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=100)
        assert p.returncode == 0, p.stderr
        out = json.loads(p.stdout.strip().splitlines()[-1])
        assert out["result"] == float(sum(range(12))) * (1 << 17)
        # the first values fit in the 6 MiB tmpfs and were mapped; the rest crossed over tcp
        assert out["shm"] >= 1 << 20
        assert out["tcp"] >= 1 << 20
        assert [n for n in os.listdir(shm_dir) if n.startswith("shoal-")] == []
