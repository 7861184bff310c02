"""The tuner's small interfaces: any Tuner drives the loop; the training set is the store's
trials featurized once; every StepTimeModel fits rows, seconds and groups and predicts seconds."""
from __future__ import annotations

import numpy as np
import pytest

from tests.fakes import three_node_cluster, tiny_model
from tuner.cost_models.analytic import AnalyticCostModel
from tuner.cost_models.ranker import RankedStepTime, StrategyRanker
from tuner.cost_models.simulator import LearnedSimulator
from tuner.cost_models.step_time_model import StepTimeModel
from tuner.records.dataset import build_trial_set
from tuner.records.history import History
from tuner.records.store import TrialStore
from tuner.records.training_set import TrainingSet
from tuner.records.warmstart import merge_groups
from tuner.search.baseline_tuner import BaselineTuner
from tuner.search.random_tuner import RandomTuner
from tuner.search.tuning import Budget, tune_loop
from tuner.synthetic.runner import SyntheticRunner, make_dataset

MODEL, CLUSTER = tiny_model(profile=True), three_node_cluster()


@pytest.fixture(scope="module")
def groups():
    return make_dataset(n_models=3, n_clusters_each=1, per_group=14, seed=4, include_configs=False)


def test_the_loop_drives_a_random_tuner(tmp_path):
    with TrialStore(tmp_path / "r.db") as store:
        tuner = RandomTuner(MODEL, CLUSTER, seed=3, batch_size=2)
        out = tune_loop(SyntheticRunner(MODEL, CLUSTER, seed=1), store, tuner, Budget(trials=5, patience=10))
    searched = [t for t in out.trials if t.role == "search"]
    assert len(searched) == 5 and {t.origin for t in searched} == {"random"}
    fps = [t.strategy.canonical(CLUSTER).fingerprint for t in out.trials if t.role != "confirm"]
    assert len(fps) == len(set(fps))     # nothing measured twice, not even as an equivalent strategy


def test_what_was_measured_is_kept_once(tmp_path):
    """The run's trials are one record, the loop's History (the outcome's ``trials``); each trial is
    one entry, built when it arrived, and a trial object already held is not recorded twice."""
    with TrialStore(tmp_path / "r.db") as store:
        tuner = RandomTuner(MODEL, CLUSTER, seed=3, batch_size=2)
        out = tune_loop(SyntheticRunner(MODEL, CLUSTER, seed=1), store, tuner, Budget(trials=4, patience=10))
    assert isinstance(out.trials, History) and not hasattr(tuner, "measurements")
    assert len({id(t) for t in out.trials}) == len(out.trials) > 4
    for e in out.trials.entries:
        assert e.key == tuner.space.encode([e.trial.strategy]).row_keys()[0]
        assert e.canonical == e.trial.strategy.canonical(CLUSTER).fingerprint
    alone = History(MODEL, CLUSTER)
    alone.add(out.trials[:3])
    alone.add(out.trials[1:4])          # what it holds already is not recorded twice
    assert list(alone) == list(out.trials[:4])


def test_the_baseline_tuner_proposes_each_builder_once_and_skips_measured_ones():
    tuner = BaselineTuner(MODEL, CLUSTER)
    first = tuner.next_batch(None, History(MODEL, CLUSTER))
    assert first and not tuner.has_next()
    assert all(p.encoded is not None and len(p.encoded) == 1 for p in first)
    history = History(MODEL, CLUSTER)
    history.add(SyntheticRunner(MODEL, CLUSTER).run([first[0].strategy], [first[0].origin]))
    assert [p.origin for p in BaselineTuner(MODEL, CLUSTER).next_batch(None, history)] == [p.origin for p in first[1:]]


def test_the_training_set_takes_history_entries_as_build_trial_set_featurizes_them(groups):
    """Rows featurized one trial at a time as they arrive are build_trial_set's, bit for bit."""
    model, cluster, trials = groups[2]
    history = History(model, cluster)
    for t in trials:
        history.add([t])
    training = TrainingSet()
    training.add_groups(groups[:2])
    assert training.add_entries(model, cluster, history.entries) == len(trials)
    assert training.add_entries(model, cluster, history.entries) == 0       # seen entries count once
    data, expected = training.trial_set(), build_trial_set(groups)
    np.testing.assert_array_equal(data.X, expected.X)
    np.testing.assert_array_equal(data.y, expected.y)


def test_the_training_set_holds_the_rows_build_trial_set_makes(groups):
    model, cluster, trials = groups[0]
    training = TrainingSet()
    training.add_groups(groups[:2])
    training.add_groups(groups[:1])                            # seen trials count once
    training.add(groups[2][0], groups[2][1], groups[2][2][:5])
    training.add(groups[2][0], groups[2][1], groups[2][2][5:])  # arriving later, in order
    data, expected = training.trial_set(), build_trial_set(merge_groups(groups))
    np.testing.assert_array_equal(data.X, expected.X)
    np.testing.assert_array_equal(data.y, expected.y)
    np.testing.assert_array_equal(data.group, expected.group)
    assert data.keys == expected.keys and len(training) == len(expected)


def test_every_step_time_model_fits_rows_seconds_and_groups_and_predicts_seconds(groups):
    data = build_trial_set(groups)
    for m in (AnalyticCostModel(), LearnedSimulator(n_estimators=20), RankedStepTime(random_state=0)):
        assert isinstance(m, StepTimeModel)
        seconds = m.fit(data.X, data.y, data.group).predict(data.X[data.group == 0])
        assert seconds.shape == ((data.group == 0).sum(),) and np.all(np.isfinite(seconds) & (seconds > 0))


def test_ranked_step_time_orders_as_the_ranker_scores(groups):
    data = build_trial_set(groups)
    ranked = RankedStepTime(random_state=0).fit(data.X, data.y, data.group)
    score = StrategyRanker(random_state=0).fit(data.X, data.y, data.group).predict(data.X)
    seconds = ranked.predict(data.X)
    np.testing.assert_array_equal(np.argsort(seconds, kind="stable"), np.argsort(-score, kind="stable"))
    assert ranked.slope_ > 0
