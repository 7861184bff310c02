"""Which lost nodes a strategy needs (``ClusterBinding.lost_for``): the nodes of its workers and of
its parameter servers; a node that hosts neither does not stop it."""
from __future__ import annotations

from strategy_space import ClusterSpec, NodeSpec
from strategy_space.builders import get_builder
from autosync.runtime.binding import ClusterBinding
from tests.fakes import tiny_model

CLUSTER = ClusterSpec("c", (NodeSpec("w0", workers=1, chief=True), NodeSpec("w1", workers=1),
                            NodeSpec("ps", workers=0)))


def _binding(lost: list[str]) -> ClusterBinding:
    binding = ClusterBinding(cluster=CLUSTER, keys={}, node_ids={})
    object.__setattr__(binding, "lost_nodes", lambda: lost)
    return binding


def test_lost_for_names_the_nodes_a_strategy_needs_and_whether_they_held_workers():
    model = tiny_model()
    on_ps_node = get_builder("ps").build(model, ClusterSpec("one", (NodeSpec("ps", workers=1),)))
    on_ps_node = type(on_ps_node)(on_ps_node.variables)   # every shard on node ps, every worker of CLUSTER
    all_reduce = get_builder("all_reduce").build(model, CLUSTER)
    assert _binding([]).lost_for(on_ps_node) is None
    assert _binding(["ps"]).lost_for(on_ps_node) == (["ps"], False)
    assert _binding(["ps"]).lost_for(all_reduce) is None        # it needs no parameter server there
    assert _binding(["w1"]).lost_for(all_reduce) == (["w1"], True)
    assert _binding(["w1", "ps"]).lost_for(on_ps_node) == (["w1", "ps"], True)


def test_lost_note_says_only_the_nodes_a_wait_is_on():
    """A wait on actors being placed asks ``lost_note`` of the nodes it places them on: a node
    that left elsewhere (a parameter-server-only node no strategy of the wait uses) does not fail
    it, and a node that held no workers is not said to stop every strategy."""
    assert _binding(["ps"]).lost_note({"w0", "w1"}) == ""
    assert "node(s) ps left" in _binding(["ps"]).lost_note({"w0", "ps"})
    assert "no strategy that places parameter servers there can run" in _binding(["ps"]).lost_note()
    assert "so no strategy can run on this cluster" in _binding(["w1", "ps"]).lost_note()
    assert _binding([]).lost_note() == ""
