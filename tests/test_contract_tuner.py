"""The Tuner contract, one suite for every Tuner (Optuna's sampler-contract style: each tuner is a
parameter of the ``make`` fixture; a new ``Tuner`` subclass fails ``test_every_tuner_is_covered``
until it is added to ``TUNERS``).

A Tuner's ``next_batch(k, history)`` proposes at most ``k`` strategies, each valid for its model
and cluster, distinct from one another, within the user's pins and, when ``lossless``, without a
lossy part; nothing in the history (failed trials included) is proposed again; once ``has_next`` is
False it stays False; the same seed proposes the same strategies.
"""
from __future__ import annotations

import dataclasses
import importlib
import pkgutil

import pytest

import tuner
from strategy_space import PS, validate
from tests.fakes import three_node_cluster, tiny_model
from tuner.records.goodput import is_lossless
from tuner.records.history import History
from tuner.search.base import Tuner
from tuner.search.baseline_tuner import BaselineTuner
from tuner.search.constraints import Constraints, Rule
from tuner.search.model_based import ModelBasedTuner, SearchSettings
from tuner.search.random_tuner import RandomTuner
from tuner.synthetic.runner import SyntheticRunner

MODEL, CLUSTER = tiny_model(profile=True), three_node_cluster()
FAST = dict(batch=3, candidates=32, chains=8, proposals=16, anneal_steps=4)
K = 3


def _random(seed=0, **kw):
    return RandomTuner(MODEL, CLUSTER, seed=seed, **kw)


def _baseline(seed=0, **kw):
    return BaselineTuner(MODEL, CLUSTER, **kw)


def _model_based(seed=0, **kw):
    return ModelBasedTuner(MODEL, CLUSTER, settings=SearchSettings(seed=seed, **FAST), **kw)


TUNERS = {RandomTuner: _random, BaselineTuner: _baseline, ModelBasedTuner: _model_based}


@pytest.fixture(params=list(TUNERS.values()), ids=[c.__name__ for c in TUNERS])
def make(request):
    """A factory ``make(seed=0, **tuner_kwargs)`` of one Tuner implementation on MODEL/CLUSTER."""
    return request.param


def _concrete_tuners() -> set[type]:
    for info in pkgutil.walk_packages(tuner.__path__, "tuner."):   # a subclass counts once its module is imported
        importlib.import_module(info.name)
    out, todo = set(), [Tuner]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if not getattr(cls, "__abstractmethods__", None) and cls.__module__.startswith("tuner."):
            out.add(cls)
    return out


def test_every_tuner_is_covered():
    missing = _concrete_tuners() - set(TUNERS)
    assert not missing, f"add {sorted(c.__name__ for c in missing)} to TUNERS in {__name__}"


def _measure(proposals, fail=()):
    """Trials of ``proposals`` from the synthetic runner; those at positions in ``fail`` failed."""
    runner = SyntheticRunner(MODEL, CLUSTER, seed=3)
    trials = runner.run([p.strategy for p in proposals], [p.origin for p in proposals])
    return [dataclasses.replace(t, status="failed", step_times=(), error="injected") if i in fail else t
            for i, t in enumerate(trials)]


def _canonical(strategies) -> list[str]:
    return [s.canonical(CLUSTER).fingerprint for s in strategies]


def test_next_batch_proposes_at_most_k_valid_distinct_strategies(make):
    t = make()
    batch = t.next_batch(K, History(MODEL, CLUSTER))
    assert 0 < len(batch) <= K
    for p in batch:
        validate(p.strategy, MODEL, CLUSTER)
        assert isinstance(p.origin, str) and p.origin
        if p.encoded is not None:   # the encoded row is the strategy's own
            assert t.space.encode([p.strategy]).row_keys() == p.encoded.row_keys()
        assert p.predicted_s is None or p.predicted_s > 0
    keys = _canonical(p.strategy for p in batch)
    assert len(set(keys)) == len(keys)


