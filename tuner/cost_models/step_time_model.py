"""``StepTimeModel``: the one interface of everything that predicts a strategy's seconds per step
from its feature rows (``tuner.features.batch.featurize``), AutoTVM's ``CostModel`` in our terms.

    model = SomeModel(...).fit(X, y, groups)   # rows, measured seconds, (model, cluster) group ids
    seconds = model.predict(X)

Implementations: ``AnalyticCostModel`` (``tuner.cost_models.analytic``; fitted on one group's rows, it ignores
the groups), ``LearnedSimulator`` (``tuner.cost_models.simulator``; transferable features, it ignores the
groups too) and ``RankedStepTime`` (``tuner.cost_models.ranker``; a learning-to-rank model whose "higher is
faster" score is turned into seconds inside it, so its order is the ranker's). ``Predictor``
(``tuner.cost_models.predictor``) judges and fuses them.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class StepTimeModel(Protocol):
    def fit(self, X: np.ndarray, y, groups=None) -> "StepTimeModel":
        """Fit on raw feature rows, their measured seconds and their group ids; returns self."""

    def predict(self, X: np.ndarray) -> np.ndarray:
        """Predicted seconds per step of each feature row (rows of one (model, cluster))."""
