"""Features of annealing proposals from their parents' (``features.featurize``'s numbers without
the pass over every variable).

A proposal of ``StrategySpace.mutate_encoded`` differs from its parent in a few cells (variables):
one variable's synchronizer, shards, placement or group, or a group's compressor; projecting onto
constraints may change a few more. Every feature is assembled (``features._assemble``) from
per-strategy sums over variables, so those sums are kept per chain and updated by the changed
cells: their old contributions are taken out and their new ones put in (one ``np.add.at``).

The sums of a strategy are one float64 column (rows: ``_Layout``): bytes hosted per node as in
``features._Parts.hosted``, the PS and all-reduce sums behind ``_Parts.psum`` / ``asum``, the wire
bytes at or after each ready-order breakpoint as difference entries (a variable adds its weight at
breakpoint 0 and takes it out past its ready position; running sums restore them), and the bytes
of each fusion group per compressor class. Strategy-wide options (staleness, sync, backend) are
reduced over the proposal itself, one exact (B, V) pass each. A cell's contribution is
``features._block_parts``' float32 arithmetic, its shards laid on nodes and groups directly rather
than through difference lines.

Sums are float64 here and in ``featurize``; float64 sums of float32 terms are exact unless their
magnitudes span more than ~2^29 (a terabyte next to a fraction of a byte), so both give the same
numbers in any order, and the features are bit for bit ``featurize``'s
(``tests/test_incremental_features.py``). Beyond that span, taking a contribution out leaves
~1e-16 of the largest sum it shared (only PS sums hold fractions of a byte: sparse shards): when
no PS variable is left their block is reset to exact zeros, as ``featurize`` gives; elsewhere the
residue is far below the threshold that counts nodes (``features._EMPTY_BYTES``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from strategy_space.space import BACKEND_ID, KIND_PS, EncodedStrategies

from .alpha_beta import AlphaBeta
from .features import _DEFAULT_PARAMS, _PSGD, _S, FeatureTables, _assemble, _Parts

# the fields a cell's contribution depends on (sync, staleness and backend are reduced instead)
CELL_FIELDS = ("kind", "shards", "axis", "dest", "group", "group_stride", "local_replication", "compressor", "rank")
_RESET_ROWS = 256   # rows per block when the sums are built from scratch (bounds the entry arrays)


class _Layout:
    """Rows of the sums (one column per strategy). PS block: hosted (3, N) | PS count, sparse,
    value, dense value bytes | PS wire differences (nbp + 1, the last a sink). All-reduce block
    (from ``ar``): the same four sums | fp16 raw, PowerSGD raw, sparse all-gathers | wire
    differences | groups (3, G)."""

    def __init__(self, N: int, nbp: int, G: int):
        self.N, self.nbp, self.G = N, nbp, G
        self.ps_sums = 3 * N
        self.ps_wire = self.ps_sums + 4
        self.ar = self.ps_wire + nbp + 1
        self.ar_scalars = self.ar + 4
        self.ar_wire = self.ar_scalars + 3
        self.groups = self.ar_wire + nbp + 1
        self.height = self.groups + 3 * G


class IncrementalFeaturizer:
    """``featurize`` for chains of mutations: ``reset`` with the chains' strategies, then per step
    ``propose`` (features of the proposals) and ``accept`` (which proposals replace their parents).

    Args:
        tables: the (model, cluster) tables.
        params: alpha-beta parameters of the ``comm_s`` / ``analytic_s`` columns (as ``featurize``).
    """

    def __init__(self, tables: FeatureTables, params: AlphaBeta | None = None):
        self.tables = tables
        self.params = params or _DEFAULT_PARAMS
        # breakpoints at or before each variable's ready position: its wire bytes count in those
        self._ready_bps = tables.after.sum(1).astype(np.int64)
        self._ps_wire = (2 * tables.val_bytes + tables.idx_bytes).astype(np.float32)
        self._sums_t = np.ascontiguousarray(tables.sums.T)
        nbp = tables.after.shape[1]
        self._running = np.tri(nbp, nbp + 1)   # row j: difference entries 0..j
        self._parent: np.ndarray | None = None   # (fields, B, V): CELL_FIELDS of the parents
        self._sums: np.ndarray | None = None
        self._pending = None

    # ---- the three steps -----------------------------------------------------------------------
    def reset(self, e: EncodedStrategies) -> np.ndarray:
        """Features of ``e`` (as ``featurize``); its rows become the parents of the next proposals.

        Raises:
            ValueError: ``e`` encodes a different number of variables than the tables.
        """
        t = self.tables
        self._check_width(e)
        B = len(e)
        self._parent = np.stack([getattr(e, f) for f in CELL_FIELDS]).astype(np.int32)
        self._changed, self._differs = np.empty((B, t.V), bool), np.empty((B, t.V), bool)
        # flat index of an entry = row of the sums x B + strategy: row offsets pre-multiplied by B
        self._four, self._three = np.arange(4)[:, None] * B, np.arange(3)[:, None] * B
        self._nodes = np.zeros(0, np.int64)
        self._lay, self._sums, self._pending = _Layout(t.N, t.after.shape[1], 1), None, None
        self._grow(dict(zip(CELL_FIELDS, self._parent)))
        self._sums = np.zeros((self._lay.height, B))
        v = np.arange(t.V)
        for s in range(0, B, _RESET_ROWS):
            rows = np.arange(s, min(s + _RESET_ROWS, B))
            cells = dict(zip(CELL_FIELDS, self._parent[:, rows].reshape(len(CELL_FIELDS), -1)))
            self._add_cells(self._sums, np.repeat(rows, t.V), np.tile(v, len(rows)), cells, paired=False)
        return self._features(e, self._sums)

    def propose(self, e: EncodedStrategies) -> np.ndarray:
        """Features of ``e``, whose row i is a variation of parent row i (any number of cells may
        differ; few is fast). ``e`` must not change before ``accept``.

        Raises:
            ValueError: before ``reset``, or ``e`` has another shape than the parents.
        """
        if self._parent is None:
            raise ValueError("IncrementalFeaturizer.propose needs the parents first: call reset(strategies)")
        self._check_width(e)
        B = self._parent.shape[1]
        if len(e) != B:
            raise ValueError(f"propose got {len(e)} strategies for {B} parents; row i of a proposal must vary "
                             f"parent row i")
        # cells where any field differs (the fields are separate (B, V) arrays: one pass each)
        changed, differs = self._changed, self._differs
        np.not_equal(self._parent[0], e.kind, out=changed)
        for parent, f in zip(self._parent[1:], CELL_FIELDS[1:]):
            np.logical_or(changed, np.not_equal(parent, getattr(e, f), out=differs), out=changed)
        flat = np.flatnonzero(changed)
        # old and new values of the changed cells, as two halves
        both = np.empty((len(CELL_FIELDS), 2 * len(flat)), np.int32)
        self._parent.reshape(len(CELL_FIELDS), -1).take(flat, axis=1, out=both[:, :len(flat)])
        for row, f in zip(both[:, len(flat):], CELL_FIELDS):
            getattr(e, f).reshape(-1).take(flat, out=row)
        cells = dict(zip(CELL_FIELDS, both))
        self._grow(cells)
        sums = self._sums.copy()
        if len(flat):
            b = flat // self.tables.V
            v = flat - b * self.tables.V
            self._add_cells(sums, np.concatenate([b, b]), np.concatenate([v, v]), cells, paired=True)
        self._pending = (e, sums)
        return self._features(e, sums)

    def accept(self, accepted: np.ndarray) -> None:
        """Rows of the last proposal that replace their parents (boolean mask over rows).

        Raises:
            ValueError: no proposal is pending.
        """
        if self._pending is None:
            raise ValueError("IncrementalFeaturizer.accept has no pending proposal: call propose first")
        e, sums = self._pending
        m = np.asarray(accepted, dtype=bool)
        for parent, f in zip(self._parent, CELL_FIELDS):
            np.copyto(parent, getattr(e, f), where=m[:, None])
        np.copyto(self._sums, sums, where=m)
        self._pending = None

    # ---- internals -----------------------------------------------------------------------------
    def _check_width(self, e: EncodedStrategies) -> None:
        if e.kind.shape[1] != self.tables.V:
            raise ValueError(f"strategies encode {e.kind.shape[1]} variables but the model has {self.tables.V}")

    def _grow(self, cells: dict) -> None:
        """Widen the group rows to every group the cells may write: strided shards reach g + k - 1,
        and ``_add_cells`` writes zeros up to g + K - 1 (K: the cells' most shards)."""
        ar = cells["kind"] != KIND_PS
        if not ar.any():
            return
        reach = int(cells["group"][ar].max()) + int(cells["shards"].max())
        old = self._lay
        if reach <= old.G:
            return
        self._lay = new = _Layout(old.N, old.nbp, reach)
        if self._sums is not None:
            B = self._sums.shape[1]
            sums = np.zeros((new.height, B))
            sums[:old.groups] = self._sums[:old.groups]
            sums[new.groups:].reshape(3, reach, B)[:, :old.G] = self._sums[old.groups:].reshape(3, old.G, B)
            self._sums = sums

    def _add_cells(self, sums: np.ndarray, b, v, cells: dict, *, paired: bool) -> None:
        """Add the contributions of cells (strategies ``b``, variables ``v``, field values ``cells``)
        to ``sums`` (height, B), in place. ``paired``: the cells are two halves, the old values then
        the new ones of the same cells, and the old ones are taken out."""
        t, lay = self.tables, self._lay
        B = sums.shape[1]
        c = _cell_parts(t, v, cells)
        n = len(b)
        sign = np.ones(n)
        if paired:
            sign[:n // 2] = -1.0
        kind = cells["kind"]
        K = int(cells["shards"].max())
        sp = np.flatnonzero(c.sparse_ps)
        # the four sums (count, sparse, value, dense value bytes) move only when a variable changes
        # synchronizer: otherwise its old and new entries cancel, and are left out
        if paired:
            flip = kind[:n // 2] != kind[n // 2:]
            moved = np.flatnonzero(np.concatenate([flip, flip]))
        else:
            moved = np.arange(n)
        # entries laid out (entry, cell), so that numpy's inner loops run over cells; an entry's
        # flat index is its row of the sums x B + its strategy
        m = 5 + K
        idx_all = np.empty(m * n + K * len(sp) + 4 * len(moved), np.int64)
        w_all = np.empty(len(idx_all))
        idx, w = idx_all[:m * n].reshape(m, n), w_all[:m * n].reshape(m, n)
        # fp16 / PowerSGD raw bytes and all-gathers
        np.add(lay.ar_scalars * B + b, self._three, out=idx[:3])
        vb = t.val_bytes[v] * sign
        np.multiply(c.is16, vb, out=w[0])
        np.multiply(c.psgd, vb, out=w[1])
        np.multiply(c.gathers, sign, out=w[2])
        # wire bytes over breakpoints: + at breakpoint 0, - past the variable's ready position
        np.add((lay.ps_wire + kind * (lay.ar_wire - lay.ps_wire)) * B, b, out=idx[3])
        np.add(idx[3], self._ready_bps[v] * B, out=idx[4])
        np.multiply((1.0 - c.arf) * self._ps_wire[v] + c.wv, sign, out=w[3])
        np.negative(w[3], out=w[4])
        # shards on nodes (PS) and on groups (all-reduce): shard i < e3 carries X + Y [i < e2]; the
        # entries past e3 weigh 0 (their group rows exist, see _grow)
        i = np.arange(K)[:, None]
        ws = w[5:]
        np.multiply(c.Y, i < c.e2, out=ws)
        ws += c.X
        ws *= i < c.e3
        ws *= sign
        node_b = self._node_of(cells["dest"] + i, B)
        ps = kind == KIND_PS
        start = np.where(ps, c.line * t.N, lay.groups + c.cls * lay.G + cells["group"]) * B + b
        np.add(start, np.where(ps, node_b, i * B), out=idx[5:])
        at = m * n
        if len(sp):   # index bytes of sparse PS shards: the third hosted lane
            idx2, w2 = idx_all[at:at + K * len(sp)].reshape(K, len(sp)), w_all[at:at + K * len(sp)].reshape(K, len(sp))
            np.add(2 * t.N * B + b[sp], node_b[:, sp], out=idx2)
            np.multiply(c.Ys[sp], i < c.extra[sp], out=w2)
            w2 += c.Xs[sp]
            w2 *= i < cells["shards"][sp]
            w2 *= sign[sp]
            at += K * len(sp)
        if len(moved):   # the four sums, into the PS or the all-reduce block
            idx4, w4 = idx_all[at:].reshape(4, len(moved)), w_all[at:].reshape(4, len(moved))
            np.add((lay.ps_sums + kind[moved] * (lay.ar - lay.ps_sums)) * B + b[moved], self._four, out=idx4)
            np.multiply(self._sums_t.take(v[moved], axis=1), sign[moved], out=w4)
        np.add.at(sums.reshape(-1), idx_all, w_all)   # numpy >= 1.25: cheaper than bincount + sum

    def _node_of(self, position: np.ndarray, B: int) -> np.ndarray:
        """Node x B of each position on a PS line (by table: integer division is slow)."""
        need = int(position.max()) + 1
        if len(self._nodes) < need:
            self._nodes = np.arange(max(need, 2 * len(self._nodes))) % self.tables.N * B
        return self._nodes.take(position)

    def _features(self, e: EncodedStrategies, sums: np.ndarray) -> np.ndarray:
        lay, t = self._lay, self.tables
        B, nbp = len(e), lay.nbp
        # no PS variable left: exact zeros (clears the residue of additions and removals of
        # fractional sparse shard bytes; all-reduce sums are whole bytes, always exact)
        has_ps = sums[lay.ps_sums] > 0.5
        if not has_ps.all():
            sums[:lay.ar] *= has_ps
        psum = np.empty((4 + nbp, B), np.float32)
        psum[:4] = sums[lay.ps_sums:lay.ps_sums + 4]
        # running sums of the difference entries, as products with a triangle of ones (numpy's
        # cumsum along the first axis runs its inner loop over the breakpoints)
        psum[4:] = self._running @ sums[lay.ps_wire:lay.ps_wire + nbp + 1]
        wsum = (self._running @ sums[lay.ar_wire:lay.ar_wire + nbp + 1]).astype(np.float32)
        groups = sums[lay.groups:].reshape(3, lay.G, B)
        total = groups.sum(0)
        full = groups > 0.5   # buffers carry whole bytes; an empty one holds rounding noise only
        scal = np.empty((len(_S), B), np.float32)
        scal[_S["fp16_raw"]] = sums[lay.ar_scalars]
        scal[_S["psgd_raw"]] = sums[lay.ar_scalars + 1]
        scal[_S["stale"]] = e.staleness.max(1)
        scal[_S["sync"]] = e.sync.sum(1)
        scal[_S["objectstore"]] = e.backend.max(1) == BACKEND_ID["objectstore"]
        scal[_S["n_groups"]] = (total > 0.5).sum(0)
        scal[_S["n_coll"]] = full.reshape(3 * lay.G, B).sum(0) + full[2].sum(0) + sums[lay.ar_scalars + 2]
        scal[_S["max_group"]] = total.max(0)
        parts = _Parts(sums[:3 * t.N].reshape(3, t.N, B), psum, sums[lay.ar:lay.ar + 4].astype(np.float32), wsum, scal)
        return _assemble(t, self.params, parts)


@dataclass
class _Cells:
    """Per-cell quantities of ``features._block_parts`` (float32 unless said)."""

    arf: np.ndarray      # 1 for all-reduce
    X: np.ndarray        # base-shard bytes on the line (unstrided all-reduce: the whole buffer)
    Y: np.ndarray        # one more slice, for the first e2 shards
    e2: np.ndarray       # int: shards with one slice more on the line
    e3: np.ndarray       # int: shards on the line (unstrided all-reduce: 1)
    extra: np.ndarray    # int: shards with one slice more
    wv: np.ndarray       # all-reduce wire bytes of the whole variable
    is16: np.ndarray     # fp16 compressor
    psgd: np.ndarray     # bool: PowerSGD on a matrix
    gathers: np.ndarray  # all-gathers (sparse all-reduce shards)
    line: np.ndarray     # int: PS lane (0 plain, 1 local replication of a dense variable)
    cls: np.ndarray      # int: all-reduce class (0 none, 1 fp16*, 2 powersgd*)
    sparse_ps: np.ndarray  # bool: sparse PS cells (index bytes lane)
    Xs: np.ndarray       # their base-shard index bytes
    Ys: np.ndarray       # one more slice


def _cell_parts(t: FeatureTables, v: np.ndarray, f: dict) -> _Cells:
    """Quantities of cells (variables ``v`` with field values ``f``): ``features._block_parts``'
    arithmetic on a flat list of cells (gathers of the tables instead of broadcasts)."""
    if f["axis"].any():
        dim = t.dims[v, f["axis"]].astype(np.float32)
        sv, si, cols = t.val_bytes[v] / dim, t.idx_bytes[v] / dim, t.size[v] / dim
    else:
        dim, sv, si, cols = t.dim0[v], t.sv0[v], t.si0[v], t.cols0[v]
    kf = f["shards"].astype(np.float32)
    arf = f["kind"].astype(np.float32)
    psf = 1.0 - arf
    base = np.floor(dim / kf)
    extra = dim - base * kf
    comp = f["compressor"]
    is16 = ((comp - 1).view(np.uint32) < 2).astype(np.float32)
    wv = arf * t.val_dense[v] + is16 * t.half_val[v]
    lay = psf + f["group_stride"].astype(np.float32)
    X = sv * base
    Y = lay * sv
    shrink = is16 * t.half_m1[v] + 1.0
    X *= shrink
    Y *= shrink
    psgd = (comp >= _PSGD) & t.matrix[v]
    if psgd.any():
        r = f["rank"][psgd].astype(np.float32)
        n, m, eb = cols[psgd], base[psgd], t.elem_bytes[v[psgd]]
        fb = np.minimum(r * (m + n), m * n) * eb
        fe = np.minimum(r * (m + 1 + n), (m + 1) * n) * eb
        X[psgd] = fb
        Y[psgd] = (fe - fb) * lay[psgd]
        wv[psgd] = kf[psgd] * fb + extra[psgd] * (fe - fb)
    X = X * lay + wv * (1.0 - lay)
    sparse = t.sparse[v]
    gathers = sparse * arf   # sparse all-reduce variables are all-gathered, never in a group
    keep = 1.0 - gathers
    X *= keep
    Y *= keep
    return _Cells(
        arf=arf, X=X, Y=Y, e2=(extra * lay).astype(np.int64), e3=((kf - 1.0) * lay + 1.0).astype(np.int64),
        extra=extra.astype(np.int64), wv=wv, is16=is16, psgd=psgd, gathers=gathers * kf,
        line=f["local_replication"] * t.dense_i[v], cls=(comp + 1) >> 1,
        sparse_ps=sparse & (f["kind"] == KIND_PS), Xs=si * base * psf, Ys=si * psf)
