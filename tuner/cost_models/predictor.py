"""What the search scores candidates with, for one (model, cluster), learned from every trial in
the store and in the warm-start dataset.

Three scorers compete: the analytic alpha-beta model (prior parameters, refitted on the target
group once it has ``min_target_trials``), the learned simulator (trained on every group through
transferable features, so other models and clusters warm-start the target) and the ranker (trained
on all groups, query = (model, cluster)). Which one the search follows is decided by measurement,
never by a fixed trial count: every refit scores the scorers on the target group's own measured
trials (the baselines give the first few) by pairwise ranking accuracy —

* with fewer than ``min_cv_trials`` target trials there is nothing to judge by: the simulator if
  other groups exist (transfer), else the analytic model;
* with fewer than ``min_target_trials``: the simulator and ranker trained on the other groups only
  (the target's trials are all held out) against the analytic model with its prior parameters;
* beyond that: ``folds``-fold cross-validation on the target group (the learned models also see the
  other groups and the training folds, the analytic model is refitted on the training folds).

The seconds come from the winner between analytic and simulator. When the learned models won the
judging (the simulator scored at least as well as the analytic model, or the ranker at least as well
as the winner, or nothing of the target could judge them), the search follows the three learned
models together: the sum of each candidate's rank positions under the simulator (log ratio to the
analytic estimate), a second simulator that learns the log step time itself, and the ranker, ties
broken by the seconds. Each of the three makes its own mistakes on the shipped dataset, and their
rank-sum orders its held-out trials better than any one of them (``benchmarks/simulator_accuracy.py
--store builtin``, within a group, 20 splits: 0.837 vs 0.820 following the ranker or the seconds
alone, the order until 2026-12-02; paired over the same splits +0.017 +- 0.006; fusing the ranker
with the seconds alone, as until 2026-11-28, scored 0.822: ``results/simulator_accuracy_builtin_fused.json``).
When the analytic model won, its seconds give the order.
"""
from __future__ import annotations

import numpy as np

from strategy_space import ClusterSpec, ModelSpec
from strategy_space.encoding import EncodedStrategies

from tuner.cost_models.analytic import AnalyticCostModel
from tuner.cost_models.evaluation import pairwise_accuracy
from tuner.cost_models.ranker import RankedStepTime
from tuner.cost_models.scoring import IncrementalScorer
from tuner.cost_models.simulator import LearnedSimulator
from tuner.features.batch import featurize
from tuner.features.incremental import IncrementalFeaturizer
from tuner.features.tables import FeatureTables
from tuner.records.dataset import TrialSet


