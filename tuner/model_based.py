"""The model-based tuner (AutoTVM's layout): a cost model (``tuner.predictor.Predictor``, refitted
on an in-memory training set) and an optimizer (simulated annealing, ``tuner.search``) glued by
``ModelBasedTuner``; its knobs are ``SearchSettings``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from strategy_space import ClusterSpec, ModelSpec
from strategy_space.encoding import EncodedStrategies
from strategy_space.errors import ConfigError

from .base import Proposal, Tuner
from .constraints import Constraints
from .goodput import estimate_encoded_efficiency, fit_feature_costs, lossy_extents
from .predictor import Predictor
from .sampler import KnowledgeSampler
from .search import PerLosslessStep, Pool, select_diverse, simulated_annealing
from .training_set import TrainingSet
from .trial import Trial
from .warmstart import Group


@dataclass(frozen=True)
class SearchSettings:
    """Knobs of one round of proposals.

    Attributes:
        batch: strategies measured per round.
        epsilon: share of each batch drawn at random from the annealing pool (exploration).
        candidates: knowledge-guided candidates per round; the same number again uniformly random.
        chains: annealing chains, started from the best-predicted candidates.
        proposals: mutations each chain proposes per step (all chains' are scored in one call; a
            chain steps towards its best). Scored per round: chains x proposals x anneal_steps.
            Under constraints every proposal is built whole to be projected, which costs several
            times more per proposal: a quarter of them are made.
        anneal_steps: steps per chain.
        seed: random seed.
    """

    batch: int = 4
    epsilon: float = 0.25
    candidates: int = 256
    chains: int = 48
    proposals: int = 64
    anneal_steps: int = 30
    seed: int = 0


class ModelBasedTuner(Tuner):
    """Proposes strategies for one (model, cluster) by simulated annealing over the predictor
    (TVM's model-based tuner: a cost model, ``Predictor``, plus an optimizer, the annealing).

    Args:
        model, cluster: the target.
        constraints: user pins (never violated).
        settings: see SearchSettings.
        warm_start: trials measured elsewhere, (model, cluster, trials) groups the predictor
            learns from besides the store (``tuner.warmstart.load_warm_start``).
        lossless, staleness, allow_async: what lossy parts are proposed (see ``Tuner``).

    Attributes:
        training: every featurized trial the predictor learns from (``tuner.training_set``).
        last_pool: the annealing pool of the last ``next_batch``.
    """

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, *, constraints: Constraints | None = None,
                 settings: SearchSettings = SearchSettings(), warm_start: Sequence[Group] = (), lossless: bool = False,
                 staleness: tuple[int, ...] = (0,), allow_async: bool = False):
        super().__init__(model, cluster, constraints=constraints, batch_size=settings.batch, lossless=lossless,
                         staleness=staleness, allow_async=allow_async)
        self.settings = settings
        self.sampler = KnowledgeSampler(self.space)
        self.predictor = Predictor(model, cluster, seed=settings.seed)
        self.rng = np.random.default_rng(settings.seed)
        self.training = TrainingSet()
        self.training.add_groups(warm_start)
        self.last_pool: Pool | None = None
        self._proposed: dict[str, EncodedStrategies] = {}   # fingerprint -> encoded row, until measured
        # feature rows of everything measured: a strategy whose features equal a measured one's moves
        # the same bytes through the same NICs and calls (e.g. an all-reduced bias split into shards of
        # the same fused group); the predictor cannot tell them apart and a trial of it measures noise
        self.measured_features: set[bytes] = set()

    def load_history(self, groups: Sequence[Group]) -> None:
        """The store's groups, read once at the start of a run (after the warm-start groups)."""
        self.training.add_groups(groups)

    def update(self, trials: Sequence[Trial]) -> None:
        """Record measured trials and append their feature rows to the training set (the refit
        happens at the next ``next_batch``)."""
        super().update(trials)
        encoded = {t.strategy.fingerprint: self._proposed.pop(t.strategy.fingerprint)
                   for t in trials if t.strategy.fingerprint in self._proposed}
        self.training.add(self.model, self.cluster, trials, encoded)
        rows = []
        for t in trials:
            row = encoded.get(t.strategy.fingerprint)
            if row is None:
                key = self.row_key(t.strategy)
                row = None if key is None else self._decode_keys([key])
            if row is not None:
                rows.append(row)
        if rows:
            self.measured_features |= set(_feature_keys(self.predictor.features(EncodedStrategies.concat(rows))))

    def refit(self) -> None:
        """Refit the predictor on the training set (every round: the ranker boosts on from its
        last fit even when no row is new)."""
        self.predictor.fit(self.training.trial_set())

    def next_batch(self, k: int | None = None) -> list[Proposal]:
        """The next strategies to measure (never one measured before), after refitting the
        predictor on everything measured so far."""
        self.refit()
        s = self.settings
        k = k or s.batch
        rng = self.rng
        parts = [self.sampler.sample(rng, s.candidates), self.space.sample_encoded(rng, s.candidates)]
        best = sorted(((v, key) for key, v in self.measured.items() if np.isfinite(v)))[:8]
        if best:  # start some chains from the best measured strategies
            parts.append(self._decode_keys([key for _, key in best]))
        cand = self.project(EncodedStrategies.concat(parts))
        order, cand_step_s = self.predictor.order(cand)
        costs = self._feature_costs()
        shares = self._param_shares()
        scorer = self.predictor.chain_scorer()
        if costs:   # once probes have priced lossy features, the chains start from and climb goodput
            scorer = PerLosslessStep(scorer, lambda e: estimate_encoded_efficiency(e, shares, costs))
            order = np.argsort(cand_step_s / estimate_encoded_efficiency(cand, shares, costs), kind="stable")
        init = cand.take(order[: s.chains])
        constrained = self.constraints is not None
        pool = simulated_annealing(self.space, scorer, init, rng, steps=s.anneal_steps,
                                   proposals=max(1, s.proposals // 4) if constrained else s.proposals,
                                   keep=max(256, 8 * k), project=self.project if constrained else None)
        fused, seconds = self.predictor.order(pool.encoded)
        pool = self._distinct(Pool(pool.encoded.take(fused), seconds[fused]))
        if len(pool.predicted) < 2 * k:
            # the chains converged on strategies already measured (or equal to them in every feature):
            # the candidates they started from widen the choice
            ranked, cand_s = self.predictor.order(cand)
            both = EncodedStrategies.concat([pool.encoded, cand.take(ranked)])
            pool = self._distinct(Pool(both, np.concatenate([pool.predicted, cand_s[ranked]])))
        # rank by goodput where efficiencies were measured: predicted step time / the estimated
        # efficiency of each candidate's lossy parts (step times are still what is predicted)
        step_s = pool.predicted
        if costs:
            # (a failed probe counts as E = 0.001: its parts are ranked last, not dropped)
            est = estimate_encoded_efficiency(pool.encoded, shares, costs)
            ranked = np.argsort(pool.predicted / est, kind="stable")
            step_s = pool.predicted[ranked]
            pool = Pool(pool.encoded.take(ranked), step_s / est[ranked])
        self.last_pool = pool
        picks = self._select(pool, k, rng)
        greedy = k - int(round(s.epsilon * k)) if k > 1 else k
        out = []
        for n, i in enumerate(picks):
            origin = "search" if n < greedy else "explore"
            row = pool.encoded.take([i])
            strategy = self.space.decode(pool.encoded, i, origin=origin)
            self._proposed[strategy.fingerprint] = row
            out.append(Proposal(strategy, origin, float(step_s[i]), encoded=row))
        return out

    def _param_shares(self) -> np.ndarray:
        sizes = np.array([max(v.size, 1) for v in self.model.variables], dtype=float)
        return sizes / sizes.sum()

    def _feature_costs(self) -> dict[str, float]:
        """What each lossy feature costs per share of the model, from the probes so far
        (``fit_feature_costs``)."""
        strategies = {t.strategy.fingerprint: t.strategy for t in self.measurements}
        rows, values = [], []
        for fp, e in self.efficiency.items():
            if fp not in strategies:
                continue
            try:   # a probed strategy outside this space (a pinned or resumed one) tells it nothing
                rows.append(self.space.encode([strategies[fp]]))
            except ConfigError:
                continue
            values.append(e.value)
        if not rows:
            return {}
        return fit_feature_costs(lossy_extents(EncodedStrategies.concat(rows), self._param_shares()),
                                 np.array(values))

    def _distinct(self, pool: Pool) -> Pool:
        """The pool (ordered by prediction) with one strategy per feature row, none with the
        features of a measured strategy (``measured_features``)."""
        seen, keep = set(self.measured_features), []
        for i, key in enumerate(_feature_keys(self.predictor.features(pool.encoded))):
            if key not in seen:
                seen.add(key)
                keep.append(i)
        return Pool(pool.encoded.take(np.asarray(keep, dtype=np.int64)), pool.predicted[keep])

    def _select(self, pool: Pool, k: int, rng: np.random.Generator, rounds: int = 8) -> list[int]:
        """``select_diverse``, never picking a strategy equivalent to a measured one or to another
        pick (measuring it again would measure noise): equivalent picks are excluded and the
        selection redone (at most ``rounds`` times; few picks ever are). Feature-equal strategies
        are out of the pool already (``_distinct``); this catches canonical equals the features
        cannot see (none known: it guards the measuring)."""
        exclude = set(self.measured)
        keys = pool.encoded.row_keys()
        picks: list[int] = []
        for _ in range(rounds):
            picks = select_diverse(pool, k, rng, epsilon=self.settings.epsilon, exclude=exclude)
            seen = set(self.measured_canonical)
            dup = []
            for i in picks:
                fp = self.canonical_key(self.space.decode(pool.encoded, i))
                if fp in seen:
                    dup.append(i)
                seen.add(fp)
            if not dup:
                return picks
            exclude |= {keys[i] for i in dup}
        return [i for i in picks if keys[i] not in exclude]

    def _decode_keys(self, keys: list[bytes]) -> EncodedStrategies:
        names = EncodedStrategies.field_names()
        V = len(self.model.variables)
        rows = [np.frombuffer(k, dtype=np.int32).reshape(V, len(names)) for k in keys]
        return EncodedStrategies(**{n: np.stack([r[:, i] for r in rows]) for i, n in enumerate(names)})


def _feature_keys(X: np.ndarray) -> list[bytes]:
    """One hashable key per feature row (float32, rounded to 6 significant digits: rows computed
    in different batches may differ in the last bit)."""
    rounded = np.asarray(X, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(rounded != 0, 10.0 ** (5 - np.floor(np.log10(np.abs(rounded)))), 1.0)
    return [r.tobytes() for r in np.round(rounded * scale) / scale]
