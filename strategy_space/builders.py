"""The classic hand-made strategies, as builders in the same space the tuner searches.

A builder is one method, ``build(model, cluster) -> Strategy``. Builders live in a closed
registry: ``get_builder(name, **options)`` rejects unknown names (listing the valid ones) and
unknown options (listing the accepted ones).

Load is measured in bytes moved per step: a dense variable moves its full size, a sparse one only
the rows it touches (``rows_per_step`` x row bytes). Loads are divided by the node's bandwidth, so
a faster node takes more.
"""
from __future__ import annotations

import abc
import inspect
import math
from typing import Callable, Iterable

import numpy as np

from .cluster_spec import ClusterSpec
from .errors import ConfigError, short_repr
from .model_spec import ModelSpec, VariableSpec
from .compressor import Compressor
from .strategy import PS, AllReduce, Strategy, VarConfig

DEFAULT_CHUNK_BYTES = 16 * 2**20     # fusion buffer size for all-reduce groups
DEFAULT_MIN_PARTITION_BYTES = 2**20  # variables smaller than this are not partitioned


def index_bytes(rows: int) -> int:
    """Bytes of one row id of a table (or shard) of ``rows`` rows as the runtime sends it: the
    narrowest unsigned integer that numbers them (1, 2 or 4 bytes), 8 past 2**32 rows."""
    for width in (1, 2, 4):
        if rows <= 1 << (8 * width):
            return width
    return 8


def step_bytes(var: VariableSpec) -> int:
    """Bytes of one worker's gradient for ``var`` in one step (sparse: touched rows only)."""
    if var.sparse and var.rows_per_step:
        return min(var.rows_per_step, var.shape[0]) * var.row_bytes
    return var.bytes


class PlacementLedger:
    """Greedy placement: each item goes where the node's transfer time (bytes / bandwidth) after
    taking it is smallest."""

    def __init__(self, cluster: ClusterSpec):
        self.cluster = cluster
        self.bytes = [0.0] * len(cluster.nodes)
        self.bw = [n.bandwidth_gbps for n in cluster.nodes]

    def place_round_robin(self, nbytes: float, shards: int) -> int:
        """Place ``shards`` equal shards on consecutive nodes, starting where the most loaded of
        those nodes ends up least loaded (the lowest such index); return the first node's index.

        Every start is scored at once (``_window_max``): time and memory grow with the number of
        nodes, not with nodes x shards, so a plan for thousands of workers stays quick."""
        n = len(self.bytes)
        part = nbytes / shards
        full, rem = divmod(shards, n)   # every node takes `full` shards, `rem` consecutive ones one more
        taken = 0.0
        for _ in range(full):           # a node's shards added one by one, as they are placed below
            taken += part
        loads = np.asarray(self.bytes)
        bw = np.asarray(self.bw)
        worst = np.full(n, -np.inf)
        if rem:      # the nodes first .. first + rem - 1 take one shard more
            worst = _window_max((loads + (taken + part)) / bw, rem)
        if full:     # the others `full` shards each (none when there are fewer shards than nodes)
            worst = np.maximum(worst, np.roll(_window_max((loads + taken) / bw, n - rem), -rem))
        first = int(np.argmin(worst))
        for i in range(shards):
            self.bytes[(first + i) % n] += part
        return first


def _window_max(a: np.ndarray, w: int) -> np.ndarray:
    """For each start s, the largest of ``a``'s ``w`` entries from s on, wrapping around (the
    blocks of prefix and suffix maxima of van Herk and Gil-Werman: linear in ``len(a)``)."""
    n = len(a)
    if w >= n:
        return np.full(n, a.max())
    line = np.concatenate([a, a[:w - 1], np.full(-(n + w - 1) % w, -np.inf)]).reshape(-1, w)
    prefix = np.maximum.accumulate(line, axis=1).ravel()
    suffix = np.maximum.accumulate(line[:, ::-1], axis=1)[:, ::-1].ravel()
    starts = np.arange(n)
    return np.maximum(suffix[starts], prefix[starts + w - 1])


# share of a step's compute the forward pass takes: no gradient is ready before it
FORWARD_SHARE = 1.0 / 3.0


def ready_order(model: ModelSpec) -> list[str]:
    """Variables in the order their gradients become ready (measured, else reverse creation)."""
    if model.profile is not None and model.profile.ready_order:
        return list(model.profile.ready_order)
    return [v.name for v in reversed(model.variables)]


