"""The tuning loop: measure the baselines, then repeat — ask the tuner for a batch, measure it,
hand the trials back — until the trial budget, the time budget or the patience runs out; then
re-measure the contenders (confirmation) so the recommended strategy is not just the luckiest single
measurement. ``tune_loop`` drives any ``Tuner`` (``tuner.search.base``) with a ``Runner`` and a
``TrialStore``; every trial carries the run's id, so a killed run can be resumed (measured
strategies are never proposed again and count against the budget).

The path of a strategy, top-down (no module is visited twice):

1. CLI: ``autosync tune`` (``autosync/cli/tune.py``) parses flags and calls the API.
2. API: ``autosync.tune`` (``autosync/api.py``) resolves the model and cluster names and files into
   a ModelSpec and a ClusterSpec, loads the warm-start groups, builds the ``RayRunner``
   (``make_runner``; the runtime, ``autosync/runtime/runner.py``, takes the resolved objects) and a
   ``ModelBasedTuner`` (``tuner/search/model_based.py``), opens the ``TrialStore`` (``tuner/records/store.py``) and
   calls ``tune_loop`` here.
3. Loop (this module): reads the store once (``load_groups``, and the run to resume), then asks
   ``BaselineTuner`` (``tuner/search/baseline_tuner.py``) and the tuner for ``Proposal``s (``tuner/search/base.py``):
   a strategy with its encoded row and predicted seconds.
4. Tuner: ``ModelBasedTuner.next_batch`` refits its ``Predictor`` (``tuner/cost_models/predictor.py``; the
   analytic model, simulator and ranker are ``StepTimeModel``s, ``tuner/cost_models/step_time_model.py``) on its
   in-memory ``TrainingSet`` (``tuner/records/training_set.py``) and anneals over it (``tuner/search/annealing.py``).
5. Runner: ``Runner.run`` (``tuner/records/trial.py``'s interface) measures the strategy and returns a
   ``Trial``.
6. Trial: appended to the store (an append-only log) and to the run's one record of what was
   measured, its ``History`` (``tuner/records/history.py``; the outcome's ``trials``): each trial's entry is
   built once there, with the encoded and feature rows its proposal carried; the tuner reads the
   History at its next ``next_batch`` — step 4 again.

At the end ``TuneOutcome.best`` recommends the fastest strategy only when it beats the best baseline
beyond the noise, a lossy one even at the low end of its efficiency's interval
(``tuner/records/outcome.py``).

Under the ``goodput`` quality (``tuner/records/goodput.py``), "fastest" is in seconds per step of lossless
progress: after each round, a lossy strategy whose step time could lead is probed for its
statistical efficiency (``Prober``; cached per model and lossy parts), and without a measured
efficiency a lossy strategy does not compete.
"""
from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass
from typing import Callable

from strategy_space import ClusterSpec, ModelSpec

from tuner.records.dataset import store_groups
from tuner.records.goodput import DEFAULT_MIN_EFFICIENCY, QUALITIES, Efficiency, Prober, failed_efficiency, is_lossless
from tuner.records.history import History
from tuner.records.outcome import NODES_LOST, TuneOutcome
from tuner.records.trial import Runner, Trial, lost_nodes_note, workers_lost
from tuner.search.base import Proposal, Tuner
from tuner.search.baseline_tuner import BaselineTuner


@dataclass(frozen=True)
class Budget:
    """When to stop: search trials (baselines come on top), seconds, rounds without improvement;
    and ``confirm``: extra measurements of the final contenders (the best strategy and the best
    baseline must each have ``1 + confirm`` before the run ends; 0 turns confirmation off)."""

    trials: int = 24
    time_s: float | None = None
    patience: int = 4
    confirm: int = 2
    started: float | None = None   # when ``time_s`` began, on the loop's clock (None: as the loop starts)


def previous_run(store, model: ModelSpec, cluster: ClusterSpec) -> tuple[str | None, list[Trial]]:
    """The most recent run id in ``store`` for (model, cluster) and its trials, oldest first."""
    trials = [t for t in store.trials_for(model.fingerprint, cluster.fingerprint) if t.run_id]
    if not trials:
        return None, []
    run_id = max(trials, key=lambda t: t.finished_at).run_id
    return run_id, sorted((t for t in trials if t.run_id == run_id), key=lambda t: t.finished_at)


