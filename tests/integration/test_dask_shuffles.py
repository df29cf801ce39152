"""dask's all-to-all exchanges (dataframe shuffles, merges, sorts, split_out
reductions; array rechunks) on worker processes: right against pandas/numpy by every
way a shoal client runs a graph, with the method dask is made to pick there (shoal's
own shuffle for dataframes, "tasks" for rechunks), the user's own choice kept, dask's
config as it was once the clients close, and a clear error for dask's "disk" shuffle
on workers that span hosts."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import dask
import dask.array as da
import dask.bag as db
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from shoal_helpers import start_scheduler, start_worker, stop_processes

import shoal
from shoal import Client, GraphError, LocalCluster

pytestmark = pytest.mark.timeout(120)

ROWS = 6000


def _left() -> pd.DataFrame:
    rng = np.random.default_rng(7)
    return pd.DataFrame({"k": rng.integers(0, 200, ROWS), "v": rng.random(ROWS), "w": np.arange(ROWS)})


def _right() -> pd.DataFrame:
    return pd.DataFrame({"k": np.arange(0, 200, 2), "r": np.arange(100) * 10})


def _ddf(pdf: pd.DataFrame, npartitions: int = 6) -> dd.DataFrame:
    return dd.from_pandas(pdf, npartitions=npartitions, sort=False)


def _rows(df: pd.DataFrame, index: bool = True) -> pd.DataFrame:
    """``df``'s rows (with its index as a column, or without it) in one order whatever
    order they came in."""
    df = df.reset_index(drop=not index)
    return df.sort_values(list(df.columns)).reset_index(drop=True)


#: case -> (the dask collection, what it must equal: made with pandas/numpy, compared)
CASES: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {
    "shuffle": (lambda: _ddf(_left()).shuffle("k"),
                lambda got: pd.testing.assert_frame_equal(_rows(got), _rows(_left()))),
    "merge": (lambda: _ddf(_left()).merge(_ddf(_right(), 3), on="k", broadcast=False),
              lambda got: pd.testing.assert_frame_equal(_rows(got, index=False),
                                                        _rows(_left().merge(_right(), on="k"), index=False))),
    "set_index": (lambda: _ddf(_left()).set_index("v"),
                  lambda got: pd.testing.assert_frame_equal(got, _left().set_index("v").sort_index())),
    "sort_values": (lambda: _ddf(_left()).sort_values("v"),
                    lambda got: pd.testing.assert_frame_equal(got.reset_index(drop=True),
                                                              _left().sort_values("v").reset_index(drop=True))),
    "groupby_split_out": (lambda: _ddf(_left()).groupby("k").v.sum(split_out=4),
                          lambda got: pd.testing.assert_series_equal(got.sort_index(),
                                                                     _left().groupby("k").v.sum(), rtol=1e-12)),
    "drop_duplicates_split_out": (
        lambda: _ddf(_left())[["k"]].drop_duplicates(split_out=4),
        lambda got: pd.testing.assert_frame_equal(_rows(got, index=False),
                                                  _rows(_left()[["k"]].drop_duplicates(), index=False))),
    "bag_groupby": (lambda: db.from_sequence(range(500), npartitions=5).groupby(lambda i: i % 7),
                    lambda got: _same_groups(got, {g: [i for i in range(500) if i % 7 == g] for g in range(7)})),
    "rechunk": (lambda: da.arange(240 * 180, chunks=1000).reshape((240, 180)).rechunk((240, 9)).rechunk((7, 180)),
                lambda got: np.testing.assert_array_equal(got, np.arange(240 * 180).reshape((240, 180)))),
}


def _same_groups(got: list[tuple[int, list[int]]], expected: dict[int, list[int]]) -> None:
    assert {g: sorted(v) for g, v in got} == expected


def _by_default(client: Client, coll: Any) -> Any:
    return coll.compute()


def _by_dask_compute(client: Client, coll: Any) -> Any:
    return dask.compute(coll, scheduler=client.get)[0]


def _by_dask_compute_client(client: Client, coll: Any) -> Any:
    return dask.compute(coll, scheduler=client)[0]


def _by_client_compute(client: Client, coll: Any) -> Any:
    return client.compute(coll).result(timeout=60)


def _by_client_persist(client: Client, coll: Any) -> Any:
    return client.persist(coll).compute(scheduler=client.get)


def _by_dask_persist(client: Client, coll: Any) -> Any:
    (persisted,) = dask.persist(coll)
    return persisted.compute()


#: entry point -> (whether its client is the default, how it runs a collection)
ENTRIES = {
    "collection.compute": (True, _by_default),
    "dask.compute-scheduler-get": (True, _by_dask_compute),
    "dask.persist": (True, _by_dask_persist),
    "client.compute-not-default": (False, _by_client_compute),
    "client.persist-not-default": (False, _by_client_persist),
    # dask lowers the collection before it calls the client that is not the default
    "dask.compute-scheduler-get-not-default": (False, _by_dask_compute),
    "dask.compute-scheduler-client-not-default": (False, _by_dask_compute_client),
}

#: the key prefixes of the tasks that only dask's disk shuffles (dataframe, bag) make
_DISK_NAMES = ("zpartd", "shuffle-partition", "partd", "groupby-part")


def _disk_tasks(stream: list[dict[str, Any]]) -> set[str]:
    """The disk shuffle's task prefixes among the tasks that ran (task-stream records)."""
    return {r["prefix"] for r in stream if r["prefix"].startswith(_DISK_NAMES)}


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True) as c:
        yield c