def ready_times(model: ModelSpec) -> dict[str, float]:
    """When each variable's gradient is ready, as a share of one step's compute: after the
    forward pass (``FORWARD_SHARE``), the backward pass in ``ready_order`` with work per variable
    proportional to its parameters (a sparse one's: the rows a step touches). The cost model's
    overlap bound (``tuner.features``) and the emulated worker (``autosync.runtime.emulated``)
    both read these times."""
    order = ready_order(model)
    work = []
    for name in order:
        v = model.var(name)
        rows = min(v.rows_per_step or v.shape[0], v.shape[0]) if v.sparse else 0
        work.append(rows * v.size / v.shape[0] if v.sparse else float(v.size))
    total, done, out = max(sum(work), 1.0), 0.0, {}
    for name, w in zip(order, work):
        done += w
        out[name] = FORWARD_SHARE + (1.0 - FORWARD_SHARE) * done / total
    return out


def fusion_groups(model: ModelSpec, names: Iterable[str], chunk_bytes: int, first_group: int = 0) -> dict[str, int]:
    """Assign fusion groups by bytes: walk ``names`` in gradient-ready order and start a new group
    whenever the current one would exceed ``chunk_bytes``."""
    wanted = set(names)
    groups: dict[str, int] = {}
    group, filled = first_group, 0
    for name in ready_order(model):
        if name not in wanted:
            continue
        b = model.var(name).bytes
        if filled and filled + b > chunk_bytes:
            group, filled = group + 1, 0
        groups[name] = group
        filled += b
    return groups


def _ps_shards(first: int, shards: int, cluster: ClusterSpec, proto: PS) -> tuple[PS, ...]:
    names = cluster.node_names
    return tuple(PS(names[(first + i) % len(names)], proto.local_replication, proto.sync, proto.staleness)
                 for i in range(shards))


class StrategyBuilder(abc.ABC):
    """Builds one strategy for a (model, cluster). Options go to ``__init__`` as keywords."""

    name: str = ""
    description: str = ""

    @abc.abstractmethod
    def build(self, model: ModelSpec, cluster: ClusterSpec) -> Strategy:
        """Return a strategy that validates against ``model`` and ``cluster``."""


class _PSOptions:
    def __init__(self, local_replication: bool = False, sync: bool = True, staleness: int = 0):
        self.proto = PS("_", local_replication, sync, staleness)


class _AROptions:
    def __init__(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES, backend: str = "auto", compressor: str = "none"):
        if not isinstance(chunk_bytes, int) or chunk_bytes < 1:
            raise ConfigError(f"chunk_bytes must be an integer >= 1, got {short_repr(chunk_bytes)}")
        Compressor.parse(compressor)
        AllReduce(backend=backend)
        self.chunk_bytes, self.backend, self.compressor = chunk_bytes, backend, compressor

    def ar(self, var: VariableSpec, group: int) -> AllReduce:
        # compression only where it is legal: dense float gradients
        comp = self.compressor if (var.is_float and not var.sparse) else "none"
        return AllReduce(backend=self.backend, compressor=comp, group=group)


class PSBuilder(StrategyBuilder, _PSOptions):
    name = "ps"
    description = "every variable on one parameter server (the chief)"

    def build(self, model, cluster):
        first = cluster.node_index(cluster.chief.name)
        return Strategy(tuple(VarConfig(v.name, _ps_shards(first, 1, cluster, self.proto)) for v in model.variables),
                        origin=self.name)


class PSLoadBalancingBuilder(StrategyBuilder, _PSOptions):
    name = "ps_lb"
    description = "whole variables spread over all nodes, greedy by bytes per bandwidth"

    def build(self, model, cluster):
        ledger = PlacementLedger(cluster)
        first: dict[str, int] = {}
        for v in sorted(model.variables, key=lambda v: -step_bytes(v)):
            first[v.name] = ledger.place_round_robin(step_bytes(v), 1)
        return Strategy(tuple(VarConfig(v.name, _ps_shards(first[v.name], 1, cluster, self.proto))
                              for v in model.variables), origin=self.name)


