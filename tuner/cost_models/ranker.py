"""The ranker: orders the candidate strategies of one (model, cluster) from fastest to slowest.

XGBoost with a ranking objective; a query group is one (model, cluster). Features are the
transferable ``dataset.relative_view`` plus group-relative ones (log of the analytic estimate over
the group's best, its percentile in the group), so a ranker trained on other models and clusters
ranks an unseen one. ``update`` adds boosting rounds on new trials starting from the current
booster (``xgb_model=``) instead of refitting from scratch.
"""
from __future__ import annotations

import numpy as np

from tuner.cost_models.errors import check_fitted
from tuner.features.batch import COL
from tuner.records.dataset import relative_view

OBJECTIVES = ("rank:pairwise", "rank:ndcg")


def group_relative(X: np.ndarray, group: np.ndarray) -> np.ndarray:
    """(rows, 2): log(analytic / best analytic of the row's group) and its percentile there."""
    a = np.log(np.maximum(X[:, COL["analytic_s"]], 1e-12))
    out = np.zeros((len(X), 2), dtype=np.float32)
    for g in np.unique(group):
        rows = np.nonzero(group == g)[0]
        ag = a[rows]
        out[rows, 0] = ag - ag.min()
        out[rows, 1] = np.argsort(np.argsort(ag)) / max(len(rows) - 1, 1)
    return out


def _relevance(y: np.ndarray, group: np.ndarray) -> np.ndarray:
    """Within each group: the fastest trial gets the highest label (rank positions)."""
    lab = np.zeros(len(y), dtype=np.float32)
    for g in np.unique(group):
        rows = np.nonzero(group == g)[0]
        lab[rows] = np.argsort(np.argsort(-y[rows]))
    return lab


class StrategyRanker:
    """Learning-to-rank model over strategies (scikit-learn conventions).

    Args:
        objective: ``rank:pairwise`` or ``rank:ndcg``.
        n_estimators: boosting rounds of ``fit``; ``update_rounds``: rounds added per ``update``.
        max_depth, learning_rate: XGBoost settings.
        n_jobs: threads. random_state: seed.

    Attributes:
        booster_: the fitted xgboost Booster.
        n_rounds_: boosting rounds so far.
    """

    def __init__(self, objective: str = "rank:pairwise", n_estimators: int = 200, update_rounds: int = 20,
                 max_depth: int = 6, learning_rate: float = 0.1, n_jobs: int = 1, random_state: int = 0):
        self.objective = objective
        self.n_estimators = n_estimators
        self.update_rounds = update_rounds
        self.max_depth = max_depth
        self.learning_rate = learning_rate
        self.n_jobs = n_jobs
        self.random_state = random_state

    def _matrix(self, X: np.ndarray, group: np.ndarray) -> np.ndarray:
        return np.concatenate([relative_view(X), group_relative(X, group)], axis=1)

    def _dmatrix(self, X, y, group):
        import xgboost as xgb

        group = np.asarray(group)
        if len(X) != len(y) or len(X) != len(group) or not len(X):
            raise ValueError(f"X, y and group must be non-empty and of equal length, got {len(X)}, {len(y)}, {len(group)}")
        order = np.argsort(group, kind="stable")   # xgboost wants each query's rows contiguous
        X, y, group = X[order], np.asarray(y, dtype=np.float64)[order], group[order]
        d = xgb.DMatrix(self._matrix(X, group), label=_relevance(y, group))
        d.set_group(np.unique(group, return_counts=True)[1])
        return d

    def _params(self) -> dict:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        return {"objective": self.objective, "max_depth": self.max_depth, "eta": self.learning_rate,
                "nthread": self.n_jobs, "seed": self.random_state, "subsample": 0.9, "tree_method": "hist"}

    def fit(self, X: np.ndarray, y, group) -> "StrategyRanker":
        """Fit on raw feature rows, measured seconds and query-group ids (one per (model, cluster))."""
        import xgboost as xgb

        self.booster_ = xgb.train(self._params(), self._dmatrix(X, y, group), num_boost_round=self.n_estimators)
        self.n_rounds_ = self.n_estimators
        return self

    def update(self, X: np.ndarray, y, group) -> "StrategyRanker":
        """Continue boosting on (new and old) trials from the current booster; fits if unfitted."""
        if getattr(self, "booster_", None) is None:
            return self.fit(X, y, group)
        import xgboost as xgb

        self.booster_ = xgb.train(self._params(), self._dmatrix(X, y, group), num_boost_round=self.update_rounds,
                                  xgb_model=self.booster_)
        self.n_rounds_ += self.update_rounds
        return self

    def predict(self, X: np.ndarray, group=None) -> np.ndarray:
        """Scores, higher = expected faster. ``group``: query ids of the rows (default: one group,
        i.e. the rows are candidates for the same (model, cluster)).

        Raises:
            NotFittedError: before ``fit``.
        """
        check_fitted(self, "booster_")
        group = np.zeros(len(X), dtype=np.int64) if group is None else np.asarray(group)
        return self.booster_.inplace_predict(self._matrix(X, group)) if len(X) else np.zeros(0)


class RankedStepTime:
    """``StrategyRanker`` as a ``StepTimeModel``: seconds whose order is the ranker's.

    The ranker's score is "higher is faster" and has no unit; ``predict`` maps it to seconds with
    ``exp(a - b * score)``, ``b > 0``, fitted by least squares of the training rows' log seconds on
    their scores (their spread, at least ``min_slope``): strictly decreasing in the score, so the
    order (and a pairwise accuracy) is exactly the ranker's; the seconds are a rough scale only.

    Args:
        ranker: the StrategyRanker to fit (a new one with ``random_state`` by default).
        warm: ``fit`` continues boosting from the previous fit (``StrategyRanker.update``) instead
            of starting over (the tuner refits every round).
        min_slope: the smallest ``b``.

    Attributes:
        ranker_: the fitted ranker. intercept_, slope_: ``a`` and ``b``.
    """

    def __init__(self, ranker: StrategyRanker | None = None, *, warm: bool = False, min_slope: float = 1e-3,
                 random_state: int = 0):
        self.ranker = ranker
        self.warm = warm
        self.min_slope = min_slope
        self.random_state = random_state

    def fit(self, X: np.ndarray, y, groups) -> "RankedStepTime":
        ranker = getattr(self, "ranker_", None) if self.warm else None
        ranker = ranker or self.ranker or StrategyRanker(random_state=self.random_state)
        self.ranker_ = ranker.update(X, y, groups) if self.warm else ranker.fit(X, y, groups)
        score = self.ranker_.predict(X, groups).astype(np.float64)
        logy = np.log(np.asarray(y, dtype=np.float64))
        spread = float(np.var(score))
        slope = -float(np.mean((score - score.mean()) * (logy - logy.mean()))) / spread if spread > 0 else 0.0
        self.slope_ = max(slope, self.min_slope)
        self.intercept_ = float(logy.mean() + self.slope_ * score.mean())
        return self

    def predict(self, X: np.ndarray) -> np.ndarray:
        """Seconds per step of rows of one (model, cluster), in the ranker's order.

        Raises:
            NotFittedError: before ``fit``.
        """
        check_fitted(self, "ranker_")
        return np.exp(self.intercept_ - self.slope_ * self.ranker_.predict(X).astype(np.float64))