def tune_loop(runner: Runner, store, tuner: Tuner, budget: Budget, *, baselines: Tuner | None = None,
              resume: bool = False, on_trial: Callable[[Trial, TuneOutcome], None] | None = None,
              quality: str = "step", prober: Prober | None = None, min_efficiency: float = DEFAULT_MIN_EFFICIENCY,
              on_probe: Callable[[Trial, Efficiency], None] | None = None,
              clock=time.monotonic) -> TuneOutcome:
    """Measure the baselines, then search with ``tuner`` until the budget is spent.

    The store is read here once, at the start (its groups for the tuner to learn from, and the run
    to resume); after that it is only appended to.

    Args:
        runner: executes strategies (Ray runtime, or a fake in tests).
        store: TrialStore; every trial is added as soon as it is measured.
        tuner: proposes the search's strategies (any ``Tuner``).
        baselines: proposes the baselines, measured first (default: every builder's strategy
            under the tuner's pins, ``BaselineTuner``).
        resume: continue the latest run of this (model, cluster) in the store.
        on_trial: called after each stored trial (progress display).
        quality: what the run ranks by (``tuner.records.goodput.QUALITIES``). ``goodput`` and ``exact``
            rank by step time / statistical efficiency; the tuner's space decides whether lossy
            parts are proposed at all (``exact``: never).
        prober: measures the efficiency of lossy strategies under ``goodput``; without one a
            lossy strategy never competes.
        on_probe: called after each probe (progress display).
        min_efficiency: under ``goodput``, the least measured efficiency a lossy strategy needs
            to compete.
    """
    if quality not in QUALITIES:
        raise ValueError(f"quality must be one of {', '.join(QUALITIES)}, got {quality!r}")
    run = _TuningRun(runner, store, tuner, budget, baselines or BaselineTuner(tuner.model, tuner.cluster,
                                                                              constraints=tuner.pins),
                     quality, prober, min_efficiency, on_trial, on_probe, clock)
    run.open(resume)
    run.measure(run.baselines.next_batch(None, run.history), "baseline")
    run.search()
    run.confirm()
    return run.outcome


