"""Warm-start datasets (tuner.records.warmstart) and the Predictor's measured choice of scorer."""
import gzip
import shutil

import numpy as np
import pytest

from strategy_space import ConfigError
from strategy_space.space import StrategySpace
from tests.fakes import three_node_cluster, tiny_model
from tuner.cost_models.predictor import Predictor
from tuner.records.dataset import build_trial_set
from tuner.records.store import TrialStore
from tuner.records.training_set import TrainingSet
from tuner.records.warmstart import BUILTIN_PATH, load_warm_start, merge_groups, resolve_warm_start
from tuner.search.model_based import ModelBasedTuner, SearchSettings
from tuner.search.tuning import Budget, tune_loop
from tuner.synthetic.runner import SyntheticRunner, candidate_strategies, make_dataset, noiseless_step_s

FAST = SearchSettings(batch=3, candidates=64, chains=12, anneal_steps=8)


@pytest.fixture(scope="module")
def groups():
    # generated models (16-36 variables) rather than the config specs (bert-full's 202 variables
    # make every stored strategy a long YAML to parse back): what is loaded is the same kind
    return make_dataset(n_models=3, n_clusters_each=1, per_group=12, seed=5, include_configs=False)


@pytest.fixture(scope="module")
def packed(groups, tmp_path_factory):
    """The synthetic groups in a TrialStore, gzip-compressed like the shipped dataset."""
    d = tmp_path_factory.mktemp("warm")
    with TrialStore(d / "w.db") as store:
        for model, cluster, trials in groups:
            store.add_many(trials, model, cluster)
    with open(d / "w.db", "rb") as f, gzip.open(d / "w.db.gz", "wb") as g:
        shutil.copyfileobj(f, g)
    return d


def _count(gs):
    return sum(len(ts) for _, _, ts in gs)


def test_load_plain_and_gzipped_stores(groups, packed):
    plain, gz = load_warm_start(packed / "w.db"), load_warm_start(str(packed / "w.db.gz"))
    assert _count(plain) == _count(gz) == _count(groups)
    assert [(m.fingerprint, c.fingerprint) for m, c, _ in gz] == [(m.fingerprint, c.fingerprint) for m, c, _ in groups]
    assert load_warm_start("none") == [] and load_warm_start(None) == []


def test_exclusions(groups, packed):
    name = groups[0][0].name
    left = load_warm_start(packed / "w.db", exclude_models=[name])
    assert left and all(m.name != name for m, _, _ in left)
    key = (groups[1][0].fingerprint, groups[1][1].fingerprint)
    left = load_warm_start(packed / "w.db", exclude_groups=[key])
    assert len(left) == len(groups) - 1 and key not in [(m.fingerprint, c.fingerprint) for m, c, _ in left]


def test_bad_sources_say_what_to_use(tmp_path):
    with pytest.raises(ConfigError, match="no such file.*builtin"):
        load_warm_start(tmp_path / "missing.db")
    junk = tmp_path / "junk.db"
    junk.write_text("not a database")
    with pytest.raises(ConfigError, match="not a readable AutoSync trial store"):
        load_warm_start(junk)


def test_merge_counts_a_measurement_once(groups):
    merged = merge_groups(groups, groups[:2], [(groups[0][0], groups[0][1], groups[0][2][:3])])
    assert len(merged) == len(groups) and _count(merged) == _count(groups)


def test_builtin_dataset_is_shipped_and_learnable():
    """The dataset AutoSync measured on its testbed: a few hundred trials over the zoo models."""
    assert resolve_warm_start("builtin") == BUILTIN_PATH
    assert BUILTIN_PATH.stat().st_size < 5 * 2**20
    gs = load_warm_start("builtin")
    models = {m.name for m, _, _ in gs}
    assert len(models) >= 5 and {"ncf-small", "dlrm-small"} <= models, models
    data = build_trial_set(gs)
    assert len(data) >= 200
    assert all(np.isfinite(data.y)) and (data.y > 0).all()


