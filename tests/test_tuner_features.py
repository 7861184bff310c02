"""Features of hand-computed tiny cases, and a brute-force check of per-node PS bytes."""
from __future__ import annotations

import numpy as np
import pytest

from strategy_space import PS, AllReduce, ClusterSpec, ModelSpec, NodeSpec, Strategy, VarConfig, VariableSpec
from strategy_space.space import StrategySpace
from strategy_space.strategy import shard_bounds
from tuner.features import COL, FeatureTables, featurize

GBIT = 1e9 / 8


def _cluster(nodes=2, workers=1):
    return ClusterSpec("c", tuple(NodeSpec(f"n{i}", workers=workers, bandwidth_gbps=1.0) for i in range(nodes)))


def _feat(model, cluster, strategy):
    X = featurize(FeatureTables.from_specs(model, cluster), StrategySpace(model, cluster).encode([strategy]))
    return {n: float(X[0, i]) for n, i in COL.items()}


MODEL = ModelSpec("m", (VariableSpec("a", (10, 10)), VariableSpec("b", (10,))), batch_size=4)  # 400 + 40 bytes


def test_ps_on_one_node_bytes_per_node_and_nic():
    f = _feat(MODEL, _cluster(), Strategy((VarConfig("a", (PS("n0"),)), VarConfig("b", (PS("n0"),)))))
    assert f["ps_push_max_node_bytes"] == 2 * 440        # both workers push 440 bytes to n0
    assert f["ps_push_sum_bytes"] == 2 * 440
    assert f["ps_imbalance"] == pytest.approx(2.0)       # all on one of two nodes
    assert f["ps_nodes_used"] == 1
    assert f["nic_in_s"] == pytest.approx(440 / GBIT)    # only n1's push crosses a NIC
    assert f["nic_out_s"] == pytest.approx(440 / GBIT)
    assert f["ar_wire_bytes"] == 0


def test_ps_spread_over_nodes():
    f = _feat(MODEL, _cluster(), Strategy((VarConfig("a", (PS("n0"),)), VarConfig("b", (PS("n1"),)))))
    assert f["ps_push_max_node_bytes"] == 800
    # n0 receives n1's push of a (400) and its own worker's pull of b from n1 (40)
    assert f["nic_in_s"] == pytest.approx(440 / GBIT)
    assert f["ps_nodes_used"] == 2


def test_all_reduce_ring_factor_and_fp16():
    s = Strategy((VarConfig("a", (AllReduce(),)), VarConfig("b", (AllReduce(group=1),))))
    f = _feat(MODEL, _cluster(nodes=4), s)
    assert f["ar_wire_bytes"] == 440
    assert f["ar_ring_bytes"] == pytest.approx(2 * 3 / 4 * 440)   # 2(n-1)/n with n = 4 workers
    assert f["ar_groups"] == 2 and f["ar_collectives"] == 2
    s16 = Strategy((VarConfig("a", (AllReduce(compressor="fp16"),)), VarConfig("b", (AllReduce(compressor="fp16"),))))
    f16 = _feat(MODEL, _cluster(nodes=4), s16)
    assert f16["ar_wire_bytes"] == 220 and f16["fp16_raw_bytes"] == 440
    assert f16["compressed_saved_bytes"] == 220


def test_powersgd_rank_r_m_plus_n_and_vectors_raw():
    s = Strategy((VarConfig("a", (AllReduce(compressor="powersgd(2)"),)),
                  VarConfig("b", (AllReduce(compressor="powersgd(2)"),))))
    f = _feat(MODEL, _cluster(), s)
    assert f["ar_wire_bytes"] == 2 * (10 + 10) * 4 + 40   # r(m+n) values for a, b (vector) raw
    assert f["ar_collectives"] == 2                        # one buffer, P and Q all-reduces


