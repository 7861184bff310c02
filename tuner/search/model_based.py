"""The model-based tuner (AutoTVM's layout): a cost model (``tuner.cost_models.predictor.Predictor``, refitted
on an in-memory training set) and an optimizer (simulated annealing, ``tuner.search.annealing``) glued by
``ModelBasedTuner``; its knobs are ``SearchSettings``.

A trust region (TuRBO's idea) guards the rounds where the predictor is unproven on the target: until
it has ranked the target's own measured trials well (cross-validated pairwise accuracy of the scorer
it follows at least ``trust_accuracy`` on at least ``trust_trials`` of them, ``Predictor.scores_``)
and its last round's picks ran as it promised, what it learned elsewhere may not
hold here — on a one-node cluster, say, that no warm-start group resembles, it scored strategies
with six collective groups and PowerSGD fastest, which measured 7x slower than every baseline. So
until then each round proposes only strategies a few mutations from the best measured ones (the
baselines within 1.25x of the best, first), ranked by the same predictor, all greedy (no pick at
random); the radius grows by one after each region round that beat its incumbent, and the whole
space opens once the predictor has proven itself (or when nothing is left to measure near the
incumbents).

Under goodput, once probes have priced lossy features, candidates are ranked by predicted step time
over their estimated efficiency, and one estimated below the run's ``min_efficiency`` ranks after
every candidate that could be recommended: measuring a strategy the floor will turn down spends a
trial on nothing (on vgg16 a search spent most of its 12 trials so, and recommended a baseline).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from strategy_space import ClusterSpec, ModelSpec, Strategy
from strategy_space.encoding import EncodedStrategies
from strategy_space.memory import fits_encoded

from tuner.cost_models.predictor import Predictor
from tuner.cost_models.scoring import PerLosslessStep
from tuner.features.batch import FEATURE_NAMES
from tuner.records.goodput import (DEFAULT_MIN_EFFICIENCY, estimate_encoded_efficiency, fit_feature_costs,
                                   lossy_extents)
from tuner.records.history import History, feature_keys
from tuner.records.outcome import TuneOutcome
from tuner.records.training_set import TrainingSet
from tuner.records.warmstart import Group
from tuner.search.annealing import Pool, select_diverse, simulated_annealing
from tuner.search.base import Proposal, Tuner
from tuner.search.constraints import Constraints
from tuner.search.sampler import KnowledgeSampler
from tuner.search.settings import SearchSettings


class ModelBasedTuner(Tuner):
    """Proposes strategies for one (model, cluster) by simulated annealing over the predictor
    (TVM's model-based tuner: a cost model, ``Predictor``, plus an optimizer, the annealing).

    Args:
        model, cluster: the target.
        constraints: user pins (never violated).
        settings: see SearchSettings.
        warm_start: trials measured elsewhere, (model, cluster, trials) groups the predictor
            learns from besides the store (``tuner.records.warmstart.load_warm_start``).
        lossless, staleness, allow_async: what lossy parts are proposed (see ``Tuner``).

    Attributes:
        training: every featurized trial the predictor learns from (``tuner.records.training_set``): the
            warm-start and store groups, then the history's entries as they arrive.
        last_pool: the annealing pool of the last ``next_batch``.
        last_radius: the trust region's radius in the last ``next_batch`` (mutations from a
            measured strategy), or None when the search was open to the whole space.
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
        self.last_radius: int | None = None

    def load_groups(self, groups: Sequence[Group]) -> None:
        """The store's groups, read once at the start of a run (after the warm-start groups)."""
        self.training.add_groups(groups)

    def refit(self, history: History) -> None:
        """Take the history's new entries into the training set and refit the predictor on it
        (every round: the ranker boosts on from its last fit even when no row is new)."""
        self.training.add_entries(self.model, self.cluster, history.entries)
        self.predictor.fit(self.training.trial_set())

    def next_batch(self, k: int | None, history: History) -> list[Proposal]:
        """The next strategies to measure (never one measured before), after refitting the
        predictor on everything measured so far."""
        self.refit(history)
        incumbents = _incumbents(history)
        self.last_radius = self._radius(incumbents, history)
        out = self._round(k or self.settings.batch, history, incumbents)
        if not out and self.last_radius is not None:
            # everything near the incumbents was measured (a small space): the region is no reason
            # to stop, the rest of the space is searched
            self.last_radius = None
            out = self._round(k or self.settings.batch, history, incumbents)
        return out

    def _round(self, k: int, history: History, incumbents: list) -> list[Proposal]:
        """One round's proposals, in the region of ``last_radius`` (None: the whole space)."""
        s = self.settings
        rng = self.rng
        rows = _RoundFeatures(self.predictor, history)   # each strategy featurized once this round
        measured = history.latest_seconds()
        best = sorted(((v, key) for key, v in measured.items() if np.isfinite(v)))[:8]
        costs = self._feature_costs(history)
        shares, floor = self._param_shares(), _least_efficiency(history)

        def efficiency(e: EncodedStrategies) -> np.ndarray:
            return _within_floor(estimate_encoded_efficiency(e, shares, costs), floor)
        if self.last_radius is not None:
            # the region is around the incumbents: the measured strategies within 1.25x of the best
            cand = self._neighbours([key for v, _, key in incumbents if v <= 1.25 * incumbents[0][0]],
                                    self.last_radius, rng)
        else:
            parts = [self.sampler.sample(rng, s.candidates), self.space.sample_encoded(rng, s.candidates)]
            if best:  # start some chains from the best measured strategies
                parts.append(self._decode_keys([key for _, key in best]))
            cand = self.project(EncodedStrategies.concat(parts))
        cand = cand.take(np.flatnonzero(fits_encoded(cand, self.model, self.cluster)))   # no strategy that cannot fit
        if not len(cand):
            return []
        cand_X = rows.of(cand)
        cand_ranked, cand_s = self.predictor.order(cand, cand_X)
        if self.last_radius is not None:
            pool = Pool(cand.take(cand_ranked), cand_s[cand_ranked])
        else:
            pool = self._anneal(cand, cand_ranked, cand_s, efficiency if costs else None, k, rng)
            fits = np.flatnonzero(fits_encoded(pool.encoded, self.model, self.cluster))   # the chains may leave it
            pool = Pool(pool.encoded.take(fits), pool.predicted[fits])
        pool_X = rows.of(pool.encoded)
        fused, seconds = self.predictor.order(pool.encoded, pool_X)
        seen = history.feature_keys()
        pool, pool_X = _distinct(Pool(pool.encoded.take(fused), seconds[fused]), pool_X[fused], seen)
        if len(pool.predicted) < 2 * k:
            # the chains converged on strategies already measured (or equal to them in every feature):
            # the candidates they started from widen the choice
            both = EncodedStrategies.concat([pool.encoded, cand.take(cand_ranked)])
            pool, pool_X = _distinct(Pool(both, np.concatenate([pool.predicted, cand_s[cand_ranked]])),
                                     np.concatenate([pool_X, cand_X[cand_ranked]]), seen)
        # rank by goodput where efficiencies were measured: predicted step time / the estimated
        # efficiency of each candidate's lossy parts (step times are still what is predicted)
        step_s = pool.predicted
        if costs:
            # (a failed probe counts as E = 0.001: its parts are ranked last, not dropped)
            est = efficiency(pool.encoded)
            ranked = np.argsort(pool.predicted / est, kind="stable")
            step_s = pool.predicted[ranked]
            pool, pool_X = Pool(pool.encoded.take(ranked), step_s / est[ranked]), pool_X[ranked]
        # inside the region every pick is greedy: the region's rounds are the test of the predictor
        # near the incumbents, and a pick at random there can be the one costly mutation (a
        # collective group of its own, the whole model asynchronous) the predictor ranked last
        search_round = 1 + max((e.trial.meta.get("search_round", 0) for e in history.entries), default=0)
        # and before the run's own rounds have tested the predictor, too (``explore_from_round``)
        epsilon = s.epsilon if self.last_radius is None and search_round >= s.explore_from_round else 0.0
        self.last_pool = pool
        meta = {"search_round": search_round, "trust_radius": self.last_radius}
        explorable = None
        if incumbents:   # what the predictor expects of each pick against the incumbent (judged next round)
            incumbent_s = float(self.predictor.predict(None, rows.of(self._decode_keys([incumbents[0][2]])))[0])
            meta["incumbent_s"] = incumbents[0][1]
            if s.explore_ratio is not None:   # the incumbent's figure over its step: 1 / its efficiency
                explorable = pool.predicted <= s.explore_ratio * incumbent_s * incumbents[0][0] / incumbents[0][1]
        picks, decoded = self._select(pool, k, rng, measured, history.canonical_keys(), epsilon, explorable)
        greedy = k - int(round(epsilon * k)) if k > 1 else k
        out = []
        for n, i in enumerate(picks):
            origin = "search" if n < greedy else "explore"
            gain = {"predicted_vs_incumbent": float(step_s[i]) / incumbent_s} if incumbents else {}
            out.append(Proposal(dataclasses.replace(decoded[i], origin=origin), origin, float(step_s[i]),
                                encoded=pool.encoded.take([i]), features=pool_X[i], meta={**meta, **gain}))
        return out

    def _anneal(self, cand: EncodedStrategies, cand_ranked: np.ndarray, cand_s: np.ndarray,
                efficiency: Callable[[EncodedStrategies], np.ndarray] | None, k: int,
                rng: np.random.Generator) -> Pool:
        """The annealing pool, its chains started from the best-predicted candidates; ``efficiency``
        (None until probes have priced a lossy feature): the estimated efficiency the chains climb
        goodput with."""
        s = self.settings
        order = cand_ranked
        scorer = self.predictor.chain_scorer()
        if efficiency is not None:   # once probes have priced lossy features, the chains start from and climb goodput
            scorer = PerLosslessStep(scorer, efficiency)
            order = np.argsort(cand_s / efficiency(cand), kind="stable")
        init = cand.take(order[: s.chains])
        constrained = self.constraints is not None
        return simulated_annealing(self.space, scorer, init, rng, steps=s.anneal_steps,
                                   proposals=max(1, s.proposals // 4) if constrained else s.proposals,
                                   keep=max(256, 8 * k), project=self.project if constrained else None)

    def proven(self, history: History | None = None) -> bool:
        """Whether the predictor may be followed anywhere in the space (module doc): judged on at
        least ``trust_trials`` of the target's own trials at ``trust_accuracy`` or better, and, when
        ``history`` holds a search round it proposed, no pick of the last such round more than
        ``trust_ratio`` slower than promised against the incumbent (``round_error``)."""
        p, s = self.predictor, self.settings
        if p.n_target_ < s.trust_trials or not (p.scores_ and p.scores_.get(p.source_, 0.0) >= s.trust_accuracy):
            return False
        error = round_error(history) if history is not None else None
        return error is None or error <= np.log(s.trust_ratio)

    def _radius(self, incumbents: list, history: History) -> int | None:
        """This round's trust-region radius, or None: no region (turned off, nothing measured to
        stand on, or the predictor proven). It grows by one for each region round that beat its
        incumbent (TuRBO grows its region on success)."""
        if self.settings.trust_radius <= 0 or not incumbents or self.proven(history):
            return None
        return self.settings.trust_radius + sum(_search_rounds(history, region_only=True)[1].values())

    def _neighbours(self, keys: list[bytes], radius: int, rng: np.random.Generator) -> EncodedStrategies:
        """Candidates within ``radius`` mutations of the measured strategies ``keys`` (best first):
        ``candidates`` mutations per step, each step varying the last step's, every one projected
        onto the pins. The best measured strategy parents half of the first step's."""
        n = self.settings.candidates
        seeds = self.project(self._decode_keys(keys))
        parents = np.concatenate([np.zeros(n // 2, dtype=np.int64), rng.integers(len(seeds), size=n - n // 2)])
        steps, frontier = [], seeds
        for _ in range(radius):
            frontier = self.project(self.space.mutate_rows(frontier, parents, rng).encoded)
            steps.append(frontier)
            parents = np.arange(len(frontier))
        return EncodedStrategies.concat(steps)

    def _param_shares(self) -> np.ndarray:
        sizes = np.array([max(v.size, 1) for v in self.model.variables], dtype=float)
        return sizes / sizes.sum()

    def _feature_costs(self, history: History) -> dict[str, float]:
        """What each lossy feature costs per share of the model, from the probes so far
        (``fit_feature_costs``)."""
        rows, values = [], []
        for fp, e in history.efficiency.items():
            entry = history.entry(fp)
            # a probed strategy outside this space (a pinned or resumed one) tells it nothing
            if entry is None or entry.encoded is None:
                continue
            rows.append(entry.encoded)
            values.append(e.value)
        if not rows:
            return {}
        return fit_feature_costs(lossy_extents(EncodedStrategies.concat(rows), self._param_shares()),
                                 np.array(values))

    def _select(self, pool: Pool, k: int, rng: np.random.Generator, measured: dict[bytes, float],
                measured_canonical: set[str], epsilon: float, explorable: np.ndarray | None = None,
                rounds: int = 8) -> tuple[list[int], dict[int, Strategy]]:
        """``select_diverse`` (random picks only where ``explorable``), never picking a strategy
        equivalent to a measured one or to another pick (measuring it again would measure noise):
        equivalent picks are excluded and the selection redone (at most ``rounds`` times; few
        picks ever are). Feature-equal strategies are out of the pool already (``_distinct``);
        this catches canonical equals the features cannot see (none known: it guards the
        measuring). Returns the picks and the strategies decoded on the way (each pool row
        decoded once)."""
        exclude = set(measured)
        keys = pool.encoded.row_keys()
        decoded: dict[int, Strategy] = {}
        picks: list[int] = []
        for _ in range(rounds):
            picks = select_diverse(pool, k, rng, epsilon=epsilon, exclude=exclude, explorable=explorable)
            seen = set(measured_canonical)
            dup = []
            for i in picks:
                if i not in decoded:
                    decoded[i] = self.space.decode(pool.encoded, i)
                fp = self.canonical_key(decoded[i])
                if fp in seen:
                    dup.append(i)
                seen.add(fp)
            if not dup:
                return picks, decoded
            exclude |= {keys[i] for i in dup}
        return [i for i in picks if keys[i] not in exclude], decoded

    def _decode_keys(self, keys: list[bytes]) -> EncodedStrategies:
        names = EncodedStrategies.field_names()
        V = len(self.model.variables)
        rows = [np.frombuffer(k, dtype=np.int32).reshape(V, len(names)) for k in keys]
        return EncodedStrategies(**{n: np.stack([r[:, i] for r in rows]) for i, n in enumerate(names)})


class _RoundFeatures:
    """Feature rows of one round's strategies, each featurized once (candidates, the pool, and the
    candidates widening it share rows: a strategy in two of them is featurized the first time; a
    measured one, e.g. a chain started from it, has its row in the history)."""

    def __init__(self, predictor: Predictor, history: History):
        self.predictor = predictor
        self._rows: dict[bytes, np.ndarray] = {e.key: e.features for e in history.entries if e.features is not None}

    def of(self, e: EncodedStrategies) -> np.ndarray:
        keys = e.row_keys()
        first: dict[bytes, int] = {}
        for i, key in enumerate(keys):
            if key not in self._rows and key not in first:
                first[key] = i
        if first:
            X = self.predictor.features(e.take(np.fromiter(first.values(), dtype=np.int64, count=len(first))))
            self._rows.update(zip(first, X))
        if not keys:
            return np.zeros((0, len(FEATURE_NAMES)), dtype=np.float32)
        return np.stack([self._rows[key] for key in keys])


def _least_efficiency(history: History) -> float:
    """The run's ``min_efficiency`` (its newest trial's meta; the default before any trial): the
    least efficiency a lossy strategy needs to be recommended; 0 where the run ranks by something
    else than goodput (no floor then)."""
    for entry in reversed(history.entries):
        if "min_efficiency" in entry.trial.meta:
            if entry.trial.meta.get("quality", "goodput") != "goodput":
                return 0.0
            return float(entry.trial.meta["min_efficiency"])
    return DEFAULT_MIN_EFFICIENCY


def _within_floor(est: np.ndarray, floor: float) -> np.ndarray:
    """Estimated efficiencies for ranking: a candidate estimated below the run's floor can never be
    recommended (``TuneOutcome``), so however fast its step it ranks after every candidate that
    can (its estimate scaled down a thousandfold keeps the order among such candidates). A feature
    no probe has priced is estimated at 1 and stays eligible, so it is still proposed and probed."""
    return np.where(est >= floor, est, est * 1e-3)


def _incumbents(history: History) -> list[tuple[float, float, bytes]]:
    """The measured strategies that compete, best first, as (figure, step seconds, encoded key):
    the figure is what the run ranks by (``TuneOutcome.figure`` under the trial's quality and
    least efficiency; a lossy strategy not yet probed does not compete); latest measurement of each."""
    latest = {e.key: e.trial for e in history.entries if e.key is not None and e.trial.ok}
    out = []
    for key, t in latest.items():
        judge = TuneOutcome(run_id="", quality=t.meta.get("quality", "step"), efficiency=history.efficiency,
                            min_efficiency=t.meta.get("min_efficiency", DEFAULT_MIN_EFFICIENCY))
        figure = judge.figure(t)
        if np.isfinite(figure):
            out.append((figure, t.median, key))
    return sorted(out, key=lambda x: x[0])


def _search_rounds(history: History, region_only: bool = False) -> tuple[dict, dict]:
    """The search trials of each round that recorded its incumbent (``next_batch``'s meta), and
    whether each round beat it (a trial measured faster than the incumbent)."""
    rounds: dict[int, list] = {}
    for e in history.entries:
        m = e.trial.meta
        if e.trial.role != "search" or "incumbent_s" not in m or (region_only and m.get("trust_radius") is None):
            continue
        rounds.setdefault(m["search_round"], []).append(e.trial)
    won = {r: any(t.ok and t.median < t.meta["incumbent_s"] for t in ts) for r, ts in rounds.items()}
    return rounds, won


def round_error(history: History) -> float | None:
    """The last search round's out-of-sample shortfall: the largest over its trials of
    max(0, log(measured gain / predicted gain)), a gain being the step time over the incumbent's
    when the round was proposed: how much slower than promised its worst pick ran (one that ran
    faster than promised cost the user nothing; a failed trial counts as infinitely wrong); None
    before any such round. (The worst, not the median: on one node a round with two of four
    picks 1.7x over their promise passed a median test, and the open search that followed
    measured four strategies at 5x the baselines.)"""
    rounds, _ = _search_rounds(history)
    if not rounds:
        return None
    errors = [max(0.0, float(np.log(t.median / t.meta["incumbent_s"] / t.meta["predicted_vs_incumbent"])))
              if t.ok and t.meta.get("predicted_vs_incumbent") else np.inf for t in rounds[max(rounds)]]
    return float(max(errors))


_feature_keys = feature_keys   # its name before it moved to tuner.records.history (tests read it)


def _distinct(pool: Pool, X: np.ndarray, measured_features: set[bytes]) -> tuple[Pool, np.ndarray]:
    """The pool (ordered by prediction; ``X`` its feature rows) with one strategy per feature row,
    none with the features of a measured strategy: a strategy whose features equal a measured one's
    moves the same bytes through the same NICs and calls (e.g. an all-reduced bias split into shards
    of the same fused group); the predictor cannot tell them apart and a trial of it measures noise."""
    seen, keep = set(measured_features), []
    for i, key in enumerate(feature_keys(X)):
        if key not in seen:
            seen.add(key)
            keep.append(i)
    rows = np.asarray(keep, dtype=np.int64)
    return Pool(pool.encoded.take(rows), pool.predicted[keep]), X[rows]
