"""What the search scores candidates with, for one (model, cluster), learned from every trial in
the store.

* cold start (no usable trials): the analytic alpha-beta model with its prior parameters;
* with trials: the learned simulator, trained on every group in the store through transferable
  features (other models and clusters warm-start the target), the analytic model refitted on the
  target group when it has enough trials;
* the ranker, trained on all groups (query = (model, cluster)), re-orders the annealing pool
  together with the simulator (rank fusion), once it has at least two groups or ``min_rank_trials``.
"""
from __future__ import annotations

import numpy as np

from strategy_space import ClusterSpec, ModelSpec
from strategy_space.space import EncodedStrategies

from .cost_model import AnalyticCostModel
from .dataset import build_trial_set, store_groups
from .features import FeatureTables, featurize
from .ranker import StrategyRanker
from .simulator import LearnedSimulator


class Predictor:
    """Predicted step seconds and a fused ranking for candidates of one (model, cluster).

    Args:
        model, cluster: the target.
        min_target_trials: target-group trials needed before the analytic model is refitted.
        min_rank_trials: trials needed (with a single group) before the ranker is used.
        seed: XGBoost seed.

    Attributes:
        source_: which predictor scores seconds: ``analytic``, ``simulator``.
        ranker_: the fitted StrategyRanker, or None.
        n_trials_, n_groups_: training data seen by the last ``refit``.
    """

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, *, min_target_trials: int = 6,
                 min_rank_trials: int = 12, seed: int = 0):
        self.model, self.cluster = model, cluster
        self.tables = FeatureTables.from_specs(model, cluster)
        self.min_target_trials = min_target_trials
        self.min_rank_trials = min_rank_trials
        self.seed = seed
        self.analytic_ = AnalyticCostModel()
        self.simulator_: LearnedSimulator | None = None
        self.ranker_: StrategyRanker | None = None
        self.source_ = "analytic"
        self.n_trials_ = self.n_groups_ = 0

    def refit(self, store) -> "Predictor":
        """Refit on every ok trial in ``store`` (a TrialStore), the target group included."""
        groups = [g for g in store_groups(store) if g[2]]
        try:
            data = build_trial_set(groups)
        except ValueError:  # no ok trial anywhere: stay analytic
            return self
        self.n_trials_, self.n_groups_ = len(data), len(data.keys)
        target = (self.model.fingerprint, self.cluster.fingerprint)
        if target in data.keys:
            rows = data.group == data.keys.index(target)
            if rows.sum() >= self.min_target_trials:
                self.analytic_ = AnalyticCostModel().fit(data.X[rows], data.y[rows])
        self.simulator_ = LearnedSimulator(random_state=self.seed).fit(data.X, data.y)
        self.source_ = "simulator"
        if self.n_groups_ >= 2 or len(data) >= self.min_rank_trials:
            self.ranker_ = (self.ranker_ or StrategyRanker(random_state=self.seed)).update(data.X, data.y, data.group)
        return self

    def features(self, e: EncodedStrategies) -> np.ndarray:
        return featurize(self.tables, e, self.analytic_.parameters)

    def predict(self, e: EncodedStrategies, X: np.ndarray | None = None) -> np.ndarray:
        """Predicted seconds per step."""
        X = self.features(e) if X is None else X
        if self.simulator_ is not None:
            return self.simulator_.predict(X)
        return self.analytic_.predict_features(X)

    def order(self, e: EncodedStrategies) -> tuple[np.ndarray, np.ndarray]:
        """(indices best first, predicted seconds): simulator order, fused with the ranker's when
        it is fitted (mean of the two rank positions)."""
        X = self.features(e)
        seconds = self.predict(e, X)
        position = np.argsort(np.argsort(seconds, kind="stable"), kind="stable").astype(float)
        if self.ranker_ is not None:
            score = self.ranker_.predict(X)  # higher = faster
            position += np.argsort(np.argsort(-score, kind="stable"), kind="stable")
        return np.argsort(position, kind="stable"), seconds
