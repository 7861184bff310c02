"""Features of hand-computed tiny cases, and a brute-force check of per-node PS bytes."""
from __future__ import annotations

import numpy as np
import pytest

from strategy_space import PS, AllReduce, ClusterSpec, ModelSpec, NodeSpec, Strategy, VarConfig, VariableSpec
from strategy_space.space import StrategySpace
from strategy_space.strategy import shard_bounds
from tuner.features.batch import COL, UPDATE_PASSES, featurize
from tuner.features.tables import FeatureTables

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
    # rows x width + row ids, one byte each for a table of 100 rows (as the runtime sends them)
    assert ps["sparse_ps_bytes"] == 10 * 32 + 10 * 1
    # float32 per-slice bytes: exact to ~1e-7 relative
    assert ps["ps_push_max_node_bytes"] == pytest.approx(2 * (330 + 32), rel=1e-6)
    assert ps["ps_pull_max_node_bytes"] == pytest.approx(2 * (320 + 32), rel=1e-6)  # values only
    ar = _feat(m, _cluster(nodes=3), Strategy((VarConfig("emb", (AllReduce(),)), VarConfig("w", (AllReduce(),)))))
    assert ar["sparse_allgather_bytes"] == pytest.approx(2 * 330, rel=1e-6)        # (W - 1) x per-worker rows + ids
    assert ar["ar_ring_bytes"] == pytest.approx(2 * 2 / 3 * 32 + 2 * 330, rel=1e-6)
    wide = ModelSpec("s", (VariableSpec("emb", (70000, 8), sparse=True, rows_per_step=10), VariableSpec("w", (8,))))
    assert _feat(wide, _cluster(), Strategy((VarConfig("emb", (PS("n0"),)), VarConfig("w", (PS("n0"),)))))[
        "sparse_ps_bytes"] == 10 * 32 + 10 * 4   # past 65,536 rows: 4-byte ids


def test_row_ids_are_counted_as_wide_as_the_runtime_sends_them():
    from autosync.runtime.rows import index_dtype
    from strategy_space.builders import index_bytes

    for rows in (1, 255, 256, 257, 65536, 65537, 2**32, 2**32 + 1):
        assert index_bytes(rows) == index_dtype(rows).itemsize, rows
    assert [index_bytes(r) for r in (256, 257, 65537, 2**32 + 1)] == [1, 2, 4, 8]


def test_local_replication_pushes_and_pulls_once_per_node():
    c = _cluster(nodes=2, workers=2)
    plain = _feat(MODEL, c, Strategy((VarConfig("a", (PS("n0"),)), VarConfig("b", (PS("n0"),)))))
    lr = _feat(MODEL, c, Strategy((VarConfig("a", (PS("n0", local_replication=True),)),
                                   VarConfig("b", (PS("n0", local_replication=True),)))))
    assert plain["ps_pull_sum_bytes"] == 4 * 440 and plain["ps_push_sum_bytes"] == 4 * 440
    # the workers of a node sum their gradients, push the sum once and share one pull
    assert lr["ps_pull_sum_bytes"] == 2 * 440 and lr["ps_push_sum_bytes"] == 2 * 440
    assert lr["lr_saved_bytes"] == 2 * 440 * (4 - 2)
    assert lr["nic_in_s"] == pytest.approx(440 / GBIT)     # n1's one push; plain: both of its workers'
    assert plain["nic_in_s"] == pytest.approx(2 * 440 / GBIT)
    assert lr["ps_calls_max"] == 2 * 2 and plain["ps_calls_max"] == 2 * 4   # one push + pull per node / worker
    assert lr["local_agg_bytes"] > 0 and plain["local_agg_bytes"] == 0


def test_uneven_partition_round_robin_exact():
    m = ModelSpec("p", (VariableSpec("v", (5, 4)),))      # 16 bytes per row
    f = _feat(m, _cluster(), Strategy((VarConfig("v", (PS("n0"), PS("n1"), PS("n0"))),)))
    # shards of 2, 2, 1 rows on n0, n1, n0 -> n0 hosts 3 rows, n1 2 rows
    assert f["ps_push_max_node_bytes"] == 2 * 48


