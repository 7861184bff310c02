"""A fusion group's new compressor, scored from aggregates (part of ``IncrementalFeaturizer``).

A group change (``Mutation.group_rows``) gives every compressible member of a fusion group one
compressor. Where the members shared one before, the proposal's sums are its chain's plus
S[new] - S[old], S[k] holding per (chain, group) the sums of the chain's compressible members of
the group as if they used compressor k: one entry per proposal instead of a cell per member (a
group may hold most of a model's variables). An entry is built when first needed and kept up to
date while the chains move (members that move in or out are added or taken out); every entry is
dropped when the sums' layout grows. Groups without a shared compressor, and every group when
there are few proposals per chain (an entry would hardly be used twice), are expanded into cells.

Sums of float32 terms in float64 are exact (see ``tuner.features.incremental``), so S[new] - S[old] gives
the numbers that taking the members' old cells out and putting their new ones in gives.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from strategy_space.encoding import (FIELD_INDEX, FIELDS, KIND_PS, VARIABLE_FIELDS, EncodedStrategies, GroupIndex,
                                     Mutation, member_codec, runs)

CELL_FIELDS = VARIABLE_FIELDS


class GroupSums:
    """S for the chains of an ``IncrementalFeaturizer``, one row per (compressor, chain, group)
    (``S``: rows x the sums' height, so that a proposal's rows are read contiguously).

    Args:
        parents: (FIELDS, C, V) the chains' strategies (the featurizer's array, moved in place).
        layout: rows of the sums (``incremental._Layout``).
        add_cells: the featurizer's ``_add_cells`` (contributions of cells to columns of sums).
    """

    def __init__(self, parents: np.ndarray, layout, add_cells: Callable):
        self.parents, self.add_cells = parents, add_cells
        self.V = parents.shape[2]
        self.compressible: np.ndarray | None = None   # of the mutations' space
        self.drop(layout)

    def index(self, m: Mutation) -> GroupIndex:
        """The chains' GroupIndex with shared compressors (``m``'s own when it has one)."""
        if self.compressible is None or not np.array_equal(self.compressible, m.compressible):
            self.compressible = np.asarray(m.compressible, bool)
            self.drop()
        if m.groups is not None and m.groups.shared is not None:
            return m.groups
        return GroupIndex.of(EncodedStrategies(*self.parents), 1, self.compressible)

    def drop(self, layout=None) -> None:
        """Forget every entry (the sums' layout changed to ``layout``, or the compressible
        variables did)."""
        self.layout = layout or self.layout
        self.S, self.valid, self.codes = np.zeros((0, self.layout.height)), np.zeros(0, bool), {}

    def changes(self, m: Mutation, aggregate: bool):
        """The group changes of ``m`` that aggregates score (indices into ``m.group_rows``; none
        unless ``aggregate``), and the others as cells (proposal, variable, old and new fields)
        whose fields change."""
        gi = self.index(m)
        uniform = gi.shared[1] & aggregate
        V = self.V
        key = m.parents[m.group_rows] * gi.G + m.group_ids
        by_cell = np.flatnonzero(~uniform[key])
        pos, n = gi.runs(key[by_cell])
        parent_cell = gi.cells[pos]
        u = np.repeat(by_cell, n)
        old = self.parents.reshape(len(FIELDS), -1)[:, parent_cell]
        new = old.copy()
        new[FIELD_INDEX["compressor"]], new[FIELD_INDEX["rank"]] = member_codec(m.group_codec[:, u],
                                                                                self.compressible[parent_cell % V])
        differs = (new != old).any(axis=0)
        cells = (m.group_rows[u][differs], parent_cell[differs] % V, old[:, differs], new[:, differs])
        return np.flatnonzero(uniform[key]), cells

    def add(self, sums: np.ndarray, m: Mutation, ops: np.ndarray) -> None:
        """Add S[new] - S[old] of group changes ``ops`` (of groups with a shared compressor) to
        their proposals."""
        gi = self.index(m)
        _, _, comp, rank = gi.shared
        chain, group = m.parents[m.group_rows[ops]], m.group_ids[ops]
        key = chain * gi.G + group
        new_c, new_r = member_codec(m.group_codec[:, ops], True)
        codes = np.concatenate([np.stack([new_c, new_r]), np.stack([comp[key], rank[key]])], axis=1)
        at = self._code_rows(codes) + np.tile(chain * self.layout.G + group, 2)
        self._build(at, codes, np.tile(key, 2), gi)
        both = self.S[at]
        delta = both[:len(ops)] - both[len(ops):]
        # most entries of a delta are 0 (a compressor moves bytes between few rows): add the others
        at = np.flatnonzero(delta)
        j = at // delta.shape[1]
        np.add.at(sums.reshape(-1), (at - j * delta.shape[1]) * sums.shape[1] + m.group_rows[ops][j],
                  delta.reshape(-1)[at])

    def _code_rows(self, codes: np.ndarray) -> np.ndarray:
        """First row of S of each (compressor, rank) column of ``codes`` (new codes get theirs)."""
        C, G = self.parents.shape[1], self.layout.G
        packed = codes[0].astype(np.int64) << 32 | codes[1]
        first = np.empty(len(packed), np.int64)
        for p in np.unique(packed):
            code = (int(p) >> 32, int(p) & 0xFFFFFFFF)
            if code not in self.codes:
                self.codes[code] = len(self.S)
                self.S = np.concatenate([self.S, np.zeros((C * G, self.layout.height))])
                self.valid = np.append(self.valid, np.zeros(C * G, bool))
            first[packed == p] = self.codes[code]
        return first

    def _build(self, col: np.ndarray, codes: np.ndarray, key: np.ndarray, gi: GroupIndex) -> None:
        """Build the rows ``col`` of S not built yet (codes and GroupIndex keys of each)."""
        todo = np.flatnonzero(~self.valid[col])
        if not len(todo):
            return
        col, at = np.unique(col[todo], return_index=True)
        codes, key = codes[:, todo[at]], key[todo[at]]
        pos, n = gi.runs(key)
        cm = self.compressible[gi.cells[pos] % self.V]
        cells = gi.cells[pos][cm]
        fields_ = self.parents.reshape(len(FIELDS), -1)[:, cells]
        member_of = np.repeat(np.arange(len(col)), n)[cm]
        fields_[FIELD_INDEX["compressor"]], fields_[FIELD_INDEX["rank"]] = codes[:, member_of]
        built = np.zeros((self.layout.height, len(col)))
        if len(cells):
            self.add_cells(built, member_of, cells % self.V, {f: fields_[FIELD_INDEX[f]] for f in CELL_FIELDS},
                           paired=False)
        self.S[col] = built.T
        self.valid[col] = True

    def follow(self, moved: np.ndarray, parents: np.ndarray, rows: np.ndarray, changed) -> None:
        """Chains ``moved`` take proposals ``rows`` (of chains ``parents``): their built rows of S
        follow, the changed cells' (``changed``: proposal, variable, old and new fields) old
        contributions taken out and new ones put in (a cell whose compressor alone changed leaves
        S as it is)."""
        if not self.codes:
            return
        C, G, F = self.parents.shape[1], self.layout.G, FIELD_INDEX
        if not np.array_equal(parents, moved):   # chains that take another chain's proposal
            S, valid = self.S.reshape(-1, C, G, self.layout.height), self.valid.reshape(-1, C, G)
            S[:, moved], valid[:, moved] = S[:, parents], valid[:, parents]
        b, v, old, new = changed
        order = np.argsort(b, kind="stable")
        pos, n = runs(b[order], rows, rows + 1)
        pos = order[pos]
        chain, v, old, new = np.repeat(moved, n), v[pos], old[:, pos], new[:, pos]
        placed = np.zeros(len(v), bool)
        for f in CELL_FIELDS:
            if f not in ("compressor", "rank"):
                placed |= old[F[f]] != new[F[f]]
        # the halves that count in S: compressible all-reduce variables; old ones taken out
        ar_old = placed & (old[F["kind"]] != KIND_PS) & self.compressible[v]
        ar_new = placed & (new[F["kind"]] != KIND_PS) & self.compressible[v]
        if not (ar_old.any() or ar_new.any()):
            return
        fields_ = np.concatenate([old[:, ar_old], new[:, ar_new]], axis=1)
        local = np.concatenate([chain[ar_old], chain[ar_new]]) * G + fields_[F["group"]]
        var = np.concatenate([v[ar_old], v[ar_new]])
        sign = np.concatenate([-np.ones(ar_old.sum()), np.ones(ar_new.sum())])
        codes = list(self.codes.items())   # every code's built rows, in one call
        col = np.concatenate([at + local for _, at in codes])
        fields_ = np.tile(fields_, len(codes))
        for j, (code, _) in enumerate(codes):
            part = slice(j * len(local), (j + 1) * len(local))
            fields_[F["compressor"], part], fields_[F["rank"], part] = code
        live = np.flatnonzero(self.valid[col])
        if len(live):
            cols, which = np.unique(col[live], return_inverse=True)
            change = np.zeros((self.layout.height, len(cols)))
            self.add_cells(change, which, np.tile(var, len(codes))[live], {f: fields_[F[f], live] for f in CELL_FIELDS},
                           paired=False, sign=np.tile(sign, len(codes))[live])
            self.S[cols] += change.T
