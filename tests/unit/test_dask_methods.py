"""shoal.client.dask_methods without a cluster: dask's config while shoal holds the
methods, the partd stores found in dask graphs, and which workers count as one host."""

from __future__ import annotations

import copy
import gc

import dask
import dask.bag as db
import dask.dataframe as dd
import pandas as pd
import pytest

from shoal import GraphError
from shoal.client import dask_methods
from shoal.client.graphs import prepare

SHUFFLE = "dataframe.shuffle.method"
RECHUNK = "array.rechunk.method"


def test_holding_sets_the_unset_methods_and_releasing_restores_the_config_exactly():
    before = copy.deepcopy(dask.config.config)
    dask.config.config["array"]["rechunk"].pop("method", None)  # absent, not None
    absent = copy.deepcopy(dask.config.config)
    try:
        dask_methods.hold()
        dask_methods.hold()
        assert dask.config.get(SHUFFLE) == "shoal" and dask.config.get(RECHUNK) == "tasks"
        dask_methods.release()
        assert dask.config.get(SHUFFLE) == "shoal"  # one holder left
        dask_methods.release()
        assert dask.config.config == absent
        dask_methods.release()  # one too many: nothing happens
        assert dask.config.config == absent
    finally:
        dask.config.config.clear()
        dask.config.config.update(before)


def test_the_users_choice_stands_before_and_while_shoal_holds():
    with dask.config.set({SHUFFLE: "disk"}):
        dask_methods.hold()
        try:
            assert dask.config.get(SHUFFLE) == "disk" and dask.config.get(RECHUNK) == "tasks"
        finally:
            dask_methods.release()
        assert dask.config.get(SHUFFLE) == "disk" and dask.config.get(RECHUNK) is None
    with dask.config.set({SHUFFLE: None}):
        dask_methods.hold()
        try:
            with dask.config.set({SHUFFLE: "disk"}):
                assert dask.config.get(SHUFFLE) == "disk"
            assert dask.config.get(SHUFFLE) == "shoal"
            dask.config.set({RECHUNK: "p2p"})  # the user's, for good
        finally:
            dask_methods.release()
        assert dask.config.get(SHUFFLE) is None and dask.config.get(RECHUNK) == "p2p"
        dask.config.set({RECHUNK: None})


def test_a_method_dasks_planner_cannot_take_gives_way_to_tasks_even_while_held(monkeypatch):
    monkeypatch.setitem(dask_methods.METHODS, SHUFFLE, "shoal")
    before = copy.deepcopy(dask.config.config)
    dask_methods.hold()
    try:
        assert dask.config.get(SHUFFLE) == "shoal"
        dask_methods.use_instead(SHUFFLE, "tasks")
        assert dask.config.get(SHUFFLE) == "tasks" and dask_methods.METHODS[SHUFFLE] == "tasks"
    finally:
        dask_methods.release()
    assert dask.config.config == before
    with dask.config.set({SHUFFLE: "disk"}):  # the user's choice is not shoal's to change
        dask_methods.hold()
        try:
            dask_methods.use_instead(SHUFFLE, "tasks")
            assert dask.config.get(SHUFFLE) == "disk"
        finally:
            dask_methods.release()


class _Owner:
    """Stands for a client: something that lives for a while."""


def test_an_owner_holds_until_it_lets_go_once_or_is_collected():
    before = copy.deepcopy(dask.config.config)
    first, second = _Owner(), _Owner()
    let_go_first = dask_methods.hold_while(first)
    dask_methods.hold_while(second)
    assert dask.config.get(SHUFFLE) == "shoal"
    let_go_first()
    let_go_first()  # a second time (a close after a failed start, say): nothing more is released
    assert dask.config.get(SHUFFLE) == "shoal"  # the second owner still holds
    del second  # collected without letting go: its hold goes with it
    gc.collect()
    assert dask.config.config == before


def _frame() -> dd.DataFrame:
    return dd.from_pandas(pd.DataFrame({"k": range(40), "v": range(40)}), npartitions=4)


def _nodes(coll):
    from dask._expr import FinalizeCompute
    from dask.base import collections_to_expr

    expr = FinalizeCompute(collections_to_expr([coll], True)).optimize()
    return prepare(expr, list(expr.__dask_keys__())).nodes


def test_the_partd_stores_of_dasks_disk_shuffles_are_found():
    frame = _nodes(_frame().shuffle("k", shuffle_method="disk"))
    (store,) = dask_methods.local_stores(frame)
    assert store[0].startswith("zpartd-")
    bag = _nodes(db.from_sequence(range(20), npartitions=2).groupby(lambda i: i % 3, shuffle="disk"))
    (store,) = dask_methods.local_stores(bag)
    assert store[0].startswith("partd-")
    assert dask_methods.local_stores(_nodes(_frame().shuffle("k", shuffle_method="tasks"))) == []
    assert dask_methods.local_stores(_nodes(_frame().groupby("k").v.sum())) == []


