"""Workers that all draw the same data are warned of (``autosync.runtime.data_check``)."""
from __future__ import annotations

import warnings

import pytest

import autosync
from autosync.runtime.data_check import SameDataWarning, check_shards


def test_every_worker_with_the_same_first_batch_is_warned_of_and_nothing_else():
    with pytest.warns(SameDataWarning, match=r"model m: workers a:0, b:0 all drew the same first batch .*ds.shard"):
        check_shards("m", ["a:0", "b:0"], ["d1", "d1"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_shards("m", ["a:0", "b:0"], ["d1", "d2"])   # their own shards
        check_shards("m", ["a:0"], ["d1"])   # one worker
        check_shards("m", ["a:0", "b:0"], [None, None])   # a worker that did not say
    # some of them alike: each group named
    with pytest.warns(SameDataWarning, match=r"workers a:0, c:0; b:0, d:0 drew the same first batch"):
        check_shards("m", ["a:0", "b:0", "c:0", "d:0", "e:0"], ["d1", "d2", "d1", "d2", "d3"])
    assert autosync.SameDataWarning is SameDataWarning and issubclass(SameDataWarning, UserWarning)
