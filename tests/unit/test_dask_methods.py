"""shoal.client.dask_methods without a cluster: dask's config while shoal holds the
methods."""

from __future__ import annotations

import copy

import dask

from shoal.client import dask_methods

SHUFFLE = "dataframe.shuffle.method"
RECHUNK = "array.rechunk.method"


def test_holding_sets_the_unset_methods_and_releasing_restores_the_config_exactly():
    before = copy.deepcopy(dask.config.config)
    dask.config.config["array"]["rechunk"].pop("method", None)  # absent, not None
    absent = copy.deepcopy(dask.config.config)
    try:
        dask_methods.hold()
        dask_methods.hold()
        assert dask.config.get(SHUFFLE) == "tasks" and dask.config.get(RECHUNK) == "tasks"
        dask_methods.release()
        assert dask.config.get(SHUFFLE) == "tasks"  # one holder left
        dask_methods.release()
        assert dask.config.config == absent
        dask_methods.release()  # one too many: nothing happens
        assert dask.config.config == absent
    finally:
        dask.config.config.clear()
        dask.config.config.update(before)


def test_the_users_choice_stands_before_and_while_shoal_holds():
    with dask.config.set({SHUFFLE: "disk"}):
        with dask_methods.chosen():
            assert dask.config.get(SHUFFLE) == "disk" and dask.config.get(RECHUNK) == "tasks"
        assert dask.config.get(SHUFFLE) == "disk" and dask.config.get(RECHUNK) is None
    with dask.config.set({SHUFFLE: None}):
        with dask_methods.chosen():
            with dask.config.set({SHUFFLE: "disk"}):
                assert dask.config.get(SHUFFLE) == "disk"
            assert dask.config.get(SHUFFLE) == "tasks"
            dask.config.set({RECHUNK: "p2p"})  # the user's, for good
        assert dask.config.get(SHUFFLE) is None and dask.config.get(RECHUNK) == "p2p"
        dask.config.set({RECHUNK: None})