def _reference_push(model, cluster, strategy):
    """Bytes pushed into each node: per worker, or once per node for dense variables with local
    replication (the node's workers sum first); row ids as the runtime sends them."""
    from autosync.runtime.rows import index_dtype

    W, Nw = cluster.num_workers, sum(1 for n in cluster.nodes if n.workers)
    host = np.zeros(len(cluster.nodes))
    for cfg in strategy.variables:
        v = model.var(cfg.name)
        rows = v.rows_per_step if v.sparse else v.shape[0]
        per_row = (v.row_bytes + (index_dtype(v.shape[0]).itemsize if v.sparse else 0)) * rows / v.shape[0]
        for (lo, hi), s in zip(shard_bounds(v.shape[0], cfg.num_shards), cfg.synchronizers):
            if isinstance(s, PS):
                once = s.local_replication and not v.sparse
                host[cluster.node_index(s.destination)] += (Nw if once else W) * (hi - lo) * per_row
    return host


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


def _reference_all_reduce(model, cluster, strategy):
    """Per-shard loop: bytes of each fused (group, class) buffer, class by compressor kind (none,
    fp16*, powersgd*), and the all-gathers of sparse shards."""
    buffers, gathers = {}, 0
    for cfg in strategy.variables:
        v = model.var(cfg.name)
        dim = v.shape[cfg.axis]
        for (lo, hi), s in zip(shard_bounds(dim, cfg.num_shards), cfg.synchronizers):
            if isinstance(s, PS):
                continue
            if v.sparse:
                gathers += 1
                continue
            kind, rank, eb = s.codec.name, s.codec.rank, v.bytes // v.size
            m, n = hi - lo, v.size // dim
            if kind.startswith("powersgd"):   # one buffer class, P and Q collectives; vectors travel raw
                cls, nbytes = 2, min(rank * (m + n), m * n) * eb if len(v.shape) >= 2 else m * n * eb
            elif kind.startswith("fp16"):
                cls, nbytes = 1, m * n * 2
            else:
                cls, nbytes = 0, m * n * eb
            buffers[(s.group, cls)] = buffers.get((s.group, cls), 0) + nbytes
    per_group = {}
    for (g, _), b in buffers.items():
        per_group[g] = per_group.get(g, 0) + b
    collectives = len(buffers) + sum(1 for (_, c) in buffers if c == 2) + gathers
    return per_group, collectives


def _reference_pull(model, cluster, strategy):
    """Bytes each node's server sends to workers: per worker, or once per node for local replication."""
    W, Nw = cluster.num_workers, sum(1 for n in cluster.nodes if n.workers)
    total = 0.0
    for cfg in strategy.variables:
        v = model.var(cfg.name)
        rows = v.rows_per_step if v.sparse else v.shape[0]
        for (lo, hi), s in zip(shard_bounds(v.shape[0], cfg.num_shards), cfg.synchronizers):
            if isinstance(s, PS):
                once = s.local_replication and not v.sparse
                total += (Nw if once else W) * (hi - lo) * v.row_bytes * rows / v.shape[0]
    return total


def test_random_strategies_all_reduce_and_pull_match_brute_force():
    rng = np.random.default_rng(5)
    m = ModelSpec("r", tuple(VariableSpec(f"v{i}", (int(rng.integers(2, 40)), int(rng.integers(1, 9)))) for i in range(10))
                  + (VariableSpec("b", (17,)), VariableSpec("e", (60, 4), sparse=True, rows_per_step=9)))
    c = ClusterSpec("c", tuple(NodeSpec(f"n{i}", workers=2, bandwidth_gbps=1.0) for i in range(3)))
    space = StrategySpace(m, c, max_shards=6, ranks=(1, 3), staleness=(0, 2), backends=("auto", "objectstore"))
    enc = space.sample_encoded(rng, 300)
    X = featurize(FeatureTables.from_specs(m, c), enc)
    for i in range(len(enc)):
        s = space.decode(enc, i)
        groups, collectives = _reference_all_reduce(m, c, s)
        assert X[i, COL["ar_groups"]] == len(groups)
        assert X[i, COL["ar_collectives"]] == collectives
        assert X[i, COL["ar_max_group_bytes"]] == pytest.approx(max(groups.values(), default=0), rel=1e-5, abs=1e-3)
        assert X[i, COL["ps_pull_sum_bytes"]] == pytest.approx(_reference_pull(m, c, s), rel=1e-5, abs=1e-3)


