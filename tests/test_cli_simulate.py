"""``autosync simulate``: analytic and learned predictions of a strategy file, the evaluation table
of a store, and bad input (exit 2, one message, no traceback)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from autosync.cli import main
from strategy_space import load_strategy, save
from strategy_space.builders import build_all
from strategy_space.space import StrategySpace
from tests.conftest import REPO
from tests.fakes import three_node_cluster, tiny_model
from tuner.cost_models.analytic import AnalyticCostModel
from tuner.cost_models.simulator import LearnedSimulator
from tuner.features.batch import featurize
from tuner.features.tables import FeatureTables
from tuner.records.dataset import build_trial_set, store_groups
from tuner.records.store import TrialStore
from tuner.synthetic.runner import SyntheticRunner, candidate_strategies


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Model, cluster and strategy YAML files, and a store of 30 synthetic trials of that pair."""
    d = tmp_path_factory.mktemp("simulate")
    model, cluster = tiny_model(profile=True), three_node_cluster()
    paths = {"model": d / "model.yaml", "cluster": d / "cluster.yaml", "strategy": d / "strategy.yaml",
             "store": d / "trials.db"}
    save(model, paths["model"])
    save(cluster, paths["cluster"])
    save(build_all(model, cluster)["parallax"], paths["strategy"])
    trials = SyntheticRunner(model, cluster, seed=0).run(candidate_strategies(model, cluster, np.random.default_rng(0), 30))
    with TrialStore(paths["store"]) as store:
        store.add_many(trials, model, cluster)
    return {k: str(v) for k, v in paths.items()}


def _json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def _features(files):
    model, cluster = tiny_model(profile=True), three_node_cluster()
    strategy = load_strategy(files["strategy"])
    return featurize(FeatureTables.from_specs(model, cluster), StrategySpace(model, cluster).encode([strategy]))


def test_strategy_json_analytic(files, capsys):
    out = _json(capsys, ["simulate", "--model", files["model"], "--cluster", files["cluster"],
                         "--strategy", files["strategy"], "--json"])
    expected = float(AnalyticCostModel().predict(_features(files))[0])
    assert out["predictor"] == "analytic" and out["model"] == "tiny" and out["cluster"] == "three"
    assert out["step_time_s"] == pytest.approx(expected, rel=1e-6)
    assert out["samples_per_s"] == pytest.approx(64 * 3 / expected, rel=1e-6)
    assert out["breakdown"]["compute_s"] == pytest.approx(0.01)
    assert out["breakdown"]["comm_s"] > 0
    assert out["compute_source"].startswith("the model spec's profile")


