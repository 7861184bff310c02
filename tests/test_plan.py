"""``autosync plan`` (planning for a cluster before renting it): every baseline and the best of a
search scored by the cost model, nothing run; bad input refused with exit code 2. Model and
cluster specs are YAML here, so nothing imports TensorFlow or Ray."""
from __future__ import annotations

import dataclasses
import json
import os
import re

import pytest

from autosync.cli import main
from autosync.planning import outline
from strategy_space import AllReduce, load_cluster_spec, load_model_spec, load_strategy, validate
from strategy_space.builders import BUILDERS
from tests.conftest import REPO

MODEL = f"{REPO}/configs/models/nvidia-h200/bert-full.yaml"
CLUSTER = f"{REPO}/configs/clusters/paper_4x4t4_50gbit.yaml"


def test_plan_prints_json_and_writes_the_best_predicted_strategy(tmp_path, capsys):
    out = tmp_path / "best.yaml"
    assert main(["plan", "--model", MODEL, "--cluster", CLUSTER, "--top", "3", "--json", "--out", str(out)]) == 0
    result = json.loads(capsys.readouterr().out)
    ranked = result["ranked"]
    times = [r["predicted_s"] for r in ranked]
    assert times == sorted(times) and result["best"] == ranked[0]
    # every builder is there, once or as an alias of one that builds the same strategy
    named = {r["origin"] for r in ranked} | {a for r in ranked for a in r["aliases"]}
    assert set(BUILDERS) <= named
    assert 1 <= sum(r["origin"] == "search" for r in ranked) <= 3
    assert result["predicted_speedup_over_best_baseline"] == pytest.approx(
        result["best_baseline"]["predicted_s"] / result["best"]["predicted_s"])
    assert result["trained_on_trials"] > 100 and result["target_trials"] == 0
    # a model no warm-start group holds: whichever of the analytic model and the simulator ranked
    # held-out models better in the warm start quotes the times (planning._transfer_scorer)
    assert "leave one model out on the trials learned from" in result["predictor"], result["predictor"]
    scorer = result["predictor"].split(" (")[0]
    # each figure says whose it is, and the one named the winner has the higher one
    found = re.search(r"pairwise order ([0-9.]+) learned, ([0-9.]+) analytic", result["predictor"])
    assert found, result["predictor"]
    assert (scorer == "analytic") == (float(found[2]) > float(found[1])), result["predictor"]
    quoted = [r["analytic_s"] for r in ranked] if scorer == "analytic" else None
    assert quoted is None or quoted == times
    assert result["compute_s"] == pytest.approx(load_model_spec(MODEL).profile.step_time_s)
    assert result["assumed"] == []   # the cluster gives the links between a node's GPUs
    for r in ranked:   # no strategy's bytes fit its busiest NIC in less time than that
        assert 0 < r["busiest_nic_s"] <= r["lower_bound_s"] and r["lower_bound_s"] >= result["compute_s"]
    model, cluster = load_model_spec(MODEL), load_cluster_spec(CLUSTER)
    best = validate(load_strategy(str(out)), model, cluster)
    import autosync

    again = autosync.plan(model, cluster, top=3)   # the Python API: the same plan again
    assert isinstance(again, autosync.Plan) and best.fingerprint == again.best.strategy.fingerprint


def test_plan_table_says_what_it_predicted_from(capsys):
    assert main(["plan", "--model", MODEL, "--cluster", CLUSTER, "--top", "2", "--warm-start", "none"]) == 0
    text = capsys.readouterr().out
    assert "bert-full on paper_4x4t4_50gbit: predicted, nothing run" in text and "the model spec's profile" in text
    assert "predictor: analytic (nothing measured to learn from)" in text   # no warm start, no store
    lines = text.splitlines()
    assert lines[3].startswith("best: ") and any(ln.startswith("ps ") and "PS: " in ln for ln in lines)