def test_objectstore_backend_counts_when_the_first_variable_is_ps():
    s = Strategy((VarConfig("a", (PS("n0"),)), VarConfig("b", (AllReduce(backend="objectstore"),))))
    f = _feat(MODEL, _cluster(nodes=3), s)
    assert f["ring_steps_objectstore"] == 2 * (3 - 1) and f["ring_steps"] == 0
    g = _feat(MODEL, _cluster(nodes=3), Strategy((VarConfig("a", (PS("n0"),)), VarConfig("b", (AllReduce(),)))))
    assert g["ring_steps"] == 2 * (3 - 1) and g["ring_steps_objectstore"] == 0


def test_partitioned_sparse_all_reduce_is_gathered_not_fused():
    m = ModelSpec("s", (VariableSpec("emb", (100, 8), sparse=True, rows_per_step=10), VariableSpec("w", (8,))))
    s = Strategy((VarConfig("emb", (AllReduce(group=0), AllReduce(group=1))), VarConfig("w", (AllReduce(group=0),))))
    f = _feat(m, _cluster(nodes=3), s)
    assert f["ar_groups"] == 1 and f["ar_max_group_bytes"] == 32   # only w's buffer
    assert f["ar_collectives"] == 1 + 2                             # w's buffer + one all-gather per shard


def test_nodes_used_by_few_parameter_servers_are_counted_exactly():
    """Mostly all-reduce strategies leave nodes without PS shards; their hosted bytes must cancel to
    exact zeros (the difference entries of big variables used to round in float32)."""
    rng = np.random.default_rng(11)
    m = ModelSpec("few", tuple(VariableSpec(f"v{i}", (int(rng.integers(100, 2000)), int(rng.integers(50, 900))))
                               for i in range(40)) + (VariableSpec("e", (9973, 16), sparse=True, rows_per_step=301),))
    c = ClusterSpec("c", tuple(NodeSpec(f"n{i}", workers=2, bandwidth_gbps=1.0) for i in range(5)))
    space = StrategySpace(m, c)
    enc = space.sample_encoded(rng, 400)
    enc.kind[:] = np.where(rng.random(enc.kind.shape) < 0.04, 0, 1)
    enc = space.normalize(enc)
    X = featurize(FeatureTables.from_specs(m, c), enc)
    for i in range(len(enc)):
        hosts = {s.destination for cfg in space.decode(enc, i).variables for s in cfg.synchronizers
                 if isinstance(s, PS)}
        assert X[i, COL["ps_nodes_used"]] == len(hosts)


def test_hierarchical_all_reduce_crosses_nics_once_per_node():
    c = _cluster(nodes=2, workers=4)                          # W = 8, Nw = 2
    flat = _feat(MODEL, c, Strategy((VarConfig("a", (AllReduce(),)), VarConfig("b", (AllReduce(),)))))
    hier = _feat(MODEL, c, Strategy((VarConfig("a", (AllReduce(hierarchical=True),)),
                                     VarConfig("b", (AllReduce(hierarchical=True),)))))
    assert flat["nic_out_s"] == pytest.approx(2 * 7 / 8 * 440 / GBIT)   # ring over 8 workers
    assert hier["nic_out_s"] == pytest.approx(2 * 1 / 2 * 440 / GBIT)   # ring over 2 node leaders
    assert flat["ring_steps"] == 2 * 7 and hier["ring_steps"] == 2 * 1 + 2   # + reduce and broadcast on the node
    assert hier["hierarchical"] == 1 and flat["hierarchical"] == 0
    assert hier["local_agg_bytes"] > 0 and flat["local_agg_bytes"] == 0


def _zoo(name):
    from strategy_space import load_model_spec

    return load_model_spec(__file__.rsplit("/tests/", 1)[0] + f"/configs/models/{name}.yaml")


