"""Simulator and ranker follow scikit-learn conventions and beat chance on synthetic data."""
from __future__ import annotations

import numpy as np
import pytest

from tuner.cost_models.analytic import AnalyticCostModel
from tuner.cost_models.errors import NotFittedError
from tuner.cost_models.evaluation import kendall_tau, pairwise_accuracy, top1_regret, within_split
from tuner.cost_models.ranker import StrategyRanker
from tuner.cost_models.simulator import LearnedSimulator
from tuner.records.dataset import build_trial_set
from tuner.synthetic.runner import make_dataset


@pytest.fixture(scope="module")
def data():
    return build_trial_set(make_dataset(n_models=3, n_clusters_each=2, per_group=24, seed=1, include_configs=False))


def test_metrics_hand_cases():
    assert pairwise_accuracy([1, 2, 3], [10, 20, 30]) == 1.0
    assert pairwise_accuracy([3, 2, 1], [10, 20, 30]) == 0.0
    assert kendall_tau([1, 2, 3], [1, 3, 2]) == pytest.approx(1 / 3)
    assert top1_regret([2, 1, 3], [1.0, 1.5, 2.0]) == pytest.approx(0.5)


def test_unfitted_use_raises_clear_error(data):
    with pytest.raises(NotFittedError, match="LearnedSimulator is not fitted yet"):
        LearnedSimulator().predict(data.X)
    with pytest.raises(NotFittedError, match="StrategyRanker is not fitted yet"):
        StrategyRanker().predict(data.X)


def test_init_does_no_work_and_fit_returns_self(data):
    sim = LearnedSimulator(target="log", n_estimators=30)
    assert not [k for k in vars(sim) if k.endswith("_")]
    assert sim.fit(data.X, data.y) is sim and sim.regressor_ is not None
    r = StrategyRanker(n_estimators=20, update_rounds=5)
    assert r.fit(data.X, data.y, data.group) is r and r.n_rounds_ == 20
    assert r.update(data.X, data.y, data.group) is r and r.n_rounds_ == 25
    with pytest.raises(ValueError, match="target must be one of"):
        LearnedSimulator(target="nope").fit(data.X, data.y)


def test_little_data_falls_back_to_analytic(data):
    sim = LearnedSimulator(min_trials=10).fit(data.X[:5], data.y[:5])
    assert sim.regressor_ is None
    np.testing.assert_allclose(sim.predict(data.X), sim.analytic_.predict(data.X))


def test_learned_models_beat_chance_on_held_out_trials(data):
    train, test = within_split(data, seed=0)
    sim = LearnedSimulator(n_estimators=80).fit(train.X, train.y)
    rank = StrategyRanker(n_estimators=60).fit(train.X, train.y, train.group)
    p_sim, p_rank = sim.predict(test.X), -rank.predict(test.X, test.group)
    acc_sim = np.mean([pairwise_accuracy(p_sim[test.group == g], test.y[test.group == g]) for g in np.unique(test.group)])
    acc_rank = np.mean([pairwise_accuracy(p_rank[test.group == g], test.y[test.group == g]) for g in np.unique(test.group)])
    assert acc_sim > 0.65 and acc_rank > 0.65


def test_analytic_fit_reduces_error(data):
    base = AnalyticCostModel()
    fitted = AnalyticCostModel().fit(data.X, data.y)
    err = lambda m: np.mean((np.log(m.predict(data.X)) - np.log(data.y)) ** 2)  # noqa: E731
    assert err(fitted) < err(base)
    assert fitted.params_ != base.parameters


def test_simulator_never_predicts_faster_for_more_wire_time(data):
    from tuner.features.batch import COL

    sim = LearnedSimulator(n_estimators=60).fit(data.X, data.y)
    slower = data.X.copy()
    slower[:, COL["wire_s"]] *= 1.5
    assert np.all(sim.predict(slower) >= sim.predict(data.X) * (1 - 1e-6))
    assert LearnedSimulator(monotone=False)._constraints() is None


