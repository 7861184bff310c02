"""A strategy whose bytes cannot cross the cluster's links within the trial limit is not run: the
bound (``tuner.cost_models.analytic``) and the runner's use of it."""
from __future__ import annotations

import pytest

from strategy_space import ClusterSpec, ModelSpec, NodeSpec, VariableSpec
from strategy_space.builders import get_builder
from tuner.cost_models.analytic import beyond_trial_limit, step_lower_bound

# 100M dense parameters (400 MB of float32 gradients) and a 2M-row embedding a step reads 1000 rows of
BIG = ModelSpec("big", (VariableSpec("dense/kernel", (10_000, 10_000)),
                        VariableSpec("embedding", (2_000_000, 64), sparse=True, rows_per_step=1000)), batch_size=32)


def cluster(gbps: float) -> ClusterSpec:
    return ClusterSpec("slow", tuple(NodeSpec(f"n{i}", address=f"10.0.0.{i + 1}", workers=1, bandwidth_gbps=gbps)
                                     for i in range(2)))


def test_the_nic_bound_follows_bytes_and_bandwidth():
    ar = get_builder("all_reduce").build(BIG, cluster(1.0))
    fast, slow = step_lower_bound(BIG, cluster(1.0), ar), step_lower_bound(BIG, cluster(0.1), ar)
    assert slow["busiest_nic_s"] == pytest.approx(10 * fast["busiest_nic_s"], rel=1e-5)
    # a dense all-reduce moves at least the model's gradients through each NIC: 400 MB at 1 Gbit/s
    assert fast["busiest_nic_s"] >= 0.4e9 / 125e6 * 0.99
    assert fast["overlapped_s"] == max(fast["compute_s"], fast["busiest_nic_s"])
    assert fast["serial_s"] == pytest.approx(fast["compute_s"] + fast["busiest_nic_s"])


def test_a_strategy_whose_bytes_need_longer_than_the_limit_is_named_with_its_figures():
    slow = cluster(0.1)                 # 100 Mbit/s: the dense all-reduce needs >= 32 s a step
    ar = get_builder("all_reduce").build(BIG, slow)
    why = beyond_trial_limit(BIG, slow, ar, steps=13, limit_s=300.0)
    assert why.startswith("not run: its busiest NIC needs at least")
    assert "100 Mbit/s" in why and "13 warm-up and timed steps" in why and "trial limit of 300 s" in why
    assert "--timeout" in why
    # the same strategy fits a longer limit, a faster link, or fewer steps
    assert beyond_trial_limit(BIG, slow, ar, steps=13, limit_s=3000.0) == ""
    assert beyond_trial_limit(BIG, cluster(10.0), ar, steps=13, limit_s=300.0) == ""
    assert beyond_trial_limit(BIG, slow, ar, steps=1, limit_s=300.0) == ""


class _NoPool:
    """A worker pool that must not be used."""

    def __getattr__(self, name):
        raise AssertionError(f"the runner used its worker pool ({name}) for a strategy it should not run")


@pytest.mark.integration
def test_the_runner_records_such_a_strategy_as_timed_out_without_starting_it():
    """The runner checks the bound after validating and planning, before any parameter server or
    session starts: a pool that fails on any use shows nothing was started."""
    from types import SimpleNamespace

    from autosync.runtime.runner import RayRunner

    slow = cluster(0.1)
    runner = object.__new__(RayRunner)      # a runner whose workers described BIG, and no Ray
    runner.cluster, runner.compute, runner.model_def = slow, "real", SimpleNamespace(name="big", batch_size=32)
    runner.warmup, runner.steps, runner.trial_timeout_s = 3, 10, 300.0
    runner._model, runner._given_spec, runner.pool = BIG, None, _NoPool()
    runner.binding = SimpleNamespace(lost_for=lambda strategy: None)   # every node still in the cluster
    [trial] = runner.run([get_builder("all_reduce").build(BIG, slow)], ["all_reduce"])
    assert trial.status == "timeout" and not trial.worth_another_run
    assert trial.error == beyond_trial_limit(BIG, slow, trial.strategy, steps=13, limit_s=300.0) != ""
    assert trial.origin == "all_reduce" and trial.model_fingerprint == BIG.fingerprint


def test_a_strategy_the_features_cannot_encode_is_run_not_failed():
    """A variable whose shards use different options (one on a PS with local replication, one
    without) cannot be encoded for the cost model; the bound cannot judge it, so the trial runs
    (it failed with "cannot be encoded for the tuner ... such strategies run" before)."""
    from strategy_space import PS, AllReduce, Strategy, VarConfig, validate

    two = cluster(0.1)
    mixed = Strategy((VarConfig("dense/kernel", (AllReduce(),)),
                      VarConfig("embedding", (PS("n0", local_replication=True), PS("n1")))))
    validate(mixed, BIG, two)
    with pytest.raises(Exception, match="cannot be encoded for the tuner"):
        step_lower_bound(BIG, two, mixed)
    assert beyond_trial_limit(BIG, two, mixed, steps=13, limit_s=300.0) == ""
