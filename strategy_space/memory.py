"""What a strategy must hold in each node's memory, at least, and whether the node has it.

A strategy that cannot fit a node starts anyway without this check and fails minutes later (a
``MemoryError`` at once past RAM plus swap, else Ray's memory monitor kills a worker or a parameter
server); ``validate`` refuses it up front where the cluster gives a node's memory (``NodeSpec.memory_gib``,
``gpu_memory_gib``) or the memory of the one machine its nodes share (``ClusterSpec.shared_memory_gib``:
the testbed), and the search never proposes it.

The figures are floors of what this project's runtime holds, counted from the variables alone (no
activations, no framework overhead, no optimizer slots beyond the full-size arrays the ModelSpec
says the optimizer keeps per variable),
so a strategy is never refused that would fit:

* a training worker builds the whole model (every variable, also those its parameter servers hold)
  and computes a dense gradient of each dense variable: ``model + dense`` bytes each, on its GPU
  where the node has GPUs (``ceil(workers / gpus)`` workers share one), else in host memory; an
  all-reduced variable with error feedback (``*_ef`` compressors) keeps a residual of its size;
* a node with training workers keeps one copy of the initial values in its object store, which
  every reset reads (host memory);
* the driver, on the chief, keeps one copy of the initial values, which the parameter servers
  start from (the worker pool's description; host memory);
* each parameter-server shard holds its values in the host memory of its node, and the optimizer's
  slots for them (``ModelSpec.optimizer_slots``: Adam 2 arrays of its size); a worker holds the slots
  of the variables it all-reduces.

With emulated compute (``ClusterSpec.compute``) a worker builds no model: it keeps one synthetic
gradient of each dense variable, no initial values are built (they are zeros), and updates run the
emulated optimizer (``--optimizer``): the model's slots are not counted.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .cluster_spec import ClusterSpec
from .compressor import COMPRESSOR_KINDS
from .encoding import KIND_PS, EncodedStrategies
from .model_spec import ModelSpec
from .strategy import PS, AllReduce, Strategy, shard_bounds

GIB = 2**30
_SHARDS = "parameter-server shards (values and optimizer slots)"


@dataclass(frozen=True)
class NodeMemory:
    """The memory one node needs, at least, for a strategy.

    Attributes:
        node: the node's name.
        host: (what, bytes) parts in host memory, largest first.
        gpu_bytes: what each GPU of the node holds, at least (0 where its workers run on CPUs).
        gpu_workers: training workers on each GPU (the most any GPU of the node runs).
    """

    node: str
    host: tuple[tuple[str, int], ...]
    gpu_bytes: int = 0
    gpu_workers: int = 0

    @property
    def host_bytes(self) -> int:
        return sum(b for _, b in self.host)


def size_text(nbytes: float) -> str:
    """``nbytes`` in the largest binary unit that keeps it >= 1 (``3.2 GiB``, ``512 MiB``)."""
    for unit, scale in (("TiB", 2**40), ("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{int(nbytes)} B"


def _training_workers(replicas: tuple[str, ...], cluster: ClusterSpec) -> dict[str, int]:
    """Training workers per node: a strategy's replicas, else every worker slot."""
    if not replicas:
        return {n.name: n.workers or 0 for n in cluster.nodes}
    counts = {n.name: 0 for n in cluster.nodes}
    for slot in replicas:
        node = slot.rpartition(":")[0]
        if node in counts:
            counts[node] += 1
    return counts


@dataclass(frozen=True)
class _Node:
    """A node's part of the floor that does not depend on where shards go: its workers' model copies
    (``base``: the whole model and a dense gradient, or with emulated compute the dense gradient
    alone), on ``gpu_workers`` per GPU or in host memory, and the fixed host parts."""

    cpu_workers: int
    gpu_workers: int
    fixed: tuple[tuple[str, int], ...]


