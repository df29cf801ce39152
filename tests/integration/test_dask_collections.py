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
