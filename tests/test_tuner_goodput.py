"""Goodput (tuner.records.goodput): lossy parts and their lossless twin, the efficiency estimate from two
loss curves, and the tuning loop ranking by step time / efficiency with a fake prober."""
import dataclasses

import numpy as np
import pytest

from strategy_space import PS, AllReduce, Strategy, VarConfig
from strategy_space.builders import get_builder
from tests.fakes import three_node_cluster, tiny_model
from tuner.search.base import Proposal
from tuner.records.goodput import (EXACT, Efficiency, ProbeResult, Prober, estimate_efficiency, goodput_seconds, is_lossless,
                           counted, lossless_twin, lossy_parts, probe_cache_key)
from tuner.records.history import History
from tuner.records.outcome import TuneOutcome
from tuner.records.store import TrialStore
from tuner.records.trial import Trial
from tuner.search.model_based import ModelBasedTuner, SearchSettings
from tuner.search.tuning import Budget, tune_loop
from tuner.synthetic.runner import SyntheticRunner

MODEL, CLUSTER = tiny_model(profile=True), three_node_cluster()


def build(name, model, cluster):
    return get_builder(name).build(model, cluster)
FAST = SearchSettings(batch=3, candidates=64, chains=16, anneal_steps=10, seed=0)


def with_lossy(strategy: Strategy, compressor="powersgd(1)", staleness=0, asynchronous=False) -> Strategy:
    """``strategy`` with ``compressor`` on every all-reduced matrix and the PS mode given."""
    out = []
    for c in strategy.variables:
        syncs = []
        for s in c.synchronizers:
            if isinstance(s, AllReduce) and c.name.endswith("kernel"):
                s = dataclasses.replace(s, compressor=compressor)
            elif isinstance(s, PS) and (staleness or asynchronous):
                s = dataclasses.replace(s, staleness=staleness, sync=not asynchronous)
            syncs.append(s)
        out.append(VarConfig(c.name, tuple(syncs), c.axis))
    return Strategy(tuple(out), strategy.replicas, origin="lossy")


def test_lossy_parts_name_every_lossy_shard_and_the_twin_removes_only_them():
    ar = build("all_reduce", MODEL, CLUSTER)
    assert is_lossless(ar) and lossy_parts(ar).describe() == "lossless"
    lossy = with_lossy(ar, "powersgd_ef(4)")
    parts = lossy_parts(lossy)
    assert parts.compressed == (("dense/kernel", 0, "powersgd_ef(4)"), ("dense_1/kernel", 0, "powersgd_ef(4)"))
    assert not parts.timing_dependent and "powersgd_ef(4) on 2 variables" in parts.describe()
    twin = lossless_twin(lossy)
    assert is_lossless(twin) and twin.fingerprint == ar.fingerprint
    stale = with_lossy(build("ps", MODEL, CLUSTER), staleness=2)
    sp = lossy_parts(stale)
    assert sp.timing_dependent and {s for _, _, s in sp.stale} == {2} and not sp.compressed
    assert lossless_twin(stale).fingerprint == build("ps", MODEL, CLUSTER).fingerprint
    asy = lossy_parts(with_lossy(build("ps", MODEL, CLUSTER), asynchronous=True))
    assert asy.asynchronous and "asynchronous" in asy.describe()
    # the key depends on the lossy parts alone: the embedding on a PS instead shares it
    moved = Strategy(tuple(VarConfig(c.name, (PS(CLUSTER.node_names[1]),)) if c.name.startswith("embedding") else c
                           for c in lossy.variables))
    assert moved.fingerprint != lossy.fingerprint and lossy_parts(moved).key == parts.key
    assert lossy_parts(with_lossy(ar, "fp16")).key != parts.key


def curve(k, rng, noise=0.02, speed=1.0):
    """A falling loss after ``speed`` x t lossless steps, with batch noise."""
    t = np.arange(1, k + 1) * speed
    return 0.5 + 2.0 / (1.0 + 0.03 * t) + rng.normal(0, noise, k)


