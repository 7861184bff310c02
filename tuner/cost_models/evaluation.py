"""How well a predictor orders strategies: pairwise accuracy, Kendall tau and top-1 regret, per
(model, cluster) group, for the analytic model, the learned simulator and the ranker side by side.

Protocols:
  * ``within``: each group's trials are split into train / test; every model trains on all groups'
    train parts and is scored on each group's test part.
  * ``warm`` (within a group, the rest whole): the same test part of one group at a time, every
    model trained on that group's train part and on every other group whole: what the search
    has once it has measured a share of the target's trials with the shipped warm-start dataset
    beside them (``within`` also holds out that share of every other group, one fit for all).
  * ``lomo`` (leave one model out): for each model, train on the groups of all other models and
    score every group of the held-out model (transfer to an unseen model).
  * ``logo`` (leave one group out): for each (model, cluster), train on every other group (other
    models, and the same model on other clusters) and score it: a new tuning target with a
    warm-start dataset and no trial of its own yet.
Lower predictions mean faster; the ranker's scores are negated to follow that.

Pairwise accuracy is reported twice: over all pairs (strict) and over the pairs whose measured
times differ by more than ``tol`` (default 5 %). Measured step times are noisy (repeats of one
strategy in the synthetic truth spread by ~2-9 %), so pairs closer than the noise are ordered by the
noise, not by the strategies: no predictor can order them better than chance. Where the noiseless
step times are known (the synthetic world), ``evaluate(truth=...)`` also scores the predictions
against them.

On real trials the truth is unknown; what stands in for it is the repeats: a strategy measured
several times (the tuner's confirmation, the dataset's on-purpose repeats) says how far one
measurement strays (``repeat_noise``). ``merge_repeats`` pools the repeats of a strategy into one
row first (identical features: no predictor can tell them apart, and a repeat left on both sides of
a train/test split would be scored as a prediction), and ``noise_ceiling`` is the accuracy that the
noiseless truth itself would score against measurements carrying that noise.

``median_abs_error`` is the step-time error |predicted / measured - 1| (methods that predict
seconds; the ranker only orders, ``NaN``).
"""
from __future__ import annotations

import warnings
from typing import Callable

import numpy as np

from tuner.cost_models.analytic import AnalyticCostModel
from tuner.cost_models.ranker import StrategyRanker
from tuner.cost_models.simulator import LearnedSimulator
from tuner.features.alpha_beta import AlphaBeta
from tuner.records.dataset import TrialSet


def _pairs(pred: np.ndarray, true: np.ndarray, tol: float):
    i, j = np.triu_indices(len(true), 1)
    dt = true[i] - true[j]
    keep = np.abs(dt) > tol * np.minimum(true[i], true[j])
    return np.sign(pred[i] - pred[j])[keep], np.sign(dt)[keep]


def pairwise_accuracy(pred, true, tol: float = 0.0) -> float:
    """Share of pairs with different true times (by more than ``tol`` relative) that ``pred``
    orders the same way (a predicted tie counts half). NaN when there is no such pair."""
    p, t = _pairs(np.asarray(pred, float), np.asarray(true, float), tol)
    return float(np.mean((p == t) + 0.5 * (p == 0))) if len(t) else float("nan")


def kendall_tau(pred, true) -> float:
    """Kendall's tau-b between predicted and true times."""
    pred, true = np.asarray(pred, float), np.asarray(true, float)
    i, j = np.triu_indices(len(true), 1)
    a, b = np.sign(pred[i] - pred[j]), np.sign(true[i] - true[j])
    denom = np.sqrt(np.sum(a != 0) * np.sum(b != 0))
    return float(np.sum(a * b) / denom) if denom else float("nan")


def top1_regret(pred, true) -> float:
    """Measured time of the predicted-best strategy over the true best, minus 1 (0 = found it)."""
    true = np.asarray(true, float)
    return float(true[int(np.argmin(pred))] / true.min() - 1.0)


