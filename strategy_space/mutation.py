"""Mutations of encoded strategies: each proposal changes one decision of its parent, drawn as a
change (``encoding.Mutation``: the cells that differ and their fields, or a fusion group's new
compressor), never as a fresh batch.

What a draw reads of its parent row (its strategy-wide options, the members of a fusion group and
whether they share a compressor, the PS variables) is indexed once per call for the batch varied
(``_RowFacts``: O(rows x V)); a draw then costs O(1) plus the cells it changes (a PS mode: every PS
variable; flat vs hierarchical all-reduce: every all-reduce variable; a group's compressor: one
group change, however large the group). The fields are
stacked (field, cell), so one gather reads every field of a set of cells; the uniform numbers of a
pass are drawn in one call. ``StrategySpace.mutate_rows`` is the entry point.
"""
from __future__ import annotations

import numpy as np

from .encoding import (COMPRESSOR_ID, FIELD_INDEX, FIELDS, KIND_AR, KIND_PS, EncodedStrategies, GroupIndex, Mutation,
                       runs)

MUTABLE = ("kind", "shards", "dest", "group", "compressor", "local_replication", "mode", "hierarchical")
_PSGD = COMPRESSOR_ID["powersgd"]
# share of proposals that switch their strategy between flat and hierarchical all-reduce (where a
# node holds several workers): a switch changes every all-reduce variable, so as one of the five
# all-reduce decisions it made scoring ~5x slower on the 200-variable benchmark, at 1 in 32 still
# ~1.5x; at 1 in 128 the cost is within noise and a search round (92,160 proposals) still tries
# ~700 switches
HIERARCHICAL_SHARE = 1.0 / 128
_F = FIELD_INDEX
_M = {n: i for i, n in enumerate(MUTABLE)}
# per field: the decisions that draw it afresh ("kind" redraws the variable's whole synchronizer)
_REDRAWS = {"kind": ("kind",), "shards": ("kind", "shards"), "dest": ("kind", "dest"), "group": ("kind", "group"),
            "group_stride": ("kind", "group"), "local_replication": ("kind", "local_replication")}
_U = {n: i for i, n in enumerate(("var", "decision", "kind", "split", "shards", "dest", "group", "stride", "lr",
                                  "mode", "backend", "pick", "hier", "flip"))}   # rows of a pass's uniform numbers


