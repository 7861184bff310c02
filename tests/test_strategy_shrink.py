"""A strategy re-placed on the nodes a cluster has left (``strategy_space.shrink.without_nodes``):
what ``Trainer.fit(elastic=True)`` goes on with after a node leaves."""
from __future__ import annotations

import pytest

from strategy_space import ClusterSpec, ConfigError, NodeSpec, validate
from strategy_space.builders import build_all, get_builder
from strategy_space.shrink import without_nodes
from strategy_space.strategy import PS, AllReduce, Strategy, VarConfig
from tests.fakes import three_node_cluster, tiny_model

MODEL = tiny_model()


def hosts(strategy: Strategy) -> dict:
    """PS bytes each node hosts."""
    out: dict[str, int] = {}
    for c in strategy.variables:
        per = MODEL.var(c.name).bytes // c.num_shards
        for s in c.synchronizers:
            if isinstance(s, PS):
                out[s.destination] = out.get(s.destination, 0) + per
    return out


def test_every_builder_on_the_nodes_left_is_a_valid_strategy_that_keeps_its_choices():
    cluster = three_node_cluster()
    for name, strategy in build_all(MODEL, cluster).items():
        shrunk, smaller = without_nodes(strategy, cluster, MODEL, ["h1"])
        assert smaller.node_names == ("h0", "h2") and smaller.name == cluster.name
        assert "h1" not in shrunk.ps_nodes(), name
        assert validate(shrunk, MODEL, smaller) is shrunk
        assert shrunk.resolved_replicas(smaller) == ("h0:0", "h2:0")
        for old, new in zip(strategy.variables, shrunk.variables):
            assert (old.name, old.axis, old.num_shards) == (new.name, new.axis, new.num_shards)
            for a, b in zip(old.synchronizers, new.synchronizers):
                assert type(a) is type(b), name
                if isinstance(a, PS):   # only the host of a lost node's shard changes
                    assert (a.local_replication, a.sync, a.staleness) == (b.local_replication, b.sync, b.staleness)
                    assert b.destination == a.destination or a.destination == "h1"
                else:
                    assert a == b


def test_a_lost_nodes_shards_go_where_the_fewest_bytes_are_largest_first():
    cluster = three_node_cluster()
    strategy = get_builder("partitioned_ps", min_partition_bytes=1).build(MODEL, cluster)
    before = hosts(strategy)
    shrunk, _ = without_nodes(strategy, cluster, MODEL, ["h0"])
    after = hosts(shrunk)
    assert set(after) == {"h1", "h2"} and sum(after.values()) == sum(before.values())
    # spread as the builder spread them: no survivor ends with more than the other plus the largest moved shard
    largest = max(MODEL.var(c.name).bytes // c.num_shards for c in strategy.variables
                  if any(isinstance(s, PS) and s.destination == "h0" for s in c.synchronizers))
    assert abs(after["h1"] - after["h2"]) <= largest

    # all on one node that goes: everything moves, the largest variable first to the first node left
    single = get_builder("ps").build(MODEL, cluster)
    lone = single.ps_nodes()[0]
    moved, smaller = without_nodes(single, cluster, MODEL, [lone])
    left = [n for n in cluster.node_names if n != lone]
    assert moved.config("embedding/embeddings").synchronizers[0].destination == left[0]
    assert set(moved.ps_nodes()) == set(left) and smaller.node_names == tuple(left)


def test_what_no_lost_node_held_is_returned_unchanged():
    cluster = three_node_cluster()
    ar = get_builder("all_reduce").build(MODEL, cluster)
    shrunk, smaller = without_nodes(ar, cluster, MODEL, ["h2"])
    assert shrunk.variables == ar.variables and shrunk.fingerprint == ar.fingerprint
    assert smaller.num_workers == 2


def test_the_chief_and_explicit_replicas_follow_the_nodes_left():
    cluster = ClusterSpec("c", (NodeSpec("a", address="10.0.0.1", workers=2, chief=True),
                                NodeSpec("b", address="10.0.0.2", workers=1),
                                NodeSpec("p", address="10.0.0.3", workers=0)))
    strategy = Strategy(tuple(VarConfig(v.name, (PS("p"),) if i % 2 else (AllReduce(),))
                              for i, v in enumerate(MODEL.variables)), replicas=("a:0", "a:1", "b:0"))
    shrunk, smaller = without_nodes(strategy, cluster, MODEL, ["a", "p"])
    assert smaller.chief.name == "b" and shrunk.replicas == ("b:0",)
    assert shrunk.ps_nodes() == ("b",)   # a PS-only node's shards go to a node with workers if none else is left
    assert validate(shrunk, MODEL, smaller) is shrunk


@pytest.mark.parametrize("lost, said", [
    (["zz"], "has no node 'zz' (its nodes: a, b, p)"),
    (["a", "b"], "without node(s) a, b cluster c has no worker left"),
    (["b"], "every worker the strategy trains on (b:0) was on a lost node (b)"),
])
def test_what_cannot_go_on_is_refused_saying_why(lost, said):
    cluster = ClusterSpec("c", (NodeSpec("a", address="10.0.0.1", workers=2),
                                NodeSpec("b", address="10.0.0.2", workers=1),
                                NodeSpec("p", address="10.0.0.3", workers=0)))
    strategy = Strategy(tuple(VarConfig(v.name, (PS("p"),)) for v in MODEL.variables), replicas=("b:0",))
    with pytest.raises(ConfigError) as e:
        without_nodes(strategy, cluster, MODEL, lost)
    assert said in str(e.value)