def test_evaluate_scores_against_the_truth_when_given(data):
    from tuner.cost_models.evaluation import evaluate

    sim = {"sim": lambda tr, te: LearnedSimulator(n_estimators=30).fit(tr.X, tr.y).predict(te.X)}
    plain = evaluate(data, sim, protocols=("within",))[0]
    assert np.isnan(plain["pairwise_truth"]) and np.isnan(plain["pairwise_truth_tol"])
    same = evaluate(data, sim, protocols=("within",), truth=data.y)[0]   # measurements as the truth
    assert same["pairwise_truth"] == pytest.approx(same["pairwise_acc"])
    assert same["pairwise_truth_tol"] == pytest.approx(same["pairwise_acc_tol"])
    with pytest.raises(ValueError, match="truth has 3 rows"):
        evaluate(data, sim, protocols=("within",), truth=data.y[:3])


def test_noiseless_step_time_is_what_measurements_scatter_around():
    from strategy_space.builders import build_all
    from tuner.synthetic.runner import SyntheticRunner, iter_groups, noiseless_step_s

    model, cluster = next(iter_groups(1, 1, seed=3, include_configs=False))
    strategies = list(build_all(model, cluster).values())[:3]
    true = noiseless_step_s(model, cluster, strategies)
    np.testing.assert_array_equal(true, noiseless_step_s(model, cluster, strategies))   # no noise: deterministic
    measured = np.array([[t.median for t in SyntheticRunner(model, cluster, seed=s).run(strategies)] for s in range(9)])
    ratio = np.median(measured, axis=0) / true
    assert np.all((ratio > 0.9) & (ratio < 1.25))    # jitter and stragglers only ever slow the slowest node


def test_synthetic_world_aggregates_on_the_node_and_reduces_hierarchically():
    """The synthetic truth runs what the runtime runs: local replication pushes a node's summed
    gradient once, a hierarchical all-reduce crosses each NIC among node leaders only."""
    from strategy_space import PS, AllReduce, ClusterSpec, ModelSpec, NodeSpec, Strategy, VarConfig, VariableSpec
    from tuner.synthetic.netsim import Truth, simulate_step

    quiet = Truth(node_jitter=0.0, straggler_p=0.0, step_noise=0.0)
    m = ModelSpec("d", tuple(VariableSpec(f"w{i}", (512, 1024)) for i in range(4)))   # 8 MiB of gradients
    c = ClusterSpec("c", tuple(NodeSpec(f"n{i}", workers=4, cpus=4, bandwidth_gbps=1.0) for i in range(2)))

    def step(sync):
        s = Strategy(tuple(VarConfig(v.name, (sync,)) for v in m.variables))
        return simulate_step(m, c, s, 0.01, np.random.default_rng(0), quiet)[0]

    assert step(PS("n0", local_replication=True)) < 0.5 * step(PS("n0"))
    assert step(AllReduce(hierarchical=True)) < step(AllReduce())


def test_synthetic_world_charges_powersgd_a_fixed_time_per_matrix():
    """Each PowerSGD matrix costs the synthetic world's workers ``psgd_matrix_s`` a step beside its
    flops: the same bytes cut into more matrices (shards) cost more, by that constant each."""
    from strategy_space import AllReduce, ClusterSpec, ModelSpec, NodeSpec, Strategy, VarConfig, VariableSpec
    from tuner.synthetic.netsim import Truth, simulate_step

    m = ModelSpec("d", (VariableSpec("w", (512, 1024)),))
    c = ClusterSpec("c", tuple(NodeSpec(f"n{i}", workers=1, bandwidth_gbps=10.0) for i in range(2)))

    def step(shards, per):
        truth = Truth(node_jitter=0.0, straggler_p=0.0, step_noise=0.0, psgd_matrix_s=per)
        s = Strategy((VarConfig("w", tuple(AllReduce(compressor="powersgd(4)", group=i) for i in range(shards))),))
        return simulate_step(m, c, s, 0.01, np.random.default_rng(0), truth)[0]

    free = step(4, 1e-12) - step(1, 1e-12)                  # what 4 shards cost without the constant
    assert step(4, 5e-3) - step(1, 5e-3) == pytest.approx(free + 3 * 5e-3, rel=0.05)