class Predictor:
    """Predicted step seconds and the order the search follows for candidates of one (model, cluster).

    Args:
        model, cluster: the target.
        min_target_trials: target-group trials needed before the analytic model is refitted.
        min_rank_trials: trials needed (with a single group) before the ranker is used.
        min_cv_trials: target-group trials needed to judge the scorers on them.
        folds: cross-validation folds on the target group.
        seed: XGBoost seed.

    Attributes:
        source_: which predictor scores seconds: ``analytic``, ``simulator``.
        follow_ranker_: whether the ranker judged at least as well as the seconds' winner.
        fused_: whether ``order`` follows the learned models' rank-sum (else the seconds).
        scores_: the judged pairwise accuracy of ``analytic``, ``simulator``, ``ranker`` on the
            target group (empty when it had too few trials to judge by).
        ranker_: the fitted ranker (a ``RankedStepTime``), or None.
        log_simulator_: the simulator of the log step time (a ``LearnedSimulator``) in the
            rank-sum, or None.
        n_trials_, n_groups_, n_target_: training data seen by the last ``fit``.
    """

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, *, min_target_trials: int = 6,
                 min_rank_trials: int = 12, min_cv_trials: int = 4, folds: int = 3, seed: int = 0):
        self.model, self.cluster = model, cluster
        self.tables = FeatureTables.from_specs(model, cluster)
        self.min_target_trials = min_target_trials
        self.min_rank_trials = min_rank_trials
        self.min_cv_trials = min_cv_trials
        self.folds = folds
        self.seed = seed
        self.analytic_ = AnalyticCostModel()
        self.simulator_: LearnedSimulator | None = None
        self.ranker_: RankedStepTime | None = None
        self.log_simulator_: LearnedSimulator | None = None
        self.source_ = "analytic"
        self.follow_ranker_ = self.fused_ = False
        self.scores_: dict[str, float] = {}
        self.n_trials_ = self.n_groups_ = self.n_target_ = 0

    def fit(self, data: TrialSet | None) -> "Predictor":
        """Refit on the featurized trials of every group (the target group included; e.g.
        ``TrainingSet.trial_set()``), then choose the scorer. With no rows (None) it stays as it is
        (analytic before any fit)."""
        if data is None or not len(data):
            return self
        self.n_trials_, self.n_groups_ = len(data), len(data.keys)
        target = (self.model.fingerprint, self.cluster.fingerprint)
        rows = data.group == data.keys.index(target) if target in data.keys else np.zeros(len(data), bool)
        self.n_target_ = int(rows.sum())
        self.analytic_ = (AnalyticCostModel().fit(data.X[rows], data.y[rows])
                          if self.n_target_ >= self.min_target_trials else AnalyticCostModel())
        self.simulator_ = LearnedSimulator(random_state=self.seed).fit(data.X, data.y)
        use_ranker = self.n_groups_ >= 2 or len(data) >= self.min_rank_trials
        if use_ranker:
            self.ranker_ = (self.ranker_ or RankedStepTime(warm=True, random_state=self.seed)).fit(data.X, data.y, data.group)
        self.scores_ = self._judge(data, rows, use_ranker)
        if self.scores_:
            self.source_ = max(("simulator", "analytic"), key=lambda k: self.scores_[k])  # ties: simulator
        else:
            self.source_ = "simulator" if self.n_groups_ > (1 if self.n_target_ else 0) else "analytic"
        best = self.scores_.get(self.source_, -np.inf)
        self.follow_ranker_ = self.ranker_ is not None and (not self.scores_ or self.scores_.get("ranker", -1) >= best)
        self.fused_ = self.source_ == "simulator" or self.follow_ranker_
        self.log_simulator_ = (LearnedSimulator(target="log", random_state=self.seed).fit(data.X, data.y)
                               if self.fused_ else None)
        return self

    def _judge(self, data: TrialSet, rows: np.ndarray, use_ranker: bool) -> dict[str, float]:
        """Mean pairwise accuracy of each scorer on the target group's trials (module doc)."""
        n = int(rows.sum())
        if n < self.min_cv_trials or (n < self.min_target_trials and rows.all()):
            return {}
        target = np.nonzero(rows)[0]
        if n < self.min_target_trials:
            splits = [(np.nonzero(~rows)[0], target)]
        else:
            fold = np.random.default_rng(self.seed).permutation(n) % self.folds
            splits = [(np.concatenate([np.nonzero(~rows)[0], target[fold != k]]), target[fold == k])
                      for k in range(self.folds)]
        scores: dict[str, list] = {"analytic": [], "simulator": [], "ranker": []}
        for train, test in splits:
            if len(test) < 2:
                continue
            y = data.y[test]
            own = np.intersect1d(train, target)
            analytic = (AnalyticCostModel().fit(data.X[own], data.y[own]) if len(own) >= self.min_cv_trials
                        else AnalyticCostModel())
            scores["analytic"].append(pairwise_accuracy(analytic.predict(data.X[test]), y))
            sim = LearnedSimulator(random_state=self.seed).fit(data.X[train], data.y[train])
            scores["simulator"].append(pairwise_accuracy(sim.predict(data.X[test]), y))
            if use_ranker and len(train) >= 2:
                ranker = RankedStepTime(random_state=self.seed).fit(data.X[train], data.y[train], data.group[train])
                scores["ranker"].append(pairwise_accuracy(ranker.predict(data.X[test]), y))
        return {k: float(np.nanmean(v)) for k, v in scores.items() if v and not np.all(np.isnan(v))}

    def features(self, e: EncodedStrategies) -> np.ndarray:
        # default alpha-beta parameters, as in the rows the learned models were trained on
        return featurize(self.tables, e)

    def chain_scorer(self) -> IncrementalScorer:
        """Scores annealing proposals from their chains' current strategies (``tuner.features.incremental``):
        the seconds ``predict`` gives, bit for bit, without featurizing every variable of every
        proposal. One per annealing run (it holds the chains' state)."""
        return IncrementalScorer(IncrementalFeaturizer(self.tables), lambda X: self.predict(None, X))

    def predict(self, e: EncodedStrategies, X: np.ndarray | None = None) -> np.ndarray:
        """Predicted seconds per step."""
        X = self.features(e) if X is None else X
        if self.source_ == "simulator" and self.simulator_ is not None:
            return self.simulator_.predict(X)
        return self.analytic_.predict(X)

    def order(self, e: EncodedStrategies, X: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(indices best first, predicted seconds): the seconds' order, or, when ``fused_``, the
        rank-sum of the learned models' orders (module doc) with ties broken by the seconds.
        ``X``: ``e``'s feature rows, when computed."""
        X = self.features(e) if X is None else X
        seconds = self.predict(e, X)
        if not self.fused_:
            return np.argsort(seconds, kind="stable"), seconds
        from scipy.stats import rankdata   # (scipy's import is paid only by a fused order)

        # (the seconds are the simulator's own when it won: not predicted twice)
        parts = [seconds if self.source_ == "simulator" else self.simulator_.predict(X), self.log_simulator_.predict(X)]
        if self.ranker_ is not None:
            parts.append(self.ranker_.predict(X))
        return np.lexsort((seconds, sum(rankdata(v) for v in parts))), seconds


def search_order(specs: dict, seed: int = 0):
    """What the search follows (``Predictor.order``) as a method of ``evaluation.evaluate``: per
    group of the test rows, a ``Predictor`` for that (model, cluster), fitted on the training rows
    (its own group's among them, which it judges its scorers on), orders them. ``specs``: group
    key -> (ModelSpec, ClusterSpec). Returns rank positions (an order, not seconds)."""
    def order(train, test):
        out = np.zeros(len(test))
        for g in np.unique(test.group):
            rows = np.nonzero(test.group == g)[0]
            model, cluster = specs[test.keys[g]]
            p = Predictor(model, cluster, seed=seed).fit(train)
            out[rows[p.order(None, test.X[rows])[0]]] = np.arange(len(rows))
        return out

    return order