Predictor = Callable[[TrialSet, TrialSet], np.ndarray]   # (train, test) -> predicted times/costs


def predictors(n_jobs: int = 1, seed: int = 0) -> dict[str, Predictor]:
    """The compared methods, each as ``(train, test) -> predictions for test rows``."""
    def analytic_default(train, test):
        return AnalyticCostModel(AlphaBeta()).predict(test.X)

    def analytic_fitted(train, test):
        return AnalyticCostModel().fit(train.X, train.y).predict(test.X)

    def simulator(target):
        return lambda train, test: LearnedSimulator(target=target, n_jobs=n_jobs, random_state=seed) \
            .fit(train.X, train.y).predict(test.X)

    def ranker(train, test):
        r = StrategyRanker(n_jobs=n_jobs, random_state=seed).fit(train.X, train.y, train.group)
        return -r.predict(test.X, test.group)

    return {"analytic (default)": analytic_default, "analytic (fitted)": analytic_fitted,
            "simulator (ratio)": simulator("ratio"), "simulator (log)": simulator("log"), "ranker": ranker}


ORDER_ONLY = frozenset({"ranker", "search"})   # methods whose output is a score or an order, not seconds


def merge_repeats(data: TrialSet) -> tuple[TrialSet, np.ndarray]:
    """One row per distinct (group, feature row): the median of its measured times.

    Returns:
        (merged set, log-deviations of every repeated measurement from its strategy's mean log
        time, ddof-corrected so their std estimates one measurement's noise; empty without repeats).
    """
    keys: dict[tuple, list[int]] = {}
    for i in range(len(data)):
        keys.setdefault((int(data.group[i]), data.X[i].tobytes()), []).append(i)
    first = np.array([rows[0] for rows in keys.values()], dtype=np.int64)
    merged = data.subset(first)
    merged.y = np.array([float(np.median(data.y[rows])) for rows in keys.values()])
    dev = []
    for rows in keys.values():
        if len(rows) >= 2:
            logs = np.log(data.y[rows])
            dev.extend((logs - logs.mean()) * np.sqrt(len(rows) / (len(rows) - 1)))
    return merged, np.asarray(dev, dtype=np.float64)


def repeat_noise(deviations: np.ndarray) -> float:
    """One measurement's noise: the std of log step time over repeats (NaN without repeats)."""
    return float(np.sqrt(np.mean(np.square(deviations)))) if len(deviations) >= 2 else float("nan")


def group_noise(data: TrialSet, min_deviations: int = 6) -> np.ndarray:
    """One measurement's noise in each group (indexed as ``data.keys``) from that group's own
    repeats (``repeat_noise``); NaN where fewer than ``min_deviations`` measurements are repeats."""
    out = np.full(len(data.keys), np.nan)
    for g in np.unique(data.group):
        _, dev = merge_repeats(data.subset(np.nonzero(data.group == g)[0]))
        if len(dev) >= min_deviations:
            out[g] = repeat_noise(dev)
    return out


def noise_ceiling(data: TrialSet, sigma, tol: float = 0.0, draws: int = 200, seed: int = 0) -> float:
    """Mean per-group pairwise accuracy of the noiseless truth scored against measurements with
    log-normal noise ``sigma``, taking ``data.y`` as the truth: the best any predictor can expect
    (NaN for an unknown ``sigma``). ``sigma``: one noise for every group, or one per group (indexed
    as ``data.keys``, e.g. ``group_noise`` with its gaps filled). Rows merged from n repeats carry
    sigma / sqrt(n)'s noise at most; using ``sigma`` keeps the ceiling conservative."""
    sigmas = np.broadcast_to(np.asarray(sigma, dtype=np.float64), (len(data.keys),))
    if not np.all(np.isfinite(sigmas[np.unique(data.group)])):
        return float("nan")
    rng = np.random.default_rng(seed)
    per = []
    for g in np.unique(data.group):
        y = data.y[data.group == g]
        if len(y) >= 3:
            per.append(np.nanmean([pairwise_accuracy(y, y * np.exp(rng.normal(0.0, sigmas[g], len(y))), tol)
                                   for _ in range(draws)]))
    return float(np.nanmean(per)) if per else float("nan")