def test_sparse_bytes_ps_and_all_gather():
    m = ModelSpec("s", (VariableSpec("emb", (100, 8), sparse=True, rows_per_step=10), VariableSpec("w", (8,))))
    ps = _feat(m, _cluster(), Strategy((VarConfig("emb", (PS("n0"),)), VarConfig("w", (PS("n0"),)))))
    assert ps["sparse_ps_bytes"] == 10 * 32 + 10 * 8       # rows x width + int64 indices
    # float32 per-slice bytes: exact to ~1e-7 relative
    assert ps["ps_push_max_node_bytes"] == pytest.approx(2 * (400 + 32), rel=1e-6)
    assert ps["ps_pull_max_node_bytes"] == pytest.approx(2 * (320 + 32), rel=1e-6)  # values only
    ar = _feat(m, _cluster(nodes=3), Strategy((VarConfig("emb", (AllReduce(),)), VarConfig("w", (AllReduce(),)))))
    assert ar["sparse_allgather_bytes"] == pytest.approx(2 * 400, rel=1e-6)        # (W - 1) x per-worker rows + indices
    assert ar["ar_ring_bytes"] == pytest.approx(2 * 2 / 3 * 32 + 2 * 400, rel=1e-6)


def test_local_replication_pulls_once_per_node():
    c = _cluster(nodes=2, workers=2)
    plain = _feat(MODEL, c, Strategy((VarConfig("a", (PS("n0"),)), VarConfig("b", (PS("n0"),)))))
    lr = _feat(MODEL, c, Strategy((VarConfig("a", (PS("n0", local_replication=True),)),
                                   VarConfig("b", (PS("n0", local_replication=True),)))))
    assert plain["ps_pull_sum_bytes"] == 4 * 440
    assert lr["ps_pull_sum_bytes"] == 2 * 440
    assert lr["lr_saved_bytes"] == 440 * (4 - 2)


def test_uneven_partition_round_robin_exact():
    m = ModelSpec("p", (VariableSpec("v", (5, 4)),))      # 16 bytes per row
    f = _feat(m, _cluster(), Strategy((VarConfig("v", (PS("n0"), PS("n1"), PS("n0"))),)))
    # shards of 2, 2, 1 rows on n0, n1, n0 -> n0 hosts 3 rows, n1 2 rows
    assert f["ps_push_max_node_bytes"] == 2 * 48


def _reference_push(model, cluster, strategy):
    W = cluster.num_workers
    host = np.zeros(len(cluster.nodes))
    for cfg in strategy.variables:
        v = model.var(cfg.name)
        rows = v.rows_per_step if v.sparse else v.shape[0]
        per_row = (v.row_bytes + (8 if v.sparse else 0)) * rows / v.shape[0]
        for (lo, hi), s in zip(shard_bounds(v.shape[0], cfg.num_shards), cfg.synchronizers):
            if isinstance(s, PS):
                host[cluster.node_index(s.destination)] += (hi - lo) * per_row
    return W * host


def test_random_strategies_match_brute_force():
    rng = np.random.default_rng(3)
    m = ModelSpec("r", tuple(VariableSpec(f"v{i}", (int(rng.integers(1, 40)), 3)) for i in range(12))
                  + (VariableSpec("e", (50, 4), sparse=True, rows_per_step=7),))
    c = ClusterSpec("c", tuple(NodeSpec(f"n{i}", workers=int(rng.integers(1, 3)), bandwidth_gbps=1.0) for i in range(3)))
    space = StrategySpace(m, c, max_shards=7)
    enc = space.sample_encoded(rng, 300)
    X = featurize(FeatureTables.from_specs(m, c), enc)
    for i in range(len(enc)):
        ref = _reference_push(m, c, space.decode(enc, i))
        assert X[i, COL["ps_push_max_node_bytes"]] == pytest.approx(ref.max(), rel=1e-5, abs=1e-3)
        assert X[i, COL["ps_push_sum_bytes"]] == pytest.approx(ref.sum(), rel=1e-5, abs=1e-3)


def test_wrong_width_is_rejected():
    t = FeatureTables.from_specs(MODEL, _cluster())
    other = ModelSpec("o", (VariableSpec("x", (3,)),))
    with pytest.raises(ValueError, match="encode 1 variables but the model has 2"):
        featurize(t, StrategySpace(other, _cluster()).sample_encoded(np.random.default_rng(0), 2))
