"""A stand-in model for efficiency probes (``autosync.probe.StandInProber``, ``tune(probe_model=)``):
a candidate's lossy parts move onto the stand-in's variables of the same names, everything else
is exact, and what cannot work is refused before any worker starts. Fakes only: the probes that
train are in ``tests/test_probe.py``."""
from __future__ import annotations

import pytest

import autosync
from autosync.probe import StandInProber
from strategy_space import PS, AllReduce, ClusterSpec, ConfigError, ModelSpec, NodeSpec, Strategy, VarConfig, VariableSpec
from tuner.records.goodput import EXACT, Efficiency, lossy_parts
from tests.fakes import three_node_cluster, tiny_model
from tuner.synthetic.runner import SyntheticRunner

CLUSTER = ClusterSpec(name="pair", nodes=(NodeSpec(name="a", address="10.0.0.1", chief=True),
                                          NodeSpec(name="b", address="10.0.0.2")))


def spec(name: str, rows: int, extra: tuple = ()) -> ModelSpec:
    variables = (VariableSpec("emb", (rows * 10, 16), sparse=True, rows_per_step=8),
                 VariableSpec("dense/kernel", (rows, 32)), VariableSpec("dense/bias", (32,))) + extra
    return ModelSpec(name=name, variables=variables, batch_size=8)


class FakeInner:
    """What StandInProber needs of a TrainingProber; records what it was asked to train."""

    def __init__(self):
        self.cluster, self.workers, self.note, self.asked = CLUSTER, 2, "", []

    def efficiency(self, strategy):
        self.asked.append(strategy)
        return Efficiency(0.9, 0.85, 0.95, True, 60, "probe", self.note)


def full_strategy(compressor: str = "powersgd_ef(4)", staleness: int = 0) -> Strategy:
    return Strategy((VarConfig("emb", (PS("a"), PS("b", staleness=staleness))),
                     VarConfig("dense/kernel", (AllReduce(compressor="none", group=1),
                                                AllReduce(compressor=compressor, group=2))),
                     VarConfig("dense/bias", (AllReduce(group=0),))), origin="search")


def test_lossy_parts_move_onto_the_stand_ins_variables_of_the_same_names():
    inner = FakeInner()
    prober = StandInProber(inner, spec("big", 4096), spec("small", 64), "zoo:small")
    e = prober.efficiency(full_strategy(staleness=2))
    (moved,) = inner.asked
    by_name = {c.name: c.synchronizers for c in moved.variables}
    # the compressor of one shard compresses the stand-in's whole variable; the stale PS shard
    # makes the stand-in's variable a stale PS; the lossless bias stays exact
    assert by_name["dense/kernel"] == (AllReduce(compressor="powersgd_ef(4)", group=by_name["dense/kernel"][0].group),)
    assert by_name["emb"] == (PS("a", staleness=2),)
    assert by_name["dense/bias"][0].codec.kind == "none" and isinstance(by_name["dense/bias"][0], AllReduce)
    parts = lossy_parts(moved)
    assert [c[0] for c in parts.compressed] == ["dense/kernel"] and [s[0] for s in parts.stale] == ["emb"]
    # the figure says what it rests on
    assert e.value == 0.9 and "stand-in model zoo:small" in e.note and "big" in e.note and prober.note == e.note


def test_a_lossless_candidate_is_not_probed_on_the_stand_in():
    inner = FakeInner()
    prober = StandInProber(inner, spec("big", 4096), spec("small", 64), "zoo:small")
    assert prober.efficiency(full_strategy(compressor="none")) == EXACT and inner.asked == []


def test_a_stand_in_without_the_tuned_models_variables_is_refused():
    other = spec("small", 64, extra=(VariableSpec("head/kernel", (32, 4)),))
    with pytest.raises(ConfigError, match=r"stand-in model big has no variable named head/kernel of model small"):
        StandInProber(FakeInner(), other, spec("big", 4096), "zoo:big")


@pytest.mark.parametrize("kwargs, message", [
    ({}, "a stand-in is for emulated compute"),                                   # real compute
    ({"compute": "emulated", "quality": "exact"}, "under --quality goodput"),
    ({"compute": "emulated", "runner": "fake"}, "on the Ray runtime's workers"),   # a runner without workers
    ({"compute": "emulated", "probe_model": "configs/models/ncf.yaml"}, "must be a trainable model"),
])
def test_tune_refuses_a_stand_in_it_cannot_use_before_anything_runs(tmp_path, kwargs, message):
    kwargs = dict(kwargs)
    if kwargs.get("runner") == "fake":
        kwargs["runner"] = SyntheticRunner(tiny_model(profile=True), three_node_cluster(), seed=0)
        kwargs.pop("compute")
        kwargs["runner"].compute = "emulated"
    kwargs.setdefault("probe_model", "zoo:ncf")
    with pytest.raises(ConfigError, match=message):
        autosync.tune("configs/models/ncf.yaml", "local", trials=1, store=tmp_path / "s.db", **kwargs)
    assert not (tmp_path / "s.db").exists()


def test_the_benchmark_refuses_a_stand_in_it_cannot_use_before_the_testbed_comes_up(capsys):
    import importlib
    import os
    import sys

    from tests.conftest import REPO

    bench = os.path.join(REPO, "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    tvb = importlib.import_module("tune_vs_baselines")
    spec = "configs/models/nvidia-h200/lm1b-full.yaml"
    assert tvb.stand_ins([f"{spec}=zoo:lm1b"], [spec]) == {spec: "zoo:lm1b"}
    for argv, message in [(["--probe-model", "zoo:lm1b"], "takes NAME=MODEL"),
                          (["--probe-model", "nope=zoo:lm1b"], "nope is not among --models"),
                          (["--models", "lm1b", "--probe-model", "lm1b=zoo:lm1b"], "needs --compute emulated"),
                          (["--trial-timeout", "0"], "--trial-timeout must be > 0 seconds, got 0")]:
        assert tvb.main(argv) == 2
        assert message in capsys.readouterr().err
