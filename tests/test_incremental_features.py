"""Incremental featurization (``tuner.features.incremental``) against ``featurize`` on chains of random
mutations (several proposals per chain and step, as the annealer makes them): every feature of
every proposal, bit for bit, across spaces, clusters, constraints and partition axes; and the
predictions and annealing pools built on them."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from strategy_space import PS, AllReduce, ClusterSpec, ModelSpec, NodeSpec, Strategy, VarConfig, VariableSpec
from strategy_space.encoding import FIELDS, KIND_AR, Mutation
from strategy_space.space import StrategySpace
from tests.fakes import three_node_cluster, tiny_model, two_node_cluster
from tuner.cost_models.analytic import AnalyticCostModel
from tuner.cost_models.scoring import IncrementalScorer
from tuner.cost_models.simulator import LearnedSimulator
from tuner.features.batch import COL, featurize
from tuner.features.incremental import IncrementalFeaturizer
from tuner.features.tables import FeatureTables
from tuner.records.dataset import featurize_trials
from tuner.search.annealing import simulated_annealing
from tuner.search.constraints import Constraints, Rule
from tuner.synthetic.runner import SyntheticRunner

def assert_same_features(inc: np.ndarray, full: np.ndarray, where: str) -> None:
    """Bit for bit: both sum float32 terms in float64, exactly for these specs."""
    differ = np.argwhere(inc != full)
    if len(differ):
        r, c = differ[0]
        name = [n for n, i in COL.items() if i == c][0]
        raise AssertionError(f"{where}: {len(differ)} values differ, first {name} of row {r}: incremental "
                             f"{inc[r, c]!r}, featurize {full[r, c]!r}")


def run_chains(space, tables, rng, *, chains=24, steps=30, proposals=3, project=None, init=None):
    """Give every chain ``proposals`` mutations per step for ``steps`` steps, moving about half the
    chains to one of theirs, and compare the incremental features of every proposal with
    ``featurize``'s. With ``project``, the projected proposals go in as a ``Mutation.diff``; every
    other step, as a plain batch (row i varies chain i)."""
    cur = space.sample_encoded(rng, chains) if init is None else init.copy()
    cur = project(cur) if project else cur
    inc = IncrementalFeaturizer(tables)
    assert_same_features(inc.reset(cur), featurize(tables, cur), "reset")
    parents = np.repeat(np.arange(chains), proposals)
    for step in range(steps):
        m = space.mutate_rows(cur, parents, rng)
        if project:
            m = Mutation.diff(cur, project(m.encoded), parents)
        if step % 2 and proposals == 1 and not project:
            m = m.encoded   # a batch, row i varying chain i
        prop = m if isinstance(m, type(cur)) else m.encoded
        assert_same_features(inc.propose(m), featurize(tables, prop), f"step {step}")
        chosen = np.where(rng.random(chains) < 0.5, np.arange(chains) * proposals + rng.integers(0, proposals, chains),
                          -1)
        inc.accept(chosen)
        moved = chosen >= 0
        for f in cur.field_names():
            getattr(cur, f)[moved] = getattr(prop, f)[chosen[moved]]
        now = inc.current()
        assert all((getattr(now, f) == getattr(cur, f)).all() for f in FIELDS), f"step {step}: chains differ"
    return inc


def wide_model(n_dense: int = 30, seed: int = 0) -> ModelSpec:
    r = np.random.default_rng(seed)
    vs = []
    for i in range(n_dense):
        a, b = int(r.integers(3, 300)), int(r.integers(1, 200))
        vs += [VariableSpec(f"l{i}/kernel", (a, b)), VariableSpec(f"l{i}/bias", (b,))]
    vs += [VariableSpec("emb0", (5000, 16), sparse=True, rows_per_step=300),
           VariableSpec("emb1", (77, 8), sparse=True, rows_per_step=5),
           VariableSpec("half", (40, 40), dtype="float16"), VariableSpec("count", (1,), dtype="int64")]
    return ModelSpec("wide", tuple(vs), 32)


def _cluster(workers, bw=None):
    return ClusterSpec("c", tuple(NodeSpec(f"n{i}", workers=w, bandwidth_gbps=(bw or [1.0] * len(workers))[i])
                                  for i, w in enumerate(workers)))


def _calibrated(cluster):
    from strategy_space.calibration import Calibration

    curve = tuple((4 ** k * 1024, 2e-4 * 1.5 ** k + 4 ** k * 1024 / 1e8) for k in range(1, 9))
    return replace(cluster, calibration=Calibration("gloo", 2, curve, ((4096, 1e-3), (2 ** 20, 5e-3))))


CASES = {
    "tiny, 3 nodes": (tiny_model(profile=True), three_node_cluster(), {}),
    "tiny, 2 nodes, every option": (tiny_model(), two_node_cluster(),
                                    dict(staleness=(0, 1, 3), allow_async=True, backends=("auto", "objectstore"),
                                         ranks=(1, 2, 8))),
    "wide, shards wrap the nodes": (wide_model(), _cluster([2, 1, 3], [1.0, 2.5, 10.0]), dict(max_shards=11)),
    "wide, a node without workers": (wide_model(seed=1), _cluster([2, 0, 2, 1]), dict(num_groups=3)),
    "wide, one node one worker": (wide_model(seed=2), _cluster([1]), {}),
    "wide, calibrated all-reduce curve": (wide_model(seed=4), _calibrated(_cluster([2, 1, 2])), dict(num_groups=5)),
    # global clipping: held steps (push and pull phases, one more round trip) where a sync PS is
    "wide, global clipping, async and stale PS": (replace(wide_model(seed=5), global_clipnorm=True), _cluster([2, 1]),
                                                  dict(staleness=(0, 2), allow_async=True)),
    # lines longer than 512 entries (nodes plus shards, groups plus shards) are folded by a cumsum
    "wide, long lines: 520 nodes, 64 shards": (wide_model(seed=6), _cluster([1] * 520),
                                               dict(max_shards=64, num_groups=40)),
    "sparse rows that do not divide": (ModelSpec("sp", (VariableSpec("e1", (101, 4), sparse=True, rows_per_step=7),
                                                        VariableSpec("e2", (53, 3), sparse=True, rows_per_step=50),
                                                        VariableSpec("d", (10, 3)))), _cluster([1, 2]),
                                       dict(max_shards=7)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_incremental_features_match_featurize_on_random_mutations(case):
    model, cluster, options = CASES[case]
    space = StrategySpace(model, cluster, **options)
    run_chains(space, FeatureTables.from_specs(model, cluster), np.random.default_rng(len(case)))
    # one proposal per chain, every other step given as a plain batch
    run_chains(space, FeatureTables.from_specs(model, cluster), np.random.default_rng(len(case) + 1), proposals=1,
               steps=10)


def test_incremental_features_match_under_constraints():
    model, cluster = wide_model(seed=3), _cluster([2, 2, 1])
    space = StrategySpace(model, cluster, staleness=(0, 2))
    # pins, a group past the space's groups (the state widens), a whole-strategy staleness
    cons = Constraints((Rule(match="l1*", sync="ps", shards=3, destination="n2"),
                        Rule(match="l2/kernel", group=17, compressor="powersgd(4)"),
                        Rule(sparse=True, sync="all_reduce"),
                        Rule(match="l3*", local_replication=True)), staleness=2).compile(space)
    run_chains(space, FeatureTables.from_specs(model, cluster), np.random.default_rng(5),
               project=lambda e: cons.apply(e, space))


def test_incremental_features_from_strategies_split_along_other_axes():
    """Encoded strategies may split along axis 1 (PowerSGD then compresses each shard's own
    (first dimension, rest) matrix); mutations normalize back to axis 0."""
    model = ModelSpec("ax", (VariableSpec("w", (6, 50)), VariableSpec("v", (9, 7)), VariableSpec("b", (50,)),
                             VariableSpec("c", (8, 5, 10))), 8)
    cluster = _cluster([1, 2])
    space = StrategySpace(model, cluster)
    psgd = AllReduce(compressor="powersgd(1)", group=2)
    s = Strategy((VarConfig("w", (PS("n0"), PS("n1"), PS("n0")), axis=1),
                  VarConfig("v", (AllReduce(group=0), AllReduce(group=1)), axis=1),
                  VarConfig("b", (AllReduce(compressor="fp16"),)),
                  VarConfig("c", (psgd, psgd), axis=1)))
    init = space.encode([s] * 6)
    assert init.axis.any()
    run_chains(space, FeatureTables.from_specs(model, cluster), np.random.default_rng(6), chains=6, init=init)
    run_chains(space, FeatureTables.from_specs(model, cluster), np.random.default_rng(6), chains=6, init=init,
               proposals=1)


def test_emptied_categories_give_exact_zeros():
    """Chains that move every variable to all-reduce (then back) end with exact zeros, as featurize
    (one worker: no ring traffic, so PS residue alone would make the overlap bound up)."""
    model, cluster = tiny_model(), _cluster([1])
    space = StrategySpace(model, cluster)
    t = FeatureTables.from_specs(model, cluster)
    rng = np.random.default_rng(7)
    cur = space.sample_encoded(rng, 4)
    inc = IncrementalFeaturizer(t)
    inc.reset(cur)
    for target in (KIND_AR, 1 - KIND_AR):
        prop = cur.copy()
        prop.kind[:] = target
        prop = space.normalize(prop)
        X = inc.propose(prop)
        assert_same_features(X, featurize(t, prop), f"all kind {target}")
        inc.accept(np.arange(len(cur)))
        cur = prop
    assert (X[:, COL["ar_wire_bytes"]] == 0).all() and (X[:, COL["ar_groups"]] == 0).all()


def test_a_category_emptied_after_rounding_is_exactly_zero():
    """An 8 TB variable next to one with fractional shard bytes: taking both off the parameter
    servers leaves float64 rounding residue in the sums unless the emptied block is reset."""
    model = ModelSpec("r", (VariableSpec("huge", (2_000_000, 1_000_000)),
                            VariableSpec("e", (999_983, 4), sparse=True, rows_per_step=3)))
    cluster = _cluster([1])
    space = StrategySpace(model, cluster)
    t = FeatureTables.from_specs(model, cluster)
    ps = space.normalize(space.sample_encoded(np.random.default_rng(0), 1))
    ps.kind[:] = 1 - KIND_AR
    ps.shards[:] = [[1, 2]]
    ps = space.normalize(ps)
    ar = ps.copy()
    ar.kind[:] = KIND_AR
    ar = space.normalize(ar)
    inc = IncrementalFeaturizer(t)
    inc.reset(ps)
    X = inc.propose(ar)
    assert_same_features(X, featurize(t, ar), "all-reduce only")
    assert X[0, COL["ps_push_max_node_bytes"]] == 0 and X[0, COL["exposed_frac"]] == 0


def test_rows_that_do_not_change_keep_their_features():
    model, cluster = tiny_model(), two_node_cluster()
    space = StrategySpace(model, cluster)
    t = FeatureTables.from_specs(model, cluster)
    cur = space.sample_encoded(np.random.default_rng(8), 5)
    inc = IncrementalFeaturizer(t)
    X0 = inc.reset(cur)
    np.testing.assert_array_equal(inc.propose(cur.copy()), X0)


def test_misuse_is_reported():
    model, cluster = tiny_model(), two_node_cluster()
    space = StrategySpace(model, cluster)
    e = space.sample_encoded(np.random.default_rng(9), 3)
    inc = IncrementalFeaturizer(FeatureTables.from_specs(model, cluster))
    with pytest.raises(ValueError, match=r"needs the parents first: call reset"):
        inc.propose(e)
    inc.reset(e)
    with pytest.raises(ValueError, match=r"no pending proposal: call propose first"):
        inc.accept(np.arange(3))
    with pytest.raises(ValueError, match=r"propose got 2 strategies for 3 parents"):
        inc.propose(e.take(np.arange(2)))
    rng = np.random.default_rng(1)
    with pytest.raises(ValueError, match=r"mutation of other strategies than the chains' current ones"):
        inc.propose(space.mutate_rows(space.sample_encoded(rng, 3), [0, 1, 2], rng))
    with pytest.raises(ValueError, match=r"propose got a mutation of 4 strategies with parents up to 3; mutate the 3 "
                                         r"chains' strategies"):
        inc.propose(space.mutate_rows(space.sample_encoded(rng, 4), [0, 3], rng))
    inc.propose(space.mutate_rows(e, [0, 0, 2, 2], rng))
    with pytest.raises(ValueError, match=r"accept takes one proposal index \(0..3\) or -1 per chain \(3 chains\)"):
        inc.accept(np.ones(3, bool))
    with pytest.raises(ValueError, match=r"accept takes one proposal index"):
        inc.accept([0, 4, -1])
    other = StrategySpace(wide_model(), cluster).sample_encoded(np.random.default_rng(0), 3)
    with pytest.raises(ValueError, match=r"strategies encode 64 variables but the model has 6"):
        inc.reset(other)


def test_incremental_scorer_predicts_what_the_simulator_predicts():
    model, cluster = wide_model(seed=4), _cluster([2, 2])
    space = StrategySpace(model, cluster)
    rng = np.random.default_rng(10)
    trials = SyntheticRunner(model, cluster, seed=0).run([space.decode(space.sample_encoded(rng, 1), 0)
                                                          for _ in range(30)])
    X, y = featurize_trials(model, cluster, trials)
    sim = LearnedSimulator().fit(X, y)
    t = FeatureTables.from_specs(model, cluster)
    scorer = IncrementalScorer(IncrementalFeaturizer(t), sim.predict)
    cur = space.sample_encoded(rng, 32)
    np.testing.assert_array_equal(scorer.reset(cur), sim.predict(featurize(t, cur)))
    parents = np.repeat(np.arange(len(cur)), 4)
    for _ in range(15):
        m = space.mutate_rows(cur, parents, rng)
        np.testing.assert_array_equal(scorer.propose(m), sim.predict(featurize(t, m.encoded)))
        chosen = np.where(rng.random(len(cur)) < 0.5, np.arange(len(cur)) * 4 + 3, -1)
        scorer.accept(chosen)
        moved = chosen >= 0
        for f in cur.field_names():
            getattr(cur, f)[moved] = getattr(m.encoded, f)[chosen[moved]]


@pytest.mark.parametrize("proposals", [1, 6])
def test_annealing_with_the_incremental_scorer_finds_the_same_pool(proposals):
    model, cluster = tiny_model(profile=True), three_node_cluster()
    space = StrategySpace(model, cluster)
    t = FeatureTables.from_specs(model, cluster)
    analytic = AnalyticCostModel()
    init = space.sample_encoded(np.random.default_rng(11), 12)
    full = simulated_annealing(space, lambda e: analytic.predict(featurize(t, e)), init,
                               np.random.default_rng(12), steps=40, proposals=proposals)
    fast = simulated_annealing(space, IncrementalScorer(IncrementalFeaturizer(t), analytic.predict), init,
                               np.random.default_rng(12), steps=40, proposals=proposals)
    assert fast.encoded.row_keys() == full.encoded.row_keys()
    np.testing.assert_array_equal(fast.predicted, full.predicted)


def test_group_changes_of_groups_without_one_compressor():
    """Chains whose fusion groups mix compressors: a group change there is scored cell by cell,
    elsewhere from the per-group aggregates; both bit for bit."""
    model, cluster = wide_model(seed=5), _cluster([2, 2])
    space = StrategySpace(model, cluster, num_groups=2, ranks=(2, 4))
    rng = np.random.default_rng(13)
    init = space.sample_encoded(rng, 10)
    init.kind[:5] = KIND_AR   # half the chains all-reduce everything, in two groups of mixed compressors
    init.compressor[:5] = rng.integers(0, 5, size=(5, init.kind.shape[1]))
    init.rank[:5] = 2
    init = space.normalize(init)
    run_chains(space, FeatureTables.from_specs(model, cluster), rng, chains=10, steps=12, proposals=8, init=init)


def test_chains_that_take_other_chains_proposals():
    model, cluster = wide_model(seed=6), _cluster([2, 1])
    space = StrategySpace(model, cluster)
    t = FeatureTables.from_specs(model, cluster)
    rng = np.random.default_rng(14)
    cur = space.sample_encoded(rng, 6)
    inc = IncrementalFeaturizer(t)
    inc.reset(cur)
    for step in range(10):
        parents = np.repeat(np.arange(6), 5)
        m = space.mutate_rows(cur, parents, rng)
        prop = m.encoded
        assert_same_features(inc.propose(m), featurize(t, prop), f"step {step}")
        chosen = rng.permutation(len(m))[:6]   # any proposal, of any chain (and some chains stay)
        chosen[rng.random(6) < 0.3] = -1
        inc.accept(chosen)
        moved = chosen >= 0
        for f in cur.field_names():
            getattr(cur, f)[moved] = getattr(prop, f)[chosen[moved]]
        now = inc.current()
        assert all((getattr(now, f) == getattr(cur, f)).all() for f in FIELDS)


def test_incremental_features_follow_a_switch_to_hierarchical_all_reduce():
    """A strategy-wide switch between flat and hierarchical all-reduce (rare among drawn mutations)
    gives featurize's numbers exactly, and they differ from the flat strategy's."""
    model, cluster = wide_model(seed=5), _cluster([2, 3, 1])
    space = StrategySpace(model, cluster)
    t = FeatureTables.from_specs(model, cluster)
    e = space.sample_encoded(np.random.default_rng(8), 16)
    e.hierarchical[:] = 0
    flipped = e.copy()
    flipped.hierarchical[:] = e.kind == KIND_AR
    inc = IncrementalFeaturizer(t)
    inc.reset(e)
    got = inc.propose(flipped)
    assert np.array_equal(got, featurize(t, flipped))
    has_ar = (e.kind == KIND_AR).any(axis=1)
    assert (got[has_ar, COL["hierarchical"]] == 1).all()
    assert (got[has_ar, COL["nic_out_s"]] != featurize(t, e)[has_ar, COL["nic_out_s"]]).any()
