"""Search pieces with a known optimum: constraints, knowledge-guided sampler, annealing, selection."""
import numpy as np
import pytest

from strategy_space import ConfigError, validate
from strategy_space.encoding import KIND_AR, KIND_PS, EncodedStrategies, Mutation
from strategy_space.space import StrategySpace
from tests.fakes import three_node_cluster, tiny_model, two_node_cluster
from tuner.search.annealing import Pool, _Fingerprints, select_diverse, simulated_annealing
from tuner.search.constraints import Constraints, Rule, as_constraints, load_constraints
from tuner.search.sampler import KnowledgeSampler

MODEL, CLUSTER = tiny_model(), three_node_cluster()


def ps_count_score(e):
    """Toy predictor: 1 s plus 1 s per PS variable plus 0.1 s per extra shard (optimum: all AR, unsplit)."""
    return 1.0 + (e.kind == KIND_PS).sum(axis=1) + 0.1 * (e.shards - 1).sum(axis=1)


def test_annealing_finds_the_optimum():
    space = StrategySpace(MODEL, CLUSTER)
    rng = np.random.default_rng(0)
    pool = simulated_annealing(space, ps_count_score, space.sample_encoded(rng, 16), rng, steps=150)
    assert pool.predicted[0] == pytest.approx(1.0)
    assert np.all(np.diff(pool.predicted) >= 0)  # best first
    assert len(set(pool.encoded.row_keys())) == len(pool)  # distinct
    for r in range(min(10, len(pool))):
        validate(space.decode(pool.encoded, r), MODEL, CLUSTER)


@pytest.mark.parametrize("proposals", [1, 6])
def test_constraints_are_never_violated(proposals):
    space = StrategySpace(MODEL, CLUSTER, staleness=(0, 1, 2))
    cons = Constraints((Rule(match="dense*kernel", sync="ps", shards=2, destination="h1"),
                        Rule(sparse=False, compressor="none", match="dense_1/bias")), staleness=1).compile(space)
    rng = np.random.default_rng(1)
    project = lambda e: cons.apply(e, space)  # noqa: E731
    pool = simulated_annealing(space, ps_count_score, space.sample_encoded(rng, 8), rng, steps=60, project=project,
                               proposals=proposals)
    assert not cons.violations(pool.encoded).any()
    best = space.decode(pool.encoded, 0)
    for name in ("dense/kernel", "dense_1/kernel"):
        syncs = best.config(name).synchronizers
        assert [s.destination for s in syncs] == ["h1", "h2"] and all(s.staleness == 1 for s in syncs)
    # everything not pinned went to all-reduce, the toy optimum
    assert all(best.config(v).synchronizers[0].__class__.__name__ == "AllReduce"
               for v in ("embedding/embeddings", "dense/bias", "steps"))


def test_a_graph_pin_keeps_its_variable_s_all_reduce_flat():
    """A hierarchical all-reduce stages through the object store whatever its backend: a variable
    pinned to the graph backend (one with a constraint, which only the graph applies) stays flat,
    while the others may still be hierarchical where a node holds several workers."""
    space = StrategySpace(MODEL, two_node_cluster())   # node a holds two workers
    assert space.multi_worker_nodes
    cons = Constraints((Rule(match="dense/kernel", sync="all_reduce", backend="graph", shards=1),)).compile(space)
    rng = np.random.default_rng(2)
    e = space.sample_encoded(rng, 64)
    e.kind[:] = KIND_AR
    e.hierarchical[:] = 1
    e = cons.apply(space.normalize(e), space)
    pinned = MODEL.names.index("dense/kernel")
    assert not e.hierarchical[:, pinned].any() and e.hierarchical[:, pinned + 1].all()
    assert not cons.violations(e).any()
    for r in range(3):
        assert not space.decode(e, r).config("dense/kernel").synchronizers[0].hierarchical
    e.hierarchical[:, pinned] = 1
    assert cons.violations(e).all()


def test_constraint_errors_are_clear(tmp_path):
    space = StrategySpace(MODEL, CLUSTER)
    with pytest.raises(ConfigError, match=r"match='nothing\*': selects no variable of model tiny"):
        Constraints((Rule(match="nothing*", sync="ps"),)).compile(space)
    with pytest.raises(ConfigError, match=r"destination 'h7' is not a node of cluster three; allowed: h0, h1, h2"):
        Constraints((Rule(destination="h7"),)).compile(space)
    with pytest.raises(ConfigError, match=r"compressor fp16 cannot apply to embedding/embeddings"):
        Constraints((Rule(compressor="fp16"),)).compile(space)
    with pytest.raises(ConfigError, match=r"fixes PS options \(destination\) and all-reduce options \(group\)"):
        Rule(destination="h0", group=1)
    f = tmp_path / "c.yaml"
    f.write_text("kind: constraints\nvariables:\n- match: '*'\n  sink: ps\n")
    with pytest.raises(ConfigError, match=r"c.yaml: constraints.variables\[0\]: unknown key\(s\) sink"):
        load_constraints(f)
    f.write_text("kind: constraints\nstaleness: 0\nvariables:\n- {match: 'emb*', sync: ps, shards: 3}\n")
    assert load_constraints(f) == Constraints((Rule(match="emb*", sync="ps", shards=3),), staleness=0)


