"""The tuning loop: measure the baselines, then repeat — refit the predictor on every stored trial,
propose candidates, anneal, measure a diverse top-k plus a few random ones, store — until the trial
budget, the time budget or the patience runs out; then re-measure the contenders (confirmation) so
the recommended strategy is not just the luckiest single measurement.

``ModelBasedTuner`` is the proposal side (TVM style: ``next_batch`` / ``update``); ``tune_loop``
drives a Runner with it and a TrialStore. Every trial carries the run's id in ``meta`` so a killed
run can be resumed: measured strategies are never proposed again and count against the budget.
"""
from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from strategy_space import ClusterSpec, ConfigError, ModelSpec, Strategy
from strategy_space.builders import BUILDERS, get_builder
from strategy_space.space import EncodedStrategies, StrategySpace

from .constraints import CompiledConstraints, Constraints
from .predictor import Predictor
from .sampler import KnowledgeSampler
from .search import Pool, select_diverse, simulated_annealing
from .trial import Runner, Trial
from .warmstart import Group

# appended to a baseline's name when the constraints changed its builder's strategy
PINNED_SUFFIX = "+pins"


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


@dataclass(frozen=True)
class Budget:
    """When to stop: search trials (baselines come on top), seconds, rounds without improvement;
    and ``confirm``: extra measurements of the final contenders (the best strategy and the best
    baseline must each have ``1 + confirm`` before the run ends; 0 turns confirmation off)."""

    trials: int = 24
    time_s: float | None = None
    patience: int = 4
    confirm: int = 2


@dataclass
class Proposal:
    strategy: Strategy
    origin: str
    predicted_s: float | None = None
    aliases: tuple[str, ...] = ()   # other builders that produce the same strategy


