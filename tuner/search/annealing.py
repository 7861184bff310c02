"""Model-based search: simulated annealing over mutations, scored by a predictor, and a diverse
choice of what to measure next.

``score`` is any vectorised function from EncodedStrategies to predicted step seconds (lower is
better), or a ``ChainScorer`` (``tuner.cost_models.scoring``) that scores each proposal from its
chain's state (an ``IncrementalScorer``: the same seconds without featurizing every variable of every
proposal). The annealer works on log time, so temperatures are relative (0.05 ~ accept a 5 % worse
neighbour with probability 1/e).

Each step, every chain proposes ``proposals`` mutations of its strategy (``StrategySpace.mutate_rows``:
changes, not fresh rows), all chains' proposals are scored in one call, and each chain takes a
Metropolis step towards its best proposal. Many proposals per step keep the predictor's calls
large (its cost per call is fixed, its cost per row small); the pool keeps the best distinct
strategies of every proposal scored, building rows only for those that can still enter it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from strategy_space.encoding import FIELD_INDEX, FIELDS, EncodedStrategies, GroupIndex, Mutation, member_codec
from strategy_space.space import StrategySpace

from tuner.cost_models.scoring import ChainScorer

Score = Callable[[EncodedStrategies], np.ndarray]
# fields that make two strategies different in what they run (options that normalize away excluded)
DECISION_FIELDS = ("kind", "shards", "dest", "group", "group_stride", "local_replication", "staleness",
                   "sync", "compressor", "rank", "backend", "hierarchical")


@dataclass
class Pool:
    """Best distinct candidates seen, with their predicted seconds."""

    encoded: EncodedStrategies
    predicted: np.ndarray

    def __len__(self) -> int:
        return len(self.predicted)


class _Recompute:
    """A ``Score`` as a ChainScorer: every proposal built and scored from scratch."""

    def __init__(self, score: Score):
        self.score = score

    def reset(self, e: EncodedStrategies) -> np.ndarray:
        return self.score(e)

    def propose(self, m: Mutation) -> np.ndarray:
        return self.score(m.encoded)

    def accept(self, chosen: np.ndarray) -> None:
        pass


class _Fingerprints:
    """64-bit fingerprints of strategies, linear in their fields (sum of field x weight over the
    cells, modulo 2^64), so a proposal's is its parent's plus the change of its changed cells: equal
    strategies have equal fingerprints; two different ones share one with probability ~2^-60."""

    def __init__(self, V: int):
        rng = np.random.default_rng(0x5EED)
        self.w = rng.integers(0, 2**63, size=(len(FIELDS), V), dtype=np.uint64) * np.uint64(2) + np.uint64(1)

    def of(self, e: EncodedStrategies) -> np.ndarray:
        h = np.zeros(len(e), np.uint64)
        for f, w in zip(FIELDS, self.w):
            h += (getattr(e, f).astype(np.uint64) * w).sum(axis=1)
        return h

    def of_mutation(self, m: Mutation, base: np.ndarray) -> np.ndarray:
        """Fingerprints of the proposals of ``m``, from ``base``: those of ``m.base``'s rows."""
        V = self.w.shape[1]
        b = m.cells // V
        v = m.cells - b * V
        at = m.parents[b] * V + v
        old = np.stack([getattr(m.base, f).reshape(-1)[at] for f in FIELDS])
        change = ((m.values.astype(np.int64) - old).astype(np.uint64) * self.w[:, v]).sum(axis=0)
        h = base[m.parents]
        np.add.at(h, b, change)
        if len(m.group_rows):
            # a group's members take (c, r) where they compress, (0, 0) elsewhere: the change is
            # c x (their compressor weights) + r x (rank weights) - (what their fields weighed)
            gi = m.groups or GroupIndex.of(m.base)
            wc, wr = self.w[FIELD_INDEX["compressor"]], self.w[FIELD_INDEX["rank"]]
            var = gi.cells % V
            cm = m.compressible[var]
            was = (m.base.compressor.reshape(-1)[gi.cells].astype(np.uint64) * wc[var]
                   + m.base.rank.reshape(-1)[gi.cells].astype(np.uint64) * wr[var])
            sums = np.zeros((3, len(gi.start) - 1), np.uint64)
            np.add.at(sums[0], gi.key[cm], wc[var[cm]])
            np.add.at(sums[1], gi.key[cm], wr[var[cm]])
            np.add.at(sums[2], gi.key, was)
            key = m.parents[m.group_rows] * gi.G + m.group_ids
            comp, rank = member_codec(m.group_codec, True)
            h[m.group_rows] += (comp.astype(np.uint64) * sums[0, key] + rank.astype(np.uint64) * sums[1, key]
                                - sums[2, key])
        return h