def test_simulate_says_where_its_compute_comes_from(tmp_path, capsys):
    """As plan does: a spec without a profile has its compute estimated at a CPU's rate, which
    the output said nowhere."""
    save(tiny_model(profile=False), tmp_path / "bare.yaml")
    assert main(["simulate", "--model", str(tmp_path / "bare.yaml"), "--cluster", "local", "--strategy", "ps"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith("compute: estimated from the parameters at 20 GFLOP/s: the model spec has no profile")


def test_a_builders_name_is_the_strategy_it_builds(files, capsys):
    """``--strategy parallax`` predicts what the parallax builder's file predicts."""
    argv = ["simulate", "--model", files["model"], "--cluster", files["cluster"], "--json", "--strategy"]
    assert _json(capsys, argv + ["parallax"]) == _json(capsys, argv + [files["strategy"]])


def test_strategy_with_store_uses_the_learned_simulator(files, capsys):
    out = _json(capsys, ["simulate", "--model", files["model"], "--cluster", files["cluster"],
                         "--strategy", files["strategy"], "--store", files["store"], "--json"])
    with TrialStore(files["store"]) as store:
        data = build_trial_set(store_groups(store))
    assert len(data) >= 20
    expected = float(LearnedSimulator().fit(data.X, data.y).predict(_features(files))[0])
    assert out["predictor"] == "learned"
    assert out["step_time_s"] == pytest.approx(expected, rel=1e-5)
    analytic = float(AnalyticCostModel().predict(_features(files))[0])
    assert out["step_time_s"] != pytest.approx(analytic, rel=1e-3)


def test_eval_prints_the_table(files, capsys):
    assert main(["simulate", "--eval", files["store"]]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["protocol", "method", "groups"]
    methods = [line for line in lines if line.startswith("within ")]
    assert {"simulator", "ranker", "analytic"} <= {m.split()[1] for m in methods}
    assert not any(line.startswith("lomo") for line in lines)      # one model: no transfer protocol
    head = lines[0].split()
    assert head[3:5] == ["pairwise", "pw>5%"]
    for line in methods:
        strict, tol = (float(x) for x in line.split()[head.index("pairwise") + 1:head.index("pairwise") + 3])
        assert 0.0 <= strict <= 1.0 and 0.0 <= tol <= 1.0
    assert "only pairs whose measured times differ by more than 5%" in out


def _cli(*argv):
    env = dict(os.environ, PYTHONPATH=REPO)
    return subprocess.run([sys.executable, "-m", "autosync", "simulate", *argv], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=120)


@pytest.mark.parametrize("argv, message", [
    (("--model", "{model}", "--cluster", "{cluster}"), "simulate needs --strategy (or --eval STORE)"),
    (("--eval", "{missing}"), "trial store not found"),
    (("--model", "{model}", "--cluster", "{cluster}", "--strategy", "{model}"),
     "expected a strategy file but this is a model file (kind: model)"),
    (("--model", "{model}", "--cluster", "{cluster}", "--strategy", "paralax"),
     "strategy 'paralax' is neither a strategy YAML file nor a builder's name; give the path of a strategy file"),
])
def test_bad_input_exits_2_without_traceback(files, tmp_path, argv, message):
    subs = dict(files, missing=str(tmp_path / "nope.db"))
    r = _cli(*(a.format(**subs) for a in argv))
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.startswith("autosync simulate: error:") and message in r.stderr
    assert r.stdout == ""


def test_gpu_workers_sharing_a_node_without_its_link_speed_are_told_what_was_assumed(tmp_path, capsys):
    """Two nodes of four GPU workers, no ``intra_node_bandwidth_gbps``: the prediction says which
    figure it took and how to give the real one; with the figure given it says nothing, and the
    intra-node seconds follow the figure (a 10x faster link, a 10x shorter intra-node time)."""
    from strategy_space import ClusterSpec, NodeSpec

    model = tiny_model(profile=True)
    nodes = tuple(NodeSpec(f"g{i}", address=f"10.0.0.{i + 1}", cpus=16, gpus=4, bandwidth_gbps=25.0,
                           gpu_memory_gib=80.0) for i in range(2))
    paths = {}
    for label, intra in (("unsaid", None), ("said", 400.0)):
        cluster = ClusterSpec("gpus", nodes, intra_node_bandwidth_gbps=intra)
        paths[label] = tmp_path / f"{label}.yaml"
        save(cluster, paths[label])
    save(model, tmp_path / "model.yaml")
    save(build_all(model, ClusterSpec("gpus", nodes))["all_reduce"], tmp_path / "ar.yaml")
    argv = ["simulate", "--model", str(tmp_path / "model.yaml"), "--strategy", str(tmp_path / "ar.yaml")]
    unsaid = _json(capsys, argv + ["--cluster", str(paths["unsaid"]), "--json"])
    said = _json(capsys, argv + ["--cluster", str(paths["said"]), "--json"])
    assert said["assumed"] == [] and len(unsaid["assumed"]) == 1
    assert "40 Gbit/s between the up to 4 GPU workers" in unsaid["assumed"][0]
    assert "intra_node_bandwidth_gbps" in unsaid["assumed"][0]
    assert unsaid["breakdown"]["intra_s"] > 0
    assert unsaid["breakdown"]["intra_s"] == pytest.approx(10 * said["breakdown"]["intra_s"], rel=1e-5)
    assert main(argv + ["--cluster", str(paths["unsaid"])]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("assumed: intra-node bandwidth 40 Gbit/s")


def test_gpu_nodes_without_their_gpus_memory_are_told_it_was_not_checked(tmp_path, capsys):
    """A GPU cluster whose YAML gives no gpu_memory_gib: the prediction says the GPUs' memory was not
    checked, naming the nodes; a CPU-only node and a node that gives it are not named."""
    from strategy_space import ClusterSpec, NodeSpec

    model = tiny_model(profile=True)
    nodes = (NodeSpec("ps0", address="10.0.0.1", cpus=16, bandwidth_gbps=25.0, chief=True),
             NodeSpec("g1", address="10.0.0.2", cpus=16, gpus=1, bandwidth_gbps=25.0),
             NodeSpec("g2", address="10.0.0.3", cpus=16, gpus=1, bandwidth_gbps=25.0, gpu_memory_gib=16.0))
    cluster = ClusterSpec("gpus", nodes)
    save(cluster, tmp_path / "c.yaml")
    save(model, tmp_path / "model.yaml")
    save(build_all(model, cluster)["all_reduce"], tmp_path / "ar.yaml")
    argv = ["simulate", "--model", str(tmp_path / "model.yaml"), "--strategy", str(tmp_path / "ar.yaml"),
            "--cluster", str(tmp_path / "c.yaml")]
    (line,) = _json(capsys, argv + ["--json"])["assumed"]
    assert line.startswith("GPU memory not checked on g1 (cluster gpus gives no gpu_memory_gib there)")
    assert "ray?gpu_gib=X" in line
    given = ClusterSpec("gpus", tuple(n if n.gpus == 0 else NodeSpec(n.name, address=n.address, cpus=16, gpus=1,
                                                                      gpu_memory_gib=16.0) for n in nodes))
    assert given.assumptions() == []


def test_the_breakdown_shows_the_collectives_steps_on_nccl_apart_from_cpu_rings(tmp_path, capsys):
    """On GPU nodes an all-reduce's steps are NCCL's (10 us each), on CPU nodes a CPU ring's (0.1 ms):
    the breakdown shows which, so a comm_s well above wire_s is explained."""
    from strategy_space import ClusterSpec, NodeSpec

    model = tiny_model(profile=True)
    save(model, tmp_path / "m.yaml")
    for name, gpus in (("g", 2), ("c", 0)):
        nodes = tuple(NodeSpec(f"n{i}", gpus=gpus, workers=2, bandwidth_gbps=1.0) for i in range(3))
        save(ClusterSpec(name, nodes, intra_node_bandwidth_gbps=100.0 if gpus else None), tmp_path / f"{name}.yaml")
    got = {name: _json(capsys, ["simulate", "--model", str(tmp_path / "m.yaml"), "--cluster",
                                str(tmp_path / f"{name}.yaml"), "--strategy", "all_reduce", "--json"])["breakdown"]
           for name in ("g", "c")}
    steps = got["c"]["ring_steps"]
    assert steps > 0 and got["c"]["nccl_ring_steps"] == 0
    assert got["g"]["nccl_ring_steps"] == steps and got["g"]["ring_steps"] == 0