def _graph(coll):
    from dask._expr import FinalizeCompute
    from dask.base import collections_to_expr

    expr = FinalizeCompute(collections_to_expr([coll], True)).optimize()
    return prepare(expr, list(expr.__dask_keys__()))


def _name(key) -> str:
    return str(key[0] if isinstance(key, tuple) else key)


#: a disk shuffle -> the names of its tasks that make its store and write into it
DISK_SHUFFLES = {
    "frame": (lambda: _frame().shuffle("k", shuffle_method="disk"), ("zpartd-", "shuffle-partition-")),
    "bag": (lambda: db.from_sequence(range(20), npartitions=3).groupby(lambda i: i % 3, shuffle="disk"),
            ("partd-", "groupby-part-")),
}


@pytest.mark.parametrize("kind", sorted(DISK_SHUFFLES))
def test_a_disk_shuffle_gets_keys_of_its_own_each_time_and_its_writers_run_once(kind):
    make, writers = DISK_SHUFFLES[kind]
    coll = make()
    graph = _graph(coll)
    before = set(graph.nodes)
    stores = dask_methods.local_stores(graph.nodes)
    renewed = dask_methods.renew_stores(graph, stores)
    assert len(renewed) == 1 and renewed != stores and _name(renewed[0]).startswith(_name(stores[0]))
    # the store and the tasks that use it have new keys, the graph holds together, and
    # the result's keys are the same
    changed = before - set(graph.nodes)
    assert stores[0] in changed and len(changed) == len(set(graph.nodes) - before) > 1
    assert all(d in graph.nodes for node in graph.nodes.values() for d in node.dependencies)
    assert set(graph.wanted) <= set(graph.nodes)
    again = _graph(coll)
    assert dask_methods.renew_stores(again, dask_methods.local_stores(again.nodes)) != renewed
    tasks = graph.tasks()
    dask_methods.mark_once(tasks, renewed)
    once = {t["key"] for t in tasks if t.get("once")}
    assert {_name(k).startswith(writers) for k in once} == {True}
    assert sum(_name(k).startswith(writers[1]) for k in once) == coll.npartitions
    assert all(t["once"] == dask_methods.ONCE for t in tasks if t["key"] in once)
    users = {t["key"] for t in tasks if renewed[0] in t["deps"]}
    assert users - once, "the collects, which read the store back, may run again"


def _worker(host: str) -> dict:
    return {"host": host, "nthreads": 1}


def test_workers_of_one_ip_and_one_host_identity_may_share_a_disk():
    one = {"tcp://10.0.0.1:4001": _worker("a/boot/1"), "tcp://10.0.0.1:4002": _worker("a/boot/1")}
    assert dask_methods.refusal([("zpartd-1",)], one) is None
    inproc = {"inproc://x/1": _worker("a/boot/1"), "inproc://x/2": _worker("a/boot/1")}
    assert dask_methods.refusal([("zpartd-1",)], inproc) is None
    two = {"tcp://10.0.0.1:4001": _worker("a/boot/1"), "tcp://10.0.0.2:4001": _worker("b/boot/1")}
    assert dask_methods.refusal([], two) is None  # no store: nothing to refuse


@pytest.mark.parametrize(("workers", "named"), [
    ({"tcp://10.0.0.1:1": _worker("a/boot/1"), "tcp://10.0.0.2:1": _worker("b/boot/1")},
     ["10.0.0.1: tcp://10.0.0.1:1", "10.0.0.2: tcp://10.0.0.2:1"]),
    # one address, two shared-memory domains: containers of one network namespace
    ({"tcp://10.0.0.1:1": _worker("a/boot/1"), "tcp://10.0.0.1:2": _worker("a/boot/2")},
     ["10.0.0.1 a/boot/1: tcp://10.0.0.1:1", "10.0.0.1 a/boot/2: tcp://10.0.0.1:2"]),
    # one machine's identity, two addresses: shoal cannot tell it from two machines
    ({"tcp://127.0.0.1:1": _worker("a/boot/1"), "tcp://[::1]:2": _worker("a/boot/1")},
     ["127.0.0.1: tcp://127.0.0.1:1", "::1: tcp://[::1]:2"]),
])
def test_workers_that_may_not_share_a_disk_refuse_a_partd_store(workers, named):
    error = dask_methods.refusal([("zpartd-abc",)], workers)
    assert isinstance(error, GraphError) and isinstance(error, ValueError)
    text = str(error)
    assert "'disk' shuffle" in text and "on 2 hosts" in text and "zpartd-abc" in text
    for host in named:
        assert host in text


def test_the_annotations_of_renamed_tasks_follow_their_new_keys():
    from shoal.client.collections import _annotations

    class Annotated:
        def __dask_annotations__(self):
            return {"priority": {("partd-1",): 3, "other": 1}}

    assert _annotations(Annotated(), {("partd-1",): ("partd-1-new",)}) == {
        "priority": {("partd-1-new",): 3, "other": 1}}
