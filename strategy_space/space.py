"""StrategySpace: the legal choices for every variable of a model on a cluster; samples, mutations,
and the integer array encoding the tuner featurizes in batches (``strategy_space.encoding``).

Strategies outside the encoded subspace (mixed PS/AR shards, arbitrary shard placement) are valid
and run, but ``encode`` rejects them with a message saying why.
"""
from __future__ import annotations

import numpy as np

from .compressor import COMPRESSOR_KINDS, Compressor
from .encoding import (BACKEND_ID, COMPRESSOR_ID, FIELD_INDEX, FIELDS, KIND_AR, KIND_PS, STRATEGY_WIDE,
                       VARIABLE_FIELDS, EncodedStrategies, Mutation)
from .cluster_spec import ClusterSpec
from .errors import ConfigError
from .model_spec import ModelSpec
from .mutation import Mutator
from .strategy import BACKENDS, PS, AllReduce, Strategy, VarConfig


class StrategySpace:
    """Legal per-variable choices for ``model`` on ``cluster``.

    Args:
        model, cluster: what the strategies are for.
        max_shards: most shards per variable (default: 2 x number of nodes, at most 16).
        num_groups: fusion groups to choose from (default: min(#variables, 8)).
        ranks: PowerSGD ranks offered.
        backends: all-reduce backends offered (one per strategy).
        staleness: staleness values offered for parameter servers (one per strategy).
        allow_async: also offer fully asynchronous parameter servers.
        compressors: compressor kinds offered.
    """

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, *, max_shards: int | None = None,
                 num_groups: int | None = None, ranks: tuple[int, ...] = (4,), backends: tuple[str, ...] = ("auto",),
                 staleness: tuple[int, ...] = (0,), allow_async: bool = False,
                 compressors: tuple[str, ...] = COMPRESSOR_KINDS):
        unknown = [c for c in compressors if c not in COMPRESSOR_KINDS] + [b for b in backends if b not in BACKENDS]
        if unknown:
            raise ConfigError(f"unknown compressor/backend {unknown}; compressors: {', '.join(COMPRESSOR_KINDS)}; "
                              f"backends: {', '.join(BACKENDS)}")
        if not backends or not staleness or any(s < 0 for s in staleness) or any(r < 1 for r in ranks):
            raise ConfigError("backends and staleness need at least one value; staleness >= 0 and ranks >= 1")
        self.model, self.cluster = model, cluster
        self.num_nodes = len(cluster.nodes)
        self.max_shards = int(max_shards or min(16, 2 * self.num_nodes))
        self.num_groups = int(num_groups or max(1, min(len(model.variables), 8)))
        self.ranks = tuple(ranks)
        self.backends = tuple(BACKEND_ID[b] for b in backends)
        self.staleness = tuple(staleness)
        self.allow_async = allow_async
        self.multi_worker_nodes = any((n.workers or 0) > 1 for n in cluster.nodes)
        # node-level aggregation (local replication, hierarchical all-reduce) exists to cut the bytes
        # a node's workers send over its NIC to other nodes; on one node there are none to cut, and
        # the extra hop is pure cost (measured on `local`: +8 ms a step for one locally replicated
        # variable, on a 13 ms step), so the search offers it only across nodes. (A strategy that has
        # it still encodes as it runs.)
        self.offers_node_aggregation = self.multi_worker_nodes and self.num_nodes > 1
        V = len(model.variables)
        # per-variable facts as arrays
        self.dim0 = np.array([v.shape[0] if v.shape else 1 for v in model.variables], dtype=np.int32)
        self.shard_max = np.minimum(self.dim0, self.max_shards).astype(np.int32)
        self.compressible = np.array([v.is_float and not v.sparse for v in model.variables])
        self.matrix = np.array([len(v.shape) >= 2 for v in model.variables])
        # compressor choices (id, rank) offered to dense float variables
        choices = [(COMPRESSOR_ID["none"], 0)]
        for c in compressors:
            if c in ("fp16", "fp16_ef"):
                choices.append((COMPRESSOR_ID[c], 0))
            elif c in ("powersgd", "powersgd_ef"):
                choices += [(COMPRESSOR_ID[c], r) for r in self.ranks]
        self.compressor_choices = np.array(sorted(set(choices)), dtype=np.int32)
        self._V = V
        self._mutator: Mutator | None = None   # built on the first mutation

    # ---- sampling --------------------------------------------------------------------------
    def sample_encoded(self, rng: np.random.Generator, n: int) -> EncodedStrategies:
        """``n`` random strategies, uniform over each decision (half of the variables whole)."""
        V = self._V
        e = EncodedStrategies.zeros(n, V)
        e.kind[:] = rng.integers(0, 2, size=(n, V))
        part = rng.random((n, V)) < 0.5
        e.shards[:] = np.where(part, rng.integers(1, self.shard_max + 1, size=(n, V)), 1)
        e.dest[:] = rng.integers(0, self.num_nodes, size=(n, V))
        e.group[:] = rng.integers(0, self.num_groups, size=(n, V))
        e.group_stride[:] = rng.integers(0, 2, size=(n, V)) * (e.shards > 1)
        if self.offers_node_aggregation:
            e.local_replication[:] = rng.integers(0, 2, size=(n, V))
        self._sample_ps_mode(rng, e, np.arange(n))
        self._sample_group_options(rng, e, np.arange(n))
        return self.normalize(e)

    def mode_choices(self) -> np.ndarray:
        """(k, 2) array of the PS modes (sync, staleness) offered; a strategy uses one of them, since
        mixing them is not allowed (see validate)."""
        return np.array([(1, s) for s in self.staleness] + ([(0, 0)] if self.allow_async else []), dtype=np.int32)

    def draw_modes(self, rng, n: int) -> np.ndarray:
        """(n, 2) array of (sync, staleness), one of ``mode_choices`` per strategy."""
        modes = self.mode_choices()
        return modes[rng.integers(0, len(modes), size=n)]

    def _sample_ps_mode(self, rng, e: EncodedStrategies, rows: np.ndarray) -> None:
        pick = self.draw_modes(rng, len(rows))
        e.sync[rows] = pick[:, :1]
        e.staleness[rows] = pick[:, 1:]

    def _sample_group_options(self, rng, e: EncodedStrategies, rows: np.ndarray) -> None:
        # one compressor per fusion group (dense members share it), one backend per strategy
        G = self.num_groups + self.max_shards  # strided shards can reach past num_groups
        comp = self.compressor_choices[rng.integers(0, len(self.compressor_choices), size=(len(rows), G))]
        g = np.minimum(e.group[rows], G - 1)
        r = np.arange(len(rows))[:, None]
        e.compressor[rows] = comp[r, g, 0]
        e.rank[rows] = comp[r, g, 1]
        e.backend[rows] = np.array(self.backends, dtype=np.int32)[rng.integers(0, len(self.backends), size=(len(rows), 1))]
        # hierarchical all-reduce differs from a flat one only where a node holds several workers,
        # and can pay only where there are other nodes to reduce with
        e.hierarchical[rows] = rng.integers(0, 2, size=(len(rows), 1)) * self.offers_node_aggregation

    def normalize(self, e: EncodedStrategies) -> EncodedStrategies:
        """Zero the fields that do not apply, so equal strategies encode equally (in place)."""
        ps = e.kind == KIND_PS
        ar = ~ps
        e.shards[:] = np.clip(e.shards, 1, self.shard_max)
        e.axis[:] = 0
        e.dest *= ps
        e.local_replication *= ps
        e.sync[:] = np.where(ps, e.sync, 0)
        e.staleness *= ps
        e.group *= ar
        e.group_stride *= ar & (e.shards > 1)
        ok = ar & self.compressible
        e.compressor *= ok
        e.rank *= ok & (e.compressor >= COMPRESSOR_ID["powersgd"])
        e.backend *= ar
        e.hierarchical *= ar & self.multi_worker_nodes
        return e

    def sample(self, rng: np.random.Generator) -> Strategy:
        return self.decode(self.sample_encoded(rng, 1), 0)

    # ---- mutation --------------------------------------------------------------------------
    def mutate_encoded(self, e: EncodedStrategies, rng: np.random.Generator, tries: int = 8) -> EncodedStrategies:
        """A copy where each strategy has one decision changed (``mutate_rows``, each row its own
        parent)."""
        return self.mutate_rows(e, np.arange(len(e)), rng, tries=tries).encoded

    def mutate_rows(self, e: EncodedStrategies, parents, rng: np.random.Generator, *, tries: int = 8) -> Mutation:
        """Proposals, as changes: proposal i is row ``parents[i]`` of ``e`` with one decision changed —
        one variable's synchronizer (redrawn whole), shards, placement, fusion groups or local
        replication, a fusion group's compressor, the strategy-wide PS mode, or whether the
        strategy's all-reduce is hierarchical (where a node holds several workers) — the new value
        drawn as ``sample_encoded`` draws it. A proposal whose draw changes nothing draws again,
        variable and decision included (up to ``tries`` times; a space with a single point cannot
        change).

        Costs O(len(e) x V) once, then O(1) per proposal plus the cells it changes; the
        proposals' rows are built only when asked for (``Mutation.take``, ``.encoded``). Normalized
        rows of ``e`` (as ``sample_encoded`` and ``normalize`` give) give normalized proposals.

        Args:
            e: the strategies to vary.
            parents: row of ``e`` each proposal varies (repeat a row for several proposals).

        Raises:
            ValueError: ``parents`` are not rows of ``e``.
        """
        parents = np.asarray(parents, dtype=np.int64).reshape(-1)
        if len(parents) and (parents.min() < 0 or parents.max() >= len(e)):
            raise ValueError(f"parents must be rows 0..{len(e) - 1} of the strategies, got values from "
                             f"{parents.min()} to {parents.max()}")
        if self._mutator is None:
            self._mutator = Mutator(self)
        return self._mutator.mutate(e, parents, rng, tries)

    def normalize_cells(self, vals: np.ndarray, vs: np.ndarray) -> None:
        """``normalize`` for single cells: ``vals`` (len(FIELDS), m) holds every field of one cell
        of variable ``vs[j]`` per column (changed in place)."""
        F = FIELD_INDEX
        ps = vals[F["kind"]] == KIND_PS
        ar = ~ps
        shards = np.clip(vals[F["shards"]], 1, self.shard_max[vs])
        vals[F["shards"]] = shards
        vals[F["axis"]] = 0
        for f in ("dest", "local_replication", "sync", "staleness"):
            vals[F[f]] *= ps
        for f in ("group", "backend"):
            vals[F[f]] *= ar
        vals[F["hierarchical"]] *= ar & self.multi_worker_nodes
        vals[F["group_stride"]] *= ar & (shards > 1)
        ok = ar & self.compressible[vs]
        vals[F["compressor"]] *= ok
        vals[F["rank"]] *= ok & (vals[F["compressor"]] >= COMPRESSOR_ID["powersgd"])

    def mutate(self, strategy: Strategy, rng: np.random.Generator) -> Strategy:
        return self.decode(self.mutate_encoded(self.encode([strategy]), rng), 0)

    # ---- encoding --------------------------------------------------------------------------
    def encode(self, strategies: list[Strategy]) -> EncodedStrategies:
        """Encode strategies of this model/cluster.

        Raises:
            ConfigError: a strategy outside the encodable subspace, saying which variable and why.
        """
        e = EncodedStrategies.zeros(len(strategies), self._V)
        names = self.cluster.node_names
        for b, s in enumerate(strategies):
            for cfg in s.variables:
                v = self.model.index(cfg.name)
                self._encode_var(e, b, v, cfg, names)
        return e

    def _encode_var(self, e: EncodedStrategies, b: int, v: int, cfg: VarConfig, names) -> None:
        first = cfg.synchronizers[0]
        k = cfg.num_shards
        e.shards[b, v], e.axis[b, v] = k, cfg.axis
        why = None
        if not cfg.uniform:
            why = "its shards use different kinds or options of synchronizer"
        elif isinstance(first, PS):
            d0 = self.cluster.node_index(first.destination)
            if [s.destination for s in cfg.synchronizers] != [names[(d0 + i) % len(names)] for i in range(k)]:
                why = "its shards are not placed round-robin over consecutive nodes"
            e.kind[b, v], e.dest[b, v] = KIND_PS, d0
            e.local_replication[b, v], e.sync[b, v], e.staleness[b, v] = first.local_replication, first.sync, first.staleness
        else:
            stride = cfg.synchronizers[1].group - first.group if k > 1 else 0
            if stride not in (0, 1) or any(s.group != first.group + stride * i for i, s in enumerate(cfg.synchronizers)):
                why = "its shards' fusion groups are neither all equal nor consecutive"
            kind, rank = first.codec.name, first.codec.rank
            e.kind[b, v], e.group[b, v], e.group_stride[b, v] = KIND_AR, first.group, stride
            e.compressor[b, v], e.rank[b, v], e.backend[b, v] = COMPRESSOR_ID[kind], rank, BACKEND_ID[first.backend]
            e.hierarchical[b, v] = first.hierarchical
        if why:
            raise ConfigError(f"variable {cfg.name}: cannot be encoded for the tuner because {why}; "
                              f"such strategies run but are not searched or simulated")

    def decode(self, e: EncodedStrategies, row: int, origin: str = "") -> Strategy:
        names = self.cluster.node_names
        N = len(names)
        configs = []
        for v, var in enumerate(self.model.variables):
            k = int(e.shards[row, v])
            if e.kind[row, v] == KIND_PS:
                d0 = int(e.dest[row, v])
                syncs = tuple(PS(names[(d0 + i) % N], bool(e.local_replication[row, v]), bool(e.sync[row, v]),
                                 int(e.staleness[row, v])) for i in range(k))
            else:
                comp = str(Compressor.of(COMPRESSOR_KINDS[e.compressor[row, v]], int(e.rank[row, v])))
                g0, st = int(e.group[row, v]), int(e.group_stride[row, v])
                hier = bool(e.hierarchical[row, v])
                syncs = tuple(AllReduce(BACKENDS[e.backend[row, v]], comp, g0 + st * i, hier) for i in range(k))
            configs.append(VarConfig(var.name, syncs, int(e.axis[row, v])))
        return Strategy(tuple(configs), origin=origin)
