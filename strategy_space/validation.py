"""Check a Strategy against a ModelSpec and a ClusterSpec; report every problem at once."""
from __future__ import annotations

from collections import Counter

from .cluster_spec import ClusterSpec
from .errors import Problems, StrategyError, listed_names, short_repr
from .memory import memory_problems
from .model_spec import ModelSpec
from .strategy import PS, AllReduce, Strategy


def _where(places: list[str]) -> str:
    """The first of ``places`` a problem was found at, and how many more."""
    if len(places) == 1:
        return places[0]
    more = ", ".join(places[1:3]) + (", ..." if len(places) > 3 else "")
    return f"{places[0]} and {len(places) - 1} more ({more})"


def validate(strategy: Strategy, model: ModelSpec, cluster: ClusterSpec) -> Strategy:
    """Return ``strategy`` if it can run ``model`` on ``cluster``.

    Raises:
        StrategyError: listing every problem; each names the variable, the bad value and what
            is allowed.
    """
    p = Problems(StrategyError)
    nodes = set(cluster.node_names)
    bad_destinations: dict[str, list[str]] = {}   # one problem per unknown node, however many shards name it

    seen: dict[str, int] = {}
    for cfg in strategy.variables:
        seen[cfg.name] = seen.get(cfg.name, 0) + 1
    for name, count in seen.items():
        if count > 1:
            p.add(f"variable {name}: configured {count} times; each variable must appear exactly once")
    unknown = [n for n in seen if n not in model._index]  # noqa: SLF001 - same package
    for name in unknown:
        p.add(f"variable {name}: not a trainable variable of model {model.name}; remove it "
              f"(the model has {len(model.variables)} variables, e.g. {', '.join(model.names[:3])})")
    missing = [v.name for v in model.variables if v.name not in seen]
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        p.add(f"{len(missing)} variable(s) of model {model.name} have no synchronizer: {shown}; "
              f"add a config for each")

    ps_modes: dict[tuple[bool, int], str] = {}
    for cfg in strategy.variables:
        if cfg.name not in model._index:  # noqa: SLF001
            continue
        var = model.var(cfg.name)
        where = f"variable {cfg.name}"
        if cfg.partitioned:
            if cfg.axis >= len(var.shape):
                p.add(f"{where}: partition axis {cfg.axis} is out of range for shape {list(var.shape)} "
                      f"(allowed 0..{len(var.shape) - 1})" if var.shape else
                      f"{where}: a scalar cannot be partitioned; use one synchronizer")
            else:
                dim = var.shape[cfg.axis]
                if cfg.num_shards > dim:
                    p.add(f"{where}: {cfg.num_shards} shards along axis {cfg.axis} but that axis has only "
                          f"{dim} slices; allowed 1..{dim}")
            if var.sparse and cfg.axis != 0:
                p.add(f"{where}: sparse (embedding) variables can only be partitioned along axis 0 "
                      f"(rows), got axis {cfg.axis}")
        for i, sync in enumerate(cfg.synchronizers):
            at = f"{where}" + (f" shard {i}" if cfg.partitioned else "")
            if isinstance(sync, PS):
                if sync.destination not in nodes:
                    bad_destinations.setdefault(sync.destination, []).append(at)
                if not sync.sync and sync.staleness:
                    p.add(f"{at}: staleness {sync.staleness} needs sync: true (asynchronous PS has no "
                          f"staleness bound); set sync: true or staleness: 0")
                ps_modes.setdefault((sync.sync, sync.staleness), at)
            elif isinstance(sync, AllReduce):
                if sync.compressor != "none" and (var.sparse or not var.is_float):
                    why = "sparse" if var.sparse else f"of dtype {var.dtype}"
                    p.add(f"{at}: compressor {sync.compressor} applies only to dense float gradients, "
                          f"this variable is {why}; use compressor: none")
                if sync.backend == "nccl":
                    no_gpu = [n.name for n in cluster.nodes if n.gpus == 0]
                    if no_gpu:
                        p.add(f"{at}: backend nccl needs GPUs but node(s) {', '.join(no_gpu)} have none; "
                              f"use backend gloo, objectstore or auto")
    for destination, places in bad_destinations.items():
        p.add(f"{_where(places)}: ps.destination {short_repr(destination)} is not a node of cluster {cluster.name}; "
              f"allowed: {listed_names(cluster.node_names)}")
    if len(ps_modes) > 1:
        modes = "; ".join(f"sync={s}, staleness={st} (e.g. {at})" for (s, st), at in ps_modes.items())
        p.add(f"parameter servers must share one sync mode and staleness per strategy, got: {modes}")

    devices = set(cluster.devices)
    reps = strategy.replicas
    for r in reps:
        if r not in devices:
            p.add(f"replica {short_repr(r)} is not a worker slot of cluster {cluster.name}; "
                  f"allowed: {listed_names(cluster.devices)}")
    dups = sorted(r for r, n in Counter(reps).items() if n > 1)
    if dups:
        p.add(f"replicas listed more than once: {', '.join(dups)}")
    for problem in memory_problems(strategy, model, cluster):   # where the cluster gives memory
        p.add(problem)
    p.raise_if_any()
    return strategy
