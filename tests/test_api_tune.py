"""autosync.tune, TuneResult and the report, measured by the synthetic runner (no Ray)."""
import json

import pytest

import autosync
from autosync.report import write_report
from strategy_space import ConfigError, load_strategy, validate
from tests.fakes import Noisy, patch_tune_runner, three_node_cluster, tiny_model
from tuner.search.model_based import SearchSettings
from tuner.synthetic.runner import SyntheticRunner

FAST = SearchSettings(batch=3, candidates=64, chains=12, anneal_steps=8)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    """One tuning run (the builtin warm start, as by default), read by the tests that take it."""
    model, cluster = tiny_model(profile=True), three_node_cluster()
    return autosync.tune("unused", cluster, trials=6, store=tmp_path_factory.mktemp("tune") / "s.db", settings=FAST,
                         runner=SyntheticRunner(model, cluster, seed=3))


def test_tune_result(result, tmp_path):
    s = result.summary()
    for key in ("best_step_time_s", "best_baseline", "best_baseline_step_time_s", "speedup_over_best_baseline", "trials"):
        assert s[key] is not None
    assert s["trials"] == 6 and s["total_trials"] == 6 + s["baseline_trials"] + s["confirm_trials"]
    assert s["confirm_trials"] >= 2 and s["best_measurements"] == 3     # the pick rests on 3 measurements
    # the speed-up is the best baseline's pooled median over the recommendation's, and a switch away
    # from the best baseline is recommended only on a gain beyond the noise between measurements
    assert s["speedup_over_best_baseline"] == pytest.approx(s["best_baseline_step_time_s"] / s["best_step_time_s"])
    best, base = result.best_trial, result.best_baseline
    assert best.strategy.fingerprint in (result.outcome.fastest.strategy.fingerprint, base.strategy.fingerprint)
    if best.strategy.fingerprint != base.strategy.fingerprint:
        assert result.outcome.significant_gain(best, base) is True and s["speedup_over_best_baseline"] > 1.0
    fastest = result.outcome.fastest    # reported apart only when it is not the recommendation
    if fastest.strategy.fingerprint == result.best_trial.strategy.fingerprint:
        assert s["fastest_not_significant"] is None
    else:
        assert s["fastest_not_significant"] == result.outcome.not_recommended(fastest)
        assert s["fastest_not_significant"]["origin"] == fastest.origin
        assert s["fastest_not_significant"]["step_time_s"] == fastest.median
        assert result.best_trial.strategy.fingerprint == result.best_baseline.strategy.fingerprint
    assert set(result.speedup_over_baselines) == set(result.baselines)
    df = result.trials
    assert len(df) == s["total_trials"] and {"origin", "median_s", "predicted_s", "role"} <= set(df.columns)
    result.save(tmp_path / "best.yaml")
    best = load_strategy(tmp_path / "best.yaml")
    assert best == result.best_strategy
    validate(best, result.model, result.cluster)
    json.dumps(s)


def test_report(result, tmp_path):
    out = write_report(result.store_path, tmp_path / "report")
    page = (out / "index.html").read_text()
    for png in ("tuning_curve.png", "predicted_vs_measured.png", "best_vs_baselines.png"):
        assert (out / png).stat().st_size > 1000 and png in page
    assert "Best strategy" in page and "All trials" in page and result.best_trial.origin in page
    with pytest.raises(ConfigError, match="no run 'nope' in the store; runs:"):
        write_report(result.store_path, tmp_path / "r2", run_id="nope")


def test_a_gain_within_the_noise_is_reported_not_recommended(tmp_path):
    model, cluster = tiny_model(profile=True), three_node_cluster()
    result = autosync.tune("unused", cluster, trials=4, store=tmp_path / "n.db", settings=FAST, warm_start="none",
                           runner=Noisy(model, cluster, seed=4, gain=1.05, spread=0.2))
    s = result.summary()
    assert s["best_origin"] == s["best_baseline"] and s["speedup_over_best_baseline"] == 1.0
    assert s["fastest_not_significant"]["origin"] in ("search", "explore")
    from autosync.cli.tune import not_recommended_line
    line = not_recommended_line(s)     # what `autosync tune` prints under its table
    assert f"{s['fastest_not_significant']['step_time_s'] * 1e3:.1f} ms) is not recommended" in line
    page = (write_report(result.store_path, tmp_path / "report") / "index.html").read_text()
    assert "is not recommended: its gain over the best baseline is within the noise" in page