@pytest.mark.parametrize("entry", sorted(ENTRIES))
@pytest.mark.parametrize("case", sorted(CASES))
def test_exchanges_are_right_by_every_entry_point(cluster: LocalCluster, case: str, entry: str) -> None:
    """(A bag's groupby picks its method when it is made: here while the client is
    open, default or not.)"""
    make, check = CASES[case]
    default, run = ENTRIES[entry]
    with Client(cluster, set_as_default=default) as client, shoal.get_task_stream(client) as ts:
        got = run(client, make())
    check(got)
    assert not _disk_tasks(ts.data), sorted(_disk_tasks(ts.data))


def _lowered_names(coll: Any) -> set[str]:
    """The key names (without their tokens) of ``coll``'s graph as dask lowers it in
    ``dask.compute``."""
    from dask._expr import FinalizeCompute
    from dask.base import collections_to_expr

    expr = FinalizeCompute(collections_to_expr([coll], True)).optimize()
    return {str(k[0] if isinstance(k, tuple) else k).rsplit("-", 1)[0] for k in dict(expr.__dask_graph__())}


@pytest.mark.parametrize("default", [True, False], ids=["default", "not-default"])
def test_dask_lowers_to_shoals_shuffle_under_any_open_client(cluster: LocalCluster, default: bool) -> None:
    df = _ddf(_left())
    assert "zpartd" in _lowered_names(df.shuffle("k"))  # dask's own choice, without shoal
    with Client(cluster, set_as_default=default):
        assert dask.config.get("dataframe.shuffle.method") == "shoal"
        assert dask.config.get("array.rechunk.method") == "tasks"
        for coll in (df.shuffle("k"), df.merge(_ddf(_right(), 3), on="k"), df.groupby("k").v.sum(split_out=4)):
            names = _lowered_names(coll)
            assert {"shoal-shuffle-split", "shoal-shuffle-locate"} <= names, names
            assert "zpartd" not in names and "split-taskshuffle" not in names, names
        bag = db.from_sequence(range(20), npartitions=2).groupby(lambda i: i % 3)  # (its method picked now)
        assert not {n for n in _lowered_names(bag) if n.startswith(("partd", "groupby-part"))}
    assert "zpartd" in _lowered_names(df.shuffle("k"))


async def test_an_asynchronous_client_that_is_not_the_default_holds_the_methods_while_open(
        cluster: LocalCluster) -> None:
    before = copy.deepcopy(dask.config.config)
    async with Client(cluster.scheduler_address, asynchronous=True, set_as_default=False) as client:
        assert dask.config.get("dataframe.shuffle.method") == "shoal"
        coll = _ddf(_left()).shuffle("k")
        assert "zpartd" not in _lowered_names(coll)
        pd.testing.assert_frame_equal(_rows(await client.compute(coll)), _rows(_left()))
    assert dask.config.config == before