class ModelBasedTuner:
    """Proposes strategies for one (model, cluster).

    Args:
        model, cluster: the target.
        constraints: user pins (never violated).
        settings: see SearchSettings.
        warm_start: trials measured elsewhere, (model, cluster, trials) groups the predictor
            learns from besides the store (``tuner.warmstart.load_warm_start``).
    """

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, *, constraints: Constraints | None = None,
                 settings: SearchSettings = SearchSettings(), warm_start: Sequence[Group] = ()):
        self.model, self.cluster = model, cluster
        self.warm_start = list(warm_start)
        self.settings = settings
        self.space = StrategySpace(model, cluster)
        self.constraints: CompiledConstraints | None = constraints.compile(self.space) if constraints else None
        self.sampler = KnowledgeSampler(self.space)
        self.predictor = Predictor(model, cluster, seed=settings.seed)
        self.rng = np.random.default_rng(settings.seed)
        self.measured: dict[bytes, float] = {}   # encoded key -> measured seconds (inf: failed)
        # canonical fingerprints of everything measured: strategies that differ only in fusion-group
        # numbering or in a rotation over identical nodes are one strategy (``Strategy.canonical``)
        self.measured_canonical: set[str] = set()
        self.last_pool: Pool | None = None

    def project(self, e: EncodedStrategies) -> EncodedStrategies:
        return self.constraints.apply(e, self.space) if self.constraints is not None else e

    def baselines(self) -> list[Proposal]:
        """Every builder's strategy (projected onto the constraints); builders that produce the same
        strategy share one proposal (measured once, reported under each name). A builder whose
        strategy the constraints change is named ``NAME+pins`` (what is measured is not NAME's
        strategy any more)."""
        out: dict[str, Proposal] = {}
        for name in BUILDERS:
            enc = self.space.encode([get_builder(name).build(self.model, self.cluster)])
            if self.constraints is not None and self.constraints.changes(enc, self.space)[0]:
                name = f"{name}{PINNED_SUFFIX}"
            strategy = self.space.decode(self.project(enc), 0, origin=name)
            key = self.canonical_key(strategy)
            if key in out:
                out[key].aliases += (name,)
            else:
                out[key] = Proposal(strategy, name)
        return list(out.values())

    def canonical_key(self, strategy: Strategy) -> str:
        """Equal for strategies that run identically (see ``Strategy.canonical``)."""
        return strategy.canonical(self.cluster).fingerprint

    def update(self, trials: list[Trial], store=None) -> None:
        """Record measured trials; refit the predictor on the store (all groups) if given."""
        for t in trials:
            self.measured_canonical.add(self.canonical_key(t.strategy))
            try:
                key = self.space.encode([t.strategy]).row_keys()[0]
            except (ConfigError, KeyError):  # outside the encodable space, or another model's strategy
                continue
            self.measured[key] = t.median if t.ok else float("inf")
        if store is not None:
            self.predictor.refit(store, self.warm_start)

    def next_batch(self, k: int | None = None) -> list[Proposal]:
        """The next strategies to measure (never one measured before)."""
        s = self.settings
        k = k or s.batch
        rng = self.rng
        parts = [self.sampler.sample(rng, s.candidates), self.space.sample_encoded(rng, s.candidates)]
        best = sorted(((v, key) for key, v in self.measured.items() if np.isfinite(v)))[:8]
        if best:  # start some chains from the best measured strategies
            parts.append(self._decode_keys([key for _, key in best]))
        cand = self.project(EncodedStrategies.concat(parts))
        order, _ = self.predictor.order(cand)
        init = cand.take(order[: s.chains])
        constrained = self.constraints is not None
        pool = simulated_annealing(self.space, self.predictor.chain_scorer(), init, rng, steps=s.anneal_steps,
                                   proposals=max(1, s.proposals // 4) if constrained else s.proposals,
                                   keep=max(256, 8 * k), project=self.project if constrained else None)
        fused, seconds = self.predictor.order(pool.encoded)
        pool = Pool(pool.encoded.take(fused), seconds[fused])
        self.last_pool = pool
        picks = self._select(pool, k, rng)
        greedy = k - int(round(s.epsilon * k)) if k > 1 else k
        return [Proposal(self.space.decode(pool.encoded, i, origin="search" if n < greedy else "explore"),
                         "search" if n < greedy else "explore", float(pool.predicted[i]))
                for n, i in enumerate(picks)]

    def _select(self, pool: Pool, k: int, rng: np.random.Generator, rounds: int = 8) -> list[int]:
        """``select_diverse``, never picking a strategy equivalent to a measured one or to another
        pick (measuring it again would measure noise): equivalent picks are excluded and the
        selection redone (at most ``rounds`` times; few picks ever are). Their features are equal
        already (features depend on group membership and node facts, not on ids), so only the
        measuring needs this."""
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


@dataclass
class TuneOutcome:
    """What a tuning run measured.

    Attributes:
        run_id: id stored in every trial's meta.
        trials: this run's trials in measurement order (resumed ones included).
        stop_reason: ``trials``, ``time``, ``patience`` or ``exhausted``.
    """

    run_id: str
    trials: list[Trial] = field(default_factory=list)
    stop_reason: str = ""

    @property
    def ok(self) -> list[Trial]:
        return [t for t in self.trials if t.ok]

    def measured(self) -> dict[str, Trial]:
        """Strategy fingerprint -> its ok measurements as one Trial (steps pooled; ``meta``
        ``measurements`` says how many); a strategy measured once is its own trial."""
        groups: dict[str, list[Trial]] = {}
        for t in self.ok:
            groups.setdefault(t.strategy.fingerprint, []).append(t)
        return {fp: merge_measurements(ts) for fp, ts in groups.items()}

    def leader(self) -> Trial | None:
        """The fastest strategy so far by the median of all its measured steps, however often measured."""
        return min(self.measured().values(), key=lambda t: t.median, default=None)

    @property
    def fastest(self) -> Trial | None:
        """The fastest strategy by its pooled steps, except that once confirmation has run only
        strategies measured as often as the most-measured ones compete (an unconfirmed lucky
        measurement never wins over confirmed ones)."""
        merged = self.measured()
        if self.confirm_trials and merged:
            top = max(t.meta.get("measurements", 1) for t in merged.values())
            merged = {k: t for k, t in merged.items() if t.meta.get("measurements", 1) == top}
        return min(merged.values(), key=lambda t: t.median, default=None)

    @property
    def best(self) -> Trial | None:
        """The recommendation: ``fastest``, unless it is not a baseline and, on the repeated
        measurements, beats the best baseline by less than the noise between measurements
        (``significant_gain``): then the best baseline, since switching strategy should be
        worth it."""
        fastest, base = self.fastest, self.best_baseline
        if fastest is None or base is None or fastest.strategy.fingerprint == base.strategy.fingerprint:
            return fastest
        gain = self.significant_gain(fastest, base)
        return fastest if gain is None or gain else base

    def significant_gain(self, a: Trial, b: Trial, z: float = 1.0) -> bool | None:
        """Whether strategy ``a`` is faster than ``b`` by more than ``z`` standard errors, on the
        log medians of their separate measurements (the noise that matters is between
        measurements: each run of a strategy lands on its own placement and contention).

        Only the re-measurements count for the means: a strategy's first measurement is how it
        was picked (the leader of many noisy single measurements is flattered by its noise). The
        noise is pooled over every strategy of the run measured more than once; it is never taken
        below the imprecision of the measurements themselves (the variance of a log median implied
        by each measurement's 95 % interval, averaged over those that count), so a few repeats
        that happen to agree cannot make imprecise measurements look decisive. None when either
        was measured once (nothing to judge by)."""
        per: dict[str, list[float]] = {}
        within: dict[str, list[float]] = {}
        for t in self.ok:
            per.setdefault(t.strategy.fingerprint, []).append(float(np.log(t.median)))
            within.setdefault(t.strategy.fingerprint, []).append(_log_median_variance(t))
        fa, fb = a.strategy.fingerprint, b.strategy.fingerprint
        la, lb = per.get(fa, [])[1:], per.get(fb, [])[1:]
        if not la or not lb:
            return None
        repeated = [v for v in per.values() if len(v) > 1]
        dof = sum(len(v) - 1 for v in repeated)
        var = sum(float(np.sum((np.asarray(v) - np.mean(v)) ** 2)) for v in repeated) / dof
        floor = [w for w in within[fa][1:] + within[fb][1:] if np.isfinite(w)]
        if floor:
            var = max(var, float(np.mean(floor)))
        se = np.sqrt(var * (1 / len(la) + 1 / len(lb)))
        return bool(np.mean(lb) - np.mean(la) > z * se)

    @property
    def baselines(self) -> dict[str, Trial]:
        """Builder name -> its measurements (builders with the same strategy share them)."""
        merged = self.measured()
        out = {}
        for t in self.trials:
            if t.meta.get("role") == "baseline":
                for name in (t.origin, *t.meta.get("aliases", ())):
                    out[name] = merged.get(t.strategy.fingerprint, t)
        return out

    @property
    def best_baseline(self) -> Trial | None:
        return min((t for t in self.baselines.values() if t.ok), key=lambda t: t.median, default=None)

    @property
    def search_trials(self) -> list[Trial]:
        return [t for t in self.trials if t.meta.get("role") not in ("baseline", "confirm")]

    @property
    def confirm_trials(self) -> list[Trial]:
        return [t for t in self.trials if t.meta.get("role") == "confirm"]

    def trials_to_within(self, fraction: float = 0.05) -> int | None:
        """Trials (in order, baselines included) until the final best strategy itself or one
        measured within ``fraction`` of its (pooled) time was first measured."""
        best = self.best
        if best is None:
            return None
        for i, t in enumerate(self.trials, 1):
            if t.ok and (t.strategy.fingerprint == best.strategy.fingerprint or t.median <= best.median * (1 + fraction)):
                return i
        return None


def _log_median_variance(t: Trial) -> float:
    """Variance of log(median step time) implied by the trial's 95 % interval (its width in logs
    over 2 x 1.96); inf when it has no interval (fewer than 6 steps)."""
    ci = t.median_ci
    if ci is None or not ci[0] > 0:
        return float("inf")
    return float((np.log(ci[1]) - np.log(ci[0])) / (2 * 1.96)) ** 2


def merge_measurements(trials: list[Trial]) -> Trial:
    """Several ok measurements of one strategy as one Trial: the first, with every step pooled."""
    if len(trials) == 1:
        return trials[0]
    steps = tuple(x for t in trials for x in t.step_times)
    return dataclasses.replace(trials[0], step_times=steps, meta={**trials[0].meta, "measurements": len(trials)})


def previous_run(store, model: ModelSpec, cluster: ClusterSpec) -> tuple[str | None, list[Trial]]:
    """The most recent run id in ``store`` for (model, cluster) and its trials, oldest first."""
    trials = [t for t in store.trials_for(model.fingerprint, cluster.fingerprint) if t.meta.get("run_id")]
    if not trials:
        return None, []
    run_id = max(trials, key=lambda t: t.finished_at).meta["run_id"]
    return run_id, sorted((t for t in trials if t.meta.get("run_id") == run_id), key=lambda t: t.finished_at)


def tune_loop(runner: Runner, store, tuner: ModelBasedTuner, budget: Budget, *, resume: bool = False,
              on_trial: Callable[[Trial, TuneOutcome], None] | None = None, clock=time.monotonic) -> TuneOutcome:
    """Measure the baselines, then search until the budget is spent.

    Args:
        runner: executes strategies (Ray runtime, or a fake in tests).
        store: TrialStore; every trial is added as soon as it is measured.
        resume: continue the latest run of this (model, cluster) in the store.
        on_trial: called after each stored trial (progress display).
    """
    model, cluster = tuner.model, tuner.cluster
    store.add_model(model)
    store.add_cluster(cluster)
    outcome = TuneOutcome(run_id=uuid.uuid4().hex[:12])
    if resume:
        run_id, previous = previous_run(store, model, cluster)
        if run_id is not None:
            outcome.run_id, outcome.trials = run_id, list(previous)
            tuner.update(previous)
    start = clock()
    done_baselines = set(outcome.baselines)
    pending = [p for p in tuner.baselines() if p.origin not in done_baselines]

    def measure(proposals: list[Proposal], role: str) -> list[Trial]:
        got = []
        for p in proposals:
            if budget.time_s is not None and clock() - start > budget.time_s and role != "baseline":
                break
            # a failed baseline is run once more before it drops out of the comparison (a fault can
            # be passing: a killed actor, a busy node); both attempts are stored
            for attempt in range(2 if role == "baseline" else 1):
                [t] = runner.run([p.strategy], [p.origin])
                t = dataclasses.replace(t, meta={**t.meta, "run_id": outcome.run_id, "role": role,
                                                 "predicted_s": p.predicted_s, "aliases": list(p.aliases),
                                                 **({"attempt": attempt + 1} if attempt else {})})
                store.add(t, model, cluster)
                outcome.trials.append(t)
                got.append(t)
                if on_trial:
                    on_trial(t, outcome)
                if t.ok:
                    break
        tuner.update(got)
        return got

    measure(pending, "baseline")
    best = outcome.leader().median if outcome.leader() else float("inf")
    stale_rounds = 0
    while True:
        remaining = budget.trials - len(outcome.search_trials)
        if remaining <= 0:
            outcome.stop_reason = "trials"
            break
        if budget.time_s is not None and clock() - start > budget.time_s:
            outcome.stop_reason = "time"
            break
        if stale_rounds >= budget.patience:
            outcome.stop_reason = "patience"
            break
        tuner.update([], store)
        proposals = tuner.next_batch(min(tuner.settings.batch, remaining))
        if not proposals:
            outcome.stop_reason = "exhausted"
            break
        measure(proposals, "search")
        leader = outcome.leader()
        new_best = leader.median if leader else float("inf")
        stale_rounds = 0 if new_best < best * (1 - 1e-3) else stale_rounds + 1
        best = min(best, new_best)
    # Confirmation (racing): the best of many noisy single measurements is flattered by its noise.
    # Re-measure the best baseline, then the leader, until each has 1 + confirm measurements; a
    # re-measured leader that falls back hands the lead to the next one. What is left unconfirmed
    # when the cap is reached cannot be recommended (``TuneOutcome.best``).
    for _ in range(1 + 5 * budget.confirm if budget.confirm else 0):
        if budget.time_s is not None and clock() - start > budget.time_s:
            break
        need = [t for t in (outcome.best_baseline, outcome.leader())
                if t is not None and t.meta.get("measurements", 1) < 1 + budget.confirm]
        if not need:
            break
        t = need[0]
        measure([Proposal(t.strategy, t.origin, aliases=tuple(t.meta.get("aliases", ())))], "confirm")
    return outcome