def test_efficiency_recovers_a_known_slowdown_within_its_interval():
    hits = 0
    for seed in range(20):
        rng = np.random.default_rng(seed)
        twin, cand = curve(300, rng), curve(300, rng, speed=0.6)
        e = estimate_efficiency(cand, twin)
        assert e.low <= e.value <= e.high and e.probed and e.steps == 300
        assert abs(e.value - 0.6) < 0.1
        hits += e.low <= 0.6 <= e.high
    assert hits >= 16   # a 95 % interval covers the true value in most seeds


def test_efficiency_of_an_equal_curve_is_one_and_noise_widens_the_interval():
    rng = np.random.default_rng(0)
    twin = curve(200, rng)
    assert estimate_efficiency(twin, twin).value == 1.0
    quiet = estimate_efficiency(curve(200, np.random.default_rng(1), 0.005, 0.7), curve(200, np.random.default_rng(2), 0.005))
    loud = estimate_efficiency(curve(200, np.random.default_rng(1), 0.08, 0.7), curve(200, np.random.default_rng(2), 0.08))
    assert loud.high - loud.low > quiet.high - quiet.low > 0


def test_a_diverged_candidate_has_efficiency_zero_and_never_competes():
    rng = np.random.default_rng(0)
    twin = curve(100, rng)
    cand = curve(100, rng)
    cand[60] = np.nan
    e = estimate_efficiency(cand, twin)
    assert e.value == 0.0 and goodput_seconds(0.01, e) == float("inf")
    with pytest.raises(ValueError, match="at least 2 steps"):
        estimate_efficiency([1.0], [1.0])


def test_the_estimate_is_deterministic_for_the_same_curves():
    rng = np.random.default_rng(3)
    twin, cand = curve(150, rng), curve(150, rng, speed=0.8)
    assert estimate_efficiency(cand, twin) == estimate_efficiency(list(cand), list(twin))


def ok_trial(strategy, seconds, role="search"):
    return Trial(strategy, MODEL.fingerprint, CLUSTER.fingerprint, "ok", step_times=(seconds,) * 6, role=role,
                 origin=strategy.origin or "search")


def test_goodput_keeps_a_lossy_strategy_only_with_a_measured_efficiency_that_pays():
    base = build("all_reduce", MODEL, CLUSTER)
    lossy = with_lossy(base)
    trials = [ok_trial(base, 0.10, "baseline"), ok_trial(lossy, 0.06)]
    step = TuneOutcome("r", trials, quality="step")
    assert step.best.strategy == lossy   # step time alone: the lossy one wins
    good = TuneOutcome("r", trials, quality="goodput")
    assert good.best.strategy == base    # not probed: it does not compete
    good.efficiency[lossy.fingerprint] = Efficiency(0.5, 0.45, 0.55, probed=True, steps=100, source="probe")
    assert good.best.strategy == base    # 0.06 / 0.5 = 0.12 s per lossless step > 0.10
    assert good.figure(good.measured()[lossy.fingerprint]) == float("inf")   # below the 0.95 margin too
    assert TuneOutcome("r", trials, quality="goodput", min_efficiency=0.0, efficiency=dict(good.efficiency)).figure(
        good.measured()[lossy.fingerprint]) == pytest.approx(0.12)
    good.efficiency[lossy.fingerprint] = Efficiency(0.97, 0.95, 1.0, probed=True, steps=100, source="probe")
    assert good.best.strategy == lossy   # 0.062 < 0.10
    assert good.efficiency_of(base) == EXACT
    # below the margin (default 0.95) a lossy strategy does not compete, however fast its steps
    good.efficiency[lossy.fingerprint] = Efficiency(0.9, 0.88, 0.92, probed=True, steps=100, source="probe")
    assert good.best.strategy == base
    looser = TuneOutcome("r", trials, quality="goodput", min_efficiency=0.8, efficiency=dict(good.efficiency))
    assert looser.best.strategy == lossy   # 0.06 / 0.9 < 0.10


class FakeProber(Prober):
    """E from a table by compressor; counts what it was asked."""

    def __init__(self, e_by_codec, fail=False):
        self.e_by_codec, self.fail, self.asked = e_by_codec, fail, []

    def efficiency(self, strategy):
        self.asked.append(strategy)
        if self.fail:
            raise RuntimeError("the probe's worker died")
        parts = lossy_parts(strategy)
        codecs = {c for _, _, c in parts.compressed} | ({"stale"} if parts.stale else set()) | (
            {"async"} if parts.asynchronous else set())
        e = min(self.e_by_codec.get(c, 1.0) for c in codecs) if codecs else 1.0
        return Efficiency(e, e - 0.02, min(1.0, e + 0.02), probed=True, steps=100, source="probe")


