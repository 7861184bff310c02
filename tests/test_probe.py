"""Statistical-efficiency probes on real Ray and TensorFlow (``autosync.probe``): a lossy choice
that measurably hurts gets E clearly below 1, the probe is deterministic for a seed, a lossless
strategy is never trained, and ``autosync probe`` prints what it measured."""
from __future__ import annotations

import dataclasses
import functools
import json
import subprocess
import sys

import pytest

from strategy_space import AllReduce, Strategy, VarConfig, dumps
from tests import runtime_models as rm
from tests.runtime_helpers import warm_pool

pytestmark = pytest.mark.integration
STEPS = 60
SCRIPT = """
import functools
import numpy as np
from autosync import ModelDef

def build():
    import keras
    x = keras.Input((8,))
    return keras.Model(x, keras.layers.Dense(8, use_bias=False, name="w")(x))

def loss():
    import keras
    return keras.losses.MeanSquaredError()

def opt():
    import keras
    return keras.optimizers.SGD(0.25)

def data(worker, workers, seed=0):
    w = np.random.default_rng(seed).normal(size=(8, 8)).astype("float32")
    rng = np.random.default_rng([seed, worker, workers])
    while True:
        x = rng.normal(size=(16, 8)).astype("float32")
        yield x, x @ w

def model():
    return ModelDef(name="teacher", model_fn=build, loss_fn=loss, optimizer_fn=opt, dataset_fn=data, batch_size=16)
"""


@pytest.fixture(scope="module")
def setup(ray_session):
    from autosync.sources import local_cluster

    cluster = local_cluster(2)
    yield from ((cluster, pool) for pool in warm_pool(ray_session, cluster))


def strategies(compressor: str):
    lossless = Strategy((VarConfig("w/kernel", (AllReduce(),)),), origin="all_reduce")
    lossy = Strategy((VarConfig("w/kernel", (AllReduce(compressor=compressor),)),), origin=compressor)
    return lossless, lossy


def prober(setup, store=None, seed=None, **change):
    from autosync.models.ingest import model_spec_from_def
    from autosync.probe import TrainingProber

    cluster, pool = setup
    md = dataclasses.replace(rm.teacher_model_def(), **change)
    return TrainingProber(md, model_spec_from_def(md), cluster, steps=STEPS, seed=seed, store=store, pool=pool)


class Trained(Exception):
    """Raised where a prober would train: its probe was not found in the cache."""


def _must_not_train(strategy):
    raise Trained(strategy.origin)


def test_powersgd_rank_1_without_error_feedback_costs_convergence_and_the_probe_is_deterministic(setup, tmp_path):
    from tuner.records.store import TrialStore

    _, lossy = strategies("powersgd(1)")
    with TrialStore(tmp_path / "p.db") as store:
        first = prober(setup, store).probe(lossy)
        e = first.efficiency
        assert e.probed and e.source == "probe" and e.steps == STEPS
        assert e.high < 0.8, e           # rank 1 of a full-rank 16x16 gradient: clearly below 1
        assert first.twin_loss[-1] < 0.3 * first.twin_loss[0]   # the twin learns the teacher
        # a second prober on the same store finds it: nothing trains again
        again = prober(setup, store)
        again._train = None   # would fail if called
        cached = again.probe(lossy)
        assert cached.efficiency.source == "cache" and cached.candidate_loss == first.candidate_loss
        assert cached.meta["training"] == again.training
        # the same variables trained another way (learning rate, optimizer, loss, layers, data) are
        # another model to a probe: its cached efficiency is not theirs
        other_lr = functools.partial(rm.make_optimizer, "sgd", learning_rate=0.05)
        for change in ({"optimizer_fn": other_lr}, {"optimizer_fn": functools.partial(rm.make_optimizer, "adam")},
                       {"loss_fn": lambda: "mae"}, {"dataset_fn": functools.partial(rm.teacher_batches, batch=16, seed=1)}):
            other = prober(setup, store, **change)
            other._train = _must_not_train
            with pytest.raises(Trained):
                other.probe(lossy)
    # deterministic for a seed: the same curves from scratch (no store)
    fresh = prober(setup).probe(lossy)
    assert fresh.candidate_loss == pytest.approx(first.candidate_loss, rel=1e-5)
    assert fresh.efficiency.value == pytest.approx(e.value, abs=1e-6)


def test_a_lossless_strategy_is_never_trained(setup):
    lossless, _ = strategies("none")
    p = prober(setup)
    p._train = None   # would fail if called
    e = p.efficiency(lossless)
    assert e.value == 1.0 and not e.probed


def test_probe_command_prints_efficiency_interval_and_both_curves(setup, tmp_path, capsys):
    _, lossy = strategies("powersgd(1)")
    (tmp_path / "s.yaml").write_text(dumps(lossy))
    script = tmp_path / "m.py"   # a user's script: the teacher model, self-contained
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "autosync", "probe", "--model", f"{script}:model", "--strategy", str(tmp_path / "s.yaml"),
           "--steps", "30", "--store", str(tmp_path / "c.db"), "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["probed"] and 0 <= out["interval"][0] <= out["statistical_efficiency"] <= out["interval"][1] <= 1
    assert out["statistical_efficiency"] < 0.95
    assert len(out["candidate_loss"]) == len(out["twin_loss"]) == 30 == out["steps"]
    # a lossless strategy: not probed, nothing trains (in this process: no second start-up)
    from autosync.cli import main

    (tmp_path / "l.yaml").write_text(dumps(strategies("none")[0]))
    capsys.readouterr()
    assert main(["probe", "--model", f"{script}:model", "--strategy", str(tmp_path / "l.yaml"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["probed"] is False and out["statistical_efficiency"] == 1.0 and out["candidate_loss"] == []
    # and the table form
    assert main(["probe", "--model", f"{script}:model", "--strategy", str(tmp_path / "l.yaml")]) == 0
    assert "statistical efficiency 1 (not probed)" in capsys.readouterr().out
    # a builder's name, as run and simulate take it (was "file not found: ps"); an unknown one lists them
    assert main(["probe", "--model", f"{script}:model", "--strategy", "ps", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["statistical_efficiency"] == 1.0
    assert main(["probe", "--model", f"{script}:model", "--strategy", "pss"]) == 2
    assert "strategy 'pss' is neither a strategy YAML file nor a builder's name" in capsys.readouterr().err


def test_a_stand_in_gives_a_bigger_models_candidate_the_efficiency_of_its_lossy_parts(setup):
    """A model-spec of the teacher at 8x the rows, its kernel split in two shards, one compressed:
    probed on the trainable teacher (``StandInProber``), its E is the one of the teacher with the
    whole kernel compressed so (the same seed: the same curves)."""
    from strategy_space import ModelSpec, VariableSpec
    from autosync.models.ingest import model_spec_from_def
    from autosync.probe import StandInProber

    big = ModelSpec(name="teacher-big", variables=(VariableSpec("w/kernel", (64, 8)),), batch_size=16)
    candidate = Strategy((VarConfig("w/kernel", (AllReduce(group=1), AllReduce(compressor="powersgd(1)", group=2))),),
                         origin="search")
    stand_in = StandInProber(prober(setup, seed=3), big, model_spec_from_def(rm.teacher_model_def()), "teacher")
    e = stand_in.efficiency(candidate)
    direct = prober(setup, seed=3).efficiency(strategies("powersgd(1)")[1])
    assert e.probed and e.value == pytest.approx(direct.value, abs=1e-6) and e.value < 0.8, (e, direct)
    assert "stand-in model teacher" in e.note and "teacher-big" in e.note