def median_abs_error(pred, true) -> float:
    """Median of |predicted / measured - 1| over the rows."""
    pred, true = np.asarray(pred, float), np.asarray(true, float)
    return float(np.median(np.abs(pred / true - 1.0))) if len(true) else float("nan")


def scored_groups(test: TrialSet) -> list[int]:
    """The groups of ``test`` that ``score_groups`` scores (>= 3 rows), in its order."""
    return [int(g) for g in np.unique(test.group) if (test.group == g).sum() >= 3]


def score_groups(pred: np.ndarray, test: TrialSet, tol: float,
                 truth: np.ndarray | None = None) -> list[tuple[float, ...]]:
    """Per group of ``test`` with >= 3 rows (``scored_groups``): (pairwise, tau, regret, pairwise
    beyond ``tol``), then the pairwise accuracies (all pairs, beyond ``tol``) against ``truth`` (NaN
    without it)."""
    out = []
    for g in scored_groups(test):
        rows = test.group == g
        p, y = pred[rows], test.y[rows]
        vs_truth = ((pairwise_accuracy(p, truth[rows]), pairwise_accuracy(p, truth[rows], tol))
                    if truth is not None else (np.nan, np.nan))
        out.append((pairwise_accuracy(p, y), kendall_tau(p, y), top1_regret(p, y), pairwise_accuracy(p, y, tol))
                   + vs_truth)
    return out


def within_test_mask(data: TrialSet, test_share: float = 0.4, seed: int = 0) -> np.ndarray:
    """Boolean mask of the rows ``within_split`` holds out (a random share of each group)."""
    rng = np.random.default_rng(seed)
    test = np.zeros(len(data), dtype=bool)
    for g in np.unique(data.group):
        rows = np.nonzero(data.group == g)[0]
        test[rng.choice(rows, size=max(3, int(round(test_share * len(rows)))), replace=False)] = True
    return test


def within_split(data: TrialSet, test_share: float = 0.4, seed: int = 0) -> tuple[TrialSet, TrialSet]:
    """Random per-group train/test split of the rows."""
    (train, test), = splits(data, "within", seed, test_share)
    return data.subset(train), data.subset(test)


def splits(data: TrialSet, protocol: str, seed: int = 0,
           test_share: float = 0.4) -> list[tuple[np.ndarray, np.ndarray]]:
    """(train rows, test rows) of every fold of ``protocol`` (module doc)."""
    if protocol == "within":
        test = within_test_mask(data, test_share, seed)
        return [(np.nonzero(~test)[0], np.nonzero(test)[0])]
    if protocol == "warm":
        test = within_test_mask(data, test_share, seed)
        held = [test & (data.group == g) for g in np.unique(data.group)]
        return [(np.nonzero(~h)[0], np.nonzero(h)[0]) for h in held]
    if protocol == "lomo":
        names = np.array([data.model_names[g] for g in data.group])
        return [(np.nonzero(names != m)[0], np.nonzero(names == m)[0])
                for m in sorted(set(data.model_names)) if (names != m).any()]
    if protocol == "logo":
        return [(np.nonzero(data.group != g)[0], np.nonzero(data.group == g)[0])
                for g in np.unique(data.group) if (data.group != g).any()]
    raise ValueError(f"unknown protocol {protocol!r}; use within, warm, lomo or logo")