class LossyIsFast(SyntheticRunner):
    """Lossy strategies measure half the step time of the others."""

    def run(self, strategies, origins=None):
        out = []
        for t in super().run(strategies, origins):
            if t.ok and not is_lossless(t.strategy):
                t = dataclasses.replace(t, step_times=tuple(x / 2 for x in t.step_times))
            out.append(t)
        return out


def tune(tmp_path, quality, prober, runner=None, trials=9, **space):
    with TrialStore(tmp_path / f"{quality}.db") as store:
        tuner = ModelBasedTuner(MODEL, CLUSTER, settings=FAST, lossless=quality == "exact", **space)
        return tune_loop(runner or LossyIsFast(MODEL, CLUSTER, seed=1), store, tuner, Budget(trials=trials, patience=10),
                         quality=quality, prober=prober)


def test_the_loop_probes_only_lossy_contenders_and_never_recommends_a_costly_one(tmp_path):
    # compressed steps are up to ~6x faster here; at E = 0.05 they cost 3x more per lossless step
    prober = FakeProber({"powersgd(4)": 0.05, "fp16": 0.05, "powersgd_ef(4)": 0.05, "fp16_ef": 0.05})
    out = tune(tmp_path, "goodput", prober)
    assert prober.asked and all(not is_lossless(s) for s in prober.asked)
    assert len({s.fingerprint for s in prober.asked}) == len(prober.asked)   # each probed once
    assert is_lossless(out.best.strategy)
    lossy = [t for t in out.ok if not is_lossless(t.strategy)]
    assert lossy, "the search proposed no lossy strategy to judge"
    # a lossy strategy slower than the leader even at E = 1 is not worth a probe
    probed = {s.fingerprint for s in prober.asked}
    assert all(t.strategy.fingerprint in probed or out.figure(t) == float("inf") for t in lossy)


def test_the_loop_keeps_a_lossy_strategy_whose_efficiency_pays(tmp_path):
    out = tune(tmp_path, "goodput", FakeProber({}))   # E = 1 for every compressor
    assert not is_lossless(out.best.strategy)
    assert out.efficiency[out.best.strategy.fingerprint].probed


def test_a_failed_probe_is_recorded_and_tuning_goes_on(tmp_path):
    prober = FakeProber({}, fail=True)
    out = tune(tmp_path, "goodput", prober)
    assert prober.asked and out.stop_reason == "trials"
    failed = [e for e in out.efficiency.values() if e.source == "failed"]
    assert failed and all("worker died" in e.note for e in failed)
    assert is_lossless(out.best.strategy)


def test_exact_never_proposes_a_lossy_part(tmp_path):
    out = tune(tmp_path, "exact", None, trials=12)
    assert len(out.search_trials) == 12
    assert all(is_lossless(t.strategy) for t in out.trials)


def test_step_quality_ranks_by_step_time_and_never_probes(tmp_path):
    prober = FakeProber({})
    out = tune(tmp_path, "step", prober)
    assert not prober.asked and not out.efficiency
    # the fastest by step time among the most-measured (confirmation: an unconfirmed lucky
    # measurement does not win), lossy or not: here a lossy one, at half the step
    merged = out.measured()
    top = max(t.measurements for t in merged.values())
    assert out.best.median == min(t.median for t in merged.values() if t.measurements == top)
    assert not is_lossless(out.best.strategy)


