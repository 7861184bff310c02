"""SyncPlan: a validated Strategy turned into what the runtime executes.

The plan says which parameter-server actor holds which variable shards, which replica slots
train, and the PS mode. It is plain data (no Ray, no TensorFlow) so it can be shipped to workers
and tested alone.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

from autosync.runtime.loss_scale import holds_steps
from autosync.runtime.optimizer_config import CONSTRAINED
from autosync.runtime.sync.allreduce import ARGroup, ARMember
from autosync.runtime.sync.backends import resolve_backend
from strategy_space import AllReduce, Compressor, ModelSpec, Strategy, VariableSpec, shard_bounds
from strategy_space.builders import ready_order



@dataclass(frozen=True)
class ShardRef:
    """One shard of one variable as held by a PS actor.

    Attributes:
        var_index: position in the model's trainable variables.
        shard_index: position among the variable's shards (0 when not partitioned).
        num_shards: how many shards the variable has.
        start, stop: slice ``[start, stop)`` along ``axis`` (the whole dimension if unsplit).
        axis: partition axis.
        sparse: the gradient is ``(indices, values)`` (rows; only axis 0 is legal then).
        local_replication: pulled once per node and shared through the node's object store.
    """

    var_index: int
    shard_index: int
    num_shards: int
    start: int
    stop: int
    axis: int
    sparse: bool
    local_replication: bool

    @property
    def key(self) -> tuple[int, int]:
        return (self.var_index, self.shard_index)

    def nbytes(self, shape, itemsize: int) -> int:
        """Bytes of this shard of a variable of ``shape`` and ``itemsize`` bytes per element."""
        n = math.prod(shape) if shape else 1
        return n // max(1, shape[self.axis] if shape else 1) * (self.stop - self.start) * itemsize

    def slicer(self, ndim: int) -> tuple:
        """Index that selects this shard from the full variable (a view, no copy); a scalar is
        one shard, selected whole by ``()``."""
        if ndim == 0:
            return ()
        return (slice(None),) * self.axis + (slice(self.start, self.stop),) + (slice(None),) * (ndim - self.axis - 1)


@dataclass(frozen=True)
class PSActorPlan:
    """One parameter-server actor: the node it runs on and the shards it holds."""

    node: str
    shards: tuple[ShardRef, ...]

    @property
    def name(self) -> str:
        return f"ps@{self.node}"


@dataclass(frozen=True)
class SyncPlan:
    """Everything a trial executes.

    Attributes:
        replicas: worker slots (``node:i``) in data-shard order.
        ps_actors: one per destination node used by the strategy.
        sync: synchronous PS (all workers' gradients of step t applied together).
        staleness: how many steps a worker may run ahead (sync mode only).
        num_vars: number of model variables.
        ar_groups: all-reduce fusion groups in gradient-ready order (backends resolved).
        layout: per variable, (number of shards, partition axis), to reassemble pulled parts.
        rows_per_step: per variable, the distinct rows one worker's step touches where the model
            spec says (sparse variables; 0 where unknown): what a sparse shard's push and pull
            weigh (``sync.ps.sparse_step_bytes``).
    """

    replicas: tuple[str, ...]
    ps_actors: tuple[PSActorPlan, ...]
    sync: bool
    staleness: int
    num_vars: int
    ar_groups: tuple[ARGroup, ...] = ()
    layout: tuple[tuple[int, int], ...] = ()
    rows_per_step: tuple[int, ...] = ()

    @property
    def num_workers(self) -> int:
        return len(self.replicas)

    @property
    def backends(self) -> tuple[str, ...]:
        """Collective backends the all-reduce groups use."""
        return tuple(sorted({m.backend for g in self.ar_groups for m in g.members}))

    def replica_node(self, slot: str) -> str:
        return slot.rsplit(":", 1)[0]

    def node_aggregation(self) -> dict[str, list[int]]:
        """Node -> indices of its workers, for the nodes whose workers sum their gradients of the
        locally replicated shards before one push and share one pull (synchronous PS, nodes with
        several workers)."""
        if not self.sync or not any(r.local_replication for p in self.ps_actors for r in p.shards):
            return {}
        by_node: dict[str, list[int]] = {}
        for i, slot in enumerate(self.replicas):
            by_node.setdefault(self.replica_node(slot), []).append(i)
        return {node: workers for node, workers in by_node.items() if len(workers) > 1}

    def segmented(self, shapes: list, itemsize: list, max_chunks: int, min_bytes: int) -> "SyncPlan":
        """This plan with the large whole variables of each synchronous PS actor cut into row
        blocks (segments) held by that same actor, so its pushes and pulls pipeline in chunks of
        similar bytes: ``sync.ps.ps_chunks`` groups whole keys, and a variable holding most of an
        actor's bytes (a classifier's kernel) would be one chunk, pulled only once all of it is
        pushed. A variable over half a chunk's share of the actor's dense bytes (with the chunk
        count ``ps_chunks`` will use) is cut along axis 0 into blocks of at most half a share (at
        most its first dimension of them). Training is unchanged for an element-wise update rule;
        the caller checks the optimizer (``keras_optimizer.check_keras_apply``) and keeps this plan
        otherwise.

        Args:
            shapes, itemsize: per model variable, its shape and bytes per element.
            max_chunks, min_bytes: as for ``ps_chunks``.

        Returns:
            a new plan, or this one where nothing is cut (pipelining off, asynchronous PS, node
            aggregation, no actor with a whole variable over its share).
        """
        if max_chunks <= 1 or not self.sync or self.node_aggregation():
            return self
        layout, actors = list(self.layout), []
        for p in self.ps_actors:
            size = {r.key: r.nbytes(shapes[r.var_index], itemsize[r.var_index]) for r in p.shards}
            dense = sum(size[r.key] for r in p.shards if not r.sparse)
            # the dense chunks ps_chunks will form (sparse shards take one of their own), and
            # blocks of at most half a chunk's share, so whole blocks pack into even chunks
            count = min(max_chunks - any(r.sparse for r in p.shards), dense // max(1, min_bytes))
            shards = []
            for r in p.shards:
                shape = shapes[r.var_index]
                whole = r.num_shards == 1 and not r.sparse and not r.local_replication
                cut = min(shape[0], math.ceil(2 * size[r.key] * count / dense)) if count >= 2 and shape and whole else 1
                if cut < 2:
                    shards.append(r)
                    continue
                layout[r.var_index] = (cut, 0)
                shards += [ShardRef(var_index=r.var_index, shard_index=i, num_shards=cut, start=a, stop=b, axis=0,
                                    sparse=False, local_replication=False)
                           for i, (a, b) in enumerate(shard_bounds(shape[0], cut))]
            actors.append(PSActorPlan(node=p.node, shards=tuple(shards)))
        if tuple(layout) == self.layout:
            return self
        return dataclasses.replace(self, ps_actors=tuple(actors), layout=tuple(layout))

    @classmethod
    def build(cls, strategy: Strategy, model: ModelSpec, cluster, optimizer: dict | None = None,
              described: list | None = None, graph: bool = True) -> "SyncPlan":
        """Plan a strategy that ``validate`` accepted.

        Args:
            optimizer: the model's ``keras_optimizer_config``, where known. Under
                ``global_clipnorm`` with gradient accumulation the ``graph`` backend cannot hold
                its part of a step beside other synchronizers (``check_global_clipnorm``): there
                backend ``auto`` on GPUs resolves to ``nccl`` (outside the graph) instead.
                A variable with a constraint (``CONSTRAINED``), which Keras applies after each
                update, is reduced in the graph where its backend is ``auto`` (the one backend
                that applies it; ``keras_optimizer.check_constraints`` refuses the others).
            described: the workers' description of the variables, whose ``rows`` (a sparse
                variable's distinct rows in a worker's first batch) stand in for rows per step
                the spec does not give (a spec built from the description has none).
            graph: the workers run TensorFlow; not so under emulated compute (``_resolved``).

        Raises:
            ConfigError: an all-reduce backend that cannot run here (e.g. gloo without torch).
        """
        gpus = any(n.gpus > 0 for n in cluster.nodes)
        backends: dict[str, str] = {}
        # with GPUs, backend auto is the graph (reduced inside the step) unless it cannot hold;
        # AUTOSYNC_IN_STEP=0 (read per plan) marks nothing, so emulated workers overlap nothing,
        # for comparison
        graph_on_gpus = ("auto", "graph") if os.environ.get("AUTOSYNC_IN_STEP", "").strip() != "0" else ()
        if _graph_cannot_hold(optimizer) and any(
                not isinstance(s, AllReduce) or s.backend not in ("auto", "graph")
                for c in strategy.variables for s in c.synchronizers):
            graph_on_gpus = tuple(b for b in graph_on_gpus if b == "graph")
            if gpus:
                backends["auto"] = "nccl"
        constrained = set((optimizer or {}).get(CONSTRAINED) or ())
        slots = strategy.resolved_replicas(cluster)
        # hierarchical all-reduce differs from flat only where a node holds several workers
        shared_nodes = len({s.rsplit(":", 1)[0] for s in slots}) < len(slots)
        by_node: dict[str, list[ShardRef]] = {}
        groups: dict[int, list[ARMember]] = {}
        modes = set()
        layout = []
        for var_index, var in enumerate(model.variables):
            cfg = strategy.config(var.name)
            axis = cfg.axis if cfg.partitioned else 0
            dim = var.shape[axis] if var.shape else 1
            layout.append((cfg.num_shards, axis))
            bounds = shard_bounds(dim, cfg.num_shards)
            for shard_index, (sync, (start, stop)) in enumerate(zip(cfg.synchronizers, bounds)):
                if isinstance(sync, AllReduce):
                    if sync.backend not in backends:
                        backends[sync.backend] = _resolved(sync.backend, gpus, graph)
                    backend = "hierarchical" if sync.hierarchical and shared_nodes else backends[sync.backend]
                    if sync.backend == "auto" and var.name in constrained and backend != "hierarchical":
                        backend = _resolved("graph", gpus, graph)
                    groups.setdefault(sync.group, []).append(ARMember(
                        key=(var_index, shard_index), start=start, stop=stop, axis=axis,
                        num_shards=cfg.num_shards, sparse=var.sparse,
                        compressor=Compressor() if var.sparse else sync.codec, backend=backend,
                        in_step=sync.backend in graph_on_gpus and backend != "hierarchical"))
                    continue
                modes.add((sync.sync, sync.staleness))
                by_node.setdefault(sync.destination, []).append(ShardRef(
                    var_index=var_index, shard_index=shard_index, num_shards=cfg.num_shards,
                    start=start, stop=stop, axis=axis, sparse=var.sparse,
                    local_replication=sync.local_replication))
        (sync_mode, staleness), = modes or {(True, 0)}  # validate() guarantees one PS mode per strategy
        seen = [d.get("rows") or 0 for d in described] if described else [0] * len(model.variables)
        order = [n for n in cluster.node_names if n in by_node]
        # groups are issued in the order their last gradient becomes ready
        ready = {name: i for i, name in enumerate(ready_order(model))}
        position = {g: max(ready[model.variables[m.key[0]].name] for m in ms) for g, ms in groups.items()}
        return cls(
            replicas=tuple(strategy.resolved_replicas(cluster)),
            ps_actors=tuple(PSActorPlan(node=n, shards=tuple(by_node[n])) for n in order),
            sync=sync_mode, staleness=staleness if sync_mode else 0, num_vars=len(model.variables),
            ar_groups=tuple(ARGroup(g, tuple(groups[g])) for g in sorted(groups, key=lambda g: (position[g], g))),
            layout=tuple(layout),
            rows_per_step=tuple((v.rows_per_step or seen[i]) if v.sparse else 0 for i, v in enumerate(model.variables)),
        )


def _resolved(backend: str, gpus: bool, graph: bool) -> str:
    """The collective backend that runs ``backend`` (``resolve_backend``), except where the workers
    hold no TensorFlow graph (emulated compute, ``graph`` False): their synthetic gradients live in
    host memory, on no GPU, so ``graph``, ``auto`` and ``nccl`` run on the CPU backend there (gloo),
    still reduced inside the step where the strategy says so (``ARMember.in_step``)."""
    if not graph and backend in ("auto", "graph", "nccl"):
        return resolve_backend("auto", False).name
    return resolve_backend(backend, gpus).name


def _graph_cannot_hold(optimizer: dict | None) -> bool:
    """Whether the optimizer clips by the global norm over accumulated batches, which the graph
    all-reduce cannot wait for beside other synchronizers (``check_global_clipnorm``)."""
    return bool(optimizer) and optimizer.get("global_clipnorm") is not None and (
        optimizer.get("gradient_accumulation_steps") or 1) > 1


def model_spec_from_vars(name: str, variables: list[dict], batch_size: int,
                         optimizer: dict | None = None, *, slots: bool = False) -> ModelSpec:
    """A ModelSpec from the variable facts a worker reports (name, shape, dtype, sparse) and, when
    given, its optimizer's config (``global_clipnorm``; with ``slots``, the full-size arrays it
    keeps per variable, which the memory check counts: this builds a copy of it, so the driver
    imports Keras)."""
    return ModelSpec(name=name, batch_size=batch_size, variables=tuple(
        VariableSpec(name=v["name"], shape=tuple(v["shape"]), dtype=v["dtype"], sparse=v["sparse"])
        for v in variables), global_clipnorm=holds_steps(optimizer),
        optimizer_slots=_optimizer_slots(optimizer) if slots and optimizer else 0)


def _optimizer_slots(config: dict) -> int:
    """``full_size_slots`` of the optimizer a worker's ``keras_optimizer_config`` describes, built
    as the runtime builds it (``keras_update.new_optimizer``); 0 where it cannot be built here."""
    from autosync.runtime.keras_optimizer import optimizer_class
    from autosync.runtime.keras_update import new_optimizer
    from autosync.runtime.optimizer_config import full_size_slots

    try:
        optimizer = new_optimizer(optimizer_class(config), config)
    except Exception:  # noqa: BLE001 - a count that cannot be made is 0, not a failure (full_size_slots)
        return 0
    return full_size_slots(optimizer)


def segment_for(plan: SyncPlan, description: dict, numpy_members: list, shapes: list, itemsize: list,
                max_chunks: int, min_bytes: int) -> SyncPlan:
    """``plan`` with large whole PS variables cut into row blocks for pipelining
    (``SyncPlan.segmented``), where the model's optimizer updates a row block as it updates the
    whole variable: the numpy rules, or a Keras optimizer ``check_keras_apply`` accepts on the cut
    shards (with the numpy all-reduce channel's members); ``plan`` itself otherwise.
    ``AUTOSYNC_PS_SEGMENT=0`` (read per session) keeps whole variables, for comparison.

    Args:
        description: the workers' description of the model (its ``optimizer`` config and
            ``variables``).
    """
    from autosync.runtime.keras_optimizer import check_keras_apply
    from autosync.runtime.optimizers import numpy_rules
    from strategy_space.errors import ConfigError

    if os.environ.get("AUTOSYNC_PS_SEGMENT", "").strip() == "0":
        return plan
    cut = plan.segmented(shapes, itemsize, max_chunks, min_bytes)
    optimizer = description["optimizer"]
    if cut is plan or numpy_rules(optimizer):
        return cut
    try:
        check_keras_apply(optimizer, [r for p in cut.ps_actors for r in p.shards] + list(numpy_members),
                          [v["name"] for v in description["variables"]])
    except ConfigError:
        return plan
    return cut
