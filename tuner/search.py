"""Model-based search: simulated annealing over mutations, scored by a predictor, and a diverse
choice of what to measure next.

``score`` is any vectorised function from EncodedStrategies to predicted step seconds (lower is
better), or a ``ChainScorer`` that scores each proposal from its parent's state (an
``IncrementalScorer``: the same seconds without featurizing every variable of every proposal). The
annealer works on log time, so temperatures are relative (0.05 ~ accept a 5 % worse neighbour with
probability 1/e).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np

from strategy_space.space import EncodedStrategies, StrategySpace

from .incremental import IncrementalFeaturizer

Score = Callable[[EncodedStrategies], np.ndarray]
# fields that make two strategies different in what they run (options that normalize away excluded)
DECISION_FIELDS = ("kind", "shards", "dest", "group", "group_stride", "local_replication", "staleness",
                   "sync", "compressor", "rank", "backend")


@dataclass
class Pool:
    """Best distinct candidates seen, with their predicted seconds."""

    encoded: EncodedStrategies
    predicted: np.ndarray

    def __len__(self) -> int:
        return len(self.predicted)


class ChainScorer(Protocol):
    """Scores chains of mutations: ``reset`` with the chains' strategies, then per step
    ``propose`` (row i varies the current row i) and ``accept`` (which proposals replace them).
    Each returns or takes one value per chain; seconds, lower is better."""

    def reset(self, e: EncodedStrategies) -> np.ndarray: ...

    def propose(self, e: EncodedStrategies) -> np.ndarray: ...

    def accept(self, accepted: np.ndarray) -> None: ...


class IncrementalScorer:
    """Predicted seconds of annealing proposals: features updated from the parents'
    (``IncrementalFeaturizer``), then a predictor on feature rows.

    Args:
        featurizer: built on the (model, cluster) tables, with the parameters the predictor's
            features use.
        predict: feature rows (``features.featurize``'s columns) -> seconds, e.g.
            ``LearnedSimulator.predict``.
    """

    def __init__(self, featurizer: IncrementalFeaturizer, predict: Callable[[np.ndarray], np.ndarray]):
        self.featurizer = featurizer
        self.predict = predict

    def reset(self, e: EncodedStrategies) -> np.ndarray:
        return self.predict(self.featurizer.reset(e))

    def propose(self, e: EncodedStrategies) -> np.ndarray:
        return self.predict(self.featurizer.propose(e))

    def accept(self, accepted: np.ndarray) -> None:
        self.featurizer.accept(accepted)


class _Recompute:
    """A ``Score`` as a ChainScorer: every proposal scored from scratch."""

    def __init__(self, score: Score):
        self.score = score

    def reset(self, e: EncodedStrategies) -> np.ndarray:
        return self.score(e)

    def propose(self, e: EncodedStrategies) -> np.ndarray:
        return self.score(e)

    def accept(self, accepted: np.ndarray) -> None:
        pass


def _dedupe(e: EncodedStrategies, scores: np.ndarray) -> tuple[EncodedStrategies, np.ndarray]:
    keys = e.row_keys()
    seen: dict[bytes, int] = {}
    for i in np.argsort(scores, kind="stable"):
        seen.setdefault(keys[i], int(i))
    keep = np.array(sorted(seen.values(), key=lambda i: scores[i]), dtype=int)
    return e.take(keep), scores[keep]


def simulated_annealing(space: StrategySpace, score: Score | ChainScorer, init: EncodedStrategies,
                        rng: np.random.Generator, *, steps: int = 60, t_start: float = 0.05, t_end: float = 0.002,
                        keep: int = 256,
                        project: Callable[[EncodedStrategies], EncodedStrategies] | None = None) -> Pool:
    """Run one annealing chain per row of ``init`` for ``steps`` steps.

    Args:
        score: predicted seconds of a batch, or a ChainScorer (e.g. an IncrementalScorer) that
            scores each proposal from its chain's current strategy.
        project: applied to every proposal (e.g. constraints), so no chain leaves the legal set.

    Returns:
        the ``keep`` best distinct strategies met on any chain, best first.
    """
    project = project or (lambda e: e)
    chains = score if hasattr(score, "propose") else _Recompute(score)
    cur = project(init.copy())
    cur_s = np.log(np.maximum(chains.reset(cur), 1e-12))
    seen_e, seen_s = [cur.copy()], [cur_s]   # a copy: cur changes in place as chains move
    for step in range(steps):
        temp = t_start * (t_end / t_start) ** (step / max(1, steps - 1))
        prop = project(space.mutate_encoded(cur, rng))
        prop_s = np.log(np.maximum(chains.propose(prop), 1e-12))
        accept = (prop_s < cur_s) | (rng.random(len(cur_s)) < np.exp(-(prop_s - cur_s) / temp))
        chains.accept(accept)
        for f in cur.field_names():
            getattr(cur, f)[accept] = getattr(prop, f)[accept]
        cur_s = np.where(accept, prop_s, cur_s)
        seen_e.append(prop)
        seen_s.append(prop_s)
        if len(seen_e) * len(cur_s) > 8 * keep:  # keep memory bounded: compact the pool
            e, s = _dedupe(EncodedStrategies.concat(seen_e), np.concatenate(seen_s))
            seen_e, seen_s = [e.take(np.arange(min(keep, len(s))))], [s[:keep]]
    e, s = _dedupe(EncodedStrategies.concat(seen_e), np.concatenate(seen_s))
    n = min(keep, len(s))
    return Pool(e.take(np.arange(n)), np.exp(s[:n]))


def decision_matrix(e: EncodedStrategies) -> np.ndarray:
    """(B, V * F) array of the fields that distinguish strategies."""
    return np.concatenate([getattr(e, f) for f in DECISION_FIELDS], axis=1)


def select_diverse(pool: Pool, k: int, rng: np.random.Generator, *, epsilon: float = 0.0,
                   exclude: set[bytes] | None = None, min_distance: int | None = None) -> list[int]:
    """Indices into ``pool`` of ``k`` strategies to measure: greedy best-first, skipping ones within
    ``min_distance`` differing decisions of an already chosen one, plus about ``epsilon * k``
    picked at random from the rest of the pool (exploration). Rows in ``exclude`` (already
    measured, by ``row_keys``) are never chosen."""
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
    if rest and len(chosen) < k:
        extra = rng.choice(len(rest), size=min(len(rest), k - len(chosen)), replace=False)
        chosen += [rest[int(j)] for j in extra]
    return chosen