def test_a_plan_says_what_it_assumed_of_the_links_inside_a_gpu_node(tmp_path, capsys):
    cluster = load_cluster_spec(CLUSTER)
    unsaid = tmp_path / "unsaid.yaml"
    from strategy_space import save

    save(dataclasses.replace(cluster, intra_node_bandwidth_gbps=None), unsaid)
    assert main(["plan", "--model", MODEL, "--cluster", str(unsaid), "--top", "1", "--warm-start", "none"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("assumed: intra-node bandwidth 40 Gbit/s between the up to 4 GPU workers"), last
    assert "intra_node_bandwidth_gbps" in last


def test_a_plan_without_a_profile_on_gpus_says_the_estimate_is_a_cpus_and_names_the_shipped_gpu_specs():
    """``autosync plan --model zoo:bert --cluster <8-GPU nodes>`` quoted 7.4 ms of compute at a CPU's
    20 GFLOP/s (the H200 measured 2.0 ms) without saying that AutoSync ships this model's spec
    measured on GPUs."""
    from autosync.planning import _estimated

    shipped = load_model_spec(f"{REPO}/configs/models/nvidia-h200/ncf-small.yaml")
    bare = dataclasses.replace(shipped, profile=None)
    gpus = load_cluster_spec(CLUSTER)
    cpus = dataclasses.replace(gpus, nodes=tuple(dataclasses.replace(n, gpus=0) for n in gpus.nodes))
    said = _estimated(bare, gpus, 20e9)
    assert said.startswith("estimated from the parameters at 20 GFLOP/s, a CPU's rate though this cluster has GPUs: "
                           "the model spec has no profile"), said
    named = said.split("or give the spec of this model measured on a GPU: ")[1].split(", ")
    assert [os.path.realpath(p) for p in named] == [
        os.path.realpath(f"{REPO}/configs/models/{d}/ncf-small.yaml") for d in ("nvidia-h100", "nvidia-h200")], said
    assert "GPU" not in _estimated(bare, cpus, 20e9)
    other = dataclasses.replace(bare, variables=bare.variables[1:])   # same name, other variables: not that model
    assert _estimated(other, gpus, 20e9).endswith("`autosync inspect --profile --out`")
    # a profile measured on a CPU quoted for GPU nodes is said to be one
    from autosync.planning import compute_source

    on_cpu = dataclasses.replace(shipped, profile=dataclasses.replace(shipped.profile, device="cpu:AMD EPYC x2"))
    assert compute_source(on_cpu, gpus).startswith("the model spec's profile, measured on cpu:AMD EPYC x2 though "
                                                   "this cluster has GPUs")
    assert compute_source(on_cpu, cpus) == "the model spec's profile (cpu:AMD EPYC x2)"
    assert compute_source(shipped, gpus) == "the model spec's profile (gpu:NVIDIA H200 x1)"


def test_outline_counts_what_goes_where():
    from strategy_space import PS, AllReduce, Strategy, VarConfig

    s = Strategy((VarConfig("a", (PS("n0"), PS("n1", local_replication=True))), VarConfig("b", (AllReduce(group=1),)),
                  VarConfig("c", (AllReduce(group=2),))))
    assert outline(s) == "PS: 1 var, 2 shards on 2 nodes; AR: 2 vars in 2 groups; local replication"


@pytest.mark.parametrize("argv, says", [
    (["--top", "0"], "top must be an integer from 1 to 100"),
    (["--cluster", "nope.yaml"], "nope.yaml"),
    (["--warm-start", "missing.db"], "missing.db"),
])
def test_plan_refuses_bad_input_with_one_message(argv, says, capsys):
    base = {"--model": MODEL, "--cluster": CLUSTER}
    for k in range(0, len(argv), 2):
        base[argv[k]] = argv[k + 1]
    assert main(["plan"] + [x for kv in base.items() for x in kv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autosync plan: error: ") and says in err and "Traceback" not in err


def test_a_plan_quotes_the_scorer_asked_for():
    model, cluster = load_model_spec(MODEL), load_cluster_spec(CLUSTER)
    import autosync

    analytic = autosync.plan(model, cluster, top=1, scorer="analytic")
    learned = autosync.plan(model, cluster, top=1, scorer="learned")
    assert analytic.predictor == "analytic" and learned.predictor == "learned"
    assert all(p.predicted_s == p.analytic_s for p in analytic.ranked)
    assert any(p.predicted_s != p.analytic_s for p in learned.ranked)
    with pytest.raises(Exception, match="scorer must be auto, learned or analytic"):
        autosync.plan(model, cluster, scorer="best")


def test_a_model_seen_on_other_clusters_is_judged_by_leaving_one_cluster_out():
    from tuner.records.warmstart import load_warm_start

    import autosync

    groups = load_warm_start("builtin")
    seen = next(m for m, _, _ in groups if m.name == "ncf-small")
    p = autosync.plan(seen, load_cluster_spec(CLUSTER), top=1, warm_start=groups)
    assert "leave one cluster out on the trials learned from" in p.predictor and p.target_trials == 0


def test_a_plan_keeps_the_pins_and_refuses_lossy_ones(tmp_path, capsys):
    pins = tmp_path / "pins.yaml"
    pins.write_text('kind: constraints\nversion: 1\nvariables:\n- match: "*embeddings*"\n  sync: ps\n  shards: 2\n')
    model = f"{REPO}/configs/models/ncf.yaml"
    assert main(["plan", "--model", model, "--cluster", CLUSTER, "--constraints", str(pins), "--json", "--top", "2"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert all(r["origin"] == "search" or r["origin"].endswith("+pins") for r in result["ranked"])
    pins.write_text("kind: constraints\nversion: 1\nvariables:\n- sparse: false\n  compressor: fp16\n")
    assert main(["plan", "--model", model, "--cluster", CLUSTER, "--constraints", str(pins)]) == 2
    assert "a plan proposes lossless strategies only" in capsys.readouterr().err


def test_quoting_the_analytic_model_its_own_search_proposes_too():
    """Where the analytic model's times are quoted, the plan's best is at least as good, by them,
    as the best of a plan that knows nothing but the analytic model."""
    import autosync

    model, cluster = load_model_spec(MODEL), load_cluster_spec(CLUSTER)
    auto = autosync.plan(model, cluster, top=2)
    assert auto.predictor.startswith("analytic")
    alone = autosync.plan(model, cluster, top=2, warm_start="none")
    assert auto.best.predicted_s <= alone.best.predicted_s * (1 + 1e-6)


@pytest.mark.integration   # builds a Keras model
def test_a_plan_for_a_trainable_model_keeps_out_what_its_optimizer_makes_the_runtime_refuse():
    """A model whose optimizer clips each variable by its own norm cannot have a variable split
    into shards updated separately: a plan proposes none, projects the builders that split one
    onto one shard (``NAME+pins``) and says why; without clipnorm the same plan splits."""
    import autosync
    from tests.runtime_models import multi_model_def

    def split(plan):
        return {r.origin for r in plan.ranked if any(v.num_shards > 1 for v in r.strategy.variables)}

    free = autosync.plan(multi_model_def("adam", learning_rate=0.01), CLUSTER, top=3)
    builders = split(free) - {"search"}
    assert "search" in split(free) and builders and free.search_note == ""
    clipped = autosync.plan(multi_model_def("adam", learning_rate=0.01, clipnorm=1.0), CLUSTER, top=3)
    named = {r.origin for r in clipped.ranked} | {a for r in clipped.ranked for a in r.aliases}
    assert split(clipped) == set() and {f"{b}+pins" for b in builders} <= named
    assert clipped.search_note.startswith("no variable partitioned: optimizer option clipnorm=1.0 clips each")
    assert clipped.search_note in autosync.planning.format_plan(clipped)


@pytest.mark.integration   # builds a Keras model
def test_a_plan_keeps_a_constrained_variable_whole_on_the_graph_all_reduce_and_so_does_emulated_tuning():
    """The runtime refuses a variable with a constraint (``kernel_constraint=NonNeg()``) anywhere
    but the graph all-reduce (only there does Keras' optimizer apply it). A plan builds the model,
    so it knows them: every strategy it ranks keeps them there, one shard, and its note names
    them; tuning under emulated compute, where no worker builds the model, pins them alike."""
    import autosync
    from autosync.search_limits import search_limits, target_optimizer
    from tests import runtime_models as rm

    constrained = {"hidden/kernel", "out/kernel"}
    plan = autosync.plan(rm.constrained_model_def("adam", learning_rate=0.1), CLUSTER, top=3)
    assert plan.ranked and "graph all-reduce" in plan.search_note
    assert all(n in plan.search_note for n in constrained)
    for ranked in plan.ranked:
        for v in ranked.strategy.variables:
            if v.name in constrained:
                (sync,) = v.synchronizers
                assert isinstance(sync, AllReduce) and sync.backend == "graph" and not sync.hierarchical, \
                    (ranked.origin, v)
    config = target_optimizer(rm.constrained_model_def("sgd", learning_rate=0.1), "emulated", runner=None)
    assert config["constrained_variables"] == {"hidden/kernel": "NonNeg", "out/kernel": "MaxNorm"}
    assert {r.match for r in search_limits(config).constraints.rules if r.backend == "graph"} == constrained