def test_a_run_on_gpu_nodes_whose_links_the_cluster_does_not_give_says_what_was_assumed(tmp_path):
    import dataclasses

    from autosync.cli.tune import quality_line
    from strategy_space import ClusterSpec

    model, three = tiny_model(profile=True), three_node_cluster()
    gpus = ClusterSpec("gpus", tuple(dataclasses.replace(n, gpus=2, workers=2, gpu_memory_gib=80.0) for n in three.nodes))
    for cluster, said in ((gpus, True), (dataclasses.replace(gpus, intra_node_bandwidth_gbps=2400.0), False)):
        result = autosync.tune("unused", cluster, trials=1, store=tmp_path / f"{said}.db", settings=FAST,
                               warm_start="none", confirm=0, runner=SyntheticRunner(model, cluster, seed=0))
        summary = result.summary()
        assert (len(summary["assumed"]) == 1) == said and ("intra-node bandwidth 40 Gbit/s" in quality_line(summary)) == said
        json.dumps(summary)


def test_every_trial_failing_is_a_clear_error(tmp_path):
    class Broken(SyntheticRunner):
        def run(self, strategies, origins=None):
            from tuner.records.trial import Trial

            return [Trial(s, self.model.fingerprint, self.cluster.fingerprint, "failed", error="worker died: OOM")
                    for s in strategies]

    model, cluster = tiny_model(), three_node_cluster()
    with pytest.raises(ConfigError, match="every baseline failed .*, so no search was run.*worker died: OOM"):
        autosync.tune("unused", cluster, trials=4, store=tmp_path / "b.db", settings=FAST, warm_start="none",
                      runner=Broken(model, cluster))
    from tuner.records.store import TrialStore

    with TrialStore(tmp_path / "b.db") as store:   # each baseline run twice, nothing searched after them
        roles = {t.role for t in store.trials()}
    assert roles == {"baseline"}

    class Hung(SyntheticRunner):   # every trial past its limit: the limit is named with how to raise it
        def run(self, strategies, origins=None):
            from tuner.records.trial import Trial

            return [Trial(s, self.model.fingerprint, self.cluster.fingerprint, "timeout",
                          error="exceeded the trial limit of 20 s: worker: time limit reached") for s in strategies]

    with pytest.raises(ConfigError, match=r"every trial ran past its limit of 20 s: .*--timeout, trial_timeout_s"):
        autosync.tune("unused", cluster, trials=4, store=tmp_path / "h.db", settings=FAST, warm_start="none",
                      runner=Hung(model, cluster), trial_timeout_s=20)
    with pytest.raises(ConfigError) as broken:
        autosync.tune("unused", cluster, trials=4, store=tmp_path / "b2.db", settings=FAST, warm_start="none",
                      runner=Broken(model, cluster))
    assert "ran past its limit" not in str(broken.value)


def test_bad_warm_start_fails_before_measuring(tmp_path):
    model, cluster = tiny_model(), three_node_cluster()
    with pytest.raises(ConfigError, match="warm start .*no such file; use 'builtin'"):
        autosync.tune("unused", cluster, trials=1, store=tmp_path / "w.db", settings=FAST, warm_start=tmp_path / "x.db",
                      runner=SyntheticRunner(model, cluster))
    assert not (tmp_path / "w.db").exists()


def test_cli_bad_warm_start_exits_2(tmp_path, capsys):
    from autosync.cli import main

    assert main(["tune", "--model", "zoo:ncf", "--warm-start", str(tmp_path / "nope.db")]) == 2
    err = capsys.readouterr().err
    assert "no such file" in err and "Traceback" not in err


def test_tune_reads_the_builtin_dataset_without_copying_it(result):
    from tuner.records.store import TrialStore

    with TrialStore(result.store_path) as store:
        assert len(store) == result.summary()["total_trials"]     # only this run's trials
        assert len(store.groups()) == 1
    assert result.summary()["warm_start_trials"] >= 200


from tuner.records.goodput import Prober  # noqa: E402


class StoringProber(Prober):
    """A fake prober that writes its probes to the run's store, as the real one does: every lossy
    strategy is worth ``e`` lossless steps (falling made-up loss curves)."""

    def __init__(self, store_path, model, e):
        self.store_path, self.model, self.e, self.note = store_path, model, e, "fake probes"

    def efficiency(self, strategy):
        import numpy as np

        from tuner.records.goodput import ProbeResult, estimate_efficiency, lossy_parts, probe_cache_key, probe_model_key
        from tuner.records.store import TrialStore

        steps = np.arange(1, 101)
        twin = 1 / (1 + 0.05 * steps)
        cand = 1 / (1 + 0.05 * self.e * steps)
        eff = estimate_efficiency(cand, twin)
        parts = lossy_parts(strategy)
        key = probe_cache_key(probe_model_key(self.model), parts, 3, 100, 0)
        with TrialStore(self.store_path) as store:
            store.add_probe(key, ProbeResult(self.model.name, probe_model_key(self.model), parts.key, parts.describe(),
                                             3, "three", 100, 0, eff, tuple(cand), tuple(twin), 1.0, 1.0, 0.0))
        return eff


