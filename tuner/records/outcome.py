"""What a tuning run measured (``TuneOutcome``) and how its recommendation is judged: the fastest
strategy, pooled over its repeated measurements, is recommended over the best baseline only when it
is faster beyond the noise between measurements (``TuneOutcome.significant_gain``), and, when
lossy, still so at the low end of its statistical efficiency's interval: a strategy is not called
faster on a convergence cost the probe could not rule out.

"Fastest" is by the run's figure (``TuneOutcome.figure``): under the ``goodput`` and ``exact``
qualities, seconds per step of lossless progress (step time / statistical efficiency,
``tuner.records.goodput``), where a lossy strategy without a measured efficiency does not compete; under
``step``, the step time alone.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from tuner.records.goodput import DEFAULT_MIN_EFFICIENCY, EXACT, Efficiency, goodput_seconds, is_lossless
from tuner.records.trial import Trial


# the stop of a run whose cluster lost nodes: every later trial would fail or time out
NODES_LOST = "nodes_lost"


@dataclass
class TuneOutcome:
    """What a tuning run measured.

    Attributes:
        run_id: id stored in every trial (``Trial.run_id``).
        trials: this run's trials in measurement order (resumed ones included): in a run of
            ``tune_loop``, its ``History`` (the one record of what was measured).
        stop_reason: ``trials``, ``time``, ``patience``, ``exhausted``, ``baselines_failed`` (no
            search: every baseline failed) or ``nodes_lost`` (nodes left the cluster: ``NODES_LOST``).
        stop_note: what a stop other than the budget's says (which nodes were lost), or "".
        quality: ``goodput``, ``exact`` or ``step`` (``tuner.records.goodput.QUALITIES``): what ``figure``
            ranks by.
        efficiency: strategy fingerprint -> its measured statistical efficiency (lossy strategies
            that were probed; lossless ones are 1 without an entry).
        probe_seconds: wall seconds the run spent probing efficiencies.
        min_efficiency: under ``goodput``, a lossy strategy whose measured efficiency is below this
            does not compete (a margin for what the probe's K steps cannot see).
    """

    run_id: str
    trials: Sequence[Trial] = field(default_factory=list)
    stop_reason: str = ""
    stop_note: str = ""
    quality: str = "step"
    efficiency: dict = field(default_factory=dict)
    probe_seconds: float = 0.0
    min_efficiency: float = DEFAULT_MIN_EFFICIENCY

    def efficiency_of(self, strategy) -> Efficiency | None:
        """The strategy's statistical efficiency: 1 when lossless, the probe's when measured, None
        when lossy and not (yet) measured."""
        found = self.efficiency.get(strategy.fingerprint)
        if found is not None:
            return found
        return EXACT if is_lossless(strategy) else None

    def figure(self, t: Trial) -> float:
        """What the run minimizes for a (pooled) trial: its median step time under ``step``;
        otherwise seconds per step of lossless progress, median / E (inf for a lossy strategy
        whose efficiency is not measured, or below ``min_efficiency``: it is never recommended)."""
        if self.quality == "step":
            return t.median
        e = self.efficiency_of(t.strategy)
        if e is not None and e.probed and e.value < self.min_efficiency:
            return float("inf")
        return goodput_seconds(t.median, e)

    @property
    def ok(self) -> list[Trial]:
        return [t for t in self.trials if t.ok]

    def measured(self) -> dict[str, Trial]:
        """Strategy fingerprint -> its ok measurements as one Trial (steps pooled; its
        ``measurements`` says how many); a strategy measured once is its own trial."""
        groups: dict[str, list[Trial]] = {}
        for t in self.ok:
            groups.setdefault(t.strategy.fingerprint, []).append(t)
        return {fp: merge_measurements(ts) for fp, ts in groups.items()}

    def leader(self) -> Trial | None:
        """The best strategy so far by ``figure`` over all its measured steps, however often
        measured (None when nothing measured competes)."""
        best = min(self.measured().values(), key=self.figure, default=None)
        return best if best is not None and np.isfinite(self.figure(best)) else None

    @property
    def fastest(self) -> Trial | None:
        """The fastest strategy by its pooled steps, except that once confirmation has run only
        strategies measured as often as the most-measured ones compete (an unconfirmed lucky
        measurement never wins over confirmed ones)."""
        merged = self.measured()
        if self.confirm_trials and merged:
            top = max(t.measurements for t in merged.values())
            merged = {k: t for k, t in merged.items() if t.measurements == top}
        best = min(merged.values(), key=self.figure, default=None)
        return best if best is not None and np.isfinite(self.figure(best)) else None

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

    def not_recommended(self, fastest: Trial) -> dict:
        """What a summary says of ``fastest`` when it is not the recommendation: its origin and
        step time, and ``because``: ``noise`` (its gain over the recommendation is within the
        noise between measurements) or ``efficiency`` (beyond the noise at the efficiency its
        probe measured, not at the low end of that efficiency's interval, also given)."""
        out = {"origin": fastest.origin, "step_time_s": fastest.median, "because": "noise"}
        best = self.best
        if best is not None and self.significant_gain(fastest, best, efficiency="value"):
            e = self.efficiency_of(fastest.strategy)
            out.update(because="efficiency", efficiency=e.value, efficiency_interval=[e.low, e.high])
        return out

    def significant_gain(self, a: Trial, b: Trial, z: float = 1.0, efficiency: str = "interval") -> bool | None:
        """Whether strategy ``a`` is faster than ``b`` by more than ``z`` standard errors, on the
        log medians of their separate measurements (each shifted by its log efficiency, unless
        the quality is ``step``) (the noise that matters is between
        measurements: each run of a strategy lands on its own placement and contention).

        ``efficiency="interval"``: a probed efficiency counts at the end of its 95 % interval that
        favours ``b`` (``a``'s low end, ``b``'s high end), so that a gain resting on a convergence
        cost the probe cannot rule out is no gain; ``"value"``: at the probe's estimate.

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
            within.setdefault(t.strategy.fingerprint, []).append(log_median_variance(t))
        fa, fb = a.strategy.fingerprint, b.strategy.fingerprint
        la, lb = per.get(fa, [])[1:], per.get(fb, [])[1:]
        if not la or not lb:
            return None
        shift = {fa: self._log_inverse_efficiency(a, "low" if efficiency == "interval" else "value"),
                 fb: self._log_inverse_efficiency(b, "high" if efficiency == "interval" else "value")}
        repeated = [v for v in per.values() if len(v) > 1]
        dof = sum(len(v) - 1 for v in repeated)
        var = sum(float(np.sum((np.asarray(v) - np.mean(v)) ** 2)) for v in repeated) / dof
        floor = [w for w in within[fa][1:] + within[fb][1:] if np.isfinite(w)]
        if floor:
            var = max(var, float(np.mean(floor)))
        se = np.sqrt(var * (1 / len(la) + 1 / len(lb)))
        return bool(np.mean(lb) + shift[fb] - np.mean(la) - shift[fa] > z * se)

    def _log_inverse_efficiency(self, t: Trial, end: str) -> float:
        """log(1 / E) of ``t``'s strategy, E at ``end`` (``value``, ``low`` or ``high``) of its
        probed interval; log(figure / median) otherwise (0 for lossless, and under ``step``)."""
        if self.quality == "step":
            return 0.0
        e = self.efficiency_of(t.strategy)
        point = float(np.log(self.figure(t) / t.median))
        if e is None or not e.probed or end == "value" or not np.isfinite(point):
            return point
        return float(-np.log(max(min(getattr(e, end), 1.0), 1e-9)))

    @property
    def baselines(self) -> dict[str, Trial]:
        """Builder name -> its measurements (builders with the same strategy share them)."""
        merged = self.measured()
        out = {}
        for t in self.trials:
            if t.role == "baseline":
                for name in (t.origin, *t.aliases):
                    out[name] = merged.get(t.strategy.fingerprint, t)
        return out

    @property
    def best_baseline(self) -> Trial | None:
        return min((t for t in self.baselines.values() if t.ok and np.isfinite(self.figure(t))),
                   key=self.figure, default=None)

    @property
    def search_trials(self) -> list[Trial]:
        return [t for t in self.trials if t.role not in ("baseline", "confirm")]

    @property
    def confirm_trials(self) -> list[Trial]:
        return [t for t in self.trials if t.role == "confirm"]

    def trials_to_within(self, fraction: float = 0.05) -> int | None:
        """Trials (in order, baselines included) until the final best strategy itself or one
        measured within ``fraction`` of its (pooled) figure was first measured."""
        best = self.best
        if best is None:
            return None
        target = self.figure(best) * (1 + fraction)
        for i, t in enumerate(self.trials, 1):
            if t.ok and (t.strategy.fingerprint == best.strategy.fingerprint or self.figure(t) <= target):
                return i
        return None


def log_median_variance(t: Trial) -> float:
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
    return dataclasses.replace(trials[0], step_times=steps, measurements=len(trials))


def not_recommended_reason(f: dict) -> str:
    """Why a strategy is not the recommendation, in words (``TuneOutcome.not_recommended``'s dict)."""
    if f.get("because") == "efficiency":
        low, high = f["efficiency_interval"]
        return (f"its gain over the best baseline holds at the statistical efficiency its probe measured "
                f"({f['efficiency']:.2f}), not at the low end of that figure's 95 % interval ({low:.2f} to {high:.2f}): "
                f"it could train that much slower (more --probe-steps narrow the interval)")
    return "its gain over the best baseline is within the noise between repeated measurements"