class Mutator:
    """Draws mutations for one StrategySpace (see ``StrategySpace.mutate_rows``).

    Args:
        space: the space whose choices are drawn (its sampling distribution, per decision).
    """

    def __init__(self, space):
        self.space = space
        per_kind = [self.choices(k) for k in (KIND_PS, KIND_AR)]
        self._count = np.array([len(c) for c in per_kind])
        self._table = np.zeros((2, max(self._count)), dtype=np.int64)
        for k, c in enumerate(per_kind):
            self._table[k, :len(c)] = c
        self._redraws = {f: np.isin(np.arange(len(MUTABLE)), [_M[d] for d in ds]) for f, ds in _REDRAWS.items()}
        self._modes = space.mode_choices()
        self._backends = np.array(space.backends, dtype=np.int32)

    def choices(self, kind: int) -> list[int]:
        """Indices into MUTABLE of the decisions that can change for a variable of ``kind``."""
        sp = self.space
        names = ["kind", "shards"]
        if kind == KIND_PS:
            names += ["dest"] if sp.num_nodes > 1 else []
            names += ["local_replication"] if sp.offers_node_aggregation else []
            names += ["mode"] if len(sp.staleness) + sp.allow_async > 1 else []
        else:
            names += ["group"] if sp.num_groups > 1 else []
            names += ["compressor"] if len(sp.compressor_choices) > 1 else []
        return [_M[n] for n in names]

    def mutate(self, e: EncodedStrategies, parents: np.ndarray, rng: np.random.Generator, tries: int) -> Mutation:
        """``StrategySpace.mutate_rows`` (``parents`` checked there)."""
        stack = np.stack([getattr(e, f) for f in FIELDS])   # the mutation's own copy, (field, row, variable)
        base = EncodedStrategies(*stack)
        facts = _RowFacts(self.space, base, stack.reshape(len(FIELDS), -1))
        V = base.kind.shape[1]
        todo = np.arange(len(parents))
        cells, values = [np.zeros(0, np.int64)], [np.zeros((len(FIELDS), 0), np.int32)]
        ops = [np.zeros((4, 0), np.int64)]   # proposal, group, compressor, rank
        left = tries
        while len(todo) and left > 0:
            # after the first pass, the few proposals left draw several times at once and keep
            # their first change: the same as drawing one after another, in fewer passes
            R = 1 if left == tries else min(left, 4)
            rows = np.repeat(todo, R)
            changed, (j, col, vals), (jo, group, codec) = self._draw(facts, parents[rows], rng)
            changed = changed.reshape(len(todo), R)
            done = changed.any(axis=1)
            first = np.zeros(len(rows), bool)
            first[(np.arange(len(todo)) * R + changed.argmax(axis=1))[done]] = True
            keep = first[j]
            cells.append(rows[j[keep]] * V + col[keep])
            values.append(vals[:, keep])
            keep = first[jo]
            ops.append(np.concatenate([rows[jo[keep]][None], group[keep][None], codec[:, keep]]))
            todo, left = todo[~done], left - R
        cells, values, ops = np.concatenate(cells), np.concatenate(values, axis=1), np.concatenate(ops, axis=1)
        order = np.argsort(cells, kind="stable")
        ops = ops[:, np.argsort(ops[0], kind="stable")]
        return Mutation(base, parents, cells[order], values[:, order], ops[0], ops[1], ops[2:],
                        self.space.compressible, facts.groups)

    def _draw(self, facts: "_RowFacts", p: np.ndarray, rng):
        """One change of each of rows ``p``.

        Returns:
            whether each draw changed its row; the cells that differ (the draw: index into ``p``,
            the variable, every field); the group changes (the draw, the group, (compressor, rank)).
        """
        V, n = facts.V, len(p)
        u = rng.random((len(_U), n))
        v = (u[_U["var"]] * V).astype(np.int64)
        old = facts.flat[:, p * V + v]
        kind = old[_F["kind"]]
        what = self._table[kind, (u[_U["decision"]] * self._count[kind]).astype(np.int64)]
        if self.space.offers_node_aggregation:   # a strategy-wide switch, drawn apart (HIERARCHICAL_SHARE)
            what[(u[_U["flip"]] < HIERARCHICAL_SHARE) & facts.has_ar[p]] = _M["hierarchical"]
        changed = np.zeros(n, bool)
        draws, cols, values = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)], [np.zeros((len(FIELDS), 0), np.int32)]
        single = np.flatnonzero((what != _M["mode"]) & (what != _M["compressor"]) & (what != _M["hierarchical"]))
        if len(single):
            new = self._redraw(facts, p[single], v[single], what[single], old[:, single], u[:, single])
            ch = (new != old[:, single]).any(axis=0)
            changed[single] = ch
            draws.append(single[ch])
            cols.append(v[single[ch]])
            values.append(new[:, ch])
        for decision, draw in (("mode", self._mode), ("hierarchical", self._hierarchical)):
            s = np.flatnonzero(what == _M[decision])
            if len(s):
                ch, i, col, vals = draw(facts, p[s], u[:, s])
                changed[s] = ch
                draws.append(s[i])
                cols.append(col)
                values.append(vals)
        # a group's new compressor: one group change, not a cell per member
        s = np.flatnonzero(what == _M["compressor"])
        choices = self.space.compressor_choices
        codec = choices[(u[_U["pick"], s] * len(choices)).astype(np.int64)].T.astype(np.int64)
        group = old[_F["group"], s].astype(np.int64)
        changed[s] = facts.compressor_changes(p[s], group, codec)
        keep = np.flatnonzero(changed[s])
        cells = (np.concatenate(draws), np.concatenate(cols), np.concatenate(values, axis=1))
        return changed, cells, (s[keep], group[keep], codec[:, keep])

    def _redraw(self, facts: "_RowFacts", p: np.ndarray, v: np.ndarray, what: np.ndarray, old: np.ndarray,
                u: np.ndarray) -> np.ndarray:
        """Fields of cells (rows ``p``, variables ``v``; ``old``: their fields) with the decision
        ``what`` drawn afresh as ``sample_encoded`` draws it, normalized."""
        sp = self.space
        drawn = {
            "kind": u[_U["kind"]] < 0.5,
            "shards": np.where(u[_U["split"]] < 0.5, 1 + (u[_U["shards"]] * sp.shard_max[v]).astype(np.int64), 1),
            "dest": (u[_U["dest"]] * sp.num_nodes).astype(np.int64),
            "group": (u[_U["group"]] * sp.num_groups).astype(np.int64),
            "group_stride": u[_U["stride"]] < 0.5,
            "local_replication": (u[_U["lr"]] < 0.5) & sp.offers_node_aggregation,
        }
        new = old.copy()
        for f, value in drawn.items():
            np.copyto(new[_F[f]], value, where=self._redraws[f][what], casting="unsafe")
        # a new synchronizer runs in its strategy's PS mode and with its backend
        whole = np.flatnonzero(what == _M["kind"])
        if len(whole):
            pw, uw = p[whole], u[:, whole]
            mode = self._modes[(uw[_U["mode"]] * len(self._modes)).astype(np.int64)]
            backend = self._backends[(uw[_U["backend"]] * len(self._backends)).astype(np.int64)]
            has_ps = facts.has_ps[pw]
            new[_F["sync"], whole] = np.where(has_ps, facts.sync[pw], mode[:, 0])
            new[_F["staleness"], whole] = np.where(has_ps, facts.stale[pw], mode[:, 1])
            new[_F["backend"], whole] = np.where(facts.has_ar[pw], facts.backend[pw], backend)
            new[_F["hierarchical"], whole] = np.where(facts.has_ar[pw], facts.hier[pw],
                                                      (uw[_U["hier"]] < 0.5) & self.space.offers_node_aggregation)
        # a variable that joins a fusion group takes the compressor of the group's other members
        s = np.flatnonzero(self._redraws["group"][what])
        if len(s):
            src = facts.group_member(p[s], new[_F["group"], s], v[s])
            has = src >= 0
            new[_F["compressor"], s[has]] = facts.flat[_F["compressor"], src[has]]
            new[_F["rank"], s[has]] = facts.flat[_F["rank"], src[has]]
        sp.normalize_cells(new, v)
        return new

    def _hierarchical(self, facts: "_RowFacts", p: np.ndarray, u: np.ndarray):
        """Strategies ``p`` switch between flat and hierarchical all-reduce: whether each changed
        (one without all-reduce variables cannot), and the cells that differ (draw, variable,
        fields)."""
        V = facts.V
        pos, n = runs(facts.ar_cells, p * V, (p + 1) * V)
        i = np.repeat(np.arange(len(p)), n)
        cell = facts.ar_cells[pos]
        vals = facts.flat[:, cell]
        vals[_F["hierarchical"]] = 1 - facts.hier[p][i]
        differs = vals[_F["hierarchical"]] != facts.flat[_F["hierarchical"], cell]
        i = i[differs]
        return np.bincount(i, minlength=len(p)) > 0, i, cell[differs] % V, vals[:, differs]

    def _mode(self, facts: "_RowFacts", p: np.ndarray, u: np.ndarray):
        """A new PS mode for strategies ``p``: whether each changed, and the cells that differ
        (draw, variable, fields)."""
        V = facts.V
        pick = self._modes[(u[_U["pick"]] * len(self._modes)).astype(np.int64)]
        pos, n = runs(facts.ps_cells, p * V, (p + 1) * V)
        i = np.repeat(np.arange(len(p)), n)
        cell = facts.ps_cells[pos]
        vals = facts.flat[:, cell]
        vals[_F["sync"]], vals[_F["staleness"]] = pick[i, 0], pick[i, 1]
        differs = (vals[_F["sync"]] != facts.flat[_F["sync"], cell]) | (vals[_F["staleness"]] !=
                                                                         facts.flat[_F["staleness"], cell])
        i = i[differs]
        return np.bincount(i, minlength=len(p)) > 0, i, cell[differs] % V, vals[:, differs]