class _Best:
    """The ``keep`` best distinct strategies offered (of equal ones and of equal scores, the first
    offered), held in ``keep`` slots: each offer ranks the held and the offered by score and builds
    rows only for the offered that enter."""

    def __init__(self, keep: int, V: int):
        self.rows = EncodedStrategies.zeros(keep, V)
        self.score = np.full(keep, np.inf)
        self.hash = np.zeros(keep, np.uint64)
        self.order = np.full(keep, -1, np.int64)   # when each was offered; -1: a free slot
        self.offered = 0

    def offer(self, source: EncodedStrategies | Mutation, scores: np.ndarray, hashes: np.ndarray) -> None:
        held = np.flatnonzero(self.order >= 0)
        full = len(held) == len(self.order)
        rank = np.arange(len(scores)) + self.offered
        self.offered += len(scores)
        cand = np.flatnonzero(scores < self.score[held].max()) if full else np.arange(len(scores))
        if not len(cand):
            return
        # of equal strategies offered now, the first in score order; none already held
        cand = cand[np.argsort(scores[cand], kind="stable")]
        cand = np.sort(cand[np.unique(hashes[cand], return_index=True)[1]])
        cand = cand[~np.isin(hashes[cand], self.hash[held])]
        # the best of held and offered (ties: the first offered)
        s = np.concatenate([self.score[held], scores[cand]])
        top = np.lexsort((np.concatenate([self.order[held], rank[cand]]), s))[:len(self.order)]
        enter = cand[top[top >= len(held)] - len(held)]
        if not len(enter):
            return
        out = held[np.setdiff1d(np.arange(len(held)), top, assume_unique=True)]
        slots = np.concatenate([np.flatnonzero(self.order < 0), out])[:len(enter)]
        new = source.take(enter)
        for f in FIELDS:
            getattr(self.rows, f)[slots] = getattr(new, f)
        self.score[slots], self.hash[slots], self.order[slots] = scores[enter], hashes[enter], rank[enter]
        rest = np.setdiff1d(out, slots, assume_unique=True)   # dropped, not refilled
        self.order[rest], self.score[rest] = -1, np.inf

    def result(self) -> tuple[EncodedStrategies, np.ndarray]:
        held = np.flatnonzero(self.order >= 0)
        held = held[np.lexsort((self.order[held], self.score[held]))]
        return self.rows.take(held), self.score[held]


