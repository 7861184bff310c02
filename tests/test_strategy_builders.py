"""Contract suite run against every builder, for every model x cluster in configs/ plus fakes."""
import glob
import os

import pytest

from strategy_space import (PS, AllReduce, ClusterSpec, NodeSpec, Strategy, VarConfig, dumps, load_cluster_spec,
                            load_model_spec, loads, validate)
from strategy_space.builders import BUILDERS, ConfigError, fusion_groups, get_builder, step_bytes
from strategy_space.space import StrategySpace
from tests.conftest import CONFIGS
from tests.fakes import three_node_cluster, tiny_model, two_node_cluster

MODELS = [tiny_model(), tiny_model(profile=True)] + [load_model_spec(f) for f in sorted(glob.glob(os.path.join(CONFIGS, "models", "*.yaml")))]
CLUSTERS = [two_node_cluster(), three_node_cluster()] + [load_cluster_spec(f) for f in sorted(glob.glob(os.path.join(CONFIGS, "clusters", "*.yaml")))]


@pytest.mark.parametrize("name", list(BUILDERS))
@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.name)
@pytest.mark.parametrize("cluster", CLUSTERS, ids=lambda c: c.name)
def test_builder_contract(name, model, cluster):
    s = get_builder(name).build(model, cluster)
    validate(s, model, cluster)
    assert loads(dumps(s)) == s
    assert s.origin == name
    StrategySpace(model, cluster).encode([s])  # the tuner can featurize every baseline


def test_ps_puts_everything_on_chief():
    s = get_builder("ps").build(tiny_model(), three_node_cluster())
    assert {sync.destination for c in s.variables for sync in c.synchronizers} == {"h0"}


def test_ps_lb_balances_by_bytes_per_bandwidth():
    model, cluster = tiny_model(), three_node_cluster()
    s = get_builder("ps_lb").build(model, cluster)
    load = {n: 0.0 for n in cluster.node_names}
    for c in s.variables:
        load[c.synchronizers[0].destination] += step_bytes(model.var(c.name))
    # the biggest variable goes to the fastest node (h2: 3 Gbit/s) first
    biggest = max(model.variables, key=step_bytes)
    assert s.config(biggest.name).synchronizers[0].destination == "h2"
    assert len({d for d, b in load.items() if b > 0}) == 3


def test_partitioned_ps_spreads_large_variables_over_all_nodes():
    model, cluster = tiny_model(), three_node_cluster()
    s = get_builder("partitioned_ps").build(model, cluster)
    big = s.config("dense_1/kernel")
    assert [x.destination for x in big.synchronizers] and {x.destination for x in big.synchronizers} == {"h0", "h1", "h2"}
    assert not s.config("dense/bias").partitioned


def test_all_reduce_groups_by_bytes_not_count():
    model = tiny_model()
    s = get_builder("all_reduce", chunk_bytes=1 << 20).build(model, two_node_cluster())
    groups = {}
    for c in s.variables:
        groups.setdefault(c.synchronizers[0].group, []).append(model.var(c.name).bytes)
    for members in groups.values():
        assert sum(members) <= (1 << 20) or len(members) == 1
    assert len(groups) >= 3  # the 6.1 MiB embedding and the 2 MiB kernel each need their own group
    assert fusion_groups(model, model.names, 1 << 40) == {n: 0 for n in model.names}


def test_all_reduce_compressor_only_where_legal():
    s = get_builder("all_reduce", compressor="fp16").build(tiny_model(), two_node_cluster())
    assert s.config("dense/kernel").synchronizers[0].compressor == "fp16"
    assert s.config("embedding/embeddings").synchronizers[0].compressor == "none"
    assert s.config("steps").synchronizers[0].compressor == "none"


def test_parallax_sparse_on_ps_dense_on_ar():
    s = get_builder("parallax").build(tiny_model(), three_node_cluster())
    emb = s.config("embedding/embeddings")
    assert all(isinstance(x, PS) for x in emb.synchronizers) and emb.num_shards == 3
    for name in ("dense/kernel", "dense_1/kernel", "dense/bias"):
        assert isinstance(s.config(name).synchronizers[0], AllReduce)


