"""The loop's History (``tuner.records.history``): each trial's entry is built once when it arrives, and over
a tuning run no strategy is encoded or featurized twice in a round (the runner's own work aside)."""
from __future__ import annotations

import collections

import numpy as np
import pytest

import tuner.cost_models.predictor
import tuner.records.dataset
import tuner.records.history
from strategy_space.space import StrategySpace
from tests.fakes import three_node_cluster, tiny_model
from tuner.records.history import History
from tuner.records.store import TrialStore
from tuner.search.model_based import ModelBasedTuner, SearchSettings
from tuner.search.tuning import Budget, tune_loop
from tuner.synthetic.runner import SyntheticRunner

MODEL, CLUSTER = tiny_model(profile=True), three_node_cluster()


class _Counts:
    """Strategies encoded and feature rows computed, per round (a round starts at each
    ``next_batch``; the baselines are round 0), not counting the runner's own work."""

    def __init__(self):
        self.round = 0
        self.paused = False
        self.encoded = collections.defaultdict(list)      # round -> fingerprints encoded
        self.featurized = collections.defaultdict(list)   # round -> encoded row keys featurized
        self.arrived = []                                  # row keys History featurized, whole run

    def watch(self, monkeypatch):
        real_encode = StrategySpace.encode

        def encode(space, strategies):
            if not self.paused:
                self.encoded[self.round].extend(s.fingerprint for s in strategies)
            return real_encode(space, strategies)

        monkeypatch.setattr(StrategySpace, "encode", encode)
        for module in (tuner.cost_models.predictor, tuner.records.history, tuner.records.dataset):
            real = module.featurize

            def featurize(tables, e, *a, _real=real, _module=module, **k):
                if not self.paused:
                    keys = e.row_keys()
                    self.featurized[self.round].extend(keys)
                    if _module is tuner.records.history:
                        self.arrived.extend(keys)
                return _real(tables, e, *a, **k)

            monkeypatch.setattr(module, "featurize", featurize)


class _Runner(SyntheticRunner):
    counts: _Counts

    def run(self, strategies, origins=None):
        self.counts.paused = True   # the fake runner prices strategies its own way: not the tuner's work
        try:
            return super().run(strategies, origins)
        finally:
            self.counts.paused = False


def _twice(keys) -> list:
    return [k for k, n in collections.Counter(keys).items() if n > 1]


def test_no_strategy_is_encoded_or_featurized_twice_in_a_round(tmp_path, monkeypatch):
    counts = _Counts()
    counts.watch(monkeypatch)
    model_based = ModelBasedTuner(MODEL, CLUSTER, settings=SearchSettings(batch=3, candidates=48, chains=8,
                                                                         proposals=16, anneal_steps=4))
    real_next_batch = model_based.next_batch

    def next_batch(k, history):
        counts.round += 1
        return real_next_batch(k, history)

    monkeypatch.setattr(model_based, "next_batch", next_batch)
    runner = _Runner(MODEL, CLUSTER, seed=2)
    runner.counts = counts
    with TrialStore(tmp_path / "h.db") as store:
        out = tune_loop(runner, store, model_based, Budget(trials=6, patience=10, confirm=1))
    assert counts.round >= 2 and len(out.confirm_trials) >= 1
    for r in range(counts.round + 1):
        assert not _twice(counts.encoded[r]), f"round {r}: a strategy was encoded twice"
        assert not _twice(counts.featurized[r]), f"round {r}: a strategy was featurized twice"
    # the first search round encodes the sampler's recipes (once per tuner); later rounds, their
    # trials and the confirmations encode nothing (proposals carry their rows)
    assert counts.featurized[1] and not any(counts.encoded[r] for r in range(2, counts.round + 1))
    # over the whole run, History featurizes only what no proposal carried: each strategy once
    assert not _twice(counts.arrived)
    assert len(counts.arrived) <= len([t for t in out.trials if t.role == "baseline"])


def test_an_entry_is_built_once_and_shared_by_measurements_of_one_strategy():
    runner = SyntheticRunner(MODEL, CLUSTER, seed=1)
    history = History(MODEL, CLUSTER)
    space = StrategySpace(MODEL, CLUSTER)
    strategies = [space.decode(space.sample_encoded(np.random.default_rng(0), 1), 0)]
    first = runner.run(strategies)
    again = runner.run(strategies)
    [a] = history.add(first)
    [b] = history.add(again)
    assert history.add(first) == []                       # a trial object held already
    assert a.encoded is b.encoded and a.features is b.features and a.canonical == b.canonical
    assert a.uid != b.uid and list(history) == first + again
    assert history.latest_seconds() == {a.key: again[0].median}
    assert history.feature_keys() == {a.feature_key} and history.canonical_keys() == {a.canonical}
    with pytest.raises(TypeError):
        hash(history)
