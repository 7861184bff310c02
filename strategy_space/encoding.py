"""The integer array encoding of strategy batches (``EncodedStrategies``), proposals stored as
changes of a batch's rows (``Mutation``), and an index of the fusion groups (``GroupIndex``).

Encoding: B strategies x V variables, one int32 array (B, V) per field. A variable's shards share
one kind of synchronizer and its options; where they differ:
  * PS shard i sits on node ``(dest + i) % N`` (round-robin from the first node);
  * AR shard i is in fusion group ``group + group_stride * i``;
  * ``hierarchical`` (all-reduce: reduce on the node, all-reduce among node leaders, broadcast) is
    strategy-wide, like the backend: one value on every all-reduce variable, 0 elsewhere.
``StrategySpace`` (``strategy_space.space``) encodes, decodes, samples and mutates these batches.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np

from .compressor import COMPRESSOR_KINDS
from .strategy import BACKENDS

KIND_PS, KIND_AR = 0, 1
COMPRESSOR_ID = {k: i for i, k in enumerate(COMPRESSOR_KINDS)}
BACKEND_ID = {b: i for i, b in enumerate(BACKENDS)}


@dataclass
class EncodedStrategies:
    """A batch of strategies as int32 arrays of shape (B, V), one per field (see module doc).
    Fields that do not apply are 0 (PS: group, compressor, rank, backend, hierarchical; AR: dest,
    PS options)."""

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
    hierarchical: np.ndarray

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


FIELDS = EncodedStrategies.field_names()
FIELD_INDEX = {n: i for i, n in enumerate(FIELDS)}
# options of a whole strategy (one PS mode, one all-reduce backend and hierarchy), stored on every
# variable they apply to and 0 elsewhere; the other fields are per variable
STRATEGY_WIDE = ("sync", "staleness", "backend", "hierarchical")
VARIABLE_FIELDS = tuple(n for n in FIELDS if n not in STRATEGY_WIDE)


@dataclass
class GroupIndex:
    """The all-reduce variables of a batch by key (row x G + fusion group).

    Attributes:
        G: groups per row in the keys (at least one more than the largest group).
        cells: flat cells (row x V + variable) of the all-reduce variables, sorted by key (variables
            ascending within a key).
        key: their keys.
        start: (rows x G + 1,) where each key's run of ``cells`` starts.
    """

    G: int
    cells: np.ndarray
    key: np.ndarray
    start: np.ndarray
    compressible: np.ndarray | None = None
    shared: tuple | None = None   # ``compressors(compressible)``, when given

    @classmethod
    def of(cls, e: EncodedStrategies, min_groups: int = 1, compressible: np.ndarray | None = None) -> "GroupIndex":
        """The index of ``e``; with ``compressible``, also each group's shared compressor."""
        B, V = e.kind.shape
        G = max(int(e.group.max(initial=0)) + 1, min_groups)
        cells = np.flatnonzero(e.kind != KIND_PS)
        key = cells // V * G + e.group.reshape(-1)[cells]
        order = np.argsort(key.astype(np.int16) if B * G < 2**15 else key, kind="stable")   # (int16: radix sort)
        cells, key = cells[order], key[order]
        gi = cls(G, cells, key, np.searchsorted(key, np.arange(B * G + 1)))
        if compressible is not None:
            gi.compressible, gi.shared = compressible, gi.compressors(e, compressible)
        return gi

    def runs(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Positions in ``cells`` of the cells of each key, concatenated, and how many each has."""
        start, n = self.start[keys], self.start[keys + 1] - self.start[keys]
        return np.repeat(start - np.cumsum(n) + n, n) + np.arange(n.sum()), n

    def compressors(self, e: EncodedStrategies, compressible: np.ndarray):
        """Per key: (compressible members, whether they all share one compressor and every other
        member has none, that compressor, its rank)."""
        V = e.kind.shape[1]
        n_keys = len(self.start) - 1
        comp, rank = e.compressor.reshape(-1)[self.cells], e.rank.reshape(-1)[self.cells]
        cm = compressible[self.cells % V]
        key = self.key[cm]
        start = np.searchsorted(key, np.arange(n_keys + 1))
        count = np.diff(start)
        first = np.minimum(start[:-1], max(len(key) - 1, 0))
        shared = [np.where(count > 0, x[cm][first] if len(key) else 0, 0) for x in (comp, rank)]
        # members off their key's first compressor, and members that cannot compress but carry one
        off = (comp[cm] != shared[0][key]) | (rank[cm] != shared[1][key])
        bad = np.bincount(key[off], minlength=n_keys) + np.bincount(self.key[~cm & ((comp != 0) | (rank != 0))],
                                                                    minlength=n_keys)
        return count, bad == 0, shared[0], shared[1]


def member_codec(codec: np.ndarray, compressible: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(compressor, rank) an all-reduce variable takes when its group takes ``codec`` (rows
    compressor, rank): normalized, so only dense float variables compress, and only PowerSGD
    keeps a rank."""
    comp = codec[0] * compressible
    return comp, codec[1] * (compressible & (comp >= COMPRESSOR_ID["powersgd"]))


@dataclass
class Mutation:
    """Proposals as changes of a batch's rows: proposal i is row ``parents[i]`` of ``base`` with
    every field of the cells ``cells`` set to ``values``, then, for a group change, every
    all-reduce variable of fusion group ``group_ids[u]`` of proposal ``group_rows[u]`` given the
    compressor ``group_codec[:, u]`` (``member_codec``: normalized per variable). A search can score
    proposals from their changes (``tuner.features.incremental``) and build only the rows it keeps.

    Attributes:
        base: the strategies varied (the mutation's own copy).
        parents: (B,) int64, the row of ``base`` each proposal varies.
        cells: (T,) int64, sorted flat indices (proposal x V + variable) of the cells whose fields
            are set.
        values: (len(FIELDS), T) int32, every field of those cells (``FIELDS`` order).
        group_rows: (U,) int64, sorted: the proposals that change a group's compressor.
        group_ids: (U,) their groups.
        group_codec: (2, U) the compressor and rank each group takes.
        compressible: (V,) bool, the variables that compress (needed with group changes).
        groups: optionally, ``base``'s GroupIndex with its shared compressors (saves its users
            building it again).
    """

    base: EncodedStrategies
    parents: np.ndarray
    cells: np.ndarray
    values: np.ndarray
    group_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    group_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    group_codec: np.ndarray = field(default_factory=lambda: np.zeros((2, 0), np.int64))
    compressible: np.ndarray | None = None
    groups: GroupIndex | None = None

    def __post_init__(self):
        if len(self.group_rows) and (self.compressible is None or (np.diff(self.group_rows) <= 0).any()):
            raise ValueError("group changes need the compressible variables and at most one change per proposal, "
                             "sorted by proposal")

    def __len__(self) -> int:
        return len(self.parents)

    @property
    def encoded(self) -> EncodedStrategies:
        """All proposals as a batch (O(B x V): a search needs only ``take`` of the rows it keeps)."""
        return self.take(np.arange(len(self)))

    def take(self, rows) -> EncodedStrategies:
        """Proposals ``rows`` as a batch."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        out = self.base.take(self.parents[rows])
        V = out.kind.shape[1]
        src, n = runs(self.cells, rows * V, (rows + 1) * V)   # each proposal's cells: a run
        dst = np.repeat(np.arange(len(rows)) * V, n) + self.cells[src] % V
        for f, vals in zip(FIELDS, self.values):
            getattr(out, f).reshape(-1)[dst] = vals[src]
        u, n = runs(self.group_rows, rows, rows + 1)
        if len(u):
            k = np.repeat(np.arange(len(rows)), n)
            members = (out.kind[k] != KIND_PS) & (out.group[k] == self.group_ids[u][:, None])
            comp, rank = member_codec(self.group_codec[:, u][:, :, None], self.compressible)
            out.compressor[k] = np.where(members, comp, out.compressor[k])
            out.rank[k] = np.where(members, rank, out.rank[k])
        return out

    @classmethod
    def diff(cls, base: EncodedStrategies, proposals: EncodedStrategies, parents) -> "Mutation":
        """The changes that turn rows ``parents`` of ``base`` into ``proposals`` (compares every
        cell: O(B x V))."""
        parents = np.asarray(parents, dtype=np.int64).reshape(-1)
        if len(parents) != len(proposals):
            raise ValueError(f"{len(proposals)} proposals but {len(parents)} parents; give one parent per proposal")
        differs = np.zeros(proposals.kind.shape, bool)
        for f in FIELDS:
            differs |= getattr(proposals, f) != getattr(base, f)[parents]
        cells = np.flatnonzero(differs)
        values = np.stack([getattr(proposals, f).reshape(-1)[cells] for f in FIELDS]).astype(np.int32)
        return cls(base.copy(), parents, cells, values.reshape(len(FIELDS), -1))


def runs(sorted_keys: np.ndarray, lo, hi) -> tuple[np.ndarray, np.ndarray]:
    """Positions in ``sorted_keys`` of the keys in [lo[i], hi[i]) for every i, concatenated, and
    how many each i has."""
    start = np.searchsorted(sorted_keys, lo)
    n = np.searchsorted(sorted_keys, hi) - start
    return np.repeat(start - np.cumsum(n) + n, n) + np.arange(n.sum()), n