def test_unknown_builder_lists_valid_ones():
    with pytest.raises(ConfigError, match=r"unknown builder 'horovod'; valid builders: ps, ps_lb, partitioned_ps"):
        get_builder("horovod")


def test_unknown_option_lists_accepted():
    with pytest.raises(ConfigError, match=r"builder all_reduce: unknown option\(s\) chunk; accepted: backend, chunk_bytes, compressor"):
        get_builder("all_reduce", chunk=3)


def test_bad_option_value():
    with pytest.raises(ConfigError, match="compressor 'gzip' is not one of"):
        get_builder("all_reduce", compressor="gzip")


def test_ready_times_follow_the_backward_pass_after_the_forward_third():
    import dataclasses

    from strategy_space import ComputeProfile, ModelSpec, VariableSpec
    from strategy_space.builders import FORWARD_SHARE, ready_order, ready_times

    spec = ModelSpec("r", (VariableSpec("emb", (1000, 4), sparse=True, rows_per_step=10),
                           VariableSpec("a", (10, 10)), VariableSpec("b", (30,))), batch_size=4,
                     profile=ComputeProfile(0.1, "t", ("b", "a", "emb")))
    times = ready_times(spec)
    assert list(times) == ready_order(spec) == ["b", "a", "emb"]
    # backward work per variable ~ its parameters, a sparse one's touched rows only: 30, 100, 40 of 170
    want = [FORWARD_SHARE + (1 - FORWARD_SHARE) * w / 170 for w in (30, 130, 170)]
    assert list(times.values()) == pytest.approx(want)
    assert times["emb"] == pytest.approx(1.0)
    unprofiled = ready_times(dataclasses.replace(spec, profile=None))   # reverse creation order
    assert list(unprofiled) == ["b", "a", "emb"]


def test_ps_nodes_names_the_nodes_that_host_a_parameter_server_shard():
    model, cluster = tiny_model(), three_node_cluster()
    assert get_builder("ps").build(model, cluster).ps_nodes() == (cluster.chief.name,)
    assert get_builder("all_reduce").build(model, cluster).ps_nodes() == ()
    spread = get_builder("partitioned_ps", min_partition_bytes=1).build(model, cluster)
    assert spread.ps_nodes() == tuple(n.name for n in cluster.nodes) == ("h0", "h1", "h2")
    # shards named out of order and twice, beside an all-reduced variable: each node once, sorted
    mixed = Strategy((VarConfig("a", (PS("h2"), PS("h0"), PS("h2"))), VarConfig("b", (AllReduce(),))))
    assert mixed.ps_nodes() == ("h0", "h2")


def _placed_one_start_at_a_time(loads, bandwidths, nbytes, shards):
    """The first node ``PlacementLedger.place_round_robin`` should pick, by trying every start in
    turn: shards added one by one, the start whose most loaded node ends up least loaded, the
    lowest index on a tie."""
    n = len(loads)
    part = nbytes / shards

    def worst(first):
        extra = [0.0] * n
        for i in range(shards):
            extra[(first + i) % n] += part
        return max((loads[j] + extra[j]) / bandwidths[j] for j in range(n) if extra[j])

    return min(range(n), key=lambda first: (worst(first), first))


def test_round_robin_placement_picks_the_start_trying_every_start_would():
    import random

    from strategy_space.builders import PlacementLedger

    rng = random.Random(3)
    for _ in range(2000):
        n = rng.randint(1, 12)
        nodes = tuple(NodeSpec(f"n{i}", bandwidth_gbps=rng.choice([1.0, 10.0, rng.uniform(0.1, 5)])) for i in range(n))
        ledger = PlacementLedger(ClusterSpec("c", nodes))
        ledger.bytes = [rng.choice([0.0, 10.0, rng.uniform(0, 100)]) for _ in range(n)]   # ties and not
        before = list(ledger.bytes)
        nbytes, shards = rng.choice([1.0, 3.0, rng.uniform(1, 1000)]), rng.randint(1, 30)
        first = ledger.place_round_robin(nbytes, shards)
        assert first == _placed_one_start_at_a_time(before, ledger.bw, nbytes, shards)
        expected = before[:]
        for i in range(shards):
            expected[(first + i) % n] += nbytes / shards
        assert ledger.bytes == expected

