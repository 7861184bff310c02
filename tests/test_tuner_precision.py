"""The median's distribution-free interval, the measuring policy, and the use of intervals in the
recommendation."""
import math
import time

import numpy as np
import pytest

from tests.fakes import tiny_model, two_node_cluster
from strategy_space.builders import get_builder
from tuner.records.outcome import TuneOutcome
from tuner.records.precision import MeasurePolicy, median_interval, order_statistic_ranks, relative_halfwidth
from tuner.records.trial import Trial


def coverage(n: int, j: int, k: int) -> float:
    return sum(math.comb(n, i) for i in range(j + 1, k + 1)) / 2 ** n


@pytest.mark.parametrize("n", [6, 7, 10, 25, 60, 200])
def test_ranks_cover_the_median_at_95_percent_and_are_the_narrowest_symmetric_pair(n):
    j, k = order_statistic_ranks(n)
    assert j + k == n - 1
    assert coverage(n, j, k) >= 0.95
    assert coverage(n, j + 1, k - 1) < 0.95 if j + 1 <= k - 1 else True


def test_too_few_steps_have_no_interval():
    assert order_statistic_ranks(5) is None and median_interval([1.0] * 5) is None
    assert relative_halfwidth([1.0, 2.0]) == math.inf


def test_known_small_case():
    # n = 6: (min, max) covers with 1 - 2/64 = 0.969
    assert order_statistic_ranks(6) == (0, 5)
    assert median_interval([6, 1, 5, 2, 4, 3]) == (1.0, 6.0)


def test_interval_covers_the_true_median_about_95_percent_of_the_time():
    rng = np.random.default_rng(0)
    true_median = np.log(2.0)   # exponential(1)
    hits = 0
    for _ in range(2000):
        lo, hi = median_interval(rng.exponential(1.0, 30))
        hits += lo <= true_median <= hi
    assert 0.93 <= hits / 2000 <= 0.99


def test_bad_confidence_is_refused():
    with pytest.raises(ValueError, match="confidence must be in"):
        order_statistic_ranks(10, 1.5)


def test_policy_stops_when_precise_and_asks_for_more_when_not():
    p = MeasurePolicy(precision=0.03, min_steps=10, max_steps=100, max_seconds=60)
    assert p.next_batch([0.1] * 4, 0.4) == 6                      # first batch not complete
    tight = list(np.linspace(0.099, 0.101, 10))
    assert p.reached(tight) and p.next_batch(tight, 1.0) == 0
    noisy = list(np.random.default_rng(1).uniform(0.05, 0.15, 10))
    assert not p.reached(noisy) and p.next_batch(noisy, 1.0) == 6
    assert p.next_batch(noisy * 9, 9.0) == 10                     # half of what was measured, at most the cap
    assert p.next_batch(noisy, 50.0) == 2                         # time cap: two more 5 s steps fit in 60 s
    assert MeasurePolicy(precision=None, min_steps=10).next_batch(noisy, 1.0) == 0


def test_policy_describes_the_interval():
    p = MeasurePolicy(min_steps=6)
    d = p.describe([1.0, 1.01, 0.99, 1.0, 1.02, 0.98])
    assert d["steps"] == 6 and d["ci"] == [0.98, 1.02] and d["reached"] is True
    assert d["halfwidth"] == pytest.approx(0.02)


@pytest.mark.parametrize("kw, message", [({"precision": 0.0}, "precision must be a fraction"),
                                         ({"min_steps": 0}, "min_steps must be"),
                                         ({"min_steps": 20, "max_steps": 10}, "must be >= min_steps"),
                                         ({"max_seconds": -1}, "max_seconds must be")])
def test_policy_validates(kw, message):
    with pytest.raises(ValueError, match=message):
        MeasurePolicy(**kw)


class FakeSession:
    """Step times drawn from a lognormal with a given spread; answers ``run`` like the workers."""

    def __init__(self, spread: float, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.spread = spread
        self.calls = []

    def run(self, steps, deadline=None):
        self.calls.append(steps)
        times = 0.1 * np.exp(self.rng.normal(0, self.spread, steps))
        times[-1] *= 2     # the last step ends with the final synchronizing pull
        t = np.concatenate([[0.0], np.cumsum(times)])
        r = {"start": list(t), "compute": [0.01] * steps, "sync": [0.05] * steps, "loss": [1.0] * steps,
             "calls": [2] * steps}
        return [r, r]


def measure(spread, **policy):
    from autosync.runtime.runner import RayRunner

    runner = object.__new__(RayRunner)   # only the measuring loop: no Ray, no model
    runner.warmup, runner.steps = 2, policy.get("min_steps", 10)
    runner.policy = MeasurePolicy(**policy)
    session = FakeSession(spread)
    return runner._measure(session, time.monotonic() + 600), session


def test_runner_measures_until_precise_or_capped():
    quiet, s1 = measure(0.005, min_steps=10, max_steps=200)
    # warm-up, the timed steps and one untimed step whose end waits for the final pull
    assert s1.calls == [13] and len(quiet["step_times"]) == 10
    assert max(quiet["step_times"]) < 1.1 * min(quiet["step_times"]), "the doubled last step was timed"
    noisy, s2 = measure(0.2, min_steps=10, max_steps=200)
    assert s2.calls[0] == 13 and len(s2.calls) > 1
    assert len(noisy["step_times"]) == sum(s2.calls) - 2 - len(s2.calls) <= 200
    assert MeasurePolicy().reached(noisy["step_times"]) or len(noisy["step_times"]) >= 190
    capped, _ = measure(0.5, min_steps=10, max_steps=30)
    assert len(capped["step_times"]) == 30
    assert capped["breakdown"]["sync"] == pytest.approx(0.05)


MODEL, CLUSTER = tiny_model(), two_node_cluster()


def trial(strategy, steps, role="search"):
    return Trial(strategy, MODEL.fingerprint, CLUSTER.fingerprint, "ok", step_times=tuple(steps),
                 origin=strategy.origin, role=role)


def test_imprecise_measurements_are_not_a_significant_gain_even_when_repeats_agree():
    """Two repeats per strategy whose medians agree to 0.1 %, a 3 % gap between strategies: with
    tight steps that gap is significant; with steps spread +-40 % (intervals far wider than the gap)
    it is not, however well the few repeats agreed."""
    a = get_builder("all_reduce").build(MODEL, CLUSTER)
    b = get_builder("ps").build(MODEL, CLUSTER)

    def outcome(spread):
        rng = np.random.default_rng(3)
        ts = []
        for s, level, role in ((a, 0.097, "search"), (b, 0.10, "baseline")):
            for rep in range(3):
                x = level * (1 + spread * rng.uniform(-1, 1, 41))
                x = x * (level * (1 + 0.001 * rep) / np.median(x))   # medians set exactly
                ts.append(trial(s, x, role))
        return TuneOutcome("r", ts), ts[0], ts[3]

    out, ta, tb = outcome(0.005)
    assert out.significant_gain(ta, tb) is True
    out, ta, tb = outcome(0.4)
    assert out.significant_gain(ta, tb) is False


def test_trial_reports_its_interval():
    a = get_builder("all_reduce").build(MODEL, CLUSTER)
    t = trial(a, [0.1, 0.11, 0.09, 0.1, 0.1, 0.12, 0.1])
    lo, hi = t.median_ci
    assert lo <= t.median <= hi
    assert t.summary()["step_time_s"]["median_ci95"] == [lo, hi]
    assert trial(a, [0.1] * 3).median_ci is None
