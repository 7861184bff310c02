"""Features of annealing proposals from their chains' (``features.batch.featurize``'s numbers without
the pass over every variable).

A proposal (``StrategySpace.mutate_rows``: a ``Mutation`` of the chains' strategies, each proposal
varying one chain, several per chain) differs from its chain's strategy in a few cells
(variables): one variable's synchronizer, shards, placement or group, or the PS mode; projecting
onto constraints may change a few more. Every feature is assembled (``features.batch.assemble``) from
per-strategy sums over variables, so those sums are kept per chain, and a proposal's are its
chain's updated by its changed cells: their old contributions taken out and their new ones put in
(one ``np.add.at`` for all proposals). A fusion group's new compressor changes every member of the
group; it is scored from per-group aggregates instead (``tuner.features.group_sums``).

The sums of a strategy are one float64 column (rows: ``_Layout``): bytes hosted per node as in
``features.sums.FeatureSums.hosted``, the PS and all-reduce sums behind ``FeatureSums.psum`` / ``asum``, the wire
bytes at or after each ready-order breakpoint as difference entries (a variable adds its weight at
breakpoint 0 and takes it out past its ready position; running sums restore them), and the bytes
of each fusion group per compressor class. Strategy-wide options (staleness, sync, backend, hierarchy) are
reduced per chain and updated by the changed cells (a maximum that a change may lower is reduced
again over that proposal's row). A cell's contribution is
``features.sums.block_sums``' float32 arithmetic (``tuner.features.cell_parts``), its shards laid on nodes and groups directly rather
than through difference lines.

Sums are float64 here and in ``featurize``; float64 sums of float32 terms are exact unless their
magnitudes span more than ~2^29 (a terabyte next to a fraction of a byte), so both give the same
numbers in any order, and the features are bit for bit ``featurize``'s
(``tests/test_incremental_features.py``). Beyond that span, taking a contribution out leaves
~1e-16 of the largest sum it shared (only PS sums hold fractions of a byte: sparse shards): when
no PS variable is left their block is reset to exact zeros, as ``featurize`` gives; elsewhere the
residue is far below the threshold that counts nodes (``features.batch._EMPTY_BYTES``).
"""
from __future__ import annotations

import numpy as np

from strategy_space.encoding import BACKEND_ID, FIELD_INDEX, FIELDS, KIND_PS, VARIABLE_FIELDS, EncodedStrategies, Mutation

from tuner.features.alpha_beta import AlphaBeta
from tuner.features.batch import DEFAULT_PARAMS, assemble
from tuner.features.cell_parts import cell_parts
from tuner.features.group_sums import GroupSums
from tuner.features.sums import SCALAR_ROWS, FeatureSums
from tuner.features.tables import FeatureTables, cpu_ring, curve_ns

# the fields a cell's contribution depends on (sync, staleness and backend are reduced instead)
CELL_FIELDS = VARIABLE_FIELDS
_RESET_ROWS = 256   # rows per block when the sums are built from scratch (bounds the entry arrays)
# group changes are scored from aggregates when there are at least this many proposals per chain (an
# aggregate costs what expanding its group into cells does, so it pays when reused)
_AGGREGATE_FROM = 2


class _Layout:
    """Rows of the sums (one column per strategy). PS block: hosted (3, N) | PS count, sparse,
    value, dense value bytes | PS wire differences (nbp + 1, the last a sink). All-reduce block
    (from ``ar``): the same four sums | fp16 raw, PowerSGD raw, sparse all-gathers, PowerSGD matrices | wire
    differences | groups (3, G)."""

    def __init__(self, N: int, nbp: int, G: int):
        self.N, self.nbp, self.G = N, nbp, G
        self.ps_sums = 3 * N
        self.ps_wire = self.ps_sums + 4
        self.ar = self.ps_wire + nbp + 1
        self.ar_scalars = self.ar + 4
        self.ar_wire = self.ar_scalars + 4
        self.groups = self.ar_wire + nbp + 1
        self.height = self.groups + 3 * G


