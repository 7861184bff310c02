"""The analytic cost model: the alpha-beta step formula, with its parameters fitted on trials.

It is the cold-start predictor: with no data it uses DESIGN.md's measured constants
(``AlphaBeta()``), works for any (model, cluster) read from YAML and needs no TensorFlow. Given
measured trials, ``fit`` adjusts alpha (per call and per ring step), the bandwidth efficiency, the
CPU byte rate, the per-call actor time and a compute scale by regularised nonlinear least squares
on log step times (Levenberg-Marquardt with a numeric Jacobian: six parameters, a few hundred rows).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from strategy_space import ClusterSpec, ConfigError, ModelSpec
from strategy_space.encoding import EncodedStrategies

from tuner.features.alpha_beta import AlphaBeta, step_time
from tuner.features.batch import featurize, terms_of
from tuner.features.tables import FeatureTables


class AnalyticCostModel:
    """Alpha-beta model of one synchronous step (see ``tuner.features.alpha_beta``).

    Args:
        prior: starting parameters, and the values the fit is pulled towards.
        ridge: weight of the pull towards ``prior`` (in log-parameter space); keeps parameters
            that the data cannot identify (e.g. ``alpha_step`` with no all-reduce trials) put.
        max_iter: Levenberg-Marquardt iterations.

    Attributes:
        params_: fitted parameters (after ``fit``).
        rmse_log_: root mean squared error of log step time on the training rows.
    """

    def __init__(self, prior: AlphaBeta | None = None, ridge: float = 0.05, max_iter: int = 50):
        self.prior = prior
        self.ridge = ridge
        self.max_iter = max_iter

    @property
    def parameters(self) -> AlphaBeta:
        """Fitted parameters, else the prior (the model is usable unfitted: that is its job)."""
        return getattr(self, "params_", None) or self.prior or AlphaBeta()

    def predict(self, X: np.ndarray) -> np.ndarray:
        """Step time (s) of feature rows (``features.batch.featurize`` output); ``StepTimeModel``."""
        return step_time(terms_of(X), self.parameters)

    def predict_strategies(self, model: ModelSpec, cluster: ClusterSpec, encoded: EncodedStrategies,
                           tables: FeatureTables | None = None) -> np.ndarray:
        """Step time (s) of each encoded strategy of ``model`` on ``cluster``."""
        tables = tables or FeatureTables.from_specs(model, cluster)
        return self.predict(featurize(tables, encoded))

    def fit(self, X: np.ndarray, y: Sequence[float], groups=None) -> "AnalyticCostModel":
        """Fit the parameters to measured step times (``StepTimeModel``).

        Args:
            X: feature rows of the measured strategies (``featurize``).
            y: their measured step times in seconds (e.g. ``Trial.median``).
            groups: ignored (the parameters are one cluster's: fit on one group's rows).

        Returns:
            self.

        Raises:
            ValueError: shapes disagree, no rows, or non-positive times.
        """
        y = np.asarray(y, dtype=np.float64)
        if X.ndim != 2 or len(X) != len(y) or not len(y):
            raise ValueError(f"fit needs matching non-empty X (rows, features) and y, got {X.shape} and {y.shape}")
        if not np.all(np.isfinite(y) & (y > 0)):
            raise ValueError("fit needs finite step times > 0 (drop failed trials first)")
        terms = terms_of(X)
        prior = (self.prior or AlphaBeta()).to_vector()
        logy = np.log(y)
        lam_reg = np.sqrt(self.ridge * len(y))

        def residuals(theta):
            pred = step_time(terms, AlphaBeta.from_vector(theta))
            return np.concatenate([np.log(np.maximum(pred, 1e-12)) - logy, lam_reg * (theta - prior)])

        theta, r = prior.copy(), residuals(prior)
        damping = 1e-2
        for _ in range(self.max_iter):
            J = np.empty((len(r), len(theta)))
            for j in range(len(theta)):
                step = np.zeros_like(theta)
                step[j] = 1e-4
                J[:, j] = (residuals(theta + step) - r) / 1e-4
            A, g = J.T @ J, J.T @ r
            improved = False
            while damping < 1e8:
                delta = np.linalg.solve(A + damping * np.diag(np.diag(A) + 1e-9), -g)
                r_new = residuals(theta + delta)
                if r_new @ r_new < r @ r:
                    theta, r, damping, improved = theta + delta, r_new, max(damping / 3, 1e-6), True
                    break
                damping *= 4
            if not improved or np.abs(delta).max() < 1e-6:
                break
        self.params_ = AlphaBeta.from_vector(theta)
        self.rmse_log_ = float(np.sqrt(np.mean(r[:len(y)] ** 2)))
        return self


def step_lower_bound(model: ModelSpec, cluster: ClusterSpec, strategy) -> dict:
    """The analytic lower bound of one synchronous step of ``strategy``: the larger of its compute
    and the least time the busiest NIC needs for the bytes it moves (each direction at the
    cluster's link rate), as if all communication overlapped compute (``overlapped_s``, the
    bound); ``serial_s`` (their sum) is what a step costs with no overlap at all, for reference.
    ``busiest_nic_s`` alone depends on nothing but bytes and the cluster's bandwidths."""
    from strategy_space.space import StrategySpace

    return lower_bound_of_row(featurize(FeatureTables.from_specs(model, cluster),
                                        StrategySpace(model, cluster).encode([strategy]))[0])


def lower_bound_of_row(x: np.ndarray) -> dict:
    """``step_lower_bound`` of a strategy whose feature row (``featurize``) is already at hand."""
    from tuner.features.batch import COL

    nic = float(max(x[COL["nic_in_s"]], x[COL["nic_out_s"]]))
    compute = float(x[COL["compute_s"]])
    return {"compute_s": compute, "busiest_nic_s": nic, "serial_s": compute + nic, "overlapped_s": max(compute, nic)}


def beyond_trial_limit(model: ModelSpec, cluster: ClusterSpec, strategy, *, steps: int, limit_s: float) -> str:
    """Why ``steps`` steps of ``strategy`` cannot finish within ``limit_s`` seconds, or "" when
    they may: the bytes its busiest NIC must move per step (``step_lower_bound``), at the cluster's
    stated bandwidth, already take longer. Such a trial would only spend the whole limit to time
    out (e.g. any uncompressed strategy for VGG-16's 138M dense parameters on three nodes at
    100 Mbit/s: 59 s a step on the busiest NIC, 13 steps 767 s against a 300 s limit). A strategy
    the features cannot encode (a variable's shards on different kinds of synchronizer) runs."""
    try:
        nic_s = step_lower_bound(model, cluster, strategy)["busiest_nic_s"]
    except ConfigError:
        return ""
    if not nic_s * steps > limit_s:
        return ""
    slowest = min(n.bandwidth_gbps for n in cluster.nodes)
    return (f"not run: its busiest NIC needs at least {nic_s:.3g} s a step for the bytes this strategy moves "
            f"(links of {slowest * 1e3:g} Mbit/s and up, as the cluster states), so its {steps} warm-up and timed "
            f"steps need at least {nic_s * steps:.0f} s, over the trial limit of {limit_s:g} s; a strategy that "
            f"moves fewer bytes (compression, parameter servers for sparse variables) may fit, or raise the "
            f"trial limit (--timeout) if it must be measured")
