"""Repeats pooled before scoring, the noise they reveal, the ceiling it sets, and step-time error."""
from __future__ import annotations

import numpy as np
import pytest

from tuner.cost_models.evaluation import (evaluate, group_noise, median_abs_error, merge_repeats, noise_ceiling,
                                          repeat_noise)
from tuner.records.dataset import TrialSet


def _set(X, y, group):
    n_groups = int(max(group)) + 1
    return TrialSet(np.asarray(X, np.float32), np.asarray(y, float), np.asarray(group),
                    [(f"m{g}", "c") for g in range(n_groups)], [f"m{g}" for g in range(n_groups)])


def test_merge_repeats_pools_identical_rows_within_a_group_only():
    X = [[1, 0], [1, 0], [1, 0], [2, 0], [1, 0]]
    data = _set(X, [1.0, 1.2, 1.1, 3.0, 5.0], [0, 0, 0, 0, 1])
    merged, dev = merge_repeats(data)
    # group 0: the three repeats of [1, 0] become one row at their median; group 1's identical row stays apart
    assert len(merged) == 3
    assert sorted(zip(merged.group.tolist(), merged.y.tolist())) == [(0, 1.1), (0, 3.0), (1, 5.0)]
    assert len(dev) == 3 and abs(float(np.sum(dev))) < 1e-12


def test_repeat_noise_recovers_the_noise_it_was_given():
    rng = np.random.default_rng(0)
    sigma, strategies, repeats = 0.05, 400, 3
    X = np.repeat(np.arange(strategies)[:, None], repeats, axis=0)
    y = np.repeat(rng.uniform(0.1, 2.0, strategies), repeats) * np.exp(rng.normal(0, sigma, strategies * repeats))
    _, dev = merge_repeats(_set(X, y, np.zeros(len(y), int)))
    assert repeat_noise(dev) == pytest.approx(sigma, rel=0.1)
    assert np.isnan(repeat_noise(np.array([])))


def test_noise_ceiling_falls_with_noise_and_is_one_without():
    y = np.linspace(1.0, 2.0, 12)
    data = _set(np.arange(12)[:, None], y, np.zeros(12, int))
    quiet, loud = noise_ceiling(data, 0.05), noise_ceiling(data, 0.3)
    assert noise_ceiling(data, 0.0) == 1.0
    assert 0.5 < loud < quiet < 1.0
    assert np.isnan(noise_ceiling(data, float("nan")))


def test_each_groups_own_noise_gives_its_own_ceiling():
    """A quiet group and a loud one: each group's noise from its own repeats, and the ceiling with
    them lies between what one pooled noise would give to both (the pooled noise over-penalises
    the quiet group and flatters the loud one)."""
    rng = np.random.default_rng(0)
    truth = np.tile(np.linspace(1.0, 2.0, 10), 2)
    group = np.repeat([0, 1], 10)
    X = np.stack([np.arange(20), group], axis=1)
    rows = np.repeat(np.arange(20), 4)   # four measurements of each strategy
    noise = np.where(group[rows] == 0, 0.01, 0.2)
    raw = _set(X[rows], truth[rows] * np.exp(rng.normal(0.0, noise)), group[rows])
    per = group_noise(raw)
    assert per[0] == pytest.approx(0.01, rel=0.3) and per[1] == pytest.approx(0.2, rel=0.3)
    assert np.isnan(group_noise(raw, min_deviations=100)).all()   # too few repeats: unknown
    data = _set(X, truth, group)
    own, pooled = noise_ceiling(data, per), noise_ceiling(data, float(np.sqrt(np.mean(per ** 2))))
    quiet, loud = noise_ceiling(data.subset(np.arange(10)), per), noise_ceiling(data.subset(np.arange(10, 20)), per)
    assert quiet > 0.95 and loud < 0.85 and own == pytest.approx((quiet + loud) / 2, abs=0.01)   # (other draws)
    assert own > pooled   # the quiet group's pairs are orderable: the pooled noise hid that
    assert np.isnan(noise_ceiling(data, [0.01, float("nan")]))


def test_median_abs_error_and_order_only_methods():
    assert median_abs_error([1.1, 0.9, 2.0], [1.0, 1.0, 1.0]) == pytest.approx(0.1)
    y = np.linspace(1.0, 3.0, 30)
    data = _set(np.arange(30)[:, None], y, np.repeat([0, 1], 15))
    twice = {"twice": lambda tr, te: 2 * te.y, "ranker": lambda tr, te: -te.y}
    rows = {r["method"]: r for r in evaluate(data, twice, protocols=("within",))}
    assert rows["twice"]["abs_error"] == pytest.approx(1.0) and rows["twice"]["pairwise_acc"] == 1.0
    assert np.isnan(rows["ranker"]["abs_error"])   # a score, not seconds