class PartitionedPSBuilder(StrategyBuilder, _PSOptions):
    name = "partitioned_ps"
    description = "large variables split into one shard per node, shards and small variables balanced"

    def __init__(self, min_partition_bytes: int = DEFAULT_MIN_PARTITION_BYTES, **ps_options):
        super().__init__(**ps_options)
        self.min_partition_bytes = min_partition_bytes

    def shards_for(self, var: VariableSpec, cluster: ClusterSpec, total: int) -> int:
        if var.bytes < self.min_partition_bytes or not var.shape:
            return 1
        return max(1, min(len(cluster.nodes), var.shape[0]))

    def build(self, model, cluster):
        ledger = PlacementLedger(cluster)
        total = sum(step_bytes(v) for v in model.variables)
        plan: dict[str, tuple[int, int]] = {}
        for v in sorted(model.variables, key=lambda v: -step_bytes(v)):
            k = self.shards_for(v, cluster, total)
            plan[v.name] = (ledger.place_round_robin(step_bytes(v), k), k)
        return Strategy(tuple(VarConfig(v.name, _ps_shards(plan[v.name][0], plan[v.name][1], cluster, self.proto))
                              for v in model.variables), origin=self.name)


class UnevenPartitionedPSBuilder(PartitionedPSBuilder):
    name = "uneven_partitioned_ps"
    description = "shard count proportional to a variable's share of the traffic, not tied to the node count"

    def shards_for(self, var, cluster, total):
        if var.bytes < self.min_partition_bytes or not var.shape:
            return 1
        n = len(cluster.nodes)
        # aim for shards of about a quarter of one node's fair share of the traffic
        target = max(1.0, total / (4 * n))
        return max(1, min(var.shape[0], 4 * n, math.ceil(step_bytes(var) / target)))


class AllReduceBuilder(StrategyBuilder, _AROptions):
    name = "all_reduce"
    description = "every variable all-reduced, fused into groups of about chunk_bytes in gradient-ready order"

    def build(self, model, cluster):
        groups = fusion_groups(model, model.names, self.chunk_bytes)
        return Strategy(tuple(VarConfig(v.name, (self.ar(v, groups[v.name]),)) for v in model.variables),
                        origin=self.name)


class PartitionedAllReduceBuilder(StrategyBuilder, _AROptions):
    name = "partitioned_all_reduce"
    description = "large variables split into one shard per node, each shard its own fusion group"

    def __init__(self, min_partition_bytes: int = DEFAULT_MIN_PARTITION_BYTES, **ar_options):
        super().__init__(**ar_options)
        self.min_partition_bytes = min_partition_bytes

    def build(self, model, cluster):
        n = len(cluster.nodes)
        big = {v.name for v in model.variables if v.bytes >= self.min_partition_bytes and v.shape and n > 1}
        groups = fusion_groups(model, [v.name for v in model.variables if v.name not in big], self.chunk_bytes)
        next_group = max(groups.values(), default=-1) + 1
        configs = []
        for v in model.variables:
            if v.name in big:
                k = min(n, v.shape[0])
                configs.append(VarConfig(v.name, tuple(self.ar(v, next_group + i) for i in range(k))))
                next_group += k
            else:
                configs.append(VarConfig(v.name, (self.ar(v, groups[v.name]),)))
        return Strategy(tuple(configs), origin=self.name)


class ParallaxBuilder(StrategyBuilder):
    name = "parallax"
    description = "sparse variables on partitioned, balanced parameter servers; dense variables in fused all-reduce"

    def __init__(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES, local_replication: bool = False,
                 backend: str = "auto", compressor: str = "none"):
        self.ps = _PSOptions(local_replication=local_replication).proto
        self.ar = _AROptions(chunk_bytes, backend, compressor)

    def build(self, model, cluster):
        ledger = PlacementLedger(cluster)
        dense = [v.name for v in model.variables if not v.sparse]
        groups = fusion_groups(model, dense, self.ar.chunk_bytes)
        plan: dict[str, tuple[int, int]] = {}
        for v in sorted((v for v in model.variables if v.sparse), key=lambda v: -step_bytes(v)):
            k = max(1, min(len(cluster.nodes), v.shape[0]))
            plan[v.name] = (ledger.place_round_robin(step_bytes(v), k), k)
        configs = []
        for v in model.variables:
            if v.sparse:
                configs.append(VarConfig(v.name, _ps_shards(plan[v.name][0], plan[v.name][1], cluster, self.ps)))
            else:
                configs.append(VarConfig(v.name, (self.ar.ar(v, groups[v.name]),)))
        return Strategy(tuple(configs), origin=self.name)


BUILDERS: dict[str, Callable[..., StrategyBuilder]] = {}


def register_builder(cls: type[StrategyBuilder]) -> type[StrategyBuilder]:
    if not cls.name:
        raise ValueError(f"{cls.__name__} needs a name to be registered")
    if cls.name in BUILDERS:
        raise ValueError(f"a builder named {short_repr(cls.name)} is already registered "
                         f"({BUILDERS[cls.name].__name__})")
    BUILDERS[cls.name] = cls
    return cls


