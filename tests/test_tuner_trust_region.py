"""The trust region: while the predictor is unproven on the target cluster, the search proposes
only strategies a few mutations from what was measured, so a predictor that learned the wrong
thing elsewhere costs the user little; once proven, the whole space opens."""
from __future__ import annotations

import numpy as np
import pytest

from tests.fakes import three_node_cluster, tiny_model
from tuner.cost_models.analytic import AnalyticCostModel
from tuner.cost_models.predictor import Predictor
from tuner.records.store import TrialStore
from tuner.search.annealing import decision_matrix
from tuner.search.model_based import ModelBasedTuner, SearchSettings
from tuner.search.tuning import Budget, tune_loop
from tuner.synthetic.runner import SyntheticRunner

MODEL, CLUSTER = tiny_model(profile=True), three_node_cluster()


class Backwards(Predictor):
    """A predictor that learned the opposite of this cluster (what transfer from unlike clusters
    can do): it scores the strategies the physics calls slowest as fastest (``backwards``; else
    it scores them as the physics does), and its judged accuracy on the target's trials is
    ``accuracy``."""

    accuracy, backwards = 0.5, True

    def fit(self, data):
        super().fit(data)
        self.source_, self.follow_ranker_, self.fused_ = "analytic", False, False
        self.scores_ = {"analytic": self.accuracy}
        return self

    def predict(self, e, X=None):
        X = self.features(e) if X is None else X
        seconds = AnalyticCostModel().predict(X)
        return 1e-3 / seconds if self.backwards else seconds


def _run(tmp_path, radius: int, accuracy: float = 0.5, trials: int = 3, backwards: bool = True,
         trust_trials: int = 6, explore_ratio: float | None = 1.25, model=MODEL, explore_from_round: int = 2):
    settings = SearchSettings(batch=3, candidates=64, chains=12, anneal_steps=8, trust_radius=radius,
                              trust_trials=trust_trials, explore_ratio=explore_ratio,
                              explore_from_round=explore_from_round, seed=5)
    tuner = ModelBasedTuner(model, CLUSTER, settings=settings)
    tuner.predictor = Backwards(model, CLUSTER)
    tuner.predictor.accuracy, tuner.predictor.backwards = accuracy, backwards
    radii = []
    name = f"r{radius}-{accuracy}-{backwards}-{trust_trials}-{explore_ratio}-{explore_from_round}.db"
    with TrialStore(tmp_path / name) as store:
        out = tune_loop(SyntheticRunner(model, CLUSTER, seed=7), store, tuner,
                        Budget(trials=trials, patience=10, confirm=0),
                        on_trial=lambda t, o: radii.append(tuner.last_radius) if t.role == "search" else None)
    return tuner, out, radii


def _distance_to_measured(tuner, trials, baselines) -> np.ndarray:
    """Decision cells each trial differs in from its nearest baseline."""
    D = decision_matrix(tuner.space.encode([t.strategy for t in trials]))
    B = decision_matrix(tuner.space.encode([t.strategy for t in baselines]))
    return (D[:, None, :] != B[None, :, :]).sum(axis=2).min(axis=1)


def _one_mutation_reach(tuner, baselines, n: int = 2000) -> int:
    """The most decision cells one mutation of a baseline changes (sampled)."""
    e = tuner.space.encode([t.strategy for t in baselines])
    parents = np.arange(n) % len(e)
    m = tuner.space.mutate_rows(e, parents, np.random.default_rng(0)).encoded
    return int((decision_matrix(m) != decision_matrix(e)[parents]).sum(axis=1).max())


def test_an_unproven_predictor_is_followed_only_near_the_measured_strategies(tmp_path):
    tuner, out, radii = _run(tmp_path, radius=1)
    baselines = [t for t in out.trials if t.role == "baseline" and t.ok]
    search = [t for t in out.trials if t.role == "search"]
    assert len(search) == 3 and radii == [1, 1, 1]
    assert [t.origin for t in search] == ["search"] * 3   # no pick at random inside the region
    reach = _one_mutation_reach(tuner, baselines)
    assert _distance_to_measured(tuner, search, baselines).max() <= reach
    # the same backwards predictor with no region walks far away, to strategies the truth makes slow
    open_tuner, open_out, open_radii = _run(tmp_path, radius=0, explore_from_round=1)
    open_search = [t for t in open_out.trials if t.role == "search"]
    assert open_radii == [None] * 3 and "explore" in [t.origin for t in open_search]
    assert _distance_to_measured(open_tuner, open_search, baselines).max() > reach
    # (one mutation can still be a slow one: the region bounds how far a wrong predictor is
    # followed, not what one step costs; most of its steps from the incumbents cost little)
    assert np.median([t.median for t in search]) < np.median([t.median for t in open_search])