def test_a_method_the_user_chose_is_kept(cluster: LocalCluster) -> None:
    expected = _rows(_left())
    with Client(cluster) as client:
        with shoal.get_task_stream(client) as ts:
            got = _ddf(_left()).shuffle("k", shuffle_method="disk").compute()
        pd.testing.assert_frame_equal(_rows(got), expected)
        assert _disk_tasks(ts.data)  # workers of one host: dask's disk shuffle runs
        with dask.config.set({"dataframe.shuffle.method": "disk"}), shoal.get_task_stream(client) as ts:
            got = client.compute(_ddf(_left()).shuffle("k")).result(timeout=60)
        pd.testing.assert_frame_equal(_rows(got), expected)
        assert _disk_tasks(ts.data)
        assert dask.config.get("dataframe.shuffle.method") == "shoal"  # shoal's again, after the user's block
    with dask.config.set({"dataframe.shuffle.method": "disk"}):
        with Client(cluster):
            assert dask.config.get("dataframe.shuffle.method") == "disk"
        assert dask.config.get("dataframe.shuffle.method") == "disk"


def test_dask_config_is_as_it_was_after_the_clients_close(cluster: LocalCluster) -> None:
    before = copy.deepcopy(dask.config.config)
    with Client(cluster) as outer:
        with Client(cluster, set_as_default=False) as aside:
            aside.compute(_ddf(_left()).shuffle("k")).result(timeout=60)
        with Client(cluster):
            _ddf(_left()).groupby("k").v.sum(split_out=4).compute()
        assert dask.config.get("dataframe.shuffle.method") == "shoal"
        _ddf(_left()).shuffle("k").compute(scheduler=outer.get)
    assert dask.config.config == before
    with Client(cluster, set_as_default=False) as aside:
        # not the default, but dask may lower a graph for it (scheduler=aside.get)
        assert dask.config.get("dataframe.shuffle.method") == "shoal"
        assert dask.config.get("scheduler", None) == before.get("scheduler")  # it is not dask's scheduler
        aside.compute(_ddf(_left()).shuffle("k")).result(timeout=60)
    assert dask.config.config == before


# -- workers on two hosts: addresses of two IPs (127.0.0.1 and 127.0.0.2, both this
# machine's loopback), which shoal cannot tell from two machines


@pytest.fixture(scope="module")
def two_ip_cluster() -> Iterator[str]:
    procs: list[Any] = []
    try:
        _, address = start_scheduler(procs, "--no-dashboard")
        for ip in ("127.0.0.1", "127.0.0.2"):
            start_worker(procs, address, "--host", ip, "--nthreads", "1", "--no-nanny")
        yield address
    finally:
        stop_processes(procs)


def test_dask_disk_shuffle_on_workers_of_two_hosts_is_refused(two_ip_cluster: str) -> None:
    with Client(two_ip_cluster) as client:
        client.wait_for_workers(2, timeout=30)
        df = _ddf(_left())
        attempts = [
            lambda: df.shuffle("k", shuffle_method="disk").compute(),
            lambda: client.compute(df.merge(_ddf(_right(), 3), on="k", broadcast=False, shuffle_method="disk")),
            lambda: client.persist(df.set_index("v", shuffle_method="disk")),
            lambda: dask.compute(df.groupby("k").v.sum(split_out=4, shuffle_method="disk"), scheduler=client.get),
            lambda: db.from_sequence(range(100), npartitions=4).groupby(lambda i: i % 3, shuffle="disk").compute(),
        ]
        for attempt in attempts:
            with pytest.raises(GraphError, match=r"'disk' shuffle.*127\.0\.0\.1.*127\.0\.0\.2"):
                attempt()
        with dask.config.set({"dataframe.shuffle.method": "disk"}), pytest.raises(GraphError, match="'disk'"):
            df.shuffle("k").compute()
        # left to shoal, the same graphs are right on these workers
        for case in ("shuffle", "merge", "set_index", "groupby_split_out"):
            make, check = CASES[case]
            check(make().compute())


async def test_an_asynchronous_client_refused_graph_errs_its_futures(two_ip_cluster: str) -> None:
    async with Client(two_ip_cluster, asynchronous=True, set_as_default=False) as client:
        await client.wait_for_workers(2, timeout=30)
        future = client.compute(_ddf(_left()).shuffle("k", shuffle_method="disk"))
        with pytest.raises(GraphError, match="'disk' shuffle"):
            await future
        got = await client.compute(_ddf(_left()).shuffle("k"))
        pd.testing.assert_frame_equal(_rows(got), _rows(_left()))
