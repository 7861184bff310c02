"""The model-based tuner never spends a trial on a strategy whose features equal a measured one's
(it moves the same bytes through the same NICs: the predictor cannot tell them apart, and the trial
would measure noise)."""
from __future__ import annotations

from strategy_space.encoding import EncodedStrategies
from tests.fakes import three_node_cluster, tiny_model
from tuner.records.store import TrialStore
from tuner.search.model_based import ModelBasedTuner, SearchSettings, _feature_keys
from tuner.search.tuning import Budget, tune_loop
from tuner.synthetic.runner import SyntheticRunner


def test_no_search_trial_repeats_the_features_of_an_earlier_trial(tmp_path):
    model, cluster = tiny_model(profile=True), three_node_cluster()
    for seed in range(3):
        tuner = ModelBasedTuner(model, cluster, settings=SearchSettings(batch=4, candidates=64, chains=12,
                                                                        anneal_steps=8, seed=seed))
        with TrialStore(tmp_path / f"s{seed}.db") as store:
            out = tune_loop(SyntheticRunner(model, cluster, seed=seed), store, tuner,
                            Budget(trials=16, patience=100, confirm=0))
        rows = EncodedStrategies.concat([tuner.space.encode([t.strategy]) for t in out.trials])
        keys = _feature_keys(tuner.predictor.features(rows))
        for i, t in enumerate(out.trials):
            if t.role == "search":
                assert keys[i] not in keys[:i], f"seed {seed}: search trial {i} ({t.origin}) repeats earlier features"
        assert sum(t.role == "search" for t in out.trials) >= 8   # the exclusion leaves the search room


def test_feature_keys_ignore_last_bit_differences_only():
    import numpy as np

    a = np.array([[1.0, 2.5e-3, 0.0]], dtype=np.float32)
    assert _feature_keys(a * (1 + 1e-7)) == _feature_keys(a)
    assert _feature_keys(a * 1.01) != _feature_keys(a)