class _RowFacts:
    """What draws read of the rows of ``e``: every field of every cell (``flat``: field x flat
    cell), per row its PS mode, backend and hierarchy, its PS and all-reduce cells, and its all-reduce cells by fusion group
    (flat indices)."""

    def __init__(self, space, e: EncodedStrategies, flat: np.ndarray):
        self.flat = flat
        B, self.V = e.kind.shape
        ps = e.kind == KIND_PS
        rows = np.arange(B)
        first_ps, first_ar = ps.argmax(axis=1), (~ps).argmax(axis=1)
        self.has_ps, self.has_ar = ps.any(axis=1), ~ps.all(axis=1)
        self.sync, self.stale = e.sync[rows, first_ps], e.staleness[rows, first_ps]
        self.backend = e.backend[rows, first_ar]
        self.hier = e.hierarchical[rows, first_ar]
        self.ps_cells = np.flatnonzero(ps)
        self.ar_cells = np.flatnonzero(~ps)
        # all-reduce variables by (row, group): the first two compressible ones of each, and
        # whether a group's members share one compressor (and which)
        self.groups = gi = GroupIndex.of(e, space.num_groups, space.compressible)
        self.G = gi.G
        cm = space.compressible[gi.cells % self.V]
        cm_cells = gi.cells[cm]
        start = np.searchsorted(gi.key[cm], np.arange(B * gi.G + 1))
        n = np.diff(start)
        pad = np.append(cm_cells, [-1, -1])   # -1: no such member
        self.cm_first = np.where(n > 0, pad[start[:-1]], -1)
        self.cm_second = np.where(n > 1, pad[np.minimum(start[:-1] + 1, len(pad) - 1)], -1)
        self.cm_count, self.uniform, self.comp, self.rank = gi.shared

    def group_member(self, p: np.ndarray, g: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Flat cell of the first compressible all-reduce variable other than ``v`` in group ``g``
        of row ``p`` (-1 where there is none)."""
        key = p * self.G + g
        first = self.cm_first[key]
        return np.where(first % self.V == v, self.cm_second[key], first)

    def compressor_changes(self, p: np.ndarray, g: np.ndarray, codec: np.ndarray) -> np.ndarray:
        """Whether group ``g`` of row ``p`` taking compressor ``codec`` changes a variable."""
        key = p * self.G + g
        changes = self.cm_count[key] > 0
        same = self.uniform[key] & (codec[0] == self.comp[key])
        rank = codec[1] * (codec[0] >= _PSGD)
        same &= rank == self.rank[key]
        # a group without one shared compressor changes whatever it takes (a stray compressor on a
        # member that cannot compress is normalized away)
        return (changes & ~same) | ~self.uniform[key]