@pytest.mark.parametrize("nodes,workers", [(1, 2), (3, 1), (2, 2)])
def test_candidates_that_move_different_bytes_get_different_predictions(nodes, workers):
    """On one node (``--cluster local``: no NIC traffic) as on several, strategies that differ in what
    they move differ in predicted step time: CPU serialization, PS sums and updates and per-call
    work differ even where no byte crosses a NIC."""
    from tuner.cost_models.analytic import AnalyticCostModel

    m = _zoo("resnet50")
    c = ClusterSpec("c", tuple(NodeSpec(f"n{i}", cpus=2, workers=workers, bandwidth_gbps=10.0) for i in range(nodes)))
    space = StrategySpace(m, c)
    e = space.sample_encoded(np.random.default_rng(0), 64)
    pred = AnalyticCostModel().predict_strategies(m, c, e)
    assert np.ptp(pred) / pred.min() > 0.05        # a spread, not a vertical line
    assert len(np.unique(np.round(pred, 6))) > 48
    # the same gradients through one parameter server vs all-reduce: PS moves more through the node
    ps = Strategy(tuple(VarConfig(v.name, (PS("n0"),)) for v in m.variables))
    ar = Strategy(tuple(VarConfig(v.name, (AllReduce(),)) for v in m.variables))
    t_ps, t_ar = AnalyticCostModel().predict_strategies(m, c, space.encode([ps, ar]))
    assert t_ps > 1.05 * t_ar


def test_a_sync_ps_step_pulls_after_it_pushes_unless_pipelined_and_global_clipping_holds_it():
    """A synchronous PS updates nothing before a step's pushes are in, so its pulls follow: a PS on
    n0 serving n1 moves 440 bytes in (push) and then 440 out (pull) through n0's NIC, 880 bytes of
    wire time, not the 440 a link moving both at once would need. Where an actor holds enough
    dense bytes to pipeline in chunks, the shorter phase overlaps all but a chunk; a held step
    (``global_clipnorm``) pipelines nothing and adds a round trip (the norm's parts, the scale)."""
    clipped = ModelSpec(MODEL.name, MODEL.variables, MODEL.batch_size, global_clipnorm=True)
    ps = Strategy((VarConfig("a", (PS("n0"),)), VarConfig("b", (PS("n0"),))))
    plain, held = _feat(MODEL, _cluster(), ps), _feat(clipped, _cluster(), ps)
    assert (plain["nic_in_s"], plain["nic_out_s"]) == pytest.approx((440 / GBIT, 440 / GBIT))
    assert plain["wire_s"] == pytest.approx(880 / GBIT) and held["wire_s"] == pytest.approx(880 / GBIT)
    assert (plain["ps_latency_rounds"], held["ps_latency_rounds"]) == (2, 3)
    assert held["analytic_s"] > plain["analytic_s"]
    # an asynchronous PS applies each push as it comes: its pulls need not wait
    free = Strategy((VarConfig("a", (PS("n0", sync=False),)), VarConfig("b", (PS("n0", sync=False),))))
    assert _feat(MODEL, _cluster(), free)["wire_s"] == pytest.approx(440 / GBIT)
    # 16 MiB of dense bytes on one actor: 4 chunks (the runtime's most), a quarter of the pull exposed
    big = ModelSpec("big", (VariableSpec("k", (1024, 4096)),), batch_size=4)
    one = Strategy((VarConfig("k", (PS("n0"),)),))
    nbytes = 1024 * 4096 * 4
    assert _feat(big, _cluster(), one)["wire_s"] == pytest.approx(nbytes * 1.25 / GBIT, rel=1e-6)
    big_clipped = ModelSpec("big", big.variables, 4, global_clipnorm=True)
    assert _feat(big_clipped, _cluster(), one)["wire_s"] == pytest.approx(nbytes * 2 / GBIT, rel=1e-6)


def test_staleness_hides_ps_traffic_only_where_the_runtime_pulls_ahead():
    """A worker pulls step t+1's values while step t computes only when every variable sits on a
    synchronous PS with staleness >= 1 (``worker.run``): then the PS traffic hides behind the
    compute. An all-reduced variable beside the stale PS, or an asynchronous PS (whose plan has no
    staleness), keeps the pull in the step: estimated as the synchronous strategy is."""
    from strategy_space import ComputeProfile

    timed = ModelSpec(MODEL.name, MODEL.variables, MODEL.batch_size, profile=ComputeProfile(1e-3, "test", ("b", "a")))

    def est(a, b):
        f = _feat(timed, _cluster(), Strategy((VarConfig("a", (a,)), VarConfig("b", (b,)))))
        return f["stale_factor"], f["analytic_s"]

    sync_ps, sync_ar = est(PS("n0"), PS("n1")), est(PS("n0"), AllReduce())
    assert sync_ps[0] == sync_ar[0] == 1.0
    stale = est(PS("n0", staleness=2), PS("n1", staleness=2))
    assert stale[0] == pytest.approx(1 / 3) and stale[1] < sync_ps[1]
    assert est(PS("n0", staleness=2), AllReduce()) == pytest.approx(sync_ar)
    # asynchronous: only its pulls' not waiting for the pushes (a few bytes of wire here) is saved
    free = est(PS("n0", sync=False), PS("n1", sync=False))
    assert free[0] == 1.0 and free[1] == pytest.approx(sync_ps[1], rel=0.01) and free[1] > stale[1]


