"""The learned simulator: predicted seconds per step for featurized strategies.

An XGBoost regressor over ``dataset.relative_view`` features. Its target is chosen by measurement
on the synthetic set (``benchmarks/simulator_accuracy.py``, 8 models x 3 clusters x 30 trials,
seed 0): either the log step time or the log ratio of the step time to the fitted analytic
estimate. The numbers and the decision: ``docs/decisions/simulator_target.md``. With fewer than ``min_trials``
training trials it predicts with the (fitted) analytic model alone.
"""
from __future__ import annotations

import numpy as np

from tuner.cost_models.analytic import AnalyticCostModel
from tuner.cost_models.errors import check_fitted
from tuner.records.dataset import RELATIVE_NAMES, relative_view

TARGETS = ("ratio", "log")
# relative features that are costs (seconds of work per second of compute): more of any of them
# never makes a step faster, so the trees may only raise the prediction with them (a prior that
# keeps the trees from fitting label noise; see docs/decisions/simulator_target.md)
MONOTONE = tuple(n for n in RELATIVE_NAMES if n.endswith("/compute") or n in ("log_analytic_s", "log_comm_s"))


class LearnedSimulator:
    """Step-time regressor (scikit-learn conventions: no work in ``__init__``, ``fit`` returns
    self, fitted attributes end in ``_``).

    Args:
        target: ``ratio`` (learn log(time / analytic estimate)) or ``log`` (learn log time).
        n_estimators, max_depth, learning_rate: XGBoost settings.
        min_trials: below this many training trials, predict with the analytic model only.
        monotone: constrain the trees to be non-decreasing in the cost features (``MONOTONE``).
        n_jobs: XGBoost threads (1 for scoring benchmarks).
        random_state: XGBoost seed.

    Attributes:
        analytic_: the alpha-beta model fitted on the same trials.
        regressor_: the XGBoost model, or None when there was too little data.
        booster_: its Booster (what ``predict`` calls), or None.
        n_train_: training rows.
    """

    def __init__(self, target: str = "ratio", n_estimators: int = 100, max_depth: int = 6,
                 learning_rate: float = 0.05, min_trials: int = 10, monotone: bool = True, n_jobs: int = 1,
                 random_state: int = 0):
        self.target = target
        self.n_estimators = n_estimators
        self.max_depth = max_depth
        self.learning_rate = learning_rate
        self.min_trials = min_trials
        self.monotone = monotone
        self.n_jobs = n_jobs
        self.random_state = random_state

    def fit(self, X: np.ndarray, y, groups=None) -> "LearnedSimulator":
        """Fit on raw feature rows ``X`` (``features.batch.featurize``) and measured seconds ``y``
        (``StepTimeModel``; ``groups`` is ignored: the features are transferable between groups).

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
                tree_method="hist", monotone_constraints=self._constraints())
            self.regressor_.fit(relative_view(X), self._encode(X, y))
            self.booster_ = self.regressor_.get_booster()
        return self

    def _constraints(self) -> str | None:
        if not self.monotone:
            return None
        return "(" + ",".join("1" if n in MONOTONE else "0" for n in RELATIVE_NAMES) + ")"

    def _base(self, X: np.ndarray) -> np.ndarray:
        return np.log(np.maximum(self.analytic_.predict(X), 1e-12)) if self.target == "ratio" else 0.0

    def _encode(self, X: np.ndarray, y: np.ndarray) -> np.ndarray:
        return np.log(y) - self._base(X)

    def predict(self, X: np.ndarray) -> np.ndarray:
        """Predicted seconds per step of each feature row.

        Raises:
            NotFittedError: before ``fit``.
        """
        check_fitted(self, "analytic_")
        if self.regressor_ is None:
            return self.analytic_.predict(X)
        if not len(X):
            return np.zeros(0)
        # inplace_predict skips the DMatrix copy of the scoring path (same trees, same numbers)
        return np.exp(self.booster_.inplace_predict(relative_view(X)).astype(np.float64) + self._base(X))
