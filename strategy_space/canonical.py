"""The canonical form of a strategy: one representative of the strategies that run identically.

Two strategies are the same run when they differ only in
  * how fusion groups are numbered: a group is a set of variables (shards) reduced together and
    the runtime issues groups in gradient-ready order, so ids carry no meaning beyond which
    shards share a group; the canonical form numbers groups 0, 1, ... in first-use order
    (variables by name, shards in order);
  * which of several identical nodes holds what (with a cluster given): when every node of the
    cluster is alike (workers, CPUs, GPUs, bandwidths), a placement and its rotation over the
    nodes are the same run; the canonical form rotates node names so that the first parameter
    server shard (variables by name) sits on the first node. A rotation keeps round-robin shard
    placement round-robin, so a canonical strategy stays in the tuner's encoded space;
  * the order the variables are listed in, and the ``origin`` label.
"""
from __future__ import annotations

import dataclasses

from .specs import ClusterSpec
from .strategy import PS, AllReduce, Strategy, VarConfig


def _identical_nodes(cluster: ClusterSpec) -> bool:
    facts = {(n.workers, n.cpus, n.gpus, n.bandwidth_gbps)
             for n in cluster.nodes}
    return len(facts) == 1


def canonical(strategy: Strategy, cluster: ClusterSpec | None = None) -> Strategy:
    """The canonical strategy equivalent to ``strategy`` (see the module doc); idempotent."""
    configs = sorted(strategy.variables, key=lambda c: c.name)
    rename: dict[str, str] = {}
    if cluster is not None and len(cluster.nodes) > 1 and not strategy.replicas and _identical_nodes(cluster):
        names = list(cluster.node_names)
        first = next((s.destination for c in configs for s in c.synchronizers if isinstance(s, PS)), None)
        if first in names:
            shift = names.index(first)
            rename = {n: names[(i - shift) % len(names)] for i, n in enumerate(names)}
    groups: dict[int, int] = {}
    out = []
    for c in configs:
        syncs = []
        for s in c.synchronizers:
            if isinstance(s, AllReduce):
                s = dataclasses.replace(s, group=groups.setdefault(s.group, len(groups)))
            elif rename:
                s = dataclasses.replace(s, destination=rename.get(s.destination, s.destination))
            syncs.append(s)
        out.append(VarConfig(c.name, tuple(syncs), c.axis))
    return Strategy(tuple(out), strategy.replicas)