def test_each_powersgd_matrix_costs_a_fixed_time_on_the_cpu():
    """PowerSGD's fixed work per matrix and step (``alpha_matrix_s``): a compressed matrix counts
    once, each shard of a partitioned one once; fp16 and matrices PowerSGD cannot shrink (a
    vector) count nothing."""
    from tuner.features.batch import DEFAULT_PARAMS

    def feat(*a_shards, b=AllReduce()):
        return _feat(MODEL, _cluster(), Strategy((VarConfig("a", tuple(a_shards)), VarConfig("b", (b,)))))

    plain, psgd = feat(AllReduce()), feat(AllReduce(compressor="powersgd(2)"))
    halves = feat(AllReduce(compressor="powersgd(2)"), AllReduce(compressor="powersgd(2)"))
    assert (plain["psgd_matrices"], psgd["psgd_matrices"], halves["psgd_matrices"]) == (0, 1, 2)
    assert feat(AllReduce(compressor="fp16"))["psgd_matrices"] == 0
    assert feat(AllReduce(), b=AllReduce(compressor="powersgd(2)"))["psgd_matrices"] == 0   # b is a vector
    # the CPU time grows by the constant per matrix (the bytes' passes move it by < 0.1 % here)
    per = DEFAULT_PARAMS.alpha_matrix_s
    assert halves["cpu_s"] - psgd["cpu_s"] == pytest.approx(per, rel=1e-3)
    assert psgd["cpu_s"] - plain["cpu_s"] == pytest.approx(per, rel=1e-3)
    assert halves["analytic_s"] > psgd["analytic_s"] + 0.5 * per


def test_embedding_tables_pipeline_where_the_runtime_cuts_them():
    """The runtime cuts a PS actor's tables into chunks (``sync.ps.pipelined_sparse``) where its
    node's link would carry a step's pushes and then its pulls: the only PS node, or one on a node
    without workers; actors spread over the worker nodes already move bytes both ways in each
    phase. A held step (``global_clipnorm``) pipelines nothing, so it shows what the cut saves."""
    tables = tuple(VariableSpec(n, (100_000, 64), sparse=True, rows_per_step=2000) for n in ("u", "i"))
    plain = ModelSpec("emb", tables, batch_size=64)
    held = ModelSpec("emb", tables, batch_size=64, global_clipnorm=True)
    c = ClusterSpec("c", (NodeSpec("n0", workers=1, bandwidth_gbps=1.0), NodeSpec("n1", workers=1, bandwidth_gbps=1.0),
                          NodeSpec("n2", workers=0, bandwidth_gbps=1.0)))

    def saved(u: str, i: str) -> float:
        s = Strategy((VarConfig("u", (PS(u),)), VarConfig("i", (PS(i),))))
        return _feat(held, c, s)["wire_s"] - _feat(plain, c, s)["wire_s"]

    assert saved("n0", "n1") == pytest.approx(0.0, abs=1e-9)   # both worker nodes: not cut
    assert saved("n2", "n2") > 0.0                            # the worker-less node, alone
    assert saved("n0", "n2") > 0.0                            # with a second PS node: still cut
    assert saved("n0", "n0") > 0.0                            # the only PS node