def test_probes_round_trip_through_the_store(tmp_path):
    lossy = with_lossy(build("all_reduce", MODEL, CLUSTER))
    parts = lossy_parts(lossy)
    e = estimate_efficiency(curve(50, np.random.default_rng(0), speed=0.5), curve(50, np.random.default_rng(1)))
    r = ProbeResult("tiny", "tiny:fp", parts.key, parts.describe(), 3, "three", 50, 0, e, (1.0, 0.9), (1.0, 0.8), 1.5, 1.4, 7.0)
    key = probe_cache_key("tiny:fp", parts, 3, 50, 0)
    assert key != probe_cache_key("tiny:fp", parts, 3, 50, 1) != probe_cache_key("tiny:fp", parts, 2, 50, 0)
    # how the model trains (a digest of its optimizer, loss, layers, weights and data) is part of it
    trained = probe_cache_key("tiny:fp", parts, 3, 50, 0, training="d1")
    assert trained != key and trained != probe_cache_key("tiny:fp", parts, 3, 50, 0, training="d2")
    assert trained == probe_cache_key("tiny:fp", parts, 3, 50, 0, "other cluster", "d1")   # not timing-dependent
    with TrialStore(tmp_path / "p.db") as store:
        assert store.probe(key) is None
        assert store.add_probe(key, r) and not store.add_probe(key, r)
    with TrialStore(tmp_path / "p.db") as store:
        assert store.probe(key) == r and store.probes("tiny:fp") == [r] and store.probes("other") == []


def test_a_proposal_of_a_lossless_tuner_round_trips_as_lossless():
    tuner, history = ModelBasedTuner(MODEL, CLUSTER, settings=FAST, lossless=True), History(MODEL, CLUSTER)
    for _ in range(3):
        batch = tuner.next_batch(3, history)
        assert batch and all(isinstance(p, Proposal) and is_lossless(p.strategy) for p in batch)
        history.add([ok_trial(p.strategy, 0.1) for p in batch], batch)


def test_offered_staleness_and_asynchrony_are_proposed_probed_and_judged_by_goodput(tmp_path):
    prober = FakeProber({"stale": 0.9, "async": 0.05, "powersgd(4)": 0.05, "fp16": 0.05, "powersgd_ef(4)": 0.05,
                         "fp16_ef": 0.05})
    out = tune(tmp_path, "goodput", prober, trials=15, staleness=(0, 2), allow_async=True)
    parts = [lossy_parts(s) for s in prober.asked]
    assert any(p.stale for p in parts) and any(p.asynchronous for p in parts)
    for t in out.measured().values():   # step time / the prober's E (inf: not probed, or E below 0.95)
        e = out.efficiency_of(t.strategy)
        assert out.figure(t) == (t.median / e.value if e and e.value >= 0.95 else float("inf"))
    assert not lossy_parts(out.best.strategy).asynchronous


def _param_shares():
    sizes = np.array([v.size for v in MODEL.variables], dtype=float)
    return sizes / sizes.sum()


def test_the_search_learns_what_a_lossy_feature_costs_per_share_of_the_model():
    """Probes fit a cost per lossy feature per share of the parameters it covers: after asynchronous
    PS on the whole model measured E = 0.05, a candidate holding it is ranked by step time / 0.05,
    while the same feature on a small share of the model stays cheap (one probe of a feature does not
    condemn every use of it), and a feature no probe held (staleness 2) stays worth proposing."""
    from tuner.records.goodput import estimate_encoded_efficiency, fit_feature_costs, lossy_extents

    space, w = ModelBasedTuner(MODEL, CLUSTER, settings=FAST, staleness=(0, 2), allow_async=True).space, _param_shares()
    ps = build("ps", MODEL, CLUSTER)
    asy = with_lossy(ps, asynchronous=True)
    fp16 = with_lossy(build("all_reduce", MODEL, CLUSTER), "fp16")
    # asynchronous PS on the biases only, the rest all-reduced
    small = Strategy(tuple(VarConfig(c.name, (PS(CLUSTER.node_names[0], sync=False),)) if c.name.endswith("bias")
                           else c for c in build("all_reduce", MODEL, CLUSTER).variables))
    ext = lossy_extents(space.encode([asy, fp16, small]), w)
    kernels = sum(v.size for v in MODEL.variables if v.name.endswith("kernel")) / MODEL.total_params
    biases = sum(v.size for v in MODEL.variables if v.name.endswith("bias")) / MODEL.total_params
    assert set(ext) == {"async", "fp16"}
    assert ext["async"] == pytest.approx([1.0, 0.0, biases]) and ext["fp16"] == pytest.approx([0.0, kernels, 0.0])
    costs = fit_feature_costs({f: x[:2] for f, x in ext.items()}, np.array([0.05, 0.9]))
    est = estimate_encoded_efficiency(space.encode([ps, asy, fp16, small, with_lossy(ps, staleness=2)]), w, costs)
    assert est == pytest.approx([1.0, 0.05, 0.9, 0.05 ** biases, 1.0], rel=0.02)
    assert est[3] > 0.99   # the biases are a thousandth of the model
    # features that compound: probes of each alone and of both give each its own cost
    ext = {"async": np.array([1.0, 0.0, 1.0]), "fp16": np.array([0.0, 0.5, 0.5])}
    costs = fit_feature_costs(ext, np.exp(-np.array([2.0, 0.5, 2.5])))
    assert costs == pytest.approx({"async": 2.0, "fp16": 1.0}, rel=0.01)
    # a failed probe (E = 0) makes its feature the costliest, not an error
    assert fit_feature_costs({"async": np.array([1.0])}, np.array([0.0]))["async"] > 6


