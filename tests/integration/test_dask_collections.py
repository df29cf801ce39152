"""dask.array, dask.dataframe and dask.delayed computations on shoal, on both cluster
kinds, compared with dask's own synchronous scheduler."""

from __future__ import annotations

import dask
import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest

import shoal


@pytest.fixture(scope="module", params=[False, True], ids=["threads", "processes"])
def client(request):
    with shoal.Client(n_workers=2, processes=request.param) as c:
        yield c


def _x():
    return da.random.default_rng(42).random((600, 400), chunks=(150, 100))


def _df():
    pdf = pd.DataFrame({
        "a": np.arange(1000),
        "b": np.arange(1000) % 7,
        "c": np.linspace(0, 1, 1000),
        "s": [f"k{i % 13}" for i in range(1000)],
    })
    return dd.from_pandas(pdf, npartitions=5)


@dask.delayed
def _inc(v):
    return v + 1


@dask.delayed
def _add(a, b):
    return a + b


CASES = {
    # dask.array
    "array-sum": lambda: _x().sum(),
    "array-mean-axis": lambda: _x().mean(axis=0),
    "array-matmul": lambda: (_x() @ _x().T)[:50, :50],
    "array-rechunk-std": lambda: _x().rechunk((200, 400)).std(axis=1),
    "array-slicing": lambda: _x()[10:500:3, ::7] * 2,
    "array-elementwise": lambda: da.exp(_x()) - da.log1p(_x()),
    "array-cumsum": lambda: _x().cumsum(axis=0)[-1],
    "array-argmax": lambda: _x().argmax(axis=1),
    "array-transpose-dot": lambda: _x().T.dot(_x()).sum(),
    "array-concatenate": lambda: da.concatenate([_x(), _x() + 1], axis=0).max(axis=0),
    "array-map-blocks": lambda: _x().map_blocks(lambda b: b * b.shape[0], dtype=float).sum(),
    "array-reshape": lambda: _x().reshape((600, 4, 100)).sum(axis=1),
    "array-unique": lambda: da.unique((_x() * 10).astype(int)),
    "array-percentile": lambda: da.percentile(_x().ravel(), [10, 50, 90]),
    # dask.dataframe
    "df-sum": lambda: _df().a.sum(),
    "df-groupby-agg": lambda: _df().groupby("b").agg({"a": "sum", "c": "mean"}),
    "df-groupby-str": lambda: _df().groupby("s").c.max(),
    "df-filter-assign": lambda: _df()[_df().a % 3 == 0].assign(d=lambda d: d.a * d.c),
    "df-describe": lambda: _df()[["a", "c"]].describe(),
    "df-value-counts": lambda: _df().s.value_counts(),
    "df-merge": lambda: _df().merge(_df()[["a", "c"]].rename(columns={"c": "c2"}), on="a").set_index("a"),
    "df-set-index": lambda: _df().set_index("c").a,
    "df-rolling": lambda: _df().a.rolling(5).mean(),
    "df-nunique": lambda: _df().s.nunique(),
    # dask.delayed
    "delayed-chain": lambda: _add(_inc(1), _inc(_inc(2))),
    "delayed-list": lambda: dask.delayed(sum)([_inc(i) for i in range(20)]),
    "delayed-dict": lambda: dask.delayed(lambda d: d["x"] * d["y"])({"x": _inc(3), "y": _add(2, 3)}),
}


def _same(got, expected):
    if isinstance(expected, (pd.DataFrame, pd.Series)):
        if isinstance(expected, pd.DataFrame):
            pd.testing.assert_frame_equal(got.sort_index(), expected.sort_index())
        else:
            pd.testing.assert_series_equal(got.sort_index(), expected.sort_index())
    else:
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected))


@pytest.mark.parametrize("case", sorted(CASES))
def test_results_match_dask_synchronous(client, case):
    expected = CASES[case]().compute(scheduler="sync")
    _same(dask.compute(CASES[case](), scheduler=client.get)[0], expected)
    _same(client.compute(CASES[case]()).result(timeout=60), expected)


def test_dask_config_scheduler(client):
    x = _x()
    with dask.config.set(scheduler=client.get):
        got = (x + 1).sum().compute()
    assert np.isclose(got, (x + 1).sum().compute(scheduler="sync"))


def test_persist_then_reuse(client):
    x = _x() + 1
    p = client.persist(x)
    futures = [v for v in dict(p.__dask_graph__()).values() if isinstance(v, shoal.Future)]
    assert futures and shoal.wait(futures, timeout=60).not_done == set()
    assert np.isclose(p.sum().compute(scheduler=client.get), x.sum().compute(scheduler="sync"))
    df = client.persist(_df())
    assert df.a.sum().compute(scheduler=client.get) == sum(range(1000))
    # dask.persist hands persisting to the client
    (q,) = dask.persist(_x() * 2, scheduler=client.get)
    assert np.isclose(q.sum().compute(scheduler=client.get), (_x() * 2).sum().compute(scheduler="sync"))


def test_compute_many_and_non_collections(client):
    a, b, c = client.compute([_x().sum(), _df().a.max(), 5])
    assert c == 5
    assert np.isclose(a.result(timeout=60), _x().sum().compute(scheduler="sync"))
    assert b.result(timeout=60) == 999


def _frame_with_empty_partition():
    pdf = pd.DataFrame({"x": [5, 3, 9, 1, 7, 2], "y": np.arange(6), "s": list("abcabc")})
    # an empty partition, and divisions dask must compute (inside a cached property of
    # the expression, the graph of that computation reading other frames' divisions)
    ddf = dd.concat([dd.from_pandas(pdf, npartitions=2), dd.from_pandas(pdf[pdf.y > 99], npartitions=1)])
    return pdf, ddf.clear_divisions()


@pytest.mark.parametrize("method", ["tasks", "disk"])
def test_set_index_with_empty_partitions_and_unknown_divisions(client, method):
    pdf, ddf = _frame_with_empty_partition()
    with dask.config.set({"scheduler": client.get, "dataframe.shuffle.method": method}):
        by_x = ddf.set_index("x")
        got = by_x.compute()
        again = by_x.repartition(npartitions=3).set_index("s").compute()
    # (dask makes the strings pyarrow strings: the values are compared)
    pd.testing.assert_frame_equal(got, pdf.set_index("x").sort_index(), check_dtype=False)
    pd.testing.assert_frame_equal(again.sort_values("y"), pdf.set_index("x").set_index("s").sort_values("y"),
                                  check_dtype=False, check_index_type=False)


class _GraphNeedsCallersLock:
    """A collection whose graph can only be made by a thread holding ``lock`` (as
    dask's expressions make theirs under locks their caller may hold)."""

    def __init__(self, lock):
        self.lock = lock

    def __dask_graph__(self):
        if not self.lock.acquire(blocking=False):  # an RLock: only its holder gets it
            raise RuntimeError("the graph was made off the caller's thread")
        try:
            return {"a": 1, "b": (_double, "a")}
        finally:
            self.lock.release()


def _double(v):
    return 2 * v


def test_get_makes_the_graph_on_the_callers_thread(client):
    import threading

    lock = threading.RLock()
    with lock:
        assert client.get(_GraphNeedsCallersLock(lock), ["b", "a"]) == [2, 1]
