"""Property-based tests: sampling and mutation always produce valid, encodable strategies."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strategy_space import ClusterSpec, ConfigError, ModelSpec, NodeSpec, PS, Strategy, VarConfig, VariableSpec, validate
from strategy_space.space import KIND_AR, KIND_PS, StrategySpace
from tests.fakes import tiny_model, two_node_cluster

variables = st.lists(
    st.tuples(st.lists(st.integers(1, 40), min_size=0, max_size=3), st.booleans(), st.sampled_from(["float32", "float16", "int32"])),
    min_size=1, max_size=12,
)


@st.composite
def specs(draw):
    vs = []
    for i, (shape, sparse, dtype) in enumerate(draw(variables)):
        sparse = sparse and len(shape) >= 1
        vs.append(VariableSpec(f"v{i}", tuple(shape), dtype=dtype, sparse=sparse,
                               rows_per_step=min(3, shape[0]) if sparse else None))
    nodes = tuple(NodeSpec(f"n{i}", workers=draw(st.integers(0, 3)) if i else 1,
                           bandwidth_gbps=draw(st.sampled_from([1.0, 10.0]))) for i in range(draw(st.integers(1, 4))))
    return ModelSpec("m", tuple(vs)), ClusterSpec("c", nodes)


@settings(max_examples=60, deadline=None)
@given(specs(), st.integers(0, 2**32 - 1), st.booleans())
def test_sample_and_mutate_always_valid(spec, seed, allow_async):
    model, cluster = spec
    space = StrategySpace(model, cluster, staleness=(0, 2), allow_async=allow_async, ranks=(1, 4))
    rng = np.random.default_rng(seed)
    batch = space.sample_encoded(rng, 16)
    mutated = space.mutate_encoded(batch, rng)
    for enc in (batch, mutated):
        for row in range(len(enc)):
            s = space.decode(enc, row)
            validate(s, model, cluster)
            back = space.encode([s])
            for f in enc.field_names():
                assert (getattr(back, f)[0] == getattr(enc, f)[row]).all(), f


def test_mutation_changes_exactly_one_decision_mostly():
    model, cluster = tiny_model(), two_node_cluster()
    space = StrategySpace(model, cluster)
    rng = np.random.default_rng(1)
    e = space.sample_encoded(rng, 500)
    m = space.mutate_encoded(e, rng)
    changed_rows = np.zeros(len(e), bool)
    for f in e.field_names():
        changed_rows |= (getattr(e, f) != getattr(m, f)).any(axis=1)
    assert changed_rows.mean() > 0.99


def test_sample_covers_both_kinds_and_partitions():
    space = StrategySpace(tiny_model(), two_node_cluster())
    e = space.sample_encoded(np.random.default_rng(0), 400)
    assert (e.kind == KIND_PS).any() and (e.kind == KIND_AR).any()
    assert (e.shards > 1).any()
    assert e.shards.max() <= space.max_shards


def test_sample_is_seeded():
    space = StrategySpace(tiny_model(), two_node_cluster())
    a = space.sample(np.random.default_rng(7))
    b = space.sample(np.random.default_rng(7))
    assert a == b


def test_encode_rejects_unencodable_with_reason():
    model, cluster = tiny_model(), ClusterSpec("c", (NodeSpec("a"), NodeSpec("b"), NodeSpec("c")))
    configs = [VarConfig(v.name, (PS("a"),)) for v in model.variables]
    configs[1] = VarConfig("dense/kernel", (PS("a"), PS("c")))
    s = Strategy(tuple(configs))
    validate(s, model, cluster)
    with pytest.raises(ConfigError, match="variable dense/kernel: cannot be encoded for the tuner because its shards are not placed round-robin"):
        StrategySpace(model, cluster).encode([s])


def test_single_point_space_cannot_crash_mutation():
    model = ModelSpec("m", (VariableSpec("x", (), dtype="int32"),))
    cluster = ClusterSpec("c", (NodeSpec("a"),))
    space = StrategySpace(model, cluster)
    e = space.mutate_encoded(space.sample_encoded(np.random.default_rng(0), 4), np.random.default_rng(1))
    for r in range(4):
        validate(space.decode(e, r), model, cluster)
