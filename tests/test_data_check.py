"""Workers that all draw the same data, and a loss that diverges on an exact strategy, are warned of
(``autosync.runtime.data_check``)."""
from __future__ import annotations

import warnings

import pytest

import autosync
from autosync.runtime.data_check import DivergedWarning, SameDataWarning, TrainingWarning, check_losses, check_shards
from strategy_space import AllReduce, PS, Strategy, VarConfig


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


def test_a_loss_that_is_not_finite_on_a_lossless_strategy_is_warned_of_and_a_lossy_ones_is_not():
    exact = Strategy((VarConfig("a", (PS("node0"),)), VarConfig("b", (AllReduce(),))))
    for bad, said in ((float("nan"), "nan"), (float("inf"), "inf"), (-float("inf"), "-inf")):
        with pytest.warns(DivergedWarning, match=rf"model m: its loss became {said} in a trial of a lossless, "
                                                 rf"synchronous strategy.* lower the learning rate"):
            check_losses("m", [0.5, 0.4, bad, 0.3], exact)
    lossy = [Strategy((VarConfig("a", (PS("node0", sync=False),)),)),
             Strategy((VarConfig("a", (PS("node0", staleness=2),)),)),
             Strategy((VarConfig("b", (AllReduce(compressor="fp16"),)),))]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_losses("m", [0.5, 0.4, 0.3], exact)          # finite: nothing to say
        check_losses("m", [], exact)
        for s in lossy:                                      # its own divergence: the goodput probe's
            check_losses("m", [0.5, float("nan")], s)
        # dynamic loss scaling skipped the step (as Keras does) and training went on
        check_losses("m", [0.5, float("inf"), 0.3], exact, {"loss_scale": {"initial_scale": 8.0}})
    with pytest.warns(DivergedWarning, match="its loss became nan"):   # ... but did not recover
        check_losses("m", [0.5, float("nan"), float("nan")], exact, {"loss_scale": {"initial_scale": 8.0}})
    assert autosync.DivergedWarning is DivergedWarning and issubclass(DivergedWarning, TrainingWarning)
    assert issubclass(SameDataWarning, TrainingWarning) and issubclass(TrainingWarning, UserWarning)