def _nodes(model: ModelSpec, cluster: ClusterSpec, workers: dict[str, int]) -> tuple[int, list[_Node]]:
    real = cluster.compute == "real"
    dense = sum(v.bytes for v in model.variables if not v.sparse)
    base = model.total_bytes + dense if real else dense
    out = []
    for node in cluster.nodes:
        w = workers[node.name]
        gpu = math.ceil(w / node.gpus) if w and node.gpus and real else 0
        fixed = []
        if w and real:
            fixed.append(("the object store's copy of the initial values", model.total_bytes))
        if node.chief and real:
            fixed.append(("the driver's copy of the model", model.total_bytes))
        out.append(_Node(0 if gpu else w, gpu, tuple(fixed)))
    return base, out


def memory_floor(strategy: Strategy, model: ModelSpec, cluster: ClusterSpec) -> list[NodeMemory]:
    """Each node's memory floor for running ``strategy`` (see the module doc), in cluster order.

    Variables or destinations the model or cluster does not have are skipped (``validate`` says so).
    """
    ps_bytes = {n.name: 0 for n in cluster.nodes}
    residual = 0   # what each worker keeps per all-reduced variable: error-feedback residuals, optimizer slots
    slots = _slots(model, cluster)
    for cfg in strategy.variables:
        if cfg.name not in model._index:  # noqa: SLF001 - same package
            continue
        var = model.var(cfg.name)
        dim = var.shape[cfg.axis] if cfg.axis < len(var.shape) else 1
        per_slice = var.bytes // dim
        for sync, (start, stop) in zip(cfg.synchronizers, shard_bounds(dim, cfg.num_shards)):
            if isinstance(sync, PS) and sync.destination in ps_bytes:
                ps_bytes[sync.destination] += (stop - start) * per_slice * (1 + slots)
            elif isinstance(sync, AllReduce):
                residual += (stop - start) * per_slice * (slots + sync.codec.error_feedback)
    base, nodes = _nodes(model, cluster, _training_workers(strategy.replicas, cluster))
    out = []
    for node, part in zip(cluster.nodes, nodes):
        host = list(part.fixed)
        w = part.cpu_workers
        if w:
            whose = "workers'" if w > 1 else "worker's"
            host.append((f"{w} {whose} model and gradients", w * (base + residual)))
        if ps_bytes[node.name]:
            host.append((_SHARDS, ps_bytes[node.name]))
        out.append(NodeMemory(node.name, tuple(sorted(host, key=lambda p: -p[1])),
                              part.gpu_workers * (base + residual), part.gpu_workers))
    return out


def memory_problems(strategy: Strategy, model: ModelSpec, cluster: ClusterSpec) -> list[str]:
    """One line per node whose memory (as the cluster gives it) is below the strategy's floor,
    saying what takes it and what to change; empty where every node fits or gives no memory."""
    if not _checked(cluster):
        return []
    problems = []
    floors = memory_floor(strategy, model, cluster)
    total = sum(f.host_bytes for f in floors)
    if cluster.shared_memory_gib is not None and total > cluster.shared_memory_gib * GIB:
        each = ", ".join(f"{f.node} {size_text(f.host_bytes)}" for f in floors if f.host_bytes)
        problems.append(f"the cluster's nodes share one machine of {cluster.shared_memory_gib:g} GiB "
                        f"(shared_memory_gib) and the strategy needs at least {size_text(total)} on them together "
                        f"({each}); run fewer workers, or a smaller model, on this machine")
    for floor, node in zip(floors, cluster.nodes):
        if node.memory_gib is not None and floor.host_bytes > node.memory_gib * GIB:
            parts = ", ".join(f"{what} {size_text(b)}" for what, b in floor.host)
            ps = dict(floor.host).get(_SHARDS, 0)
            fix = ("host fewer or smaller parameter-server shards there (ps.destination; partition the large "
                   "variables across nodes)" if ps > floor.host_bytes - node.memory_gib * GIB else
                   "run fewer workers on it (every worker builds the whole model) or use nodes with more memory")
            problems.append(f"node {node.name}: the strategy needs at least {size_text(floor.host_bytes)} of memory "
                            f"there ({parts}) but the node has {node.memory_gib:g} GiB (memory_gib); {fix}")
        if node.gpu_memory_gib is not None and floor.gpu_bytes > node.gpu_memory_gib * GIB:
            on_it = f"{floor.gpu_workers} {'workers' if floor.gpu_workers > 1 else 'worker'} on it"
            problems.append(f"node {node.name}: each GPU holds at least {size_text(floor.gpu_bytes)} ({on_it}: the "
                            f"model and gradients) but has {node.gpu_memory_gib:g} GiB (gpu_memory_gib); every worker "
                            f"builds the whole model: use GPUs with more memory or fewer workers per GPU")
    return problems


