"""A strategy on the nodes a cluster has left: what training goes on with after nodes are lost.

Horovod's elastic mode and TorchElastic go on with the workers that remain; a strategy also
places parameter-server shards on nodes. ``without_nodes`` keeps every choice the strategy made
(which variables are PS or all-reduce, partitions, fusion groups, compression, staleness, the
shards already on surviving nodes) and moves only what the lost nodes held: their workers are
gone, and each PS shard they hosted goes to the surviving node that hosts the fewest PS bytes so
far (largest shards first), so the shards stay spread as the builders spread them.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from .cluster_spec import ClusterSpec
from .errors import ConfigError, short_repr
from .model_spec import ModelSpec
from .strategy import PS, Strategy, VarConfig, shard_bounds


def without_nodes(strategy: Strategy, cluster: ClusterSpec, model: ModelSpec,
                  lost: Iterable[str]) -> tuple[Strategy, ClusterSpec]:
    """``strategy`` and ``cluster`` without the nodes ``lost``.

    The cluster keeps its name and settings; a lost chief's role goes to the first node left.
    Workers on lost nodes are dropped (an explicit ``replicas`` list loses theirs; an empty one
    still means every worker of the smaller cluster). Each PS shard hosted on a lost node moves
    to the surviving node with the fewest PS bytes (ties: the cluster's node order), largest
    shards first; nothing else changes, so a strategy that uses no lost node is returned as is.

    Raises:
        ConfigError: a name the cluster does not have, every node lost, or no worker left (on the
            nodes left, or of the strategy's ``replicas``).
    """
    lost = list(dict.fromkeys(lost))
    unknown = [n for n in lost if n not in cluster.node_names]
    if unknown:
        raise ConfigError(f"cluster {cluster.name} has no node {', '.join(map(short_repr, unknown))} "
                          f"(its nodes: {', '.join(cluster.node_names)})")
    left = tuple(n for n in cluster.nodes if n.name not in lost)
    if not any((n.workers or 0) > 0 for n in left):
        raise ConfigError(f"without node(s) {', '.join(lost)} cluster {cluster.name} has no worker left: "
                          f"training cannot go on until nodes with workers come back")
    if any(n.chief for n in cluster.nodes if n.name in lost):
        left = (dataclasses.replace(left[0], chief=True),) + left[1:]
    smaller = dataclasses.replace(cluster, nodes=left)
    replicas = tuple(r for r in strategy.replicas if r.rsplit(":", 1)[0] not in lost)
    if strategy.replicas and not replicas:
        raise ConfigError(f"every worker the strategy trains on ({', '.join(strategy.replicas)}) was on a lost "
                          f"node ({', '.join(lost)}): training cannot go on until they come back")
    return dataclasses.replace(strategy, variables=_rehosted(strategy, model, smaller, set(lost)),
                               replicas=replicas), smaller


def _rehosted(strategy: Strategy, model: ModelSpec, smaller: ClusterSpec, lost: set) -> tuple[VarConfig, ...]:
    """The variables' configs with every PS shard on a ``lost`` node moved (``without_nodes``)."""
    load = {n: 0 for n in smaller.node_names}
    moving = []   # (bytes, variable index, shard index)
    for i, c in enumerate(strategy.variables):
        sizes = _shard_bytes(c, model)
        for j, s in enumerate(c.synchronizers):
            if isinstance(s, PS):
                if s.destination in lost:
                    moving.append((sizes[j], i, j))
                elif s.destination in load:
                    load[s.destination] += sizes[j]
    if not moving:
        return strategy.variables
    order = {n: k for k, n in enumerate(smaller.node_names)}
    syncs = [list(c.synchronizers) for c in strategy.variables]
    for size, i, j in sorted(moving, key=lambda m: (-m[0], m[1], m[2])):
        node = min(load, key=lambda n: (load[n], order[n]))
        load[node] += size
        syncs[i][j] = dataclasses.replace(syncs[i][j], destination=node)
    return tuple(VarConfig(c.name, tuple(s), c.axis) for c, s in zip(strategy.variables, syncs))


def _shard_bytes(config: VarConfig, model: ModelSpec) -> list[int]:
    """Bytes of each of ``config``'s shards."""
    var = model.var(config.name)
    if not config.partitioned or not var.shape or config.axis >= len(var.shape):
        return [var.bytes // config.num_shards] * config.num_shards
    per_slice = var.bytes // max(1, var.shape[config.axis])
    return [(stop - start) * per_slice for start, stop in shard_bounds(var.shape[config.axis], config.num_shards)]