def evaluate(data: TrialSet, methods: dict[str, Predictor] | None = None, protocols=("within", "lomo"),
             seed: int = 0, test_share: float = 0.4, tol: float = 0.05,
             truth: np.ndarray | None = None) -> list[dict]:
    """Mean per-group metrics of every method under every protocol.

    Args:
        tol: relative gap of measured times above which a pair counts for ``pairwise_acc_tol``.
        truth: noiseless step time of every row of ``data``, where known (the synthetic world):
            the predictions are also scored against it (``pairwise_truth``, ``pairwise_truth_tol``),
            i.e. on how they order the strategies rather than one noisy measurement of each.

    Returns:
        rows ``{protocol, method, groups, pairwise_acc, pairwise_acc_tol, tol, kendall_tau, top1_regret,
        pairwise_truth, pairwise_truth_tol, abs_error, group_pairwise}`` (the truth columns NaN without
        ``truth``; ``abs_error``: median |predicted / measured - 1| over the held-out rows, NaN for a
        method in ``ORDER_ONLY``; ``group_pairwise``: each scored group's pairwise accuracy, by its
        index in ``data.keys``).
    """
    methods = methods or predictors(seed=seed)
    if truth is not None and len(truth) != len(data):
        raise ValueError(f"truth has {len(truth)} rows, the data {len(data)}")
    results = []
    for protocol in protocols:
        folds = splits(data, protocol, seed, test_share)
        for name, method in methods.items():
            scores, errors, scored = [], [], []
            for train, test in folds:
                part = data.subset(test)
                pred = np.asarray(method(data.subset(train), part))
                scores += score_groups(pred, part, tol, None if truth is None else np.asarray(truth)[test])
                scored += scored_groups(part)
                if name not in ORDER_ONLY:
                    errors.append(np.abs(pred / part.y - 1.0))
            s = np.array(scores)
            with warnings.catch_warnings():   # all-NaN columns (no truth) stay NaN quietly
                warnings.simplefilter("ignore", RuntimeWarning)
                means = np.nanmean(s, axis=0)
            results.append({"protocol": protocol, "method": name, "groups": len(s),
                            "pairwise_acc": float(means[0]), "pairwise_acc_tol": float(means[3]),
                            "tol": tol, "kendall_tau": float(means[1]), "top1_regret": float(means[2]),
                            "pairwise_truth": float(means[4]), "pairwise_truth_tol": float(means[5]),
                            "abs_error": float(np.median(np.concatenate(errors))) if errors else float("nan"),
                            "group_pairwise": {g: float(v[0]) for g, v in zip(scored, scores)}})
    return results


def format_table(rows: list[dict]) -> str:
    """A plain-text table of ``evaluate`` rows (with the columns against the truth when known)."""
    tol = rows[0]["tol"] if rows else 0.05
    truth = any(np.isfinite(r.get("pairwise_truth", np.nan)) for r in rows)
    head = (f"{'protocol':<8} {'method':<20} {'groups':>6} {'pairwise':>9} {f'pw>{tol:.0%}':>9} {'tau':>7} "
            f"{'regret':>8} {'|err|':>7}")
    head += f" {'truth pw':>9} {f'truth>{tol:.0%}':>9}" if truth else ""
    lines = [head, "-" * len(head)]
    for r in rows:
        line = (f"{r['protocol']:<8} {r['method']:<20} {r['groups']:>6} {r['pairwise_acc']:>9.3f} "
                f"{r['pairwise_acc_tol']:>9.3f} {r['kendall_tau']:>7.3f} {r['top1_regret']:>7.1%} "
                f"{_pct(r.get('abs_error', np.nan)):>7}")
        line += f" {r['pairwise_truth']:>9.3f} {r['pairwise_truth_tol']:>9.3f}" if truth else ""
        lines.append(line)
    lines.append(f"pairwise: all pairs of a group's held-out trials; pw>{tol:.0%}: only pairs whose measured times "
                 f"differ by more than {tol:.0%} (closer pairs are within the measurement noise)")
    lines.append("|err|: median |predicted / measured - 1| of the step time (- for a method that only orders)")
    if truth:
        lines.append(f"truth pw / truth>{tol:.0%}: the same predictions scored against the noiseless step times of the "
                     f"held-out strategies (how they order the strategies, not one noisy measurement of each)")
    return "\n".join(lines)


def _pct(x: float) -> str:
    return "-" if not np.isfinite(x) else f"{x:.1%}"
