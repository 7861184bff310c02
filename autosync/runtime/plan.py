"""SyncPlan: a validated Strategy turned into what the runtime executes.

The plan says which parameter-server actor holds which variable shards, which replica slots
train, and the PS mode. It is plain data (no Ray, no TensorFlow) so it can be shipped to workers
and tested alone.
"""
from __future__ import annotations

from dataclasses import dataclass

from strategy_space import PS, AllReduce, ModelSpec, Strategy, VariableSpec, shard_bounds
from strategy_space.errors import ConfigError

AR_NOT_SUPPORTED = "all-reduce is not supported yet by this runtime"


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

    def slicer(self, ndim: int) -> tuple:
        """Index that selects this shard from the full variable (a view, no copy)."""
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
    """

    replicas: tuple[str, ...]
    ps_actors: tuple[PSActorPlan, ...]
    sync: bool
    staleness: int
    num_vars: int

    @property
    def num_workers(self) -> int:
        return len(self.replicas)

    def replica_node(self, slot: str) -> str:
        return slot.rsplit(":", 1)[0]

    @classmethod
    def build(cls, strategy: Strategy, model: ModelSpec, cluster) -> "SyncPlan":
        """Plan a strategy that ``validate`` accepted.

        Raises:
            ConfigError: the strategy uses all-reduce (not supported yet by this runtime).
        """
        ar = [c.name for c in strategy.variables if any(isinstance(s, AllReduce) for s in c.synchronizers)]
        if ar:
            shown = ", ".join(ar[:5]) + (f" and {len(ar) - 5} more" if len(ar) > 5 else "")
            raise ConfigError(f"{AR_NOT_SUPPORTED}: {len(ar)} variable(s) use all_reduce ({shown}); "
                              f"use a parameter-server strategy (e.g. builders ps, ps_lb, partitioned_ps)")
        by_node: dict[str, list[ShardRef]] = {}
        modes = set()
        for var_index, var in enumerate(model.variables):
            cfg = strategy.config(var.name)
            axis = cfg.axis if cfg.partitioned else 0
            dim = var.shape[axis] if var.shape else 1
            bounds = shard_bounds(dim, cfg.num_shards)
            for shard_index, (sync, (start, stop)) in enumerate(zip(cfg.synchronizers, bounds)):
                assert isinstance(sync, PS)  # all-reduce was rejected above
                modes.add((sync.sync, sync.staleness))
                by_node.setdefault(sync.destination, []).append(ShardRef(
                    var_index=var_index, shard_index=shard_index, num_shards=cfg.num_shards,
                    start=start, stop=stop, axis=axis, sparse=var.sparse,
                    local_replication=sync.local_replication))
        (sync_mode, staleness), = modes  # validate() guarantees one mode per strategy
        order = [n for n in cluster.node_names if n in by_node]
        return cls(
            replicas=tuple(strategy.resolved_replicas(cluster)),
            ps_actors=tuple(PSActorPlan(node=n, shards=tuple(by_node[n])) for n in order),
            sync=sync_mode, staleness=staleness if sync_mode else 0, num_vars=len(model.variables),
        )


def model_spec_from_vars(name: str, variables: list[dict], batch_size: int) -> ModelSpec:
    """A ModelSpec from the variable facts a worker reports (name, shape, dtype, sparse)."""
    return ModelSpec(name=name, batch_size=batch_size, variables=tuple(
        VariableSpec(name=v["name"], shape=tuple(v["shape"]), dtype=v["dtype"], sparse=v["sparse"])
        for v in variables))