def test_a_worker_updates_its_copy_of_every_all_reduced_table_whole():
    """All-reduced, a table's gradient rows are all-gathered, and then every worker updates its own
    copy of all of it (Keras' Adam decays both moments on every row): CPU work on the CPUs the
    worker computes on, counted from the table's bytes, not its rows. On a PS only the server
    updates it; on GPU nodes the device does; emulated compute applies no Adam to tables."""
    table = VariableSpec("t", (100_000, 64), sparse=True, rows_per_step=100)   # 25.6 MB, 25.6 KB a step
    m = ModelSpec("emb", (table,), batch_size=64)
    ar, ps = Strategy((VarConfig("t", (AllReduce(),)),)), Strategy((VarConfig("t", (PS("n0"),)),))
    whole = UPDATE_PASSES * 100_000 * 64 * 4
    assert _feat(m, _cluster(), ar)["cpu_bytes_max"] >= whole
    assert _feat(m, _cluster(), ps)["cpu_bytes_max"] < whole / 100
    gpu = ClusterSpec("g", tuple(NodeSpec(f"n{i}", gpus=1, bandwidth_gbps=1.0) for i in range(2)))
    emulated = ClusterSpec("e", _cluster().nodes, compute="emulated")
    assert _feat(m, gpu, ar)["cpu_bytes_max"] < whole / 100
    assert _feat(m, emulated, ar)["cpu_bytes_max"] < whole / 100
    assert _feat(m, _cluster(), ar)["analytic_s"] > _feat(m, _cluster(), ps)["analytic_s"]


def test_ps_actors_on_every_worker_node_push_and_pull_both_ways_at_once():
    """Each actor serves the other node's worker: in each phase a NIC sends and receives, so the
    phases cost no more than both directions at once."""
    spread = Strategy((VarConfig("a", (PS("n0"),)), VarConfig("b", (PS("n1"),))))
    f = _feat(ModelSpec("m2", (VariableSpec("a", (10, 10)), VariableSpec("b", (10, 10))), batch_size=4), _cluster(),
              spread)
    assert f["wire_s"] == pytest.approx(max(f["nic_in_s"], f["nic_out_s"])) == pytest.approx(800 / GBIT)


def test_global_clipping_leaves_all_reduce_and_asynchronous_ps_unheld():
    """An all-reduced step needs no scale from anyone (every worker holds the whole gradient), and
    an asynchronous PS applies each push as it comes: neither is held (``ps_clip``)."""
    clipped = ModelSpec(MODEL.name, MODEL.variables, MODEL.batch_size, global_clipnorm=True)
    for s in (Strategy((VarConfig("a", (AllReduce(),)), VarConfig("b", (AllReduce(),)))),
              Strategy((VarConfig("a", (PS("n0", sync=False),)), VarConfig("b", (PS("n1", sync=False),))))):
        assert _feat(clipped, _cluster(), s) == _feat(MODEL, _cluster(), s)
    # one synchronous PS variable beside an all-reduced one holds the step
    mixed = Strategy((VarConfig("a", (AllReduce(),)), VarConfig("b", (PS("n0"),))))
    assert _feat(clipped, _cluster(), mixed)["ps_latency_rounds"] == 3


@pytest.mark.integration
def test_the_features_pipeline_ps_steps_as_the_runtime_does():
    from autosync.runtime import engine
    from autosync.runtime.sync import ps
    from tuner.features import batch

    assert (batch.PS_CHUNKS, batch.PS_CHUNK_MIN_BYTES, batch.SPARSE_CHUNK_MIN_S) == (
        engine.PS_CHUNKS, engine.PS_CHUNK_MIN_BYTES, ps.SPARSE_CHUNK_MIN_S)


def _featurized_with_peak(tables, encoded):
    """``featurize``'s matrix and the most memory it held at once (bytes, as tracemalloc counts numpy's)."""
    import tracemalloc

    tracemalloc.start()
    try:
        X = featurize(tables, encoded)
        return X, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_features_of_a_strategy_with_thousands_of_groups_and_shards_take_memory_linear_in_them():
    """A 1,024-worker cluster and a variable in 4,096 all-reduce groups, another on 4,096 PS shards:
    the cumulative sums along the shard lines are folded without an (L, L) matrix (8,200 entries a
    line here: 540 MB each), and the features still count every byte."""
    model = ModelSpec("m", (VariableSpec("a", (4096, 64)), VariableSpec("b", (4096, 64))), batch_size=4)
    cluster = _cluster(nodes=128, workers=8)
    k = 4096
    strategy = Strategy((
        VarConfig("a", tuple(AllReduce(group=g) for g in range(k))),
        VarConfig("b", tuple(PS(f"n{s % 128}") for s in range(k)))))
    X, peak = _featurized_with_peak(FeatureTables.from_specs(model, cluster),
                                    StrategySpace(model, cluster).encode([strategy]))
    assert peak < 100 * 2**20, f"{peak / 2**20:.0f} MiB"
    f = {n: float(X[0, i]) for n, i in COL.items()}
    assert f["ps_push_sum_bytes"] == 1024 * 4096 * 64 * 4    # every worker pushes all of b
    assert f["ps_nodes_used"] == 128
    assert f["ar_groups"] == k