def _tune_with_priced_async(tmp_path, base: float):
    """A goodput run where asynchronous PS halves the step (``LossyIsFast``) and a probe measures
    ``base ** share`` (``base`` with the whole model asynchronous, less lost on less of it). Returns
    the share function and the search trials after the first probe of a mostly-asynchronous strategy."""
    from tuner.records.goodput import lossy_extents

    space = ModelBasedTuner(MODEL, CLUSTER, settings=FAST, allow_async=True).space

    def async_share(strategy):
        return float(lossy_extents(space.encode([strategy]), _param_shares()).get("async", np.zeros(1))[0])

    class AsyncCosts(FakeProber):
        def efficiency(self, strategy):
            self.asked.append(strategy)
            e = base ** async_share(strategy)
            return Efficiency(e, e - 0.01, min(1.0, e + 0.01), probed=True, steps=100, source="probe")

    prober = AsyncCosts({})
    # enough trials that a few search rounds follow the first probe of a mostly-asynchronous strategy
    out = tune(tmp_path, "goodput", prober, trials=24, allow_async=True)
    asked = {s.fingerprint for s in prober.asked}
    first = next((i for i, t in enumerate(out.trials) if t.strategy.fingerprint in asked
                  and async_share(t.strategy) > 0.5), None)
    assert first is not None, "no strategy asynchronous on most of the model was probed: nothing to learn from"
    return out, async_share, [t for t in out.trials[first + FAST.batch:] if t.role == "search"]


def test_once_probes_price_a_feature_the_search_stops_proposing_it_widely(tmp_path):
    """In the tuning loop (lossy strategies twice as fast by step time): once a probe finds
    asynchronous PS costs E = 0.05, the search's next rounds keep it off most of the model."""
    _, async_share, later = _tune_with_priced_async(tmp_path, 0.05)
    assert later, "no search round after the first probe of asynchronous PS"
    shares = [async_share(t.strategy) for t in later]
    assert max(shares) < 0.5, shares


def test_the_search_does_not_spend_trials_on_what_the_efficiency_floor_will_turn_down(tmp_path):
    """Asynchronous PS here halves the step and costs E = 0.85 with the whole model asynchronous
    (less on less of it): better goodput (0.5 / 0.85), but under the 0.95 floor, so never
    recommended. Once a probe has priced it, the search proposes asynchrony only where its estimate
    clears the floor (on at most ~30 % of the model), not the fast strategies it must turn down."""
    out, async_share, later = _tune_with_priced_async(tmp_path, 0.85)
    assert len(later) >= 6, "too few search rounds after the first probe of asynchronous PS"
    below = [async_share(t.strategy) for t in later if 0.85 ** async_share(t.strategy) < 0.95]
    assert not below, f"{len(below)} of {len(later)} later search trials were estimated under the floor: {below}"
    assert out.efficiency_of(out.best.strategy) is None or out.efficiency_of(out.best.strategy).value >= 0.95