def _slots(model: ModelSpec, cluster: ClusterSpec) -> int:
    """The optimizer's full-size slots per variable; 0 with emulated compute, whose updates run the
    emulated optimizer (``--optimizer``, SGD by default), not the model's."""
    return model.optimizer_slots if cluster.compute == "real" else 0


def _checked(cluster: ClusterSpec) -> bool:
    return cluster.shared_memory_gib is not None or any(
        n.memory_gib is not None or n.gpu_memory_gib is not None for n in cluster.nodes)


def fits_encoded(e: EncodedStrategies, model: ModelSpec, cluster: ClusterSpec) -> np.ndarray:
    """Whether each strategy of an encoded batch (every worker slot training) fits every node, as
    ``memory_problems`` judges: (B,) bools, all true where the cluster gives no memory. Vectorized
    over the batch: node ``n`` holds shards ``i = r, r + N, ...`` of a variable placed from node
    ``d`` (``r = (n - d) mod N``), the first ``dim % shards`` of them one slice longer."""
    B, V = e.kind.shape
    if not _checked(cluster) or B == 0:
        return np.ones(B, bool)
    N = len(cluster.nodes)
    nbytes = np.array([v.bytes for v in model.variables], np.float64)
    dims = np.ones((V, max([len(v.shape) for v in model.variables] + [1])), np.int64)
    for j, v in enumerate(model.variables):
        dims[j, :len(v.shape)] = v.shape
    dim = dims[np.arange(V), np.minimum(e.axis, dims.shape[1] - 1)]   # (B, V)
    per_slice = nbytes / dim
    shards = np.maximum(e.shards.astype(np.int64), 1)
    base_rows, extra = np.divmod(dim, shards)
    ps = e.kind == KIND_PS
    ef = np.isin(e.compressor, [i for i, k in enumerate(COMPRESSOR_KINDS) if k.endswith("_ef")])
    slots = _slots(model, cluster)
    residual = (~ps * (ef + slots) * nbytes).sum(axis=1)   # (B,)
    base, nodes = _nodes(model, cluster, _training_workers((), cluster))
    ok = np.ones(B, bool)
    total = np.zeros(B)
    for n, (node, part) in enumerate(zip(cluster.nodes, nodes)):
        r = (n - e.dest.astype(np.int64)) % N
        count = np.where(r < shards, (shards - r + N - 1) // N, 0)
        longer = np.where(r < extra, (extra - r + N - 1) // N, 0)
        held = (ps * (count * base_rows + longer) * per_slice).sum(axis=1) * (1 + slots)
        host = sum(b for _, b in part.fixed) + held + part.cpu_workers * (base + residual)
        total += host
        if node.memory_gib is not None:
            ok &= host <= node.memory_gib * GIB
        if node.gpu_memory_gib is not None and part.gpu_workers:
            ok &= part.gpu_workers * (base + residual) <= node.gpu_memory_gib * GIB
    if cluster.shared_memory_gib is not None:
        ok &= total <= cluster.shared_memory_gib * GIB
    return ok
