"""Issue 17, item 5: canonical strategies, and the tuner never measuring two equivalent ones."""
from __future__ import annotations

import dataclasses

import numpy as np

from strategy_space import ClusterSpec, ConfigError, NodeSpec
from strategy_space.encoding import KIND_AR
from strategy_space.space import StrategySpace
from strategy_space.strategy import PS, AllReduce, Strategy, VarConfig
from tests.fakes import three_node_cluster, tiny_model
from tuner.features.batch import featurize
from tuner.features.tables import FeatureTables
from tuner.records.history import History
from tuner.search.annealing import Pool
from tuner.search.model_based import ModelBasedTuner, SearchSettings
from tuner.synthetic.runner import SyntheticRunner

MODEL = tiny_model(profile=True)
ALIKE = ClusterSpec("alike", tuple(NodeSpec(f"h{i}", address=f"10.0.0.{i + 1}", bandwidth_gbps=1.0) for i in range(3)))


def renumbered(s: Strategy, mapping: dict[int, int]) -> Strategy:
    return Strategy(tuple(VarConfig(c.name, tuple(dataclasses.replace(x, group=mapping.get(x.group, x.group))
                                                  if isinstance(x, AllReduce) else x for x in c.synchronizers), c.axis)
                          for c in s.variables), s.replicas, origin="other")


def rotated(s: Strategy, names: list[str], by: int) -> Strategy:
    move = {n: names[(i + by) % len(names)] for i, n in enumerate(names)}
    return Strategy(tuple(VarConfig(c.name, tuple(dataclasses.replace(x, destination=move[x.destination])
                                                  if isinstance(x, PS) else x for x in c.synchronizers), c.axis)
                          for c in s.variables), s.replicas)


def two_groups() -> Strategy:
    v = MODEL.variables
    return Strategy(tuple(VarConfig(x.name, (AllReduce(group=3 if i % 2 else 7),)) if i else
                          VarConfig(x.name, (PS("h1"),)) for i, x in enumerate(v)))


def test_group_numbering_and_variable_order_do_not_count():
    s = two_groups()
    other = renumbered(s, {3: 7, 7: 3})
    assert s.fingerprint != other.fingerprint
    assert s.canonical() == other.canonical() == s.canonical().canonical()
    assert Strategy(tuple(reversed(s.variables))).canonical() == s.canonical()
    groups = [x.group for c in s.canonical().variables for x in c.synchronizers if isinstance(x, AllReduce)]
    assert sorted(set(groups)) == [0, 1] and groups[0] == 0
    # a different grouping stays different
    merged = renumbered(s, {3: 7})
    assert merged.canonical() != s.canonical()


def test_placements_are_identified_only_over_identical_nodes():
    s = two_groups()
    names = list(ALIKE.node_names)
    assert rotated(s, names, 1).canonical(ALIKE) == s.canonical(ALIKE)
    hetero = three_node_cluster()   # nodes with different bandwidths: placement matters
    assert rotated(s, names, 1).canonical(hetero) != s.canonical(hetero)


def test_features_of_equivalent_strategies_are_equal():
    """Featurizing needs no canonical step: features depend on group membership and node
    facts, never on ids (checked on random strategies and their canonical forms)."""
    for cluster in (three_node_cluster(), ALIKE):
        space = StrategySpace(MODEL, cluster)
        e = space.sample_encoded(np.random.default_rng(3), 200)
        tables = FeatureTables.from_specs(MODEL, cluster)
        rows, canon = [], []
        for i in range(len(e)):
            c = space.decode(e, i).canonical(cluster)
            try:
                space.encode([c])
            except ConfigError:   # canonical numbering can leave the encoded subspace (strided groups)
                continue
            rows.append(i)
            canon.append(c)
        assert len(rows) > 100
        # float32 sums in another order: equal to rounding
        np.testing.assert_allclose(featurize(tables, e.take(rows)), featurize(tables, space.encode(canon)), rtol=1e-6)


def test_the_tuner_never_picks_a_strategy_equivalent_to_a_measured_one():
    cluster = three_node_cluster()
    tuner = ModelBasedTuner(MODEL, cluster, settings=SearchSettings(batch=2, epsilon=0.0, seed=0))
    s = two_groups()
    history = History(MODEL, cluster)
    history.add(SyntheticRunner(MODEL, cluster).run([s]))
    same = renumbered(s, {3: 7, 7: 3})
    other = renumbered(s, {3: 7})
    enc = tuner.space.encode([same, other, same])
    assert (enc.kind == KIND_AR).any()
    pool = Pool(enc, np.array([1.0, 2.0, 3.0]))
    picks, _ = tuner._select(pool, 2, np.random.default_rng(0), history.latest_seconds(), history.canonical_keys(),
                             tuner.settings.epsilon)
    assert picks == [1]


def test_a_strategy_serializes_for_its_fingerprint_once(monkeypatch):
    """``Strategy.fingerprint`` is read many times per trial (indexes, stores, outcomes): it is
    computed on the first read and kept on the object, out of equality, hashing and repr."""
    import strategy_space.strategy as strategy_module
    from strategy_space.builders import get_builder

    calls = []
    real = strategy_module.fingerprint
    monkeypatch.setattr(strategy_module, "fingerprint", lambda d: calls.append(1) or real(d))
    s = get_builder("ps").build(MODEL, ALIKE)
    first = s.fingerprint
    assert [s.fingerprint for _ in range(5)] == [first] * 5 and len(calls) == 1
    relabelled = dataclasses.replace(s, origin="elsewhere")   # a new object: its own (equal) fingerprint
    assert relabelled.fingerprint == first and len(calls) == 2
    fresh = Strategy(s.variables, s.replicas)
    assert fresh == s and hash(fresh) == hash(s) and repr(fresh) == repr(dataclasses.replace(s, origin=""))
    assert "_fingerprint" not in repr(s)
