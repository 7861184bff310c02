"""Search pieces with a known optimum: constraints, knowledge-guided sampler, annealing, selection."""
import numpy as np
import pytest

from strategy_space import ConfigError, validate
from strategy_space.space import KIND_AR, KIND_PS, StrategySpace
from tests.fakes import three_node_cluster, tiny_model, two_node_cluster
from tuner.constraints import Constraints, Rule, load_constraints
from tuner.sampler import KnowledgeSampler
from tuner.search import Pool, select_diverse, simulated_annealing

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


def test_constraints_are_never_violated():
    space = StrategySpace(MODEL, CLUSTER, staleness=(0, 1, 2))
    cons = Constraints((Rule(match="dense*kernel", sync="ps", shards=2, destination="h1"),
                        Rule(sparse=False, compressor="none", match="dense_1/bias")), staleness=1).compile(space)
    rng = np.random.default_rng(1)
    project = lambda e: cons.apply(e, space)  # noqa: E731
    pool = simulated_annealing(space, ps_count_score, space.sample_encoded(rng, 8), rng, steps=60, project=project)
    assert not cons.violations(pool.encoded).any()
    best = space.decode(pool.encoded, 0)
    for name in ("dense/kernel", "dense_1/kernel"):
        syncs = best.config(name).synchronizers
        assert [s.destination for s in syncs] == ["h1", "h2"] and all(s.staleness == 1 for s in syncs)
    # everything not pinned went to all-reduce, the toy optimum
    assert all(best.config(v).synchronizers[0].__class__.__name__ == "AllReduce"
               for v in ("embedding/embeddings", "dense/bias", "steps"))


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
    from strategy_space.space import EncodedStrategies

    pool = Pool(EncodedStrategies.concat([base, near, far]), np.array([1.0, 1.01, 2.0]))
    assert select_diverse(pool, 2, rng, min_distance=2) == [0, 2]
    assert select_diverse(pool, 2, rng, min_distance=2, exclude={pool.encoded.row_keys()[0]}) == [1, 2]
    picked = select_diverse(pool, 3, rng, min_distance=2)
    assert sorted(picked) == [0, 1, 2]  # the rest fills up when k is not reached


def test_pool_scores_are_the_scores_of_its_strategies():
    """Chains that end worse than they started (hot annealing) must not carry their start's score."""
    space = StrategySpace(MODEL, CLUSTER)
    rng = np.random.default_rng(4)
    pool = simulated_annealing(space, ps_count_score, space.sample_encoded(rng, 16), rng, steps=10, t_start=50.0,
                               t_end=50.0)
    np.testing.assert_allclose(pool.predicted, ps_count_score(pool.encoded))