def test_the_radius_grows_each_unproven_round_and_the_space_opens_once_proven(tmp_path):
    _, out, radii = _run(tmp_path, radius=2, trials=12, backwards=False)
    # a round "wins" when one of its trials measured faster than everything measured before it
    trials, expected, won = list(out.trials), [], 0
    first = next(i for i, t in enumerate(trials) if t.role == "search")
    for r in range(4):
        before = min(t.median for t in trials[:first + 3 * r] if t.ok)
        expected += [2 + won] * 3
        won += any(t.ok and t.median < before for t in trials[first + 3 * r:first + 3 * r + 3])
    assert radii == expected and won >= 1
    _, _, proven = _run(tmp_path, radius=2, accuracy=0.9, trials=3)
    assert proven == [None] * 3


def test_exploration_draws_only_among_candidates_predicted_near_the_incumbent(tmp_path):
    """A pick at random is one the predictor could be wrong about, not one it predicts twice as
    slow as the best measured strategy (on one node such picks measured 1.6-1.8x the slowest
    baseline, round after round). The embedding here has most of its rows touched each step, so the
    pool holds strategies predicted well above the incumbent (with a few touched rows, every
    all-reduce of the table pays the workers' update of all of it, and the search's pool holds
    none such)."""
    from strategy_space import ModelSpec, VariableSpec

    busy = ModelSpec(MODEL.name, tuple(VariableSpec(v.name, v.shape, v.dtype, v.sparse, 30_000 if v.sparse else None)
                                       for v in MODEL.variables), MODEL.batch_size, profile=MODEL.profile)

    def explored(ratio):
        _, out, _ = _run(tmp_path, radius=0, accuracy=0.9, trials=12, backwards=False, explore_ratio=ratio, model=busy)
        picks = [t for t in out.trials if t.role == "search" and t.origin == "explore"]
        assert len(picks) == 3   # one per round of three but the first
        return np.array([t.meta["predicted_vs_incumbent"] for t in picks])

    assert explored(1.25).max() <= 1.25
    assert explored(None).max() > 1.25   # the whole pool holds such candidates: the cap is what keeps them out


def test_the_first_round_picks_none_at_random_until_the_run_has_tested_the_predictor(tmp_path):
    """A predictor proven on the target's warm-start trials extrapolates beyond them; the run's
    first round is its own best picks only, and exploration starts from the second."""
    def origins(**kw):
        _, out, radii = _run(tmp_path, radius=0, accuracy=0.9, trials=6, backwards=False, **kw)
        search = [t for t in out.trials if t.role == "search"]
        assert len(search) == 6 and radii == [None] * 6 and [t.meta["search_round"] for t in search] == [1] * 3 + [2] * 3
        return [t.origin for t in search[:3]], [t.origin for t in search[3:]]

    first, second = origins()
    assert first == ["search"] * 3 and "explore" in second
    first, _ = origins(explore_from_round=1)
    assert "explore" in first


@pytest.mark.parametrize("accuracy,expected", [(0.74, False), (0.75, True)])
def test_proven_means_judged_at_the_trust_accuracy(tmp_path, accuracy, expected):
    tuner, _, _ = _run(tmp_path, radius=2, accuracy=accuracy, trials=3)
    assert tuner.proven() is expected


def test_a_predictor_whose_picks_ran_slower_than_promised_is_followed_only_near_again(tmp_path):
    """Judged well on the target (accuracy 0.9) the search opens; when its first round then runs
    far slower than it promised against the incumbent, the next rounds are in the region again.
    A predictor whose picks run as promised keeps the space open."""
    _, out, radii = _run(tmp_path, radius=2, accuracy=0.9, trials=6)
    first = [t for t in out.trials if t.role == "search"][:3]
    incumbent = min(t.median for t in out.trials if t.role == "baseline" and t.ok)
    promised = [t.predicted_s / t.meta["predicted_vs_incumbent"] for t in first]   # the incumbent, predicted
    assert all(t.median / incumbent > 1.5 * t.predicted_s / p for t, p in zip(first, promised))
    assert radii == [None] * 3 + [2] * 3
    _, _, radii = _run(tmp_path, radius=2, accuracy=0.9, trials=9, backwards=False)
    assert radii == [None] * 9


