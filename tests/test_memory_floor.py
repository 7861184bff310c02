"""Memory admission (``strategy_space.memory``): what a strategy must hold on each node, the nodes'
memory in the ClusterSpec, and every path that refuses or never proposes a strategy that cannot fit:
``validate``, the search, ``plan``, the runner (before its workers load), the command line."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from autosync.cli import main
from autosync.ray_cluster import describe_nodes
from autosync.host_memory import machine_memory_gib
from autosync.sources import local_cluster
from strategy_space import (PS, AllReduce, ClusterSpec, ModelSpec, NodeSpec, Strategy, StrategyError, VarConfig,
                            VariableSpec, dumps, load_cluster_spec, save, validate)
from strategy_space.builders import BUILDERS, get_builder
from strategy_space.errors import ConfigError
from strategy_space.memory import _SHARDS, GIB, fits_encoded, memory_floor, memory_problems
from strategy_space.space import StrategySpace
from tuner.records.history import History
from tuner.search.model_based import ModelBasedTuner, SearchSettings
from tuner.search.random_tuner import RandomTuner

MIB = 2**20
# a 2.4 GiB table (rows do not split evenly), a 244 MiB dense kernel, a bias and a scalar
MODEL = ModelSpec("big", (VariableSpec("emb", (10_000_003, 64), sparse=True), VariableSpec("w", (6400, 10007)),
                          VariableSpec("b", (1000,)), VariableSpec("s", ())))
DENSE = MODEL.var("w").bytes + MODEL.var("b").bytes + MODEL.var("s").bytes


def _cluster(memory=None, gpu_memory=None, gpus=0, workers=(1, 1, 1), compute="real") -> ClusterSpec:
    return ClusterSpec("c", tuple(NodeSpec(f"n{i}", workers=w, gpus=gpus, memory_gib=memory, gpu_memory_gib=gpu_memory,
                                           bandwidth_gbps=1.0) for i, w in enumerate(workers)), compute=compute)


def _strategy(emb_nodes=("n0",), w=None) -> Strategy:
    """emb partitioned over ``emb_nodes`` on parameter servers; w all-reduced with compressor ``w``
    (None: on a PS of n1); b and s all-reduced."""
    wsync = PS("n1") if w is None else AllReduce(compressor=w)
    return Strategy((VarConfig("emb", tuple(PS(n) for n in emb_nodes)), VarConfig("w", (wsync,)),
                     VarConfig("b", (AllReduce(),)), VarConfig("s", (AllReduce(),))))


def test_the_floor_counts_each_workers_model_the_object_store_the_driver_and_each_nodes_shards():
    emb = MODEL.var("emb")
    floors = {f.node: dict(f.host) for f in memory_floor(_strategy(("n0", "n2")), MODEL, _cluster(workers=(2, 1, 0)))}
    per_worker = MODEL.total_bytes + DENSE
    first_half = 5_000_002 * emb.row_bytes   # 10,000,003 rows in two: the first shard one row longer
    assert floors["n0"] == {"2 workers' model and gradients": 2 * per_worker,
                            "the object store's copy of the initial values": MODEL.total_bytes,
                            "the driver's copy of the model": MODEL.total_bytes,
                            _SHARDS: first_half}
    assert floors["n1"] == {"1 worker's model and gradients": per_worker,
                            "the object store's copy of the initial values": MODEL.total_bytes,
                            _SHARDS: MODEL.var("w").bytes}
    assert floors["n2"] == {_SHARDS: emb.bytes - first_half}   # no workers: its shard only


def test_the_optimizers_slots_count_on_each_shard_and_on_each_worker_for_what_it_all_reduces():
    adam = dataclasses.replace(MODEL, optimizer_slots=2)
    plain = {f.node: dict(f.host) for f in memory_floor(_strategy(("n0",), w="fp16_ef"), MODEL, _cluster())}
    slots = {f.node: dict(f.host) for f in memory_floor(_strategy(("n0",), w="fp16_ef"), adam, _cluster())}
    assert slots["n0"][_SHARDS] == 3 * plain["n0"][_SHARDS] == 3 * MODEL.var("emb").bytes
    ar = MODEL.var("w").bytes + MODEL.var("b").bytes + MODEL.var("s").bytes
    worker = "1 worker's model and gradients"
    assert slots["n1"][worker] - plain["n1"][worker] == 2 * ar   # w's residual was counted already
    assert ModelSpec.from_dict(adam.to_dict()) == adam and "optimizer_slots" not in MODEL.to_dict()
    assert adam.fingerprint == MODEL.fingerprint   # a step moves the same bytes
    emulated = _cluster(compute="emulated")   # its updates run the emulated optimizer, not the model's
    assert memory_floor(_strategy(), adam, emulated) == memory_floor(_strategy(), MODEL, emulated)
    for bad in (-1, 17, 1.5, True):
        with pytest.raises(ConfigError, match="optimizer_slots must be an integer from 0 to 16"):
            dataclasses.replace(MODEL, optimizer_slots=bad)


def test_error_feedback_residuals_gpus_replicas_and_emulated_compute():
    ef = memory_floor(_strategy(w="fp16_ef"), MODEL, _cluster())
    plain = memory_floor(_strategy(w="fp16"), MODEL, _cluster())
    assert ef[1].host_bytes - plain[1].host_bytes == MODEL.var("w").bytes   # the residual each worker keeps
    gpu = memory_floor(_strategy(w="fp16_ef"), MODEL, _cluster(gpus=2, workers=(3, 1, 1)))
    # 3 workers on 2 GPUs: one GPU runs two; the host keeps the object store's, the driver's and shards
    assert (gpu[0].gpu_workers, gpu[0].gpu_bytes) == (2, 2 * (MODEL.total_bytes + DENSE + MODEL.var("w").bytes))
    assert "3 workers' model and gradients" not in dict(gpu[0].host)
    only = dataclasses.replace(_strategy(), replicas=("n0:0",))
    assert [f.host_bytes > 0 for f in memory_floor(only, MODEL, _cluster())] == [True, True, False]
    assert dict(memory_floor(only, MODEL, _cluster())[1].host) == {_SHARDS: MODEL.var("w").bytes}
    emulated = memory_floor(_strategy(), MODEL, _cluster(compute="emulated"))
    assert dict(emulated[1].host) == {"1 worker's model and gradients": DENSE,   # a synthetic dense gradient alone
                                      _SHARDS: MODEL.var("w").bytes}


def test_validate_refuses_a_strategy_that_cannot_fit_and_says_what_takes_the_memory_and_what_to_change():
    cluster = _cluster(memory=9.5)
    assert validate(_strategy(("n0", "n1", "n2")), MODEL, cluster)   # the table spread: at most 8.9 GiB a node
    with pytest.raises(StrategyError) as e:
        validate(_strategy(("n0",)), MODEL, cluster)    # the whole table on n0
    text = str(e.value)
    assert "node n0: the strategy needs at least 10.5 GiB of memory there" in text
    assert f"{_SHARDS} 2.38 GiB" in text and "but the node has 9.5 GiB (memory_gib)" in text
    assert "partition the large variables across nodes" in text and "node n1" not in text
    # where the workers' copies alone do not fit, no placement helps: said so
    with pytest.raises(StrategyError, match="node n1: .* run fewer workers on it"):
        validate(_strategy(("n0", "n1", "n2")), MODEL, _cluster(memory=4.0))
    with pytest.raises(StrategyError, match=r"node n0: each GPU holds at least 2.86 GiB \(1 worker on it: .*has 2.5 GiB"):
        validate(_strategy(("n0", "n1", "n2")), MODEL, _cluster(gpus=1, gpu_memory=2.5))
    assert validate(_strategy(("n0",)), MODEL, _cluster())   # a cluster that gives no memory is not checked


@pytest.mark.parametrize("memory, gpus, gpu_memory, workers, compute, slots", [
    (8.5, 0, None, (1, 1, 1), "real", 0), (9.5, 0, None, (1, 1, 1), "real", 0),
    (2.0, 0, None, (3, 2, 2), "emulated", 0), (7.0, 2, 6.0, (1, 2, 3), "real", 0), (None, 1, 3.0, (1, 1, 1), "real", 0),
    (12.0, 0, None, (1, 1, 1), "real", 2), (None, 1, 3.4, (1, 1, 1), "real", 1),
    (2.0, 0, None, (3, 2, 2), "emulated", 2)])
def test_the_searchs_vectorized_check_judges_as_memory_problems(memory, gpus, gpu_memory, workers, compute, slots):
    cluster = _cluster(memory=memory, gpu_memory=gpu_memory, gpus=gpus, workers=workers, compute=compute)
    model = dataclasses.replace(MODEL, optimizer_slots=slots)
    space = StrategySpace(model, cluster)
    e = space.sample_encoded(np.random.default_rng(3), 300)
    fits = fits_encoded(e, model, cluster)
    assert fits.tolist() == [not memory_problems(space.decode(e, i), model, cluster) for i in range(len(e))]
    assert 0 < fits.sum() < len(fits)   # both kinds drawn: the comparison tells something


def test_the_search_never_proposes_a_strategy_that_cannot_fit():
    cluster = _cluster(memory=8.9)
    proposed = []
    for seed in range(3):
        tuner = ModelBasedTuner(MODEL, cluster, lossless=True, settings=SearchSettings(batch=8, seed=seed))
        proposed += [p.strategy for p in tuner.next_batch(8, History(MODEL, cluster))]
    assert len(proposed) >= 12 and all(validate(s, MODEL, cluster) for s in proposed)
    unchecked = []   # the same search where memory is not given proposes some that would not fit
    for seed in range(3):
        tuner = ModelBasedTuner(MODEL, _cluster(), lossless=True, settings=SearchSettings(batch=8, seed=seed))
        unchecked += [p.strategy for p in tuner.next_batch(8, History(MODEL, _cluster()))]
    assert any(memory_problems(s, MODEL, cluster) for s in unchecked)
    drawn = RandomTuner(MODEL, cluster, seed=0).next_batch(40, History(MODEL, cluster))
    assert len(drawn) == 40 and all(validate(p.strategy, MODEL, cluster) for p in drawn)


def test_a_plan_leaves_out_the_baselines_that_cannot_fit_and_says_why():
    import autosync
    from autosync.planning import format_plan

    cluster = _cluster(memory=9.0)
    p = autosync.plan(MODEL, cluster, top=3, scorer="analytic", warm_start="none")
    unfit = dict(p.unfit)
    assert {"ps", "ps_lb"} <= set(unfit) and all(validate(r.strategy, MODEL, cluster) for r in p.ranked)
    assert not {r.origin for r in p.ranked} & set(unfit)
    assert "node n0: the strategy needs at least" in unfit["ps"][0]
    assert "does not fit, left out: ps" in format_plan(p) and "fullest node" in format_plan(p)
    for r in p.ranked:   # what the fullest node holds at least, beside each strategy's times
        assert r.memory_bytes == max(f.host_bytes for f in memory_floor(r.strategy, MODEL, cluster)) <= 9 * GIB
        assert r.to_dict()["memory_bytes"] == r.memory_bytes
    assert p.to_dict()["unfit"][0]["problems"]
    with pytest.raises(ConfigError, match="no strategy of model big fits the memory of cluster c"):
        autosync.plan(MODEL, _cluster(memory=3.0), top=2, scorer="analytic", warm_start="none")


def test_node_memory_is_checked_written_and_kept_out_of_the_fingerprint():
    node = NodeSpec("a", gpus=1, memory_gib=64, gpu_memory_gib=80)
    assert NodeSpec.from_dict(node.to_dict()) == node
    assert "memory_gib" not in NodeSpec("a").to_dict()
    plain, given = ClusterSpec("c", (NodeSpec("a"),)), ClusterSpec("c", (NodeSpec("a", memory_gib=64),))
    assert plain.fingerprint == given.fingerprint   # trials measured before stay in their group
    for bad in (0, -1, float("nan"), float("inf"), 2.0**21, True, "64"):
        with pytest.raises(ConfigError, match="memory_gib must be a number of GiB > 0"):
            NodeSpec("a", memory_gib=bad)
    assert not memory_problems(_strategy(), MODEL, _cluster(gpu_memory=0.001))   # no GPUs: nothing held there
    with pytest.raises(ConfigError, match=r"node a.memory_gib: expected int or float or NoneType, got str"):
        NodeSpec.from_dict({"name": "a", "memory_gib": "64G"})


def test_local_and_ray_clusters_give_the_memory_they_know(tmp_path):
    total = machine_memory_gib()
    assert total is not None and local_cluster().nodes[0].memory_gib == total
    # a container's limit where it is lower; "max" (none), garbage and a missing file are no limit
    for name, text in (("v2", "max\n"), ("bad", "lots"), ("v1", "9223372036854771712\n"), ("low", f"{2**31}\n")):
        (tmp_path / name).write_text(text)
    assert machine_memory_gib([str(tmp_path / n) for n in ("v2", "bad", "v1", "missing")]) == machine_memory_gib(())
    assert machine_memory_gib([str(tmp_path / "v2"), str(tmp_path / "low")]) == 2.0
    nodes = [{"Alive": True, "NodeManagerAddress": "10.0.0.1", "NodeID": "a" * 32,
              "Resources": {"CPU": 4.0, "memory": 6 * GIB, "object_store_memory": 2 * GIB, "node:__internal_head__": 1}},
             {"Alive": True, "NodeManagerAddress": "10.0.0.2", "NodeID": "b" * 32, "Resources": {"CPU": 4.0}}]
    assert [n.memory_gib for n in describe_nodes(nodes).nodes] == [8.0, None]


def test_validate_at_the_command_line_says_the_memory_problem_with_exit_2(tmp_path, capsys):
    cluster = _cluster(memory=9.5)
    (tmp_path / "c.yaml").write_text(dumps(cluster))
    (tmp_path / "m.yaml").write_text(dumps(MODEL))
    save(_strategy(("n0",)), tmp_path / "s.yaml")
    assert main(["validate", str(tmp_path / "s.yaml"), "--model", str(tmp_path / "m.yaml"),
                 "--cluster", str(tmp_path / "c.yaml")]) == 2
    err = capsys.readouterr().err
    assert "node n0: the strategy needs at least 10.5 GiB" in err and "Traceback" not in err
    assert load_cluster_spec(str(tmp_path / "c.yaml")).nodes[0].memory_gib == 9.5


def test_every_builder_fits_where_memory_is_plenty():
    cluster = _cluster(memory=1024.0)
    assert all(not memory_problems(get_builder(b).build(MODEL, cluster), MODEL, cluster) for b in BUILDERS)


def test_tuning_records_the_baselines_that_cannot_fit_and_searches_among_those_that_can(tmp_path):
    """The runner refuses what cannot fit (a failed trial saying why), the run goes on, and every
    searched strategy fits."""
    import autosync
    from tuner.synthetic.runner import SyntheticRunner

    cluster = _cluster(memory=8.9)
    result = autosync.tune("unused", cluster, trials=6, store=tmp_path / "t.db", warm_start="none", quality="step",
                           settings=SearchSettings(batch=3, candidates=64, chains=12, anneal_steps=8),
                           runner=SyntheticRunner(MODEL, cluster, seed=1))
    failed = {name: t.error for name, t in result.baselines.items() if not t.ok}
    assert "ps" in failed and "node n0: the strategy needs at least" in failed["ps"]
    # refused before it ran, so not run a second time as a failure that may pass would be
    assert sum(t.origin == "ps" for t in result.outcome.trials) == 1 and not result.baselines["ps"].worth_another_run
    searched = [t for t in result.outcome.trials if t.origin in ("search", "explore")]
    assert searched and all(t.ok for t in searched)
    assert not memory_problems(result.best_strategy, MODEL, cluster)


@pytest.mark.integration
def test_a_real_trial_that_cannot_fit_fails_before_any_worker_loads_and_one_that_fits_runs(ray_session):
    from autosync.runtime.runner import RayRunner
    from autosync.sources import load_model_def, load_model_spec

    spec = load_model_spec("zoo:ncf")
    assert spec.optimizer_slots == 2   # its Adam's m and v, counted on a copy of the optimizer
    ps, ar = (get_builder(b).build(spec, local_cluster()) for b in ("ps", "all_reduce"))
    floor = lambda s: memory_floor(s, spec, local_cluster())[0].host_bytes   # noqa: E731
    # the parameter server's values and slots of every variable, against each worker's slots of them
    assert floor(ps) - floor(ar) == (1 + 2 - 2 * 2) * spec.total_bytes
    node = dataclasses.replace(local_cluster().nodes[0], memory_gib=(floor(ps) + floor(ar)) / 2 / GIB)
    cluster = dataclasses.replace(local_cluster(), nodes=(node,))
    runner = RayRunner(load_model_def("zoo:ncf"), cluster, model_spec=spec, warmup=1, steps=2, trial_timeout_s=120)
    try:
        refused = runner.run([ar])[0]
        assert refused.status == "failed" and "node node0: the strategy needs at least" in refused.error
        assert "2 workers' model and gradients" in refused.error and not runner.loaded   # no worker started for it
        assert not refused.worth_another_run   # a tuning run does not try it again
        assert runner.run([ps])[0].ok
    finally:
        runner.close()


def test_show_gives_each_nodes_memory_floor_beside_its_memory(tmp_path, capsys):
    cluster = ClusterSpec("c", (NodeSpec("n0", workers=1, memory_gib=64), NodeSpec("n1", gpus=2, workers=2),
                                NodeSpec("n2", workers=1)))
    (tmp_path / "c.yaml").write_text(dumps(cluster))
    (tmp_path / "m.yaml").write_text(dumps(MODEL))
    save(_strategy(("n0", "n1", "n2")), tmp_path / "s.yaml")
    assert main(["show", str(tmp_path / "s.yaml"), "--model", str(tmp_path / "m.yaml"),
                 "--cluster", str(tmp_path / "c.yaml")]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()
            if line.startswith(("n0 ", "n1 ", "n2 "))}
    floors = {f.node: f for f in memory_floor(_strategy(("n0", "n1", "n2")), MODEL, cluster)}
    assert rows["n0"][1:5] == [f"{floors['n0'].host_bytes / GIB:.1f}", "GiB", "64", "GiB"]
    assert rows["n1"][5:7] == [f"{floors['n1'].gpu_bytes / GIB:.1f}", "GiB"]   # one worker per GPU
    assert rows["n2"][3:5] == ["not", "given"]


@pytest.mark.integration
def test_the_optimizers_full_size_slots_are_counted_on_a_copy_of_it():
    import keras

    from autosync.runtime.optimizer_config import full_size_slots

    class Unbuildable(keras.optimizers.SGD):   # its config does not make it again
        def __init__(self, rate, **kwargs):
            super().__init__(learning_rate=rate, **kwargs)

    class Hoarding(keras.optimizers.SGD):   # keeps 20 arrays of each variable's size
        def build(self, variables):
            super().build(variables)
            self.hoard = [self.add_variable_from_reference(v, f"hoard{i}") for v in variables for i in range(20)]

    counts = {name: full_size_slots(o) for name, o in {
        "sgd": keras.optimizers.SGD(0.1), "momentum": keras.optimizers.SGD(0.1, momentum=0.9),
        "adam": keras.optimizers.Adam(), "amsgrad+ema": keras.optimizers.Adam(amsgrad=True, use_ema=True),
        "rmsprop": keras.optimizers.RMSprop(momentum=0.9, centered=True), "adagrad": keras.optimizers.Adagrad(),
        "accumulated": keras.optimizers.SGD(0.1, gradient_accumulation_steps=4),
        "unbuildable": Unbuildable(0.1), "hoarding": Hoarding(0.1)}.items()}
    assert counts == {"sgd": 0, "momentum": 1, "adam": 2, "amsgrad+ema": 4, "rmsprop": 3, "adagrad": 1,
                      "accumulated": 1, "unbuildable": 0, "hoarding": 16}   # at most ModelSpec's cap: not refused


def test_tuning_where_nothing_fits_says_so_with_the_reasons(tmp_path):
    import autosync
    from tuner.synthetic.runner import SyntheticRunner

    cluster = _cluster(memory=3.0)
    with pytest.raises(ConfigError) as e:
        autosync.tune("unused", cluster, trials=3, store=tmp_path / "t.db", warm_start="none", quality="step",
                      runner=SyntheticRunner(MODEL, cluster, seed=1))
    text = str(e.value)
    assert "every baseline failed" in text and "each was refused before it ran: fix what it says" in text
    assert "the node has 3 GiB (memory_gib); run fewer workers on it" in text and "Check that the model" not in text


def test_nodes_sharing_one_machine_must_fit_it_together():
    """The testbed's hosts are network namespaces of one machine: each node's floor may fit while
    their sum does not."""
    from autosync.testbed import state
    from autosync.testbed.config import TestbedConfig

    shared = dataclasses.replace(_cluster(), shared_memory_gib=20.0)
    spread = _strategy(("n0", "n1", "n2"))
    total = sum(f.host_bytes for f in memory_floor(spread, MODEL, shared))
    assert 20 * GIB < total < 22 * GIB
    [problem] = memory_problems(spread, MODEL, shared)
    assert problem.startswith("the cluster's nodes share one machine of 20 GiB (shared_memory_gib) and the strategy "
                              "needs at least 21.7 GiB on them together (n0 8.9 GiB, n1 6.52 GiB, n2 6.28 GiB)")
    assert not memory_problems(spread, MODEL, dataclasses.replace(shared, shared_memory_gib=22.0))
    space = StrategySpace(MODEL, shared)
    e = space.sample_encoded(np.random.default_rng(5), 300)
    fits = fits_encoded(e, MODEL, shared)
    assert fits.tolist() == [not memory_problems(space.decode(e, i), MODEL, shared) for i in range(len(e))]
    assert 0 < fits.sum() < len(fits)
    assert ClusterSpec.from_dict(shared.to_dict()) == shared and shared.fingerprint == _cluster().fingerprint
    with pytest.raises(ConfigError, match="shared_memory_gib must be a number of GiB > 0"):
        dataclasses.replace(shared, shared_memory_gib=-1)
    testbed = state.cluster_spec(TestbedConfig(nodes=3, bandwidth="200mbit", cpus_per_node=1))
    assert testbed.shared_memory_gib == machine_memory_gib() and all(n.memory_gib is None for n in testbed.nodes)


@pytest.mark.integration
def test_without_a_given_spec_the_workers_optimizer_slots_are_counted(ray_session):
    """The runner without a spec (``make_runner(profile=False)``) and the Trainer check a strategy
    against the spec the workers describe: their optimizer's slots count there too."""
    from autosync.runtime.runner import RayRunner
    from autosync.runtime.trainer import Trainer
    from autosync.sources import load_model_def, load_model_spec

    spec = load_model_spec("zoo:ncf")   # Adam: 2 slots
    ps = get_builder("ps").build(spec, local_cluster())
    without = memory_floor(ps, dataclasses.replace(spec, optimizer_slots=0), local_cluster())[0].host_bytes
    # room for the strategy's values, not for the parameter server's m and v of every variable
    node = dataclasses.replace(local_cluster().nodes[0], memory_gib=(without + spec.total_bytes) / GIB)
    cluster = dataclasses.replace(local_cluster(), nodes=(node,))
    runner = RayRunner(load_model_def("zoo:ncf"), cluster, warmup=1, steps=2, trial_timeout_s=120)
    try:
        assert runner.model.optimizer_slots == 2
        refused = runner.run([ps])[0]
        assert refused.status == "failed" and "node node0: the strategy needs at least" in refused.error
        assert _SHARDS in refused.error
    finally:
        runner.close()
    with pytest.raises(ConfigError, match=r"node node0: the strategy needs at least .*parameter-server shards"):
        Trainer(load_model_def("zoo:ncf"), ps, cluster, timeout_s=120)