class IncrementalFeaturizer:
    """``featurize`` for chains of mutations: ``reset`` with the chains' strategies, then per step
    ``propose`` (features of the proposals, any number per chain) and ``accept`` (the proposal each
    chain moves to, if any).

    Args:
        tables: the (model, cluster) tables.
        params: alpha-beta parameters of the ``comm_s`` / ``analytic_s`` columns (as ``featurize``).
    """

    def __init__(self, tables: FeatureTables, params: AlphaBeta | None = None):
        self.tables = tables
        self.params = params or DEFAULT_PARAMS
        # breakpoints at or before each variable's ready position: its wire bytes count in those
        self._ready_bps = tables.after.sum(1).astype(np.int64)
        self._ps_wire = (2 * tables.val_bytes + tables.idx_bytes).astype(np.float32)
        self._sums_t = np.ascontiguousarray(tables.sums.T)
        nbp = tables.after.shape[1]
        self._running = np.tri(nbp, nbp + 1)   # row j: difference entries 0..j
        self._parent: np.ndarray | None = None   # (FIELDS, C, V): every field of the chains' strategies
        self._sums: np.ndarray | None = None      # (height, C): their sums
        self._wide: np.ndarray | None = None      # (4, C): staleness max, sync count, backend and hierarchy max
        self._pending = None
        self._groups: GroupSums | None = None     # aggregates for group compressor changes

    # ---- the three steps -----------------------------------------------------------------------
    def reset(self, e: EncodedStrategies) -> np.ndarray:
        """Features of ``e`` (as ``featurize``); its rows become the chains whose strategies the next
        proposals vary.

        Raises:
            ValueError: ``e`` encodes a different number of variables than the tables.
        """
        t = self.tables
        self._check_width(e)
        C = len(e)
        self._parent = np.stack([getattr(e, f) for f in FIELDS]).astype(np.int32)
        self._nodes = np.zeros(0, np.int64)
        self._lay, self._sums, self._pending = _Layout(t.N, t.after.shape[1], 1), None, None
        self._groups = GroupSums(self._parent, self._lay, self._add_cells)
        cell_fields = self._parent[[FIELD_INDEX[f] for f in CELL_FIELDS]]
        self._grow(dict(zip(CELL_FIELDS, cell_fields)))
        self._sums = np.zeros((self._lay.height, C))
        v = np.arange(t.V)
        for s in range(0, C, _RESET_ROWS):
            rows = np.arange(s, min(s + _RESET_ROWS, C))
            cells = dict(zip(CELL_FIELDS, cell_fields[:, rows].reshape(len(CELL_FIELDS), -1)))
            self._add_cells(self._sums, np.repeat(rows, t.V), np.tile(v, len(rows)), cells, paired=False)
        self._wide = np.stack([e.staleness.max(1), e.sync.sum(1), e.backend.max(1), e.hierarchical.max(1)]).astype(np.int64)
        return self._features(self._sums, self._wide)

    def propose(self, proposals: Mutation | EncodedStrategies) -> np.ndarray:
        """Features of proposals that vary the chains' strategies: a ``Mutation`` of them (its
        ``base`` the strategies of the last ``reset`` / ``accept``; proposal i varies chain
        ``parents[i]``; only the changes are read), or a batch whose row i varies chain i (every
        cell compared). Any number of cells may differ; few is fast. The proposals must not change
        before ``accept``.

        Raises:
            ValueError: before ``reset``; a batch with another shape than the chains; a mutation of
                other strategies than the chains' (seen where its proposals change them).
        """
        if self._parent is None:
            raise ValueError("IncrementalFeaturizer.propose needs the parents first: call reset(strategies)")
        C, V = self._parent.shape[1], self.tables.V
        if isinstance(proposals, EncodedStrategies):
            self._check_width(proposals)
            if len(proposals) != C:
                raise ValueError(f"propose got {len(proposals)} strategies for {C} parents; row i of a batch must "
                                 f"vary parent row i (or propose a Mutation with its parents)")
            proposals = Mutation.diff(self.current(), proposals, np.arange(C))
        m = proposals
        self._check_width(m.base)
        cells, parents = m.cells, m.parents
        if len(m.base) != C or len(parents) and (parents.min() < 0 or parents.max() >= C):
            raise ValueError(f"propose got a mutation of {len(m.base)} strategies with parents up to "
                             f"{parents.max(initial=-1)}; mutate the {C} chains' strategies")
        b = cells // V
        v = cells - b * V
        at = parents[b] * V + v
        old = self._parent.reshape(len(FIELDS), -1)[:, at]
        # where the proposals change them, the mutated strategies must be the chains' (comparing
        # every cell would cost a pass over all chains per step)
        if any((getattr(m.base, f).reshape(-1)[at] != o).any() for f, o in zip(FIELDS, old)):
            raise ValueError("propose got a mutation of other strategies than the chains' current ones; mutate the "
                             "strategies of the last reset/accept")
        new = m.values
        fast = np.zeros(0, np.int64)
        if len(m.group_rows):   # group changes: from aggregates where they pay (see below), else by cell
            fast, (gb, gv, gold, gnew) = self._groups.changes(m, aggregate=len(m) >= _AGGREGATE_FROM * C)
            b, v = np.concatenate([b, gb]), np.concatenate([v, gv])
            old, new = np.concatenate([old, gold], axis=1), np.concatenate([new, gnew], axis=1)
        # cells whose own fields changed (not only their strategy's options): old and new halves
        own = np.zeros(len(b), bool)
        for f in CELL_FIELDS:
            own |= old[FIELD_INDEX[f]] != new[FIELD_INDEX[f]]
        own = np.flatnonzero(own)
        both = np.concatenate([old[:, own], new[:, own]], axis=1)
        cell_dict = {f: both[FIELD_INDEX[f]] for f in CELL_FIELDS}
        self._grow(cell_dict)
        # (C-contiguous, entries index it flat; take with out and mode="clip" is several times
        # faster than without)
        sums = np.take(self._sums, parents, axis=1, out=np.empty((self._sums.shape[0], len(parents))), mode="clip")
        if len(own):
            bb = np.concatenate([b[own], b[own]])
            self._add_cells(sums, bb, np.concatenate([v[own], v[own]]), cell_dict, paired=True)
        if len(fast):
            self._groups.add(sums, m, fast)
        wide = self._propose_wide(parents, len(m), b, v, old, new)
        self._pending = (m, sums, wide, (b[own], v[own], old[:, own], new[:, own]))
        return self._features(sums, wide)

    def accept(self, chosen) -> None:
        """Which proposals of the last ``propose`` replace the chains' strategies: ``chosen[c]`` the
        proposal that chain c moves to, -1 where it stays.

        Raises:
            ValueError: no proposal is pending, or ``chosen`` is not one proposal or -1 per chain.
        """
        if self._pending is None:
            raise ValueError("IncrementalFeaturizer.accept has no pending proposal: call propose first")
        m, sums, wide, changed = self._pending
        C = self._parent.shape[1]
        chosen = np.asarray(chosen)
        if chosen.shape != (C,) or chosen.dtype.kind not in "iu" or (chosen >= len(m)).any() or (chosen < -1).any():
            raise ValueError(f"accept takes one proposal index (0..{len(m) - 1}) or -1 per chain ({C} chains), "
                             f"got {chosen!r}")
        moved = np.flatnonzero(chosen >= 0)
        if len(moved):
            rows = chosen[moved]
            self._groups.follow(moved, m.parents[rows], rows, changed)
            moved_to = m.take(rows)
            for parent, f in zip(self._parent, FIELDS):
                parent[moved] = getattr(moved_to, f)
            self._sums[:, moved] = sums[:, rows]
            self._wide[:, moved] = wide[:, rows]
        self._pending = None

    def current(self) -> EncodedStrategies:
        """The chains' strategies (a copy)."""
        if self._parent is None:
            raise ValueError("IncrementalFeaturizer has no chains yet: call reset(strategies)")
        return EncodedStrategies(*self._parent.copy())

    # ---- internals -----------------------------------------------------------------------------
    def _check_width(self, e: EncodedStrategies) -> None:
        if e.kind.shape[1] != self.tables.V:
            raise ValueError(f"strategies encode {e.kind.shape[1]} variables but the model has {self.tables.V}")

    def _propose_wide(self, parents: np.ndarray, B: int, b: np.ndarray, v: np.ndarray, old: np.ndarray,
                      new: np.ndarray) -> np.ndarray:
        """(4, B) staleness max, sync count, backend and hierarchy max of the proposals (``featurize`` reduces
        them over the variables): the parents' updated by the changed cells (proposals ``b``,
        variables ``v``; ``old``, ``new``: their fields). A maximum that a change may have lowered
        is recomputed over its proposal's row."""
        wide = self._wide[:, parents]
        for row, f in ((0, "staleness"), (1, "sync"), (2, "backend"), (3, "hierarchical")):
            i = FIELD_INDEX[f]
            ch = np.flatnonzero(new[i] != old[i])   # few: cells that changed synchronizer, a PS mode
            if not len(ch):
                continue
            bc, o, n = b[ch], old[i, ch], new[i, ch]
            if f == "sync":
                np.add.at(wide[row], bc, n - o)
                continue
            lowered = np.unique(bc[(o == wide[row, bc]) & (n < o)])
            np.maximum.at(wide[row], bc, n)
            if len(lowered):   # the row's maximum again, from the parent's row with the cells changed
                vals = self._parent[i].take(parents[lowered], axis=0)
                at = np.flatnonzero(np.isin(b, lowered))
                vals[np.searchsorted(lowered, b[at]), v[at]] = new[i, at]
                wide[row, lowered] = vals.max(axis=1)
        return wide

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
        if self._groups is not None:
            self._groups.drop(new)   # laid out for the old layout
        if self._sums is not None:
            B = self._sums.shape[1]
            sums = np.zeros((new.height, B))
            sums[:old.groups] = self._sums[:old.groups]
            sums[new.groups:].reshape(3, reach, B)[:, :old.G] = self._sums[old.groups:].reshape(3, old.G, B)
            self._sums = sums

    def _add_cells(self, sums: np.ndarray, b, v, cells: dict, *, paired: bool, sign: np.ndarray | None = None) -> None:
        """Add the contributions of cells (strategies ``b``, variables ``v``, field values ``cells``)
        to ``sums`` (height, B), in place. ``paired``: the cells are two halves, the old values then
        the new ones of the same cells, and the old ones are taken out. ``sign``: else, per cell,
        1 to put it in, -1 to take it out (default: all in)."""
        t, lay = self.tables, self._lay
        B = sums.shape[1]
        c = cell_parts(t, v, cells)
        n = len(b)
        if paired:
            sign = np.ones(n)
            sign[:n // 2] = -1.0
        elif sign is None:
            sign = np.ones(n)
        kind = cells["kind"]
        sp = np.flatnonzero(c.sparse_ps)
        K = int(cells["shards"][sp].max()) if len(sp) else 0
        # the four sums (count, sparse, value, dense value bytes) move only when a variable changes
        # synchronizer: otherwise its old and new entries cancel, and are left out
        if paired:
            flip = kind[:n // 2] != kind[n // 2:]
            moved = np.flatnonzero(np.concatenate([flip, flip]))
        else:
            moved = np.arange(n)
        # shards on nodes (PS) and on groups (all-reduce): shard i < e3 carries X + Y [i < e2], one
        # entry per shard (cell: the cell of each; i: its shard)
        cell = np.repeat(np.arange(n), c.e3)
        i = np.arange(len(cell)) - np.repeat(np.cumsum(c.e3) - c.e3, c.e3)
        # entries laid out (entry, cell), so that numpy's inner loops run over cells; an entry's
        # flat index is its row of the sums x B + its strategy
        idx_all = np.empty(6 * n + len(cell) + K * len(sp) + 4 * len(moved), np.int64)
        w_all = np.empty(len(idx_all))
        idx, w = idx_all[:6 * n].reshape(6, n), w_all[:6 * n].reshape(6, n)
        # fp16 / PowerSGD raw bytes, all-gathers and PowerSGD matrices
        np.add(lay.ar_scalars * B + b, np.arange(4)[:, None] * B, out=idx[:4])
        vb = t.val_bytes[v] * sign
        np.multiply(c.is16, vb, out=w[0])
        np.multiply(c.psgd, vb, out=w[1])
        np.multiply(c.gathers, sign, out=w[2])
        np.multiply(c.psgd_mats, sign, out=w[3])
        # wire bytes over breakpoints: + at breakpoint 0, - past the variable's ready position
        np.add((lay.ps_wire + kind * (lay.ar_wire - lay.ps_wire)) * B, b, out=idx[4])
        np.add(idx[4], self._ready_bps[v] * B, out=idx[5])
        np.multiply((1.0 - c.arf) * self._ps_wire[v] + c.wv, sign, out=w[4])
        np.negative(w[4], out=w[5])
        at = 6 * n
        ws, ids = w_all[at:at + len(cell)], idx_all[at:at + len(cell)]
        ws[:] = c.Y[cell]
        ws *= i < c.e2[cell]
        ws += c.X[cell]
        ws *= sign[cell]
        ps = kind == KIND_PS
        start = np.where(ps, c.line * t.N, lay.groups + c.cls * lay.G + cells["group"]) * B + b
        on_ps = ps[cell]
        np.add(start[cell], np.where(on_ps, self._node_of(cells["dest"][cell] + i * on_ps, B), i * B), out=ids)
        at += len(cell)
        if len(sp):   # index bytes of sparse PS shards: the third hosted lane
            k = np.arange(K)[:, None]
            idx2, w2 = idx_all[at:at + K * len(sp)].reshape(K, len(sp)), w_all[at:at + K * len(sp)].reshape(K, len(sp))
            np.add(2 * t.N * B + b[sp], self._node_of(cells["dest"][sp] + k, B), out=idx2)
            np.multiply(c.Ys[sp], k < c.extra[sp], out=w2)
            w2 += c.Xs[sp]
            w2 *= k < cells["shards"][sp]
            w2 *= sign[sp]
            at += K * len(sp)
        if len(moved):   # the four sums, into the PS or the all-reduce block
            idx4, w4 = idx_all[at:].reshape(4, len(moved)), w_all[at:].reshape(4, len(moved))
            np.add((lay.ps_sums + kind[moved] * (lay.ar - lay.ps_sums)) * B + b[moved], np.arange(4)[:, None] * B,
                   out=idx4)
            np.multiply(self._sums_t.take(v[moved], axis=1), sign[moved], out=w4)
        np.add.at(sums.reshape(-1), idx_all, w_all)   # numpy >= 1.25: cheaper than bincount + sum

    def _node_of(self, position: np.ndarray, B: int) -> np.ndarray:
        """Node x B of each position on a PS line (by table: integer division is slow)."""
        need = int(position.max(initial=0)) + 1
        if len(self._nodes) < need:
            self._nodes = np.arange(2 * need) % self.tables.N
        return self._nodes.take(position) * B

    def _features(self, sums: np.ndarray, wide: np.ndarray) -> np.ndarray:
        lay, t = self._lay, self.tables
        B, nbp = sums.shape[1], lay.nbp
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
        scal = np.empty((len(SCALAR_ROWS), B), np.float32)
        scal[SCALAR_ROWS["fp16_raw"]] = sums[lay.ar_scalars]
        scal[SCALAR_ROWS["psgd_raw"]] = sums[lay.ar_scalars + 1]
        scal[SCALAR_ROWS["psgd_n"]] = sums[lay.ar_scalars + 3]
        scal[SCALAR_ROWS["stale"]] = wide[0]
        scal[SCALAR_ROWS["sync"]] = wide[1]
        scal[SCALAR_ROWS["objectstore"]] = wide[2] == BACKEND_ID["objectstore"]
        scal[SCALAR_ROWS["cpu_ring"]] = cpu_ring(wide[2])
        scal[SCALAR_ROWS["hier"]] = wide[3]
        scal[SCALAR_ROWS["n_groups"]] = (total > 0.5).sum(0)
        scal[SCALAR_ROWS["n_coll"]] = full.reshape(3 * lay.G, B).sum(0) + full[2].sum(0) + sums[lay.ar_scalars + 2]
        scal[SCALAR_ROWS["max_group"]] = total.max(0)
        scal[SCALAR_ROWS["curve_ns"]] = curve_ns(t.ar_curve, total.T) if t.ar_curve is not None else 0.0
        parts = FeatureSums(sums[:3 * t.N].reshape(3, t.N, B), psum, sums[lay.ar:lay.ar + 4].astype(np.float32), wsum, scal)
        return assemble(t, self.params, parts)