def test_nothing_measured_is_proposed_again_failed_trials_included(make):
    t, h = make(), History(MODEL, CLUSTER)
    first = t.next_batch(K, h)
    h.add(_measure(first, fail={0}), first)
    seen = set(_canonical(p.strategy for p in first))
    for _ in range(2):
        batch = t.next_batch(K, h) if t.has_next() else []
        assert not seen & set(_canonical(p.strategy for p in batch)), "a measured strategy was proposed again"
        h.add(_measure(batch), batch)
        seen |= set(_canonical(p.strategy for p in batch))


def test_what_it_would_propose_is_skipped_once_measured(make):
    """A fresh tuner told that what it would propose first was measured (one of them failed),
    e.g. by a resumed run, proposes other strategies."""
    would = make().next_batch(K, History(MODEL, CLUSTER))
    t, h = make(), History(MODEL, CLUSTER)
    h.add(_measure(would, fail={0}))
    batch = t.next_batch(K, h)
    assert not set(_canonical(p.strategy for p in batch)) & set(_canonical(p.strategy for p in would))


def test_a_strategy_measured_by_someone_else_is_not_proposed(make):
    t = make()
    would = make().next_batch(K, History(MODEL, CLUSTER))
    h = History(MODEL, CLUSTER)
    h.add(_measure([dataclasses.replace(p, origin="elsewhere") for p in would]))
    batch = t.next_batch(K, h)
    if isinstance(t, BaselineTuner):
        # its documented exception: each builder's strategy is measured under that builder's name,
        # whoever measured the same strategy before (it skips by origin only)
        assert [p.origin for p in batch] == [p.origin for p in would]
        return
    assert not set(_canonical(p.strategy for p in batch)) & set(_canonical(p.strategy for p in would))


def test_has_next_is_a_bool_and_once_false_stays_false(make):
    t, h = make(), History(MODEL, CLUSTER)
    was_false = False
    for _ in range(3):
        more = t.has_next()
        assert isinstance(more, bool)
        assert not (was_false and more)
        was_false = not more
        batch = t.next_batch(K, h) if more else []
        h.add(_measure(batch), batch)
    if was_false:   # exhausted: nothing left to propose once everything proposed was measured
        assert t.next_batch(K, h) == []


def test_pins_hold_for_every_proposal(make):
    pins = Constraints((Rule(match="embedding*", sync="ps"), Rule(match="dense_1/kernel", compressor="none")))
    t, h = make(constraints=pins), History(MODEL, CLUSTER)
    for _ in range(2):
        batch = t.next_batch(K, h)
        for p in batch:
            validate(p.strategy, MODEL, CLUSTER)
            emb, kernel = p.strategy.config("embedding/embeddings"), p.strategy.config("dense_1/kernel")
            assert all(isinstance(s, PS) for s in emb.synchronizers), p.origin
            assert all(isinstance(s, PS) or s.codec.kind == "none" for s in kernel.synchronizers), p.origin
        h.add(_measure(batch), batch)


def test_lossless_tuners_propose_no_lossy_part(make):
    t, h = make(lossless=True), History(MODEL, CLUSTER)
    for _ in range(2):
        batch = t.next_batch(K, h)
        assert all(is_lossless(p.strategy) for p in batch), [p.origin for p in batch if not is_lossless(p.strategy)]
        h.add(_measure(batch), batch)


def test_the_same_seed_proposes_the_same_strategies(make):
    def run(seed):
        t, h, out = make(seed=seed), History(MODEL, CLUSTER), []
        for _ in range(2):
            batch = t.next_batch(K, h)
            out.append([p.strategy.fingerprint for p in batch])
            h.add(_measure(batch), batch)
        return out

    assert run(0) == run(0)


def test_next_batch_leaves_the_history_as_it_was(make):
    """The history is the loop's: a tuner reads it and keeps no copy that could drift from it."""
    t, h = make(), History(MODEL, CLUSTER)
    first = t.next_batch(K, h)
    h.add(_measure(first, fail={0}), first)
    entries = list(h.entries)
    t.next_batch(K, h)
    assert h.entries == entries and len(h) == len(first)