def test_round_error_is_the_worst_shortfall_against_the_promise():
    from types import SimpleNamespace as NS

    from tuner.search.model_based import round_error

    def trial(r, measured, promised, ok=True):
        return NS(trial=NS(role="search", ok=ok, median=measured,
                           meta={"search_round": r, "incumbent_s": 0.1, "trust_radius": None,
                                 "predicted_vs_incumbent": promised}))

    assert round_error(NS(entries=[])) is None
    # round 2 is the last: ran 1x, 0.5x and 1.25x its promise -> shortfalls 0, 0, log 1.25 (faster
    # is no harm; round 1's 18x is not the last round's)
    h = NS(entries=[trial(1, 0.9, 0.05), trial(2, 0.05, 0.5), trial(2, 0.05, 1.0), trial(2, 0.125, 1.0)])
    assert round_error(h) == pytest.approx(np.log(1.25))
    h.entries.append(trial(2, 0.4, 1.0))
    assert round_error(h) == pytest.approx(np.log(4.0))
    h.entries.append(trial(2, 1.0, 1.0, ok=False))
    assert round_error(h) == np.inf


def test_too_few_own_trials_prove_nothing(tmp_path):
    """Judged at 0.9, a predictor with fewer than ``trust_trials`` of the target's trials (7
    baselines, then 3 more per round) stays in the region; the space opens at 12."""
    _, _, radii = _run(tmp_path, radius=2, accuracy=0.9, trials=9, backwards=False, trust_trials=12)
    assert None not in radii[:6] and radii[6:] == [None] * 3


def test_a_region_with_nothing_left_to_measure_hands_the_round_to_the_whole_space(tmp_path):
    """One variable on one node: a small space. The region never ends a run early: the run with
    it measures at least as many strategies as the run without it before both run out of distinct
    ones."""
    from strategy_space import ClusterSpec, ComputeProfile, ModelSpec, NodeSpec, VariableSpec

    model = ModelSpec("one", (VariableSpec("w", (64,)),), batch_size=8, profile=ComputeProfile(0.01, "test", ("w",)))
    cluster = ClusterSpec("solo", (NodeSpec("a", address="10.0.0.1", workers=2, bandwidth_gbps=1.0),))
    got = {}
    for radius in (1, 0):
        tuner = ModelBasedTuner(model, cluster, settings=SearchSettings(batch=3, candidates=64, chains=8, anneal_steps=5,
                                                                        trust_radius=radius, seed=1))
        radii = []
        with TrialStore(tmp_path / f"small-{radius}.db") as store:
            out = tune_loop(SyntheticRunner(model, cluster, seed=1), store, tuner, Budget(trials=60, patience=100, confirm=0),
                            on_trial=lambda t, o: radii.append(tuner.last_radius) if t.role == "search" else None)
        got[radius] = (out.stop_reason, len({t.strategy.canonical(cluster).fingerprint for t in out.search_trials}), radii,
                       tuner.last_radius)
    assert got[1][0] == got[0][0] == "exhausted" and got[1][1] >= got[0][1] > 3, got
    # began in the region; its last round, with nothing left near the incumbents, searched the whole space
    assert got[1][2][0] == 1 and got[1][3] is None


def test_the_region_stands_on_the_strategies_the_run_would_recommend():
    """Its incumbents are ranked as the outcome ranks (goodput): a lossy strategy not yet probed,
    or probed below the least efficiency, is no incumbent however fast its steps; a probed one
    counts per lossless step; under ``step`` every strategy counts by its step time."""
    from strategy_space.builders import get_builder
    from tests.test_tuner_goodput import with_lossy
    from tuner.records.goodput import Efficiency
    from tuner.records.history import History
    from tuner.records.trial import Trial
    from tuner.search.model_based import _incumbents

    ps = get_builder("ps").build(MODEL, CLUSTER)
    fast, costly, cheap = (with_lossy(ps, staleness=s) for s in (1, 2, 3))

    def trial(strategy, seconds, quality):
        return Trial(strategy, MODEL.fingerprint, CLUSTER.fingerprint, "ok", step_times=(seconds,) * 3,
                     meta={"quality": quality, "min_efficiency": 0.5})

    for quality, want in (("goodput", [0.08, 0.1]), ("step", [0.02, 0.04, 0.06, 0.1])):
        h = History(MODEL, CLUSTER)
        h.add([trial(ps, 0.1, quality), trial(fast, 0.02, quality), trial(costly, 0.04, quality),
               trial(cheap, 0.06, quality)])
        h.efficiency[costly.fingerprint] = Efficiency(0.3, 0.25, 0.35, probed=True, steps=100, source="probe")
        h.efficiency[cheap.fingerprint] = Efficiency(0.75, 0.7, 0.8, probed=True, steps=100, source="probe")
        assert [round(f, 6) for f, _, _ in _incumbents(h)] == want, quality