def test_a_twin_that_rises_back_is_flagged_and_a_steady_one_is_not():
    """A lossless twin whose loss climbs back towards its start (VGG at the edge of stability) makes
    E a comparison with one unstable run: the efficiency says so; a steadily falling twin does not."""
    rng = np.random.default_rng(0)
    steps = np.arange(200)
    falling = 2.3 * np.exp(-steps / 60) + 0.1 + 0.02 * rng.standard_normal(200)
    rising = np.where(steps < 100, falling, falling[99] + (steps - 99) * 0.015)
    candidate = 2.3 * np.exp(-steps / 50) + 0.1 + 0.02 * rng.standard_normal(200)
    assert "rose back" in estimate_efficiency(candidate, rising).note
    assert estimate_efficiency(candidate, falling).note == ""


def test_counted_says_one_in_the_singular():
    """tune's lines ('within 5 % of it after 1 trial', '1 probe took') and the lossy parts' names."""
    assert [counted(n, "trial") for n in (0, 1, 3)] == ["0 trials", "1 trial", "3 trials"]


def test_a_probe_whose_twin_does_not_learn_gives_the_low_end_and_says_so():
    """Noise targets (nothing to learn in the probe's steps): the twin's loss stays flat and E came
    out 1.00 (here [0.96, 1.00]; [0.53, 1.00] for a lossy strategy tune recommended at 1.17x on the
    testbed, by hand): the probe cannot tell, so E is unknown and counts as 0, with the reason."""
    for seed in range(5):
        rng = np.random.default_rng(seed)
        flat_twin, flat_candidate = 1.0 + 0.05 * rng.standard_normal(100), 1.0 + 0.05 * rng.standard_normal(100)
        e = estimate_efficiency(flat_candidate, flat_twin)
        assert (e.value, e.low, e.high) == (0.0, 0.0, 1.0) and e.probed, (seed, e)
        assert "within the noise" in e.note and "--probe-steps" in e.note
        assert goodput_seconds(0.01, e) == float("inf")
    learning = estimate_efficiency(curve(100, np.random.default_rng(1)), curve(100, np.random.default_rng(2)))
    assert learning.value > learning.low and "within the noise" not in learning.note


def test_a_lossy_gain_is_recommended_only_if_it_holds_at_the_low_end_of_the_efficiency_interval():
    """Measured 3 times each: the lossy strategy's steps are 8 % shorter than the baseline's,
    beyond the noise between measurements. At its probed E 0.98 that is 1.06x in goodput; but an
    interval reaching 0.90 cannot rule out a strategy that trains 10 % slower, so the baseline is
    recommended and the summary says why; a probe whose interval stays above 0.97 keeps the gain."""
    from tuner.records.outcome import not_recommended_reason

    base = build("all_reduce", MODEL, CLUSTER)
    lossy = with_lossy(base)
    wobble = (1.0, 1.01, 0.99)
    trials = ([ok_trial(base, 0.100 * w, "baseline") for w in wobble]
              + [ok_trial(lossy, 0.092 * w, "search" if i == 0 else "confirm") for i, w in enumerate(wobble)])
    wide = TuneOutcome("r", trials, quality="goodput")
    wide.efficiency[lossy.fingerprint] = Efficiency(0.98, 0.90, 1.0, probed=True, steps=100, source="probe")
    fastest = wide.fastest
    assert fastest.strategy == lossy and wide.best.strategy == base
    assert wide.significant_gain(fastest, wide.best, efficiency="value") is True
    assert wide.significant_gain(fastest, wide.best) is False
    said = wide.not_recommended(fastest)
    assert said["because"] == "efficiency" and said["efficiency_interval"] == [0.90, 1.0]
    assert "0.90 to 1.00" in not_recommended_reason(said)
    narrow = TuneOutcome("r", trials, quality="goodput", efficiency={
        lossy.fingerprint: Efficiency(0.98, 0.97, 0.99, probed=True, steps=100, source="probe")})
    assert narrow.best.strategy == lossy
    # a gain within the noise is said to be that, whatever the interval
    close = [ok_trial(base, 0.100 * w, "baseline") for w in wobble] + [
        ok_trial(lossy, 0.099 * w, "search" if i == 0 else "confirm") for i, w in enumerate(wobble[::-1])]
    noisy = TuneOutcome("r", close, quality="goodput", efficiency={
        lossy.fingerprint: Efficiency(1.0, 0.99, 1.0, probed=True, steps=100, source="probe")})
    assert noisy.best.strategy == base and noisy.not_recommended(noisy.fastest)["because"] == "noise"