for _cls in (PSBuilder, PSLoadBalancingBuilder, PartitionedPSBuilder, UnevenPartitionedPSBuilder,
             AllReduceBuilder, PartitionedAllReduceBuilder, ParallaxBuilder):
    register_builder(_cls)


def _option_defaults(name: str) -> dict:
    """Keyword options a builder accepts, with their defaults."""
    out: dict = {}
    for klass in BUILDERS[name].__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        for p in inspect.signature(init).parameters.values():
            if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "self":
                out.setdefault(p.name, p.default)
    return out


def builder_options(name: str) -> list[str]:
    """Keyword options a builder accepts."""
    return sorted(_option_defaults(name))


def _option_problem(key: str, value, default) -> str | None:
    """Why ``value`` cannot be option ``key`` (whose default gives its type), or None."""
    if isinstance(default, bool):
        ok, want = isinstance(value, bool), "true or false"
    elif isinstance(default, int):
        ok, want = isinstance(value, int) and not isinstance(value, bool) and value >= 0, "an integer >= 0"
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        want = "a finite number"
    elif isinstance(default, str):
        ok, want = isinstance(value, str), "a string"
    else:
        return None
    return None if ok else f"option {key} must be {want}, got {short_repr(value)}"


def get_builder(name: str, **options) -> StrategyBuilder:
    """The builder registered as ``name``, configured with ``options``.

    Raises:
        ConfigError: unknown name (lists the valid ones) or unknown option (lists the accepted ones).
    """
    if name not in BUILDERS:
        raise ConfigError(f"unknown builder {short_repr(name)}; valid builders: {', '.join(BUILDERS)}")
    defaults = _option_defaults(name)
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise ConfigError(f"builder {name}: unknown option(s) {', '.join(unknown)}; accepted: "
                          f"{', '.join(sorted(defaults)) or 'none'}")
    problems = [f"builder {name}: {why}" for key, value in options.items()
                if (why := _option_problem(key, value, defaults[key]))]
    if problems:
        raise ConfigError(problems)
    return BUILDERS[name](**options)


def build_all(model: ModelSpec, cluster: ClusterSpec, names: Iterable[str] | None = None) -> dict[str, Strategy]:
    """Every registered builder's strategy (or just ``names``), keyed by builder name."""
    return {n: get_builder(n).build(model, cluster) for n in (names or BUILDERS)}


def resolve_strategy(strategy, model: ModelSpec | Callable[[], ModelSpec], cluster: ClusterSpec) -> Strategy:
    """A Strategy given as itself, as a strategy YAML path, or as a builder's name (``ps``,
    ``all_reduce``, ...: the strategy that builder makes for ``model`` and ``cluster``, as
    ``autosync build`` writes it; a file of that name wins). ``model`` may be a function that
    makes the ModelSpec, called only for a builder's name.

    Raises:
        ConfigError: see ``strategy_or_builder``.
    """
    found = strategy_or_builder(strategy)
    if isinstance(found, Strategy):
        return found
    return get_builder(found).build(model() if callable(model) else model, cluster)


def strategy_or_builder(strategy) -> Strategy | str:
    """What ``resolve_strategy`` reads without a model: the Strategy given or read from its YAML
    file, or the builder's name given. A command checks this before it builds a model, so that
    a bad file or name is said at once.

    Raises:
        ConfigError: neither an existing file nor a builder's name (the builders are listed), a
            file that is not a valid strategy, or something that is not a name at all.
    """
    import os

    from .yaml_io import load_strategy

    if isinstance(strategy, Strategy):
        return strategy
    text = os.fspath(strategy) if isinstance(strategy, (str, os.PathLike)) else None
    if not isinstance(text, str):
        raise ConfigError(f"the strategy must be a strategy YAML path (a str or a path), a builder's name or a "
                          f"Strategy, got {type(strategy).__name__} {strategy!r:.80}")
    if os.path.exists(os.path.expanduser(text)):
        return load_strategy(os.path.expanduser(text))
    if text in BUILDERS:
        return text
    raise ConfigError(f"strategy {text!r} is neither a strategy YAML file nor a builder's name; give the path "
                      f"of a strategy file (autosync tune writes best_strategy.yaml, autosync build writes one) or "
                      f"a builder: {', '.join(BUILDERS)}")
