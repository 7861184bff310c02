"""StrategySpace: the legal choices for every variable of a model on a cluster, and the integer
array encoding the tuner featurizes in batches.

Encoding (``EncodedStrategies``): B strategies x V variables, one int32 array (B, V) per field.
A variable's shards share one kind of synchronizer and its options; where they differ:
  * PS shard i sits on node ``(dest + i) % N`` (round-robin from the first node);
  * AR shard i is in fusion group ``group + group_stride * i``.
Strategies outside that subspace (mixed PS/AR shards, arbitrary shard placement) are valid and run,
but ``encode`` rejects them with a message saying why.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from .errors import ConfigError
from .specs import ClusterSpec, ModelSpec
from .strategy import BACKENDS, COMPRESSOR_KINDS, PS, AllReduce, Strategy, VarConfig, format_compressor

KIND_PS, KIND_AR = 0, 1
COMPRESSOR_ID = {k: i for i, k in enumerate(COMPRESSOR_KINDS)}
BACKEND_ID = {b: i for i, b in enumerate(BACKENDS)}


@dataclass
class EncodedStrategies:
    """A batch of strategies as int32 arrays of shape (B, V), one per field (see module doc).
    Fields that do not apply are 0 (PS: group, compressor, rank, backend; AR: dest, PS options)."""

    kind: np.ndarray
    shards: np.ndarray
    axis: np.ndarray
    dest: np.ndarray
    group: np.ndarray
    group_stride: np.ndarray
    local_replication: np.ndarray
    sync: np.ndarray
    staleness: np.ndarray
    compressor: np.ndarray
    rank: np.ndarray
    backend: np.ndarray

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def zeros(cls, batch: int, num_vars: int) -> "EncodedStrategies":
        return cls(**{n: np.zeros((batch, num_vars), dtype=np.int32) for n in cls.field_names()})

    def __len__(self) -> int:
        return self.kind.shape[0]

    def take(self, rows) -> "EncodedStrategies":
        return EncodedStrategies(**{n: getattr(self, n)[rows] for n in self.field_names()})

    def copy(self) -> "EncodedStrategies":
        return EncodedStrategies(**{n: getattr(self, n).copy() for n in self.field_names()})

    @classmethod
    def concat(cls, parts: list["EncodedStrategies"]) -> "EncodedStrategies":
        return cls(**{n: np.concatenate([getattr(p, n) for p in parts]) for n in cls.field_names()})

    def row_keys(self) -> list[bytes]:
        """A hashable key per strategy (for de-duplication)."""
        stacked = np.stack([getattr(self, n) for n in self.field_names()], axis=-1)
        return [r.tobytes() for r in stacked]


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
        if self.multi_worker_nodes:
            e.local_replication[:] = rng.integers(0, 2, size=(n, V))
        self._sample_ps_mode(rng, e, np.arange(n))
        self._sample_group_options(rng, e, np.arange(n))
        return self.normalize(e)

    def _draw_modes(self, rng, n: int) -> np.ndarray:
        """(n, 2) array of (sync, staleness): one PS mode per strategy, since mixing them is not
        allowed (see validate)."""
        modes = [(1, s) for s in self.staleness] + ([(0, 0)] if self.allow_async else [])
        return np.array(modes, dtype=np.int32)[rng.integers(0, len(modes), size=n)]

    def _sample_ps_mode(self, rng, e: EncodedStrategies, rows: np.ndarray) -> None:
        pick = self._draw_modes(rng, len(rows))
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
        return e

    def sample(self, rng: np.random.Generator) -> Strategy:
        return self.decode(self.sample_encoded(rng, 1), 0)

    # ---- mutation --------------------------------------------------------------------------
    MUTABLE = ("kind", "shards", "dest", "group", "compressor", "local_replication", "mode")

    def _mutation_choices(self, kind: int) -> list[int]:
        """Indices into MUTABLE of the decisions that can change for a variable of ``kind``."""
        names = ["kind", "shards"]
        if kind == KIND_PS:
            names += ["dest"] if self.num_nodes > 1 else []
            names += ["local_replication"] if self.multi_worker_nodes else []
            names += ["mode"] if len(self.staleness) + self.allow_async > 1 else []
        else:
            names += ["group"] if self.num_groups > 1 else []
            names += ["compressor"] if len(self.compressor_choices) > 1 else []
        return [self.MUTABLE.index(n) for n in names]

    def mutate_encoded(self, e: EncodedStrategies, rng: np.random.Generator, tries: int = 8) -> EncodedStrategies:
        """A copy where each strategy has one decision changed: one variable's synchronizer, shards,
        placement or group, a group's compressor, or the strategy-wide PS mode. A draw that
        changes nothing is retried (up to ``tries`` times; a space with a single point cannot
        change)."""
        out = self._mutate_once(e, rng)
        for _ in range(tries - 1):
            same = np.ones(len(e), dtype=bool)
            for f in e.field_names():
                same &= (getattr(out, f) == getattr(e, f)).all(axis=1)
            if not same.any():
                break
            idx = np.nonzero(same)[0]
            redo = self._mutate_once(e.take(idx), rng)
            for f in e.field_names():
                getattr(out, f)[idx] = getattr(redo, f)
        return out

    def _mutate_once(self, e: EncodedStrategies, rng: np.random.Generator) -> EncodedStrategies:
        out = e.copy()
        n = len(out)
        rows = np.arange(n)
        v = rng.integers(0, self._V, size=n)
        what = np.empty(n, dtype=np.int64)
        is_ps = e.kind[rows, v] == KIND_PS
        for kind, sel in ((KIND_PS, is_ps), (KIND_AR, ~is_ps)):
            choices = np.array(self._mutation_choices(kind))
            what[sel] = choices[rng.integers(0, len(choices), size=int(sel.sum()))]
        fresh = self.sample_encoded(rng, n)
        sync, stale, backend = self._row_modes(e, fresh)
        for i, name in enumerate(self.MUTABLE):
            sel = rows[what == i]
            if not len(sel):
                continue
            vs = v[sel]
            if name == "mode":
                pick = self._draw_modes(rng, len(sel))
                sync[sel], stale[sel] = pick[:, 0], pick[:, 1]
            elif name == "compressor":
                # every dense member of the chosen variable's group takes the new compressor
                same = (out.group[sel] == out.group[sel, vs][:, None]) & (out.kind[sel] == KIND_AR)
                out.compressor[sel] = np.where(same, fresh.compressor[sel, vs][:, None], out.compressor[sel])
                out.rank[sel] = np.where(same, fresh.rank[sel, vs][:, None], out.rank[sel])
            else:
                fields_ = ("kind", "group", "shards", "dest") if name == "kind" else (name,)
                for f in fields_:
                    getattr(out, f)[sel, vs] = getattr(fresh, f)[sel, vs]
                if name in ("kind", "group"):
                    self._adopt_group_compressor(out, sel, vs)
        ps = out.kind == KIND_PS
        out.sync[:] = np.where(ps, sync[:, None], 0)
        out.staleness[:] = np.where(ps, stale[:, None], 0)
        out.backend[:] = np.where(ps, 0, backend[:, None])
        return self.normalize(out)

    def _row_modes(self, e: EncodedStrategies, fallback: EncodedStrategies):
        """Per strategy: (sync, staleness) of its parameter servers and its all-reduce backend,
        taken from ``fallback`` where ``e`` has no PS / no AR variable."""
        rows = np.arange(len(e))
        ps = e.kind == KIND_PS
        first_ps, first_ar = np.argmax(ps, axis=1), np.argmax(~ps, axis=1)
        fb_ps = fallback.kind == KIND_PS
        fb_first_ps, fb_first_ar = np.argmax(fb_ps, axis=1), np.argmax(~fb_ps, axis=1)
        fb_sync = np.where(fb_ps.any(1), fallback.sync[rows, fb_first_ps], 1)
        fb_stale = np.where(fb_ps.any(1), fallback.staleness[rows, fb_first_ps], self.staleness[0])
        fb_backend = np.where((~fb_ps).any(1), fallback.backend[rows, fb_first_ar], self.backends[0])
        has_ps, has_ar = ps.any(1), (~ps).any(1)
        sync = np.where(has_ps, e.sync[rows, first_ps], fb_sync).astype(np.int32)
        stale = np.where(has_ps, e.staleness[rows, first_ps], fb_stale).astype(np.int32)
        backend = np.where(has_ar, e.backend[rows, first_ar], fb_backend).astype(np.int32)
        return sync, stale, backend

    def _adopt_group_compressor(self, e: EncodedStrategies, sel: np.ndarray, vs: np.ndarray) -> None:
        g = e.group[sel, vs]
        members = (e.group[sel] == g[:, None]) & (e.kind[sel] == KIND_AR) & self.compressible
        members[np.arange(len(sel)), vs] = False
        has = members.any(axis=1)
        src = np.argmax(members, axis=1)
        take = sel[has]
        e.compressor[take, vs[has]] = e.compressor[take, src[has]]
        e.rank[take, vs[has]] = e.rank[take, src[has]]

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
            kind, rank = first.compressor_kind, first.compressor_rank
            e.kind[b, v], e.group[b, v], e.group_stride[b, v] = KIND_AR, first.group, stride
            e.compressor[b, v], e.rank[b, v], e.backend[b, v] = COMPRESSOR_ID[kind], rank, BACKEND_ID[first.backend]
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
                comp = format_compressor(COMPRESSOR_KINDS[e.compressor[row, v]], int(e.rank[row, v]))
                g0, st = int(e.group[row, v]), int(e.group_stride[row, v])
                syncs = tuple(AllReduce(BACKENDS[e.backend[row, v]], comp, g0 + st * i) for i in range(k))
            configs.append(VarConfig(var.name, syncs, int(e.axis[row, v])))
        return Strategy(tuple(configs), origin=origin)
