"""The learned simulator: predicted seconds per step for featurized strategies.

An XGBoost regressor over ``dataset.relative_view`` features. Its target is chosen by measurement
on the synthetic set (``benchmarks/simulator_accuracy.py``, 8 models x 3 clusters x 30 trials,
seed 0): either the log step time or the log ratio of the step time to the fitted analytic
estimate. See ``TARGET_CHOICE`` for the numbers and the decision. With fewer than ``min_trials``
training trials it predicts with the (fitted) analytic model alone.
"""
from __future__ import annotations

import numpy as np

from .cost_model import AnalyticCostModel
from .dataset import relative_view
from .errors import check_fitted

TARGETS = ("ratio", "log")
TARGET_CHOICE = """
benchmarks/simulator_accuracy.py defaults (8 models x 3 clusters x 30 strategies, 720 ok trials,
seed 0), mean per-group pairwise accuracy (all pairs / pairs > 5 % apart) / Kendall tau / top-1 regret,
100 trees, depth 6, learning rate 0.05:
  within-group held-out:   ratio 0.854 / 0.903 / 0.712 / 4.8 %    log 0.821 / 0.873 / 0.651 / 4.9 %
  leave-one-model-out:     ratio 0.836 / 0.876 / 0.676 / 12.0 %   log 0.771 / 0.801 / 0.553 / 18.9 %
  noise ceiling (within):  0.876 / 0.914 (median of 3 re-measurements of each held-out strategy)
Means over three within-group splits (seeds 0-2), all pairs / pairs > 5 % apart, and leave-one-model-out:
  100 trees, lr 0.05 (chosen) 0.854 / 0.897, 0.836;  100 trees, lr 0.1 0.852 / 0.894, 0.832;
  150 trees, lr 0.05 0.853 / 0.897, 0.836;  300 trees, lr 0.03 0.852 / 0.898, 0.838;
  depth 4 0.850 / 0.891, 0.827;  depth 8 0.846 / 0.892, 0.832.
The differences are within split noise, so the smallest forest wins: prediction cost grows with the
trees and the search scores every candidate with it. 60 instead of 30 trials per group (seed 0,
100 trees at lr 0.1): 0.860 / 0.886, i.e. more data orders the close pairs better, not the far ones.
Chosen: ratio (better ordering in both protocols, and it transfers: the analytic estimate carries
the scale of an unseen model, the trees only correct it).
"""


class LearnedSimulator:
    """Step-time regressor (scikit-learn conventions: no work in ``__init__``, ``fit`` returns
    self, fitted attributes end in ``_``).

    Args:
        target: ``ratio`` (learn log(time / analytic estimate)) or ``log`` (learn log time).
        n_estimators, max_depth, learning_rate: XGBoost settings.
        min_trials: below this many training trials, predict with the analytic model only.
        n_jobs: XGBoost threads (1 for scoring benchmarks).
        random_state: XGBoost seed.

    Attributes:
        analytic_: the alpha-beta model fitted on the same trials.
        regressor_: the XGBoost model, or None when there was too little data.
        booster_: its Booster (what ``predict`` calls), or None.
        n_train_: training rows.
    """

    def __init__(self, target: str = "ratio", n_estimators: int = 100, max_depth: int = 6,
                 learning_rate: float = 0.05, min_trials: int = 10, n_jobs: int = 1, random_state: int = 0):
        self.target = target
        self.n_estimators = n_estimators
        self.max_depth = max_depth
        self.learning_rate = learning_rate
        self.min_trials = min_trials
        self.n_jobs = n_jobs
        self.random_state = random_state

    def fit(self, X: np.ndarray, y) -> "LearnedSimulator":
        """Fit on raw feature rows ``X`` (``features.featurize``) and measured seconds ``y``.

        Raises:
            ValueError: unknown target, mismatched shapes or non-positive times.
        """
        if self.target not in TARGETS:
            raise ValueError(f"target must be one of {TARGETS}, got {self.target!r}")
        y = np.asarray(y, dtype=np.float64)
        self.analytic_ = AnalyticCostModel().fit(X, y)
        self.n_train_ = len(y)
        self.regressor_ = self.booster_ = None
        if len(y) >= self.min_trials:
            import xgboost as xgb

            self.regressor_ = xgb.XGBRegressor(
                n_estimators=self.n_estimators, max_depth=self.max_depth, learning_rate=self.learning_rate,
                subsample=0.9, colsample_bytree=0.9, n_jobs=self.n_jobs, random_state=self.random_state,
                tree_method="hist")
            self.regressor_.fit(relative_view(X), self._encode(X, y))
            self.booster_ = self.regressor_.get_booster()
        return self

    def _base(self, X: np.ndarray) -> np.ndarray:
        return np.log(np.maximum(self.analytic_.predict_features(X), 1e-12)) if self.target == "ratio" else 0.0

    def _encode(self, X: np.ndarray, y: np.ndarray) -> np.ndarray:
        return np.log(y) - self._base(X)

    def predict(self, X: np.ndarray) -> np.ndarray:
        """Predicted seconds per step of each feature row.

        Raises:
            NotFittedError: before ``fit``.
        """
        check_fitted(self, "analytic_")
        if self.regressor_ is None:
            return self.analytic_.predict_features(X)
        if not len(X):
            return np.zeros(0)
        # inplace_predict skips the DMatrix copy of the scoring path (same trees, same numbers)
        return np.exp(self.booster_.inplace_predict(relative_view(X)).astype(np.float64) + self._base(X))