@pytest.mark.parametrize("quality,e", [("goodput", 1.0), ("goodput", 0.1), ("step", 0.1)])
def test_goodput_in_the_summary_and_the_report(tmp_path, quality, e):
    """Lossy strategies are 2x faster per step here: at E = 1 goodput keeps one, at E = 0.1 it keeps
    a lossless one; step ranks by step time whatever they cost. The report says which and plots
    loss against time from the probes."""
    from tests.test_tuner_goodput import LossyIsFast
    from tuner.records.goodput import is_lossless

    model, cluster = tiny_model(profile=True), three_node_cluster()
    db = tmp_path / "g.db"
    result = autosync.tune("unused", cluster, trials=6, store=db, settings=FAST, warm_start="none",
                           runner=LossyIsFast(model, cluster, seed=3), quality=quality,
                           prober=StoringProber(db, model, e))
    s = result.summary()
    assert s["quality"] == quality
    lossy_best = not is_lossless(result.best_strategy)
    if quality == "step":
        assert s["ranked_by"].startswith("step time only") and lossy_best and s["statistical_efficiency"] is None
        assert s["probes"] == 0
    elif e == 1.0:
        assert lossy_best and s["efficiency_probed"] and s["statistical_efficiency"] == 1.0 and s["probes"] >= 1
    else:
        assert not lossy_best and s["statistical_efficiency"] == 1.0 and not s["efficiency_probed"]
        assert s["probes"] >= 1
    out = write_report(db, tmp_path / "r")
    page = (out / "index.html").read_text()
    if quality == "step":
        assert "step time only" in page and not (out / "loss_vs_time.png").exists()
    else:
        assert "goodput" in page and "statistical efficiency" in page and (out / "loss_vs_time.png").exists()