def simulated_annealing(space: StrategySpace, score: Score | ChainScorer, init: EncodedStrategies,
                        rng: np.random.Generator, *, steps: int = 60, proposals: int = 1, t_start: float = 0.05,
                        t_end: float = 0.002, keep: int = 256,
                        project: Callable[[EncodedStrategies], EncodedStrategies] | None = None) -> Pool:
    """Run one annealing chain per row of ``init`` for ``steps`` steps.

    Args:
        score: predicted seconds of a batch, or a ChainScorer (e.g. an IncrementalScorer) that
            scores each proposal from its chain's current strategy.
        steps: moves per chain.
        proposals: mutations each chain proposes per step; the chain takes a Metropolis step
            towards the best of them (1: plain annealing).
        t_start, t_end: temperature (on log seconds) of the first and last step, geometric between.
        keep: size of the returned pool.
        project: applied to every proposal (e.g. constraints), so no chain leaves the legal set
            (the proposals are then built whole and compared with their chains').

    Returns:
        the ``keep`` best distinct strategies met on any chain, best first.

    Raises:
        ValueError: ``proposals`` or ``keep`` below 1.
    """
    if proposals < 1 or keep < 1:
        raise ValueError(f"proposals (per chain and step) and keep must be >= 1, got proposals={proposals}, "
                         f"keep={keep}")
    chains = score if hasattr(score, "propose") else _Recompute(score)
    cur = project(init.copy()) if project is not None else init.copy()
    C = len(cur)
    cur_s = np.log(np.maximum(chains.reset(cur), 1e-12))
    fingerprints = _Fingerprints(cur.kind.shape[1])
    cur_h = fingerprints.of(cur)
    best = _Best(keep, cur.kind.shape[1])
    best.offer(cur, cur_s, cur_h)   # copies: cur changes in place as chains move
    parents = np.repeat(np.arange(C), proposals)
    first = np.arange(C) * proposals
    for step in range(steps):
        temp = t_start * (t_end / t_start) ** (step / max(1, steps - 1))
        m = space.mutate_rows(cur, parents, rng)
        if project is not None:
            m = Mutation.diff(cur, project(m.encoded), parents)
        prop_s = np.log(np.maximum(chains.propose(m), 1e-12))
        prop_h = fingerprints.of_mutation(m, cur_h)
        pick = first + prop_s.reshape(C, proposals).argmin(axis=1)
        pick_s = prop_s[pick]
        with np.errstate(over="ignore"):
            accept = (pick_s < cur_s) | (rng.random(C) < np.exp(-(pick_s - cur_s) / temp))
        best.offer(m, prop_s, prop_h)
        chains.accept(np.where(accept, pick, -1))
        moved = np.flatnonzero(accept)
        if len(moved):
            moved_to = m.take(pick[moved])
            for f in cur.field_names():
                getattr(cur, f)[moved] = getattr(moved_to, f)
        cur_s = np.where(accept, pick_s, cur_s)
        cur_h[moved] = prop_h[pick[moved]]
    e, s = best.result()
    return Pool(e, np.exp(s))


def decision_matrix(e: EncodedStrategies) -> np.ndarray:
    """(B, V * F) array of the fields that distinguish strategies."""
    return np.concatenate([getattr(e, f) for f in DECISION_FIELDS], axis=1)


def select_diverse(pool: Pool, k: int, rng: np.random.Generator, *, epsilon: float = 0.0,
                   exclude: set[bytes] | None = None, min_distance: int | None = None,
                   explorable: np.ndarray | None = None) -> list[int]:
    """Indices into ``pool`` of ``k`` strategies to measure: greedy best-first, skipping ones within
    ``min_distance`` differing decisions of an already chosen one, plus about ``epsilon * k``
    picked at random from the rest of the pool (exploration) where ``explorable`` (a mask over the
    pool; None: every row) allows; picks exploration cannot make are made greedily (best-first
    among the rest). Rows in ``exclude`` (already measured, by ``row_keys``) are never chosen."""
    exclude = exclude or set()
    keys = pool.encoded.row_keys()
    candidates = [i for i in range(len(pool)) if keys[i] not in exclude]
    if not candidates or k <= 0:
        return []
    D = decision_matrix(pool.encoded)
    V = pool.encoded.kind.shape[1]
    min_distance = max(1, V // 20) if min_distance is None else min_distance
    n_random = int(round(epsilon * k)) if k > 1 else 0
    chosen: list[int] = []
    for i in candidates:  # pool is best-first
        if len(chosen) >= k - n_random:
            break
        if all((D[i] != D[j]).sum() >= min_distance for j in chosen):
            chosen.append(i)
    rest = [i for i in candidates if i not in chosen]
    wild = [i for i in rest if explorable is None or explorable[i]]
    if wild and len(chosen) < k:
        extra = rng.choice(len(wild), size=min(len(wild), k - len(chosen)), replace=False)
        chosen += [wild[int(j)] for j in extra]
    chosen += [i for i in rest if i not in chosen][: max(0, k - len(chosen))]
    return chosen