def test_the_api_takes_constraints_as_an_object_a_path_or_the_files_content(tmp_path):
    """``autosync.plan(constraints=Path(...))`` and a dict were AttributeErrors in search_limits."""
    from pathlib import Path

    pinned = Constraints((Rule(match="emb*", sync="ps", shards=3),), staleness=0)
    f = tmp_path / "c.yaml"
    f.write_text("kind: constraints\nstaleness: 0\nvariables:\n- {match: 'emb*', sync: ps, shards: 3}\n")
    for given in (pinned, f, str(f), Path(f),
                  {"kind": "constraints", "staleness": 0, "variables": [{"match": "emb*", "sync": "ps", "shards": 3}]}):
        assert as_constraints(given) == pinned
    assert as_constraints(None) is None
    with pytest.raises(ConfigError, match=r"constraints.variables\[0\]: unknown key\(s\) sink"):
        as_constraints({"kind": "constraints", "variables": [{"match": "*", "sink": "ps"}]})
    with pytest.raises(ConfigError, match=r"constraints must be a Constraints, a constraints YAML path or its "
                                          r"content as a dict, got list \["):
        as_constraints([Rule(match="emb*")])


def test_knowledge_sampler_starts_from_expert_recipes():
    space = StrategySpace(MODEL, two_node_cluster())
    e = KnowledgeSampler(space).sample(np.random.default_rng(2), 64)
    assert len(e) == 64
    sparse = MODEL.index("embedding/embeddings")
    # most candidates keep the embedding on parameter servers, most dense kernels all-reduced
    assert (e.kind[:, sparse] == KIND_PS).mean() > 0.5
    assert (e.kind[:, MODEL.index("dense_1/kernel")] == KIND_AR).mean() > 0.4
    for r in range(len(e)):
        validate(space.decode(e, r), MODEL, two_node_cluster())


def test_select_diverse_skips_near_duplicates_and_measured():
    space = StrategySpace(MODEL, CLUSTER)
    rng = np.random.default_rng(3)
    base = space.sample_encoded(rng, 1)
    near = space.mutate_encoded(base, rng)
    far = space.sample_encoded(rng, 1)
    from strategy_space.encoding import EncodedStrategies

    pool = Pool(EncodedStrategies.concat([base, near, far]), np.array([1.0, 1.01, 2.0]))
    assert select_diverse(pool, 2, rng, min_distance=2) == [0, 2]
    assert select_diverse(pool, 2, rng, min_distance=2, exclude={pool.encoded.row_keys()[0]}) == [1, 2]
    picked = select_diverse(pool, 3, rng, min_distance=2)
    assert sorted(picked) == [0, 1, 2]  # the rest fills up when k is not reached


def test_select_diverse_explores_only_where_allowed_and_fills_greedily():
    space = StrategySpace(MODEL, CLUSTER)
    rng = np.random.default_rng(5)
    pool = Pool(space.sample_encoded(rng, 6), np.arange(1.0, 7.0))
    allowed = np.array([True, False, False, False, False, True])
    for seed in range(20):   # one greedy pick, one at random: always the allowed one
        assert select_diverse(pool, 2, np.random.default_rng(seed), epsilon=0.5, min_distance=0,
                              explorable=allowed) == [0, 5]
    assert {select_diverse(pool, 2, np.random.default_rng(seed), epsilon=0.5, min_distance=0)[1]
            for seed in range(20)} != {5}   # unmasked, the random pick ranges over the pool
    none = np.zeros(6, dtype=bool)   # nothing to explore: the picks are the next best
    assert select_diverse(pool, 3, rng, epsilon=0.5, min_distance=0, explorable=none) == [0, 1, 2]


def test_pool_scores_are_the_scores_of_its_strategies():
    """Chains that end worse than they started (hot annealing) must not carry their start's score."""
    space = StrategySpace(MODEL, CLUSTER)
    rng = np.random.default_rng(4)
    pool = simulated_annealing(space, ps_count_score, space.sample_encoded(rng, 16), rng, steps=10, t_start=50.0,
                               t_end=50.0)
    np.testing.assert_allclose(pool.predicted, ps_count_score(pool.encoded))