class _TuningRun:
    """One call of ``tune_loop``: its history (the one record of what was measured, which the
    tuners read and its outcome reports), the clock it started on, and the steps of the loop."""

    def __init__(self, runner: Runner, store, tuner: Tuner, budget: Budget, baselines: Tuner, quality: str,
                 prober: Prober | None, min_efficiency: float, on_trial, on_probe, clock):
        self.runner, self.store, self.tuner, self.budget, self.baselines = runner, store, tuner, budget, baselines
        self.quality, self.prober, self.min_efficiency = quality, prober, min_efficiency
        self.on_trial, self.on_probe, self.clock = on_trial, on_probe, clock
        self.model, self.cluster = tuner.model, tuner.cluster
        self.history = History(self.model, self.cluster)
        self.outcome = TuneOutcome(run_id=uuid.uuid4().hex[:12], trials=self.history, quality=quality,
                                   efficiency=self.history.efficiency, min_efficiency=min_efficiency)
        self.start = clock() if budget.started is None else budget.started
        self.gone: set[str] = set()   # lost nodes that held no workers: no search trial places shards there

    def out_of_time(self) -> bool:
        return self.budget.time_s is not None and self.clock() - self.start > self.budget.time_s

    def open(self, resume: bool) -> None:
        """Record the model and cluster, hand the tuner the store's groups, and take over the run to
        resume (its trials into the history, its lossy trials probed)."""
        store, outcome = self.store, self.outcome
        store.add_model(self.model)
        store.add_cluster(self.cluster)
        self.tuner.load_groups(store_groups(store))
        if not resume:
            return
        run_id, previous = previous_run(store, self.model, self.cluster)
        if run_id is not None:
            outcome.run_id = run_id
            self.history.add(previous)
        self.probe(list(self.history))

    def probe(self, trials: list[Trial]) -> None:
        """Measure the efficiency of the lossy strategies among ``trials`` that could lead: whose
        step time beats the leader's figure (at E = 1 a strategy that does not is no contender)."""
        if self.quality != "goodput" or self.prober is None:
            return
        outcome = self.outcome
        for t in trials:
            fp = t.strategy.fingerprint
            if not t.ok or fp in outcome.efficiency or is_lossless(t.strategy):
                continue
            leader = outcome.leader()
            if leader is not None and outcome.measured()[fp].median >= outcome.figure(leader):
                continue
            if self.out_of_time():
                return
            lossless = min((m for m in outcome.measured().values() if is_lossless(m.strategy)),
                           key=lambda m: m.median, default=None)
            if lossless is not None:
                self.prober.use_lossless(lossless.strategy)
            t0 = self.clock()
            try:
                e = self.prober.efficiency(t.strategy)
            except Exception as exc:   # a failed probe is recorded; the strategy cannot be kept
                e = failed_efficiency(f"{type(exc).__name__}: {exc}")
            outcome.probe_seconds += self.clock() - t0
            outcome.efficiency[fp] = e
            if self.on_probe:
                self.on_probe(t, e)

    def measure(self, proposals: list[Proposal], role: str) -> list[Trial]:
        """Run, store and record each proposal (into the history, with the rows it carries), and
        probe the trials."""
        got = []
        for p in proposals:
            if self.outcome.stop_reason == NODES_LOST or (role != "baseline" and self.out_of_time()):
                break
            if role == "search" and self.gone.intersection(p.strategy.ps_nodes()):
                continue   # it would fail at once: not a trial spent
            # a failed baseline is run once more before it drops out of the comparison (a fault can
            # be passing; a time-out is not: Trial.worth_another_run); both attempts are stored
            for attempt in range(2 if role == "baseline" else 1):
                [t] = self.runner.run([p.strategy], [p.origin])
                # a lost node that held workers fails every later trial (or makes it wait); one that
                # held none fails only the strategies that place parameter servers there: go on
                gone = [] if t.ok else getattr(self.runner, "lost_nodes", list)()
                lost = workers_lost(gone, self.cluster)
                self.gone.update(n for n in gone if n not in lost)
                if lost:
                    note = lost_nodes_note(lost)
                    self.outcome.stop_reason, self.outcome.stop_note = NODES_LOST, note + "; --resume continues the run"
                    t = dataclasses.replace(t, error=t.error if note in t.error else f"{note} ({t.error})")
                training = getattr(self.prober, "training_known", None)   # (``report.run_probes``)
                t = dataclasses.replace(t, run_id=self.outcome.run_id, role=role, predicted_s=p.predicted_s,
                                        aliases=p.aliases, meta={**t.meta, **p.meta, "quality": self.quality,
                                                                 "min_efficiency": self.min_efficiency,
                                                                 **({"attempt": attempt + 1} if attempt else {}),
                                                                 **({"training": training} if training else {})})
                self.store.add(t, self.model, self.cluster)
                self.history.add([t], [p])
                got.append(t)
                if self.on_trial:
                    self.on_trial(t, self.outcome)
                if not t.worth_another_run or self.outcome.stop_reason == NODES_LOST:
                    break
        self.probe(got)
        return got

    def _figure_of_leader(self) -> float:
        leader = self.outcome.leader()
        return self.outcome.figure(leader) if leader else float("inf")

    def search(self) -> None:
        """Rounds of the tuner's proposals until the trials, the time or the patience run out (or
        the tuner has nothing left, or every baseline failed); the reason is the outcome's
        ``stop_reason``."""
        outcome, budget = self.outcome, self.budget
        if outcome.stop_reason == NODES_LOST:
            return
        baselines = [t for t in outcome.trials if t.role == "baseline"]
        if baselines and not any(t.ok for t in baselines):
            # every builder's strategy failed, each run twice unless it timed out: PS and all-reduce
            # alike, so what fails is the model or the cluster, not a strategy; a search of their
            # mixes would fail the same way, one trial time-out after another
            outcome.stop_reason = "baselines_failed"
            return
        best, stale_rounds = self._figure_of_leader(), 0
        while True:
            remaining = budget.trials - len(outcome.search_trials)
            if remaining <= 0:
                outcome.stop_reason = "trials"
                return
            if self.out_of_time():
                outcome.stop_reason = "time"
                return
            if stale_rounds >= budget.patience:
                outcome.stop_reason = "patience"
                return
            k = min(self.tuner.batch_size, remaining)
            proposals = self.tuner.next_batch(k, self.history) if self.tuner.has_next() else []
            if not proposals:
                outcome.stop_reason = "exhausted"
                return
            self.measure(proposals, "search")
            if outcome.stop_reason == NODES_LOST:
                return
            new_best = self._figure_of_leader()
            stale_rounds = 0 if new_best < best * (1 - 1e-3) else stale_rounds + 1
            best = min(best, new_best)

    def confirm(self) -> None:
        """Confirmation (racing): the best of many noisy single measurements is flattered by its
        noise. Re-measure the best baseline, then the leader, until each has 1 + confirm
        measurements; a re-measured leader that falls back hands the lead to the next one. What is
        left unconfirmed when the cap is reached cannot be recommended (``TuneOutcome.best``)."""
        confirm = self.budget.confirm
        for _ in range(1 + 5 * confirm if confirm else 0):
            need = [t for t in (self.outcome.best_baseline, self.outcome.leader())
                    if t is not None and t.measurements < 1 + confirm]
            if not need or self.out_of_time():
                return
            if self.outcome.stop_reason == NODES_LOST:
                self.outcome.stop_note += ("; nothing was re-measured, so the recommendation rests on single "
                                           "measurements")
                return
            t = need[0]
            self.measure([Proposal(t.strategy, t.origin, aliases=t.aliases)], "confirm")