def test_a_batch_whose_lines_run_to_a_million_entries_is_featurized_in_blocks_of_bounded_memory():
    """Each row's bincount lines hold 2 L + 3 G float64 entries: with 100,000 fusion groups
    (a partitioned all-reduce on a large cluster) that is 2.4 MB a row, so 200 rows in one
    block took 1.7 GB; blocks now have as many rows as fit in about 256 MB."""
    k = 100_000
    model = ModelSpec("m", (VariableSpec("a", (k, 4)), VariableSpec("b", (10,))), batch_size=4)
    cluster = _cluster()
    one = Strategy((VarConfig("a", tuple(AllReduce(group=g) for g in range(k))), VarConfig("b", (PS("n0"),))))
    tables = FeatureTables.from_specs(model, cluster)
    encoded = StrategySpace(model, cluster).encode([one])
    batch = encoded.take(np.zeros(200, dtype=np.intp))
    single = featurize(tables, encoded)
    X, peak = _featurized_with_peak(tables, batch)
    assert peak < 600 * 2**20, f"{peak / 2**20:.0f} MiB"
    np.testing.assert_array_equal(X, np.repeat(single, 200, axis=0))
    assert X[0, COL["ar_groups"]] == k


def test_nccl_rings_count_their_steps_apart_from_cpu_rings():
    """Where every node has GPUs and the backend is NCCL's (auto, graph), a collective's steps are
    NCCL's (10 us each, NCCL's latency model); gloo and the object store reduce on the CPU (0.1 ms
    and a Ray call a step), as do nodes without GPUs."""
    from tuner.features.alpha_beta import AlphaBeta, net_time
    from tuner.features.batch import terms_of

    gpus = ClusterSpec("g", tuple(NodeSpec(f"n{i}", gpus=4, workers=4, bandwidth_gbps=1.0) for i in range(3)))
    cpus = _cluster(nodes=3, workers=4)
    W = 12

    def ar(backend):
        return Strategy((VarConfig("a", (AllReduce(backend=backend),)), VarConfig("b", (AllReduce(backend=backend),))))

    for backend in ("auto", "graph"):
        f = _feat(MODEL, gpus, ar(backend))
        assert f["nccl_ring_steps"] == 2 * (W - 1) and f["ring_steps"] == 0
    g = _feat(MODEL, gpus, ar("gloo"))
    assert g["ring_steps"] == 2 * (W - 1) and g["nccl_ring_steps"] == 0
    c = _feat(MODEL, cpus, ar("auto"))
    assert c["ring_steps"] == 2 * (W - 1) and c["nccl_ring_steps"] == 0
    # a CPU node without workers (parameter servers alone) takes no part in the GPUs' ring
    with_ps_node = ClusterSpec("gp", gpus.nodes + (NodeSpec("ps", workers=0, bandwidth_gbps=1.0),))
    assert _feat(MODEL, with_ps_node, ar("auto"))["nccl_ring_steps"] == 2 * (W - 1)
    # the latency they add: 22 steps at 10 us on NCCL, at 0.1 ms on a CPU ring
    rows = [featurize(FeatureTables.from_specs(MODEL, cl), StrategySpace(MODEL, cl).encode([ar(b)]))
            for cl, b in ((gpus, "auto"), (gpus, "gloo"))]
    p = AlphaBeta()
    nccl, cpu = (net_time(terms_of(X), p)[0] for X in rows)
    wire = float(rows[0][0, COL["wire_s"]]) / p.efficiency
    assert nccl - wire == pytest.approx(2 * (W - 1) * p.alpha_nccl_step_s, rel=1e-6)
    assert cpu - wire == pytest.approx(2 * (W - 1) * p.alpha_step_s, rel=1e-6)
