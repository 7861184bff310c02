"""The graph backend's pure parts: which backend ``auto`` picks, which all-reduce members are
reduced inside the training step, and the overlap figure read from a profiler trace."""
from __future__ import annotations

import pytest

from autosync.runtime.sync.allreduce import ARGroup, ARMember
from autosync.runtime.sync.backends import resolve_backend
from autosync.runtime.sync.graph import split_groups
from autosync.runtime.sync.graph_trace import overlap_from_trace
from strategy_space.compressor import Compressor
from strategy_space.errors import ConfigError


def _m(var, shard=0, shards=1, backend="graph", compressor="none", sparse=False):
    return ARMember(key=(var, shard), start=0, stop=1, axis=0, num_shards=shards, sparse=sparse,
                    compressor=Compressor.parse(compressor), backend=backend)


@pytest.mark.integration
def test_auto_is_graph_on_gpus_and_gloo_on_cpus():
    assert resolve_backend("auto", gpus=True).name == "graph"
    assert resolve_backend("auto", gpus=False).name == "gloo"
    assert resolve_backend("graph", gpus=False).name == "graph"
    with pytest.raises(ConfigError, match="unknown all-reduce backend 'ring'; valid: auto, gloo, nccl, objectstore, graph"):
        resolve_backend("ring", gpus=False)


def test_split_groups_keeps_in_graph_only_whole_variables_it_can_reduce():
    groups = [
        ARGroup(0, (_m(0), _m(1, compressor="powersgd(2)"), _m(2, compressor="fp16_ef"))),
        ARGroup(1, (_m(3, 0, 2), _m(4, 0, 2, sparse=True))),       # var 3 and 4: shard 1 elsewhere
        ARGroup(2, (_m(3, 1, 2), _m(4, 1, 2, sparse=True), _m(5, 0, 2))),  # var 5: shard 1 on a PS
        ARGroup(3, (_m(6, backend="gloo"), _m(7, sparse=True))),
    ]
    layout = [(1, 0), (1, 0), (1, 0), (2, 0), (2, 0), (2, 0), (1, 0), (1, 0)]
    graph, rest = split_groups(groups, layout)
    assert [(g.group, [m.key for m in g.members]) for g in graph] == [
        (0, [(0, 0), (1, 0), (2, 0)]), (1, [(3, 0)]), (2, [(3, 1)]), (3, [(7, 0)])]
    assert [(g.group, [m.key for m in g.members]) for g in rest] == [
        (1, [(4, 0)]), (2, [(4, 1), (5, 0)]), (3, [(6, 0)])]


def test_overlap_from_trace():
    events = [("gradient_tape/out/MatMul", 0, 10), ("CollectiveReduceV2", 12, 30),
              ("CollectiveReduceV2_1", 20, 40), ("gradient_tape/conv/Conv2DBackpropFilter", 10, 25),
              ("sgd/AssignSub", 40, 41)]
    found = overlap_from_trace(events)
    assert found["first_collective_start"] == 12 and found["last_gradient_end"] == 25
    assert found["hidden_share"] == pytest.approx(13 / 28)   # union [12, 40], 13 ns before 25
    late = overlap_from_trace([("gradient_tape/a", 0, 10), ("CollectiveReduceV2", 11, 20)])
    assert late["hidden_share"] == 0.0
    assert overlap_from_trace([("gradient_tape/a", 0, 10)])["hidden_share"] == 0.0