def test_predictor_transfers_from_prior_groups_alone(groups):
    model, cluster = tiny_model(profile=True), three_node_cluster()
    p = Predictor(model, cluster).fit(build_trial_set(groups))
    assert p.n_groups_ == len(groups) and p.n_target_ == 0
    assert p.source_ == "simulator" and p.scores_ == {}     # nothing of the target to judge by: transfer
    assert p.follow_ranker_ and p.fused_ and p.log_simulator_ is not None   # the learned models' rank-sum


def test_predictor_judges_scorers_on_the_target_group(groups, tmp_path):
    """With target trials, the scorer that orders them best is followed (judged by cross-validation)."""
    model, cluster = tiny_model(profile=True), three_node_cluster()
    target = SyntheticRunner(model, cluster, seed=2)
    strategies = candidate_strategies(model, cluster, np.random.default_rng(0), 12)
    training = TrainingSet()
    training.add_groups(groups)
    training.add(model, cluster, target.run(strategies[:4]))
    few = Predictor(model, cluster).fit(training.trial_set())
    assert few.n_target_ == 4 and set(few.scores_) >= {"analytic", "simulator"}
    training.add(model, cluster, target.run(strategies[4:]))
    many = Predictor(model, cluster).fit(training.trial_set())
    assert many.n_target_ == 12
    assert many.source_ == max(("simulator", "analytic"), key=lambda k: many.scores_[k])
    assert many.follow_ranker_ == (many.scores_["ranker"] >= many.scores_[many.source_])
    assert many.fused_ == (many.source_ == "simulator" or many.follow_ranker_)
    assert (many.log_simulator_ is not None) == many.fused_
    for s in many.scores_.values():
        assert 0.0 <= s <= 1.0
    # on strategies of the target it never saw, the predictions follow the synthetic world's
    # noiseless truth: the same order (rank correlation) and the same scale
    held = candidate_strategies(model, cluster, np.random.default_rng(101), 16)
    truth = noiseless_step_s(model, cluster, held)
    seconds = many.predict(StrategySpace(model, cluster).encode(held))
    ranks = lambda x: np.argsort(np.argsort(x))   # noqa: E731
    assert np.corrcoef(ranks(seconds), ranks(truth))[0, 1] >= 0.75
    ratio = seconds / truth
    assert 0.8 <= np.median(ratio) <= 1.25 and np.all((ratio > 0.5) & (ratio < 2.0)), ratio


def test_tuning_loop_learns_from_the_warm_start(groups, tmp_path):
    model, cluster = tiny_model(profile=True), three_node_cluster()
    with TrialStore(tmp_path / "t.db") as store:
        tuner = ModelBasedTuner(model, cluster, settings=FAST, warm_start=groups)
        out = tune_loop(SyntheticRunner(model, cluster, seed=1), store, tuner, Budget(trials=3, patience=10))
        assert tuner.predictor.n_groups_ == len(groups) + 1
        assert len(store) == len(out.trials)        # the warm start is read, never copied in


def test_search_order_scores_what_the_predictor_of_each_group_orders(groups):
    """``predictor.search_order`` (simulator_accuracy's ``search`` row) gives each held-out group
    the positions of its own ``Predictor.order``, fitted on the training rows."""
    from tuner.cost_models.evaluation import splits
    from tuner.cost_models.predictor import search_order

    data = build_trial_set(groups)
    specs = {(m.fingerprint, c.fingerprint): (m, c) for m, c, _ in groups}
    (tr, te), = splits(data, "within", seed=1)
    train, test = data.subset(tr), data.subset(te)
    got = search_order(specs, seed=0)(train, test)
    for g in np.unique(test.group):
        rows = np.nonzero(test.group == g)[0]
        assert sorted(got[rows]) == list(range(len(rows)))
        p = Predictor(*specs[test.keys[g]], seed=0).fit(train)
        assert list(rows[np.argsort(got[rows])]) == list(rows[p.order(None, test.X[rows])[0]])
