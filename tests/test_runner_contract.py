"""The Runner contract, one suite for every Runner (Optuna's sampler-contract style: each runner
is a fixture parameter; the Ray runner's case is an integration test).

A Runner returns one Trial per strategy, in order, recorded against its own model and cluster,
with the origin it was given (else the strategy's); a strategy that cannot run is a failed Trial,
never an exception; origins of another length are a ValueError.
"""
from __future__ import annotations

import pytest

from strategy_space import PS, Strategy, VarConfig
from strategy_space.builders import get_builder
from tests.fakes import Noisy, three_node_cluster, tiny_model
from tuner.synthetic.runner import SyntheticRunner


def _synthetic():
    model, cluster = tiny_model(profile=True), three_node_cluster()
    return SyntheticRunner(model, cluster, seed=2)


def _noisy():
    model, cluster = tiny_model(profile=True), three_node_cluster()
    return Noisy(model, cluster, seed=2, gain=1.2, spread=0.05)


def _ray():
    from autosync.api import make_runner

    return make_runner("zoo:ncf", "local", warmup=1, steps=2, trial_timeout_s=240)


RUNNERS = [pytest.param(_synthetic, id="synthetic"), pytest.param(_noisy, id="noisy"),
           pytest.param(_ray, id="ray", marks=pytest.mark.integration)]


@pytest.fixture(scope="module", params=RUNNERS)
def runner(request):
    if request.param is _ray:
        request.getfixturevalue("ray_session")
    r = request.param()
    yield r
    r.close()


def test_one_trial_per_strategy_in_order_on_its_model_and_cluster(runner):
    names = ["ps", "all_reduce"]
    strategies = [get_builder(n).build(runner.model, runner.cluster) for n in names]
    trials = runner.run(strategies, ["first", "second"])
    assert [t.strategy.fingerprint for t in trials] == [s.fingerprint for s in strategies]
    assert [t.origin for t in trials] == ["first", "second"]
    for t in trials:
        assert t.ok, t.error
        assert (t.model_fingerprint, t.cluster_fingerprint) == (runner.model.fingerprint, runner.cluster.fingerprint)
        assert t.step_times and min(t.step_times) > 0 and t.batch_size >= runner.model.batch_size
        assert t.started_at <= t.finished_at


def test_the_origin_defaults_to_the_strategys(runner):
    s = get_builder("ps").build(runner.model, runner.cluster)
    assert s.origin == "ps"
    [t] = runner.run([s])
    assert t.origin == "ps"


def test_a_strategy_that_cannot_run_is_a_failed_trial(runner):
    names = runner.model.names
    missing = Strategy(tuple(VarConfig(n, (PS(runner.cluster.nodes[0].name),)) for n in names[1:]), origin="bad")
    good = get_builder("ps").build(runner.model, runner.cluster)
    bad, ok = runner.run([missing, good], ["bad", "good"])
    assert bad.status == "failed" and bad.error and not bad.step_times and bad.origin == "bad"
    assert ok.ok, ok.error    # one bad strategy does not spoil the next


def test_origins_of_another_length_are_refused(runner):
    s = get_builder("ps").build(runner.model, runner.cluster)
    with pytest.raises(ValueError, match="origins has 2 entries for 1 strategies"):
        runner.run([s], ["a", "b"])
