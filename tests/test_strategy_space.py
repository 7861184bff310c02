"""Property-based tests: sampling and mutation always produce valid, encodable strategies."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strategy_space import (AllReduce, ClusterSpec, ConfigError, ModelSpec, NodeSpec, PS, Strategy, VarConfig, VariableSpec,
                            validate)
from strategy_space.encoding import KIND_AR, KIND_PS, Mutation
from strategy_space.space import StrategySpace
from tests.fakes import three_node_cluster, tiny_model, two_node_cluster

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


# ---- mutate_rows: proposals as changes ------------------------------------------------------------
def _spaces():
    wide = ModelSpec("wide", tuple(VariableSpec(f"l{i}/{p}", (a, b) if p == "kernel" else (b,))
                                   for i, (a, b) in enumerate([(30, 20), (7, 5), (64, 3), (9, 9), (40, 12)] * 3)
                                   for p in ("kernel", "bias")) + (VariableSpec("emb", (500, 8), sparse=True,
                                                                                rows_per_step=20),
                                                                   VariableSpec("n", (1,), dtype="int64")))
    return [StrategySpace(tiny_model(), two_node_cluster()),
            StrategySpace(tiny_model(), two_node_cluster(), staleness=(0, 1, 3), allow_async=True,
                          backends=("auto", "objectstore"), ranks=(1, 2), max_shards=5),
            StrategySpace(wide, two_node_cluster(), num_groups=3, staleness=(0, 2))]


def _differing_cells(space, m, parents):
    """Per proposal, the (variable, field) pairs that differ from its parent."""
    e = m.encoded
    out = []
    for i, p in enumerate(parents):
        out.append({(v, f) for f in e.field_names() for v in np.flatnonzero(getattr(e, f)[i] != getattr(m.base, f)[p])})
    return out


@pytest.mark.parametrize("which", range(3))
def test_mutate_rows_changes_one_decision_of_each_parent(which):
    space = _spaces()[which]
    rng = np.random.default_rng(which)
    base = space.sample_encoded(rng, 12)
    parents = np.repeat(np.arange(12), 25)
    m = space.mutate_rows(base, parents, rng)
    assert len(m) == len(parents) and (m.parents == parents).all()
    wide = {"sync", "staleness", "backend", "hierarchical"}
    op_rows = set(m.group_rows.tolist())
    unchanged = 0
    for i, diff in enumerate(_differing_cells(space, m, parents)):
        if not diff:   # every draw of its tries changed nothing (documented; rare in these spaces)
            unchanged += 1
            continue
        variables = {v for v, _ in diff}
        fields_ = {f for _, f in diff}
        p = parents[i]
        if i in op_rows:   # a fusion group's compressor: only all-reduce members of that group
            assert fields_ <= {"compressor", "rank"}
            assert len({int(base.group[p, v]) for v in variables}) == 1
            assert all(base.kind[p, v] == KIND_AR for v in variables)
        elif len(variables) > 1 and all(base.kind[p, v] == KIND_PS for v in variables):
            assert fields_ <= wide - {"backend"}   # the strategy's PS mode: every PS variable, nothing else
        elif len(variables) > 1:   # flat <-> hierarchical all-reduce: every all-reduce variable, nothing else
            assert fields_ == {"hierarchical"} and all(base.kind[p, v] == KIND_AR for v in variables)
            assert {v for v in range(base.kind.shape[1]) if base.kind[p, v] == KIND_AR} == variables
        # else: one variable's decision (its synchronizer may bring the strategy's options along)
    assert unchanged <= len(parents) // 100, f"{unchanged} of {len(parents)} proposals equal their parents"
    e = m.encoded
    normalized = space.normalize(e.copy())
    for f in e.field_names():
        assert (getattr(normalized, f) == getattr(e, f)).all(), f"{f} not normalized"
    for i in range(0, len(e), 7):
        s = space.decode(e, i)
        validate(s, space.model, space.cluster)
        back = space.encode([s])
        assert all((getattr(back, f)[0] == getattr(e, f)[i]).all() for f in e.field_names())


@pytest.mark.parametrize("which", range(3))
def test_mutation_cells_are_its_changes_and_rows_build_alike(which):
    space = _spaces()[which]
    rng = np.random.default_rng(10 + which)
    base = space.sample_encoded(rng, 6)
    parents = rng.integers(0, 6, 200)
    m = space.mutate_rows(base, parents, rng)
    V = base.kind.shape[1]
    e = m.encoded
    ops = set(m.group_rows.tolist())
    expected = {i * V + v for i, diff in enumerate(_differing_cells(space, m, parents)) if i not in ops
                for v, _ in diff}
    assert set(m.cells.tolist()) == expected and (np.diff(m.cells) > 0).all()
    assert not ops & set((m.cells // V).tolist())   # a proposal is either cells or a group change
    rows = rng.integers(0, len(m), 30)
    part = m.take(rows)
    assert all((getattr(part, f) == getattr(e, f)[rows]).all() for f in e.field_names())
    again = Mutation.diff(base, e, parents)
    assert all((getattr(again.encoded, f) == getattr(e, f)).all() for f in e.field_names())


def test_mutate_rows_reaches_every_decision():
    space = _spaces()[1]
    rng = np.random.default_rng(3)
    base = space.sample_encoded(rng, 40)
    m = space.mutate_rows(base, np.repeat(np.arange(40), 50), rng)
    seen = {"group compressor": len(m.group_rows)}
    for diff in _differing_cells(space, m, m.parents):
        fields_ = {f for _, f in diff}
        for name in ("kind", "shards", "dest", "group", "local_replication", "staleness"):
            seen[name] = seen.get(name, 0) + (name in fields_)
    assert all(n > 20 for n in seen.values()), seen


def test_mutate_rows_draws_no_fresh_batch(monkeypatch):
    space = StrategySpace(tiny_model(), two_node_cluster())
    base = space.sample_encoded(np.random.default_rng(0), 4)

    def no_batches(*args, **kwargs):
        raise AssertionError("mutation drew a whole fresh batch")
    monkeypatch.setattr(space, "sample_encoded", no_batches)
    m = space.mutate_rows(base, [0, 0, 1, 3], np.random.default_rng(1))
    assert len(m.encoded) == 4
    assert len(space.mutate_encoded(base, np.random.default_rng(2))) == 4


def test_mutate_rows_rejects_parents_outside_the_batch():
    space = StrategySpace(tiny_model(), two_node_cluster())
    base = space.sample_encoded(np.random.default_rng(0), 3)
    with pytest.raises(ValueError, match=r"parents must be rows 0..2 of the strategies, got values from 0 to 3"):
        space.mutate_rows(base, [0, 3], np.random.default_rng(1))


def test_hierarchical_all_reduce_is_sampled_mutated_and_decoded_only_with_several_workers_on_a_node():
    rng = np.random.default_rng(4)
    multi = StrategySpace(tiny_model(), two_node_cluster())     # node a holds two workers
    e = multi.sample_encoded(rng, 200)
    ar = e.kind == KIND_AR
    hier = e.hierarchical.astype(bool)
    assert hier.any() and not (hier & ~ar).any()
    # one value per strategy, on every all-reduce variable
    assert all(len(set(e.hierarchical[b][ar[b]].tolist())) <= 1 for b in range(len(e)))
    row = int(np.flatnonzero(hier.any(axis=1))[0])
    s = multi.decode(e, row)
    assert all(sync.hierarchical for cfg in s.variables for sync in cfg.synchronizers if isinstance(sync, AllReduce))
    assert (multi.encode([s]).hierarchical[0] == e.hierarchical[row]).all()
    flipped = multi.mutate_rows(e, np.repeat(np.arange(len(e)), 20), rng).encoded
    assert (flipped.hierarchical != e.hierarchical[np.repeat(np.arange(len(e)), 20)]).any()
    single = StrategySpace(tiny_model(), three_node_cluster())  # one worker per node: nothing to gain
    e1 = single.sample_encoded(rng, 200)
    m1 = single.mutate_rows(e1, np.repeat(np.arange(200), 5), rng).encoded
    assert not e1.hierarchical.any() and not m1.hierarchical.any()


def test_node_aggregation_is_offered_only_across_nodes_and_still_encoded_where_it_runs():
    """One node with two workers: no NIC bytes to cut, so neither local replication nor
    hierarchical all-reduce is sampled or mutated into a strategy; one that has them (a user's,
    a baseline) still encodes them, since it runs differently. Two such nodes: both are offered."""
    from strategy_space import ClusterSpec, NodeSpec

    rng = np.random.default_rng(5)
    one = StrategySpace(tiny_model(), ClusterSpec("one", (NodeSpec("a", address="10.0.0.1", workers=2),)))
    two = StrategySpace(tiny_model(), ClusterSpec("two", tuple(NodeSpec(n, address=f"10.0.0.{i + 1}", workers=2)
                                                               for i, n in enumerate("ab"))))
    for space, offered in ((one, False), (two, True)):
        e = space.sample_encoded(rng, 300)
        m = space.mutate_rows(e, np.repeat(np.arange(len(e)), 10), rng).encoded
        for enc in (e, m):
            assert bool(enc.local_replication.any()) is offered and bool(enc.hierarchical.any()) is offered
    kept = one.encode([Strategy.from_dict({"kind": "strategy", "version": 1, "variables": [
        {"var": v.name, "ps": {"destination": "a", "local_replication": True}} if i % 2 else
        {"var": v.name, "all_reduce": {"hierarchical": True}} for i, v in enumerate(tiny_model().variables)]})])
    assert kept.local_replication.any() and kept.hierarchical.any()