def test_the_predictor_follows_the_learned_models_rank_sum_when_they_won_the_judging():
    from tests.fakes import three_node_cluster, tiny_model
    from tuner.cost_models.predictor import Predictor

    class Fixed:
        def __init__(self, *v):
            self.v = np.array(v)

        def predict(self, X):
            return self.v

    p = Predictor(tiny_model(), three_node_cluster())
    p.predict = lambda e, X=None: np.array([4.0, 2.0, 3.0, 1.0])
    X = np.zeros((4, 1))
    p.simulator_, p.log_simulator_, p.ranker_ = Fixed(1, 2, 3, 4), Fixed(2, 1, 4, 3), Fixed(3, 1, 2, 4)
    assert list(p.order(None, X)[0]) == [3, 1, 2, 0]   # the analytic model won: the seconds' order
    p.fused_ = True
    # rank sums 6, 4, 9, 11: an order none of the three gives alone
    assert list(p.order(None, X)[0]) == [1, 0, 2, 3]
    assert list(p.order(None, X)[1]) == [4.0, 2.0, 3.0, 1.0]   # the seconds stay the seconds
    p.ranker_ = Fixed(1, 1, 3, 4)   # rows 0 and 1 tie at 4.5: the faster in seconds (row 1) first
    assert list(p.order(None, X)[0]) == [1, 0, 2, 3]
    p.log_simulator_ = Fixed(1, 2, 3, 4)   # now row 0 leads (3.5 vs 5.5)
    assert list(p.order(None, X)[0]) == [0, 1, 2, 3]
    p.ranker_ = None   # a single group too small for the ranker: the two simulators
    p.simulator_ = Fixed(4, 3, 2, 1)   # ties everywhere (5 each): the seconds decide
    assert list(p.order(None, X)[0]) == [3, 1, 2, 0]


def test_warm_protocol_holds_out_one_groups_share_and_keeps_every_other_group_whole():
    """``warm``: one fold per group; its test rows are the rows ``within`` holds out of that group,
    and it trains on everything else (the other groups whole), where ``within`` trains on the
    train share of every group at once."""
    from tuner.cost_models.evaluation import splits, within_test_mask

    group = np.repeat([0, 1, 2], [6, 8, 10])
    data = _set(np.arange(24)[:, None], np.linspace(1.0, 3.0, 24), group)
    held = within_test_mask(data, seed=3)
    folds = splits(data, "warm", seed=3)
    assert len(folds) == 3
    for g, (train, test) in enumerate(folds):
        assert set(test) == set(np.nonzero(held & (group == g))[0])
        assert set(train) == set(range(24)) - set(test)
    (within_train, _), = splits(data, "within", seed=3)
    assert set(within_train) == set(np.nonzero(~held)[0])


def test_warm_protocol_scores_what_a_method_learns_from_the_other_groups_whole():
    """A method that can only order a group's held-out rows by what the other groups' held-out
    share teaches it scores under ``warm`` and not under ``within``: the two protocols differ in
    exactly what the other groups give."""
    group = np.repeat([0, 1], 10)
    X = np.tile(np.arange(10), 2)[:, None].astype(float)
    y = np.tile(np.linspace(1.0, 2.0, 10), 2)
    data = _set(X, y, group)

    def lookup(train, test):   # each test row's time as another group's training rows know it, else 0
        seen = {float(x): float(t) for x, t, g in zip(train.X[:, 0], train.y, train.group)
                if g not in set(test.group.tolist())}
        return np.array([seen.get(float(x), 0.0) for x in test.X[:, 0]])

    within, = evaluate(data, {"lookup": lookup}, protocols=("within",), seed=0)
    warm, = evaluate(data, {"lookup": lookup}, protocols=("warm",), seed=0)
    assert warm["pairwise_acc"] == 1.0 and within["pairwise_acc"] < 1.0


def test_evaluate_reports_each_groups_pairwise_whose_mean_is_the_figure():
    """``group_pairwise``: every scored group's own pairwise accuracy (by its index in ``keys``);
    a predictor right on one group and reversed on the other shows 1 and 0, mean 0.5."""
    group = np.repeat([0, 1], 8)
    y = np.tile(np.linspace(1.0, 2.0, 8), 2)
    data = _set(np.stack([np.arange(16), group], 1), y, group)

    def half_right(train, test):
        return np.where(test.group == 0, test.y, -test.y)

    for protocol in ("within", "warm", "logo"):
        row, = evaluate(data, {"m": half_right}, protocols=(protocol,), seed=1)
        assert row["group_pairwise"] == {0: 1.0, 1: 0.0}
        assert row["pairwise_acc"] == 0.5
