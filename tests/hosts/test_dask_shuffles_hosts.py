"""dask dataframe shuffles and array rechunks on workers of two test hosts, each host
with a scratch directory of its own (its TMPDIR and its workers' local directory on a
mount the other host does not see), checked against pandas/numpy; and dask's "disk"
shuffle, which keeps its pieces on one worker's disk, refused there."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from hostcluster import host_cluster, on_client_host

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    with host_cluster(tmp_path_factory.mktemp("hosts"), scratch=True) as c:
        yield c


def test_each_host_writes_to_a_scratch_disk_of_its_own(cluster: dict[str, Any]) -> None:
    out = on_client_host(cluster, """
import os, tempfile
def write():
    path = os.path.join(tempfile.gettempdir(), "written-on-host1")
    open(path, "w").close()
    return path
def look(path):
    return os.path.exists(path)
path = c.submit(write, workers=W["host1"][:1], pure=False).result()
out = {"path": path, "host1": c.submit(look, path, workers=W["host1"][1:], pure=False).result(),
       "host2": c.submit(look, path, workers=W["host2"], pure=False).result()}
""")
    assert out["host1"] and not out["host2"], out
    assert os.path.exists(os.path.join(cluster["scratch"]["host1"], "written-on-host1"))
    assert not os.path.exists(os.path.join(cluster["scratch"]["host2"], "written-on-host1"))


#: the client's checks: each dask computation against pandas/numpy ("ok" or what differs),
#: the hosts whose workers ran tasks, and the key prefixes of dask's disk shuffle that ran
_CHECKS = """
import traceback
import dask, dask.array as da, dask.dataframe as dd, numpy as np, pandas as pd
rng = np.random.default_rng(11)
left = pd.DataFrame({"k": rng.integers(0, 500, 40_000), "v": rng.random(40_000), "w": np.arange(40_000)})
right = pd.DataFrame({"k": np.arange(0, 500, 2), "r": np.arange(250) * 10})
L, R = dd.from_pandas(left, npartitions=12, sort=False), dd.from_pandas(right, npartitions=6, sort=False)
def rows(df, index=True):
    df = df.reset_index(drop=not index)
    return df.sort_values(list(df.columns)).reset_index(drop=True)
checks = {
    "shuffle": lambda: pd.testing.assert_frame_equal(rows(L.shuffle("k").compute()), rows(left)),
    "merge": lambda: pd.testing.assert_frame_equal(
        rows(L.merge(R, on="k", broadcast=False).compute(), False), rows(left.merge(right, on="k"), False)),
    "set_index": lambda: pd.testing.assert_frame_equal(L.set_index("v").compute(), left.set_index("v").sort_index()),
    "sort_values": lambda: pd.testing.assert_frame_equal(L.sort_values("v").compute().reset_index(drop=True),
                                                         left.sort_values("v").reset_index(drop=True)),
    "groupby_split_out": lambda: pd.testing.assert_series_equal(
        L.groupby("k").v.sum(split_out=4).compute().sort_index(), left.groupby("k").v.sum(), rtol=1e-12),
    "drop_duplicates_split_out": lambda: pd.testing.assert_frame_equal(
        rows(L[["k"]].drop_duplicates(split_out=4).compute(), False), rows(left[["k"]].drop_duplicates(), False)),
    "rechunk": lambda: np.testing.assert_array_equal(
        da.arange(400 * 300, chunks=7000).reshape((400, 300)).rechunk((400, 10)).rechunk((9, 300)).compute(),
        np.arange(400 * 300).reshape((400, 300))),
}
results = {}
with shoal.get_task_stream(c) as ts:
    for name, check in checks.items():
        try:
            check()
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()[-2000:]
hosts = {h for h, ws in W.items() for r in ts.data if r["worker"] in ws}
disk = sorted({r["prefix"] for r in ts.data if r["prefix"].startswith(("zpartd", "shuffle-partition"))})
shoals = sorted({r["prefix"] for r in ts.data if r["prefix"].startswith("shoal-shuffle")})
out = {"results": results, "hosts": sorted(hosts), "disk": disk, "shoal": shoals,
       "method": dask.config.get("dataframe.shuffle.method")}
"""


def test_dataframe_exchanges_are_right_on_workers_of_two_hosts(cluster: dict[str, Any]) -> None:
    out = on_client_host(cluster, _CHECKS)
    assert out["results"] == {name: "ok" for name in out["results"]}, out["results"]
    assert len(out["results"]) == 7
    assert out["hosts"] == ["host1", "host2"] and out["disk"] == [] and out["method"] == "shoal", out
    assert {"shoal-shuffle-split", "shoal-shuffle-locate"} <= set(out["shoal"]), out


def test_dasks_disk_shuffle_on_workers_of_two_hosts_is_refused(cluster: dict[str, Any]) -> None:
    out = on_client_host(cluster, """
import dask, dask.dataframe as dd, pandas as pd
df = dd.from_pandas(pd.DataFrame({"k": range(1000), "v": range(1000)}), npartitions=8)
errors = []
for attempt in (lambda: df.shuffle("k", shuffle_method="disk").compute(),
                lambda: c.compute(df.groupby("k").v.sum(split_out=4, shuffle_method="disk")).result(timeout=60)):
    try:
        attempt()
        errors.append(None)
    except shoal.GraphError as e:
        errors.append(str(e))
with dask.config.set({"dataframe.shuffle.method": "disk"}):
    try:
        df.merge(df, on="k", broadcast=False).compute()
        errors.append(None)
    except shoal.GraphError as e:
        errors.append(str(e))
out = {"errors": errors}
""")
    ips = [h.ip for h in cluster["hosts"][1:]]
    for error in out["errors"]:
        assert error is not None and "'disk' shuffle" in error and all(ip in error for ip in ips), error