@pytest.mark.parametrize("quality", ["goodput", "exact", "step"])
def test_tune_command_takes_each_quality_and_says_it(tmp_path, monkeypatch, capsys, quality):
    """`autosync tune --quality Q` end to end through the command line (the synthetic runner in
    place of Ray): the table and the JSON say what the run ranked by."""
    from autosync.cli import main
    from strategy_space import dumps

    model, cluster = tiny_model(profile=True), three_node_cluster()

    patch_tune_runner(monkeypatch, model, cluster)
    (tmp_path / "c.yaml").write_text(dumps(cluster))
    argv = ["tune", "--model", "zoo:ncf", "--cluster", str(tmp_path / "c.yaml"), "--trials", "3", "--warm-start", "none",
            "--store", str(tmp_path / "s.db"), "--out", str(tmp_path / "b.yaml"), "--quality", quality]
    assert main(argv + ["--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["quality"] == quality
    if quality == "exact":
        assert s["lossy_parts"] == "lossless" and "no lossy part" in s["lossy_note"]
    if quality == "goodput":   # a runner without a trainable model: nothing to probe, so nothing lossy
        assert s["lossy_parts"] == "lossless" and "not proposed" in s["lossy_note"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert ("ranked by step time only" if quality == "step" else "ranked by goodput") in text
    assert ("in step time only" if quality == "step" else "in goodput") in text


@pytest.mark.parametrize("clipnorm", [None, 1.0])
def test_under_global_clipnorm_the_search_proposes_no_staleness(tmp_path, clipnorm):
    """The runtime refuses staleness and asynchronous PS when the optimizer clips by the global
    norm (every gradient of a step must be in first): tuning does not spend trials on them, and
    says so. Without the option, the same run proposes them (stale steps are fast here)."""
    from tests.test_tuner_goodput import LossyIsFast
    from tuner.records.goodput import lossy_parts

    class Timed(StoringProber):
        on_target = True

    class Clipping(LossyIsFast):
        def optimizer_config(self):
            return {"class": "SGD", "learning_rate": 0.1, "global_clipnorm": clipnorm}

    model, cluster = tiny_model(profile=True), three_node_cluster()
    db = tmp_path / "c.db"
    result = autosync.tune("unused", cluster, trials=9, store=db, settings=FAST, warm_start="none",
                           runner=Clipping(model, cluster, seed=3), prober=Timed(db, model, 1.0))
    timing = [t for t in result.outcome.trials if lossy_parts(t.strategy).stale or lossy_parts(t.strategy).asynchronous]
    if clipnorm is None:
        assert timing and "global_clipnorm" not in result.lossy_note
    else:
        assert not timing and "global_clipnorm needs every gradient" in result.lossy_note


def test_tune_refuses_settings_that_are_not_search_settings(tmp_path):
    model, cluster = tiny_model(), three_node_cluster()
    with pytest.raises(ConfigError, match="settings must be a SearchSettings .*got dict"):
        autosync.tune("unused", cluster, trials=1, store=tmp_path / "s.db", settings={"batch": 2},
                      warm_start="none", runner=SyntheticRunner(model, cluster))
    assert not (tmp_path / "s.db").exists()


@pytest.mark.parametrize("config", [{"class": "Adam", "learning_rate": 0.01},
                                    {"class": "Adam", "learning_rate": 0.01, "clipnorm": 1.0},
                                    {"class": "Lamb", "learning_rate": 0.01}])
def test_under_clipnorm_or_a_whole_variable_rule_the_search_partitions_no_variable(tmp_path, config):
    """The runtime refuses a variable split into shards under clipnorm (each variable clipped by its
    own norm) or Lamb (a whole variable's trust ratio): the search proposes none, and says so,
    so no trial is spent on a refusal (two of three were, on a script with clipnorm). The baselines
    stay as their builders make them (partitioned_ps is a user's hand choice: its refusal is
    recorded). Without either, the same search partitions."""
    class WithOptimizer(SyntheticRunner):
        def optimizer_config(self):
            return dict(config)

    model, cluster = tiny_model(profile=True), three_node_cluster()
    result = autosync.tune("unused", cluster, trials=12, store=tmp_path / "p.db", settings=FAST, warm_start="none",
                           runner=WithOptimizer(model, cluster, seed=3))
    search = [t.strategy for t in result.outcome.trials if t.role == "search"]
    partitioned = [s for s in search if any(v.num_shards > 1 for v in s.variables)]
    assert len(search) == 12
    assert any(v.num_shards > 1 for v in result.baselines["partitioned_ps"].strategy.variables)
    if "clipnorm" not in config and config["class"] != "Lamb":
        assert partitioned and result.search_note == "" and result.summary()["search_note"] == ""
    else:
        assert not partitioned, [s.origin for s in partitioned]
        assert result.search_note.startswith("no variable partitioned: ")
        assert ("clipnorm=1.0" if "clipnorm" in config else "'Lamb' reads whole variables") in result.search_note


def test_a_pin_that_the_optimizer_makes_the_runtime_refuse_is_refused_before_any_trial(tmp_path):
    from tuner.search.constraints import Constraints, Rule

    class Clipping(SyntheticRunner):
        def optimizer_config(self):
            return {"class": "SGD", "learning_rate": 0.1, "clipnorm": 0.5, "global_clipnorm": None}

    model, cluster = tiny_model(profile=True), three_node_cluster()
    pins = Constraints((Rule(match="embedding*", shards=2),))
    with pytest.raises(ConfigError, match=r"constraint rule match='embedding\*': pins shards 2, but optimizer option "
                                          r"clipnorm=0.5 clips each variable by its own norm.*pin shards 1"):
        autosync.tune("unused", cluster, trials=2, store=tmp_path / "r.db", settings=FAST, warm_start="none",
                      constraints=pins, runner=Clipping(model, cluster, seed=3))


@pytest.mark.integration   # builds the model's own Keras optimizer
def test_under_emulated_compute_the_search_keeps_to_the_optimizer_the_model_trains_with(tmp_path):
    """Emulated trials apply the emulated optimizer (plain SGD here); the recommendation trains
    with the model's own, whose clipnorm the runtime refuses on a split variable: no search trial
    partitions one."""
    from tests.runtime_models import multi_model_def

    class Emulated(SyntheticRunner):
        compute = "emulated"

        def optimizer_config(self):
            return {"class": "SGD", "learning_rate": 0.01}

    model, cluster = tiny_model(profile=True), three_node_cluster()
    result = autosync.tune(multi_model_def("adam", learning_rate=0.01, clipnorm=1.0), cluster, trials=12,
                           store=tmp_path / "e.db", settings=FAST, warm_start="none", compute="emulated",
                           runner=Emulated(model, cluster, seed=3))
    search = [t.strategy for t in result.outcome.trials if t.role == "search"]
    assert len(search) == 12 and not [s for s in search if any(v.num_shards > 1 for v in s.variables)]
    assert "clipnorm=1.0" in result.search_note


def test_the_time_budget_counts_from_the_call(tmp_path, monkeypatch):
    """What the run spends before its loop (the workers' start, the model's profile) is part of
    ``time_budget_s``: the budget's clock starts at the call."""
    import time

    from autosync import api

    seen = []
    real = api.tune_loop

    def loop(runner, store, tuner, budget, **kw):
        seen.append(budget)
        return real(runner, store, tuner, budget, **kw)

    monkeypatch.setattr(api, "tune_loop", loop)
    model, cluster = tiny_model(profile=True), three_node_cluster()
    t0 = time.monotonic()
    autosync.tune("unused", cluster, trials=2, time_budget_s=600, store=tmp_path / "s.db", settings=FAST,
                  warm_start="none", confirm=0, runner=SyntheticRunner(model, cluster, seed=0))
    assert seen and seen[0].time_s == 600 and t0 <= seen[0].started <= time.monotonic()


def test_a_store_and_a_report_under_home_go_there(tmp_path, monkeypatch):
    """``autosync.tune(..., store="~/runs/t.db")`` and ``write_report(..., "~/r")`` from Python (no
    shell expands the ~) made folders named '~' in the working directory."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    model, cluster = tiny_model(profile=True), three_node_cluster()
    result = autosync.tune("unused", cluster, trials=2, store="~/runs/t.db", settings=FAST, warm_start="none",
                           runner=SyntheticRunner(model, cluster, seed=3))
    assert (tmp_path / "home" / "runs" / "t.db").is_file() and str(result.store_path).startswith(str(tmp_path / "home"))
    out = write_report("~/runs/t.db", "~/r")
    assert (tmp_path / "home" / "r" / "index.html").is_file() and out == tmp_path / "home" / "r"
    assert not (tmp_path / "~").exists()


def test_a_report_reads_the_probes_of_its_runs_training_only():
    """A run's report, written again after a run at another learning rate, shows its own
    efficiencies: the probes of the training digest the run probed with, not the latest."""
    from types import SimpleNamespace

    from autosync.report import run_probes

    def probe(started, training):
        return SimpleNamespace(started_at=started, meta={} if training is None else {"training": training})

    run = [SimpleNamespace(started_at=100.0, finished_at=110.0, meta={}),
           SimpleNamespace(started_at=120.0, finished_at=200.0, meta={})]
    cached, own, later = probe(50.0, "d1"), probe(150.0, "d1"), probe(300.0, "d2")
    assert run_probes([cached, own, later], run) == [cached, own]        # the later run's digest left out
    assert run_probes([cached, later], run) == [cached, later]           # it probed nothing: all, as before
    mixed = [own, probe(160.0, "d2"), later]
    assert run_probes(mixed, run) == mixed                               # two digests in one run: all
    old = [probe(150.0, None), later]
    assert run_probes(old, run) == old                                   # stored before digests: all
    # a run whose probes all came from the cache: its trials name the digest it read them under
    named = run + [SimpleNamespace(started_at=210.0, finished_at=220.0, meta={"training": "d1"})]
    assert run_probes([cached, later], named) == [cached]


def test_the_trials_after_a_probe_carry_the_digest_of_the_training_it_probed(tmp_path):
    """A run whose probes come from the cache stores none itself: its trials name the training
    digest (``Prober.training_known``) for its report (``report.run_probes``)."""
    from tests.test_tuner_goodput import LossyIsFast

    class Digesting(StoringProber):
        training_known = None

        def efficiency(self, strategy):
            self.training_known = "d1"   # as TrainingProber's, computed at its first probe
            return super().efficiency(strategy)

    model, cluster = tiny_model(profile=True), three_node_cluster()
    db = tmp_path / "d.db"
    result = autosync.tune("unused", cluster, trials=9, store=db, settings=FAST, warm_start="none",
                           runner=LossyIsFast(model, cluster, seed=3), prober=Digesting(db, model, 1.0))
    assert result.outcome.efficiency   # a lossy strategy was probed
    named = [t.meta.get("training") for t in result.outcome.trials]
    first = named.index("d1")   # every trial from the first one stored after a probe on
    assert first > 0 and set(named[:first]) == {None} and set(named[first:]) == {"d1"}
