"""What ``autosync.tune`` returns: the recommended strategy, its measurements and the run's
summary (``autosync tune --json`` prints ``TuneResult.summary``)."""
from __future__ import annotations

import os
from dataclasses import dataclass

from strategy_space import ClusterSpec, ModelSpec, Strategy
from strategy_space.yaml_io import save as save_yaml
from tuner.records.goodput import Efficiency, lossy_parts
from tuner.records.outcome import TuneOutcome
from tuner.records.trial import Trial


@dataclass
class TuneResult:
    """The outcome of ``tune``.

    Attributes:
        best_strategy: the fastest measured strategy (its ``origin`` says if it is a baseline).
        best_trial: its measurement.
        baselines: builder name -> Trial, measured in the same run.
        model, cluster: what was tuned.
        outcome: every trial of the run and why it stopped.
        store_path: the TrialStore the trials were added to.
        warm_start_trials: trials of the warm-start dataset the predictor learned from besides.
        quality: what the run ranked by (``tuner.records.goodput.QUALITIES``).
        lossy_note: why lossy parts were not proposed, or what their efficiencies rest on.
        search_note: what else the search did not propose, and why (``autosync.search_limits``).
    """

    best_strategy: Strategy
    best_trial: Trial
    baselines: dict
    model: ModelSpec
    cluster: ClusterSpec
    outcome: TuneOutcome
    store_path: str
    warm_start_trials: int = 0
    quality: str = "step"
    lossy_note: str = ""
    search_note: str = ""

    @property
    def efficiency(self) -> Efficiency | None:
        """The statistical efficiency of the recommendation (1, not probed, when lossless; None
        under ``step`` for a lossy one, which was never probed)."""
        return self.outcome.efficiency_of(self.best_strategy)

    @property
    def trials(self):
        """Every trial of the run as a pandas DataFrame (one row per trial)."""
        import pandas as pd

        rows = []
        for i, t in enumerate(self.outcome.trials, 1):
            rows.append({"trial": i, "origin": t.origin, "role": t.role or None, "status": t.status,
                         "median_s": t.median if t.ok else None, "p90_s": t.p90 if t.ok else None,
                         "predicted_s": t.predicted_s, "samples_per_s": t.samples_per_s if t.ok else None,
                         "error": t.error or None, "strategy_fingerprint": t.strategy.fingerprint})
        return pd.DataFrame(rows)

    @property
    def best_baseline(self) -> Trial | None:
        return self.outcome.best_baseline

    @property
    def speedup_over_baselines(self) -> dict[str, float | None]:
        """Builder name -> its figure / the best's (None where the baseline failed): seconds per
        step of lossless progress, or step time under the ``step`` quality."""
        f = self.outcome.figure
        return {name: (f(t) / f(self.best_trial) if t.ok else None) for name, t in self.baselines.items()}

    @property
    def speedup_over_best_baseline(self) -> float | None:
        """The best baseline's figure over the recommendation's (goodput, or step time under the
        ``step`` quality)."""
        b = self.best_baseline
        return self.outcome.figure(b) / self.outcome.figure(self.best_trial) if b is not None else None

    def save(self, path: str | os.PathLike) -> None:
        """Write the best strategy as YAML (atomically)."""
        save_yaml(self.best_strategy, path)

    def summary(self) -> dict:
        """The JSON summary ``autosync tune --json`` prints."""
        b, fastest = self.best_baseline, self.outcome.fastest
        e = self.efficiency
        return {
            "model": self.model.name, "cluster": self.cluster.name, "quality": self.quality,
            "ranked_by": ("step time only: what lossy parts cost in convergence was not measured"
                          if self.quality == "step" else "goodput: step time / statistical efficiency"),
            "statistical_efficiency": e.value if e else None,
            "statistical_efficiency_interval": [e.low, e.high] if e else None,
            "efficiency_probed": e.probed if e else False,
            "efficiency_source": e.source if e else "not measured (quality step)",
            "efficiency_note": e.note if e else "",
            "lossy_parts": lossy_parts(self.best_strategy).describe(),
            "lossy_note": self.lossy_note,
            "search_note": self.search_note,
            "best_goodput_s": self.outcome.figure(self.best_trial) if self.quality != "step" else None,
            "step_speedup_over_best_baseline": (b.median / self.best_trial.median) if b is not None else None,
            "probes": sum(1 for x in self.outcome.efficiency.values() if x.source == "probe"),
            "probe_seconds": self.outcome.probe_seconds, "best_step_time_s": self.best_trial.median,
            "best_p90_s": self.best_trial.p90,
            "best_origin": self.best_trial.origin,
            "best_samples_per_s": self.best_trial.samples_per_s,
            "best_baseline": b.origin if b else None,
            "best_baseline_step_time_s": b.median if b else None,
            "speedup_over_best_baseline": self.speedup_over_best_baseline,
            "speedup_over_baselines": self.speedup_over_baselines,
            "trials": len(self.outcome.search_trials),
            "baseline_trials": sum(1 for t in self.outcome.trials if t.role == "baseline"),
            "confirm_trials": len(self.outcome.confirm_trials),
            "best_measurements": self.best_trial.measurements,
            # the fastest strategy measured, when not recommended: its gain over the best baseline was within the
            # noise of repeated measurements (``because``: noise), or only at its probed efficiency (efficiency)
            "fastest_not_significant": (None if fastest is None
                                        or fastest.strategy.fingerprint == self.best_trial.strategy.fingerprint
                                        else self.outcome.not_recommended(fastest)),
            "total_trials": len(self.outcome.trials),
            "failed_trials": sum(1 for t in self.outcome.trials if not t.ok),
            "trials_to_within_5pct": self.outcome.trials_to_within(0.05),
            "stop_reason": self.outcome.stop_reason,
            "stop_note": self.outcome.stop_note,
            "run_id": self.outcome.run_id,
            "store": self.store_path,
            "warm_start_trials": self.warm_start_trials,
            # what the cost model that chose the candidates took on trust about the cluster
            "assumed": self.cluster.assumptions(),
        }