def test_several_proposals_per_chain_find_the_optimum_in_fewer_steps():
    space = StrategySpace(MODEL, CLUSTER)
    rng = np.random.default_rng(5)
    init = space.sample_encoded(rng, 8)
    one = simulated_annealing(space, ps_count_score, init, np.random.default_rng(6), steps=12)
    many = simulated_annealing(space, ps_count_score, init, np.random.default_rng(6), steps=12, proposals=16)
    assert many.predicted[0] == pytest.approx(1.0)
    assert many.predicted[0] <= one.predicted[0]


class RecordingScorer:
    """A ChainScorer that scores from scratch and records what the annealer asks."""

    def __init__(self, score):
        self.score, self.proposed, self.chosen, self.scored = score, [], [], []

    def reset(self, e):
        self.chains = e.copy()
        self.scored.append(e.copy())
        return self.score(e)

    def propose(self, m):
        assert isinstance(m, Mutation)
        for f in m.base.field_names():   # a mutation of the chains as they are now
            assert (getattr(m.base, f) == getattr(self.chains, f)).all()
        self.proposed.append(m)
        self.scored.append(m.encoded)
        return self.score(m.encoded)

    def accept(self, chosen):
        m = self.proposed[-1]
        self.chosen.append(np.array(chosen))
        moved = np.flatnonzero(chosen >= 0)
        rows = m.take(chosen[moved])
        for f in self.chains.field_names():
            getattr(self.chains, f)[moved] = getattr(rows, f)


def test_each_chain_proposes_several_and_moves_to_one_of_its_own():
    space = StrategySpace(MODEL, CLUSTER)
    rng = np.random.default_rng(7)
    scorer = RecordingScorer(ps_count_score)
    simulated_annealing(space, scorer, space.sample_encoded(rng, 5), rng, steps=8, proposals=4)
    assert len(scorer.proposed) == len(scorer.chosen) == 8
    for m, chosen in zip(scorer.proposed, scorer.chosen):
        np.testing.assert_array_equal(m.parents, np.repeat(np.arange(5), 4))
        assert chosen.shape == (5,) and chosen.min() >= -1
        moved = np.flatnonzero(chosen >= 0)
        np.testing.assert_array_equal(m.parents[chosen[moved]], moved)   # a chain takes one of its own
        # ... the best of its proposals
        s = ps_count_score(m.encoded).reshape(5, 4)
        np.testing.assert_array_equal(s[moved, chosen[moved] % 4], s[moved].min(axis=1))


def test_pool_is_the_best_distinct_of_everything_scored():
    space = StrategySpace(MODEL, CLUSTER, staleness=(0, 1))
    rng = np.random.default_rng(8)
    scorer = RecordingScorer(ps_count_score)
    pool = simulated_annealing(space, scorer, space.sample_encoded(rng, 6), rng, steps=15, proposals=5, keep=12,
                               t_start=1.0, t_end=0.5)
    every = EncodedStrategies.concat(scorer.scored)
    scores = ps_count_score(every)
    keys = every.row_keys()
    expected, seen = [], set()
    for i in np.argsort(scores, kind="stable"):
        if keys[i] not in seen:
            seen.add(keys[i])
            expected.append(keys[i])
    assert pool.encoded.row_keys() == expected[:12]
    np.testing.assert_allclose(pool.predicted, ps_count_score(pool.encoded))


def test_fingerprints_of_proposals_are_those_of_their_rows():
    space = StrategySpace(MODEL, two_node_cluster(), staleness=(0, 1), num_groups=2)
    rng = np.random.default_rng(9)
    base = space.sample_encoded(rng, 6)
    fp = _Fingerprints(base.kind.shape[1])
    m = space.mutate_rows(base, np.repeat(np.arange(6), 30), rng)
    assert len(m.group_rows) and len(m.cells)
    np.testing.assert_array_equal(fp.of_mutation(m, fp.of(base)), fp.of(m.encoded))
    keys = m.encoded.row_keys()
    h = fp.of(m.encoded)
    assert len(set(h.tolist())) == len(set(keys))   # equal rows, equal fingerprints; and only they


def test_proposals_and_pool_size_must_be_positive():
    space = StrategySpace(MODEL, CLUSTER)
    rng = np.random.default_rng(10)
    with pytest.raises(ValueError, match=r"must be >= 1, got proposals=0, keep=256"):
        simulated_annealing(space, ps_count_score, space.sample_encoded(rng, 2), rng, steps=2, proposals=0)
    with pytest.raises(ValueError, match=r"must be >= 1, got proposals=1, keep=0"):
        simulated_annealing(space, ps_count_score, space.sample_encoded(rng, 2), rng, steps=2, keep=0)
