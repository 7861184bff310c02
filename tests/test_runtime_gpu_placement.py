"""On a Ray node with GPUs, each worker computing for real gets a GPU of its own and every other
actor (parameter servers, emulated workers) sees none; a node with fewer GPUs than its workers
ask for is refused before any actor starts. Ray's GPUs here are logical (this machine has none):
Ray assigns them and sets ``CUDA_VISIBLE_DEVICES`` as on a GPU node, and TensorFlow, finding no
such device, computes on the CPU.

The cluster runs in a subprocess: this test session already has its own Ray.
"""
from __future__ import annotations

import os

import pytest

from strategy_space import ClusterSpec, NodeSpec
from autosync.runtime.binding import ClusterBinding
from tests.runtime_helpers import run_cluster_script

SCRIPT = r'''
import dataclasses, functools, json, os
import ray
from ray.cluster_utils import Cluster

from tests import runtime_models as rm
from strategy_space import ClusterSpec, NodeSpec, ConfigError
from autosync.api import make_runner
from autosync.runtime.binding import ClusterBinding
from autosync.runtime.runner import RayRunner

cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
cluster.add_node(num_cpus=2, num_gpus=2, resources={"g0": 1})
ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
cluster.wait_for_nodes()
ray.cloudpickle.register_pickle_by_value(rm)
out = {}
try:
    ClusterBinding.bind(ClusterSpec(name="big", nodes=(NodeSpec(name="g", cpus=2, gpus=4, workers=4, resource="g0"),)))
except ConfigError as e:
    out["too_many"] = str(e)
spec = ClusterSpec(name="gpu", nodes=(NodeSpec(name="g", cpus=2, gpus=2, workers=2, resource="g0", chief=True),))
visible = lambda actor: ray.get(actor.__ray_call__.remote(lambda self: os.environ.get("CUDA_VISIBLE_DEVICES")), timeout=60)
runner = RayRunner(rm.model_def("sgd", learning_rate=0.1), spec, warmup=1, steps=2, trial_timeout_s=240)
trials = runner.run(["ps", "all_reduce"])
out["trials"] = [[t.origin, t.status, t.error] for t in trials]
out["workers"] = {slot: visible(a) for slot, a in runner.pool.actors.items()}
out["ps"] = [visible(a) for actors in runner.pool.ps.idle.values() for a in actors]
runner.close()
emulated = make_runner(runner.model, spec, compute="emulated", step_time_s=0.01, steps=2, warmup=1)
trial = emulated.run(["all_reduce"])[0]
out["emulated"] = [trial.status, trial.error, {s: visible(a) for s, a in emulated.pool.actors.items()}]
emulated.close()
def marked_model(path):   # where each build of the model ran: process, visible GPUs, actor (None: a task)
    with open(path, "a") as f:
        f.write(json.dumps([os.getpid(), os.environ.get("CUDA_VISIBLE_DEVICES"),
                            ray.get_runtime_context().get_actor_id()]) + "\n")
    return rm.build_model()
marks = os.path.join(os.environ["MARKS_DIR"], "marks.jsonl")
md = dataclasses.replace(rm.model_def("sgd", learning_rate=0.1), model_fn=functools.partial(marked_model, marks))
profiled = make_runner(md, spec, profile=True, steps=2, warmup=1)
out["profile"] = [profiled.given_spec.profile is not None, profiled.run(["ps"])[0].status]
profiled.close()
out["builds"] = [json.loads(line) for line in open(marks)]
out["driver_pid"] = os.getpid()
def failing():
    raise ValueError("no such layer")
try:
    make_runner(dataclasses.replace(md, model_fn=failing), spec, profile=True)
except ConfigError as e:   # the user's error, said as the profile in the driver says it
    out["bad"] = [type(e).__name__, str(e)]
big = ClusterSpec(name="big", nodes=(NodeSpec(name="g", cpus=2, gpus=4, workers=4, resource="g0", chief=True),))
emulated = make_runner(runner.model, big, compute="emulated", step_time_s=0.01, steps=2, warmup=1)
trial = emulated.run(["ps"])[0]   # emulated workers take no GPU: a spec with more GPUs than Ray's binds
out["emulated_more_gpus"] = [trial.status, trial.error]
emulated.close()
ray.shutdown()
cluster.shutdown()
print("RESULT " + json.dumps(out))
'''


@pytest.mark.integration
def test_each_real_worker_takes_a_gpu_and_nothing_else_sees_one(tmp_path, monkeypatch):
    monkeypatch.setenv("MARKS_DIR", str(tmp_path))
    out = run_cluster_script(tmp_path, SCRIPT)
    assert "requested 4 GPUs" in out["too_many"] and "available 2" in out["too_many"], out["too_many"]
    assert [t[:2] for t in out["trials"]] == [["ps", "ok"], ["all_reduce", "ok"]], out["trials"]
    assert sorted(out["workers"].values()) == ["0", "1"], out["workers"]   # one GPU each, not shared
    assert out["ps"] and set(out["ps"]) == {""}, out["ps"]                  # parameter servers: none
    status, error, emulated = out["emulated"]
    assert status == "ok", error
    assert set(emulated.values()) == {""}, emulated                         # synthetic gradients: none
    assert out["emulated_more_gpus"] == ["ok", ""], out["emulated_more_gpus"]
    # tune's profile ran in a task of its own on the first worker's GPU, not in the driver
    assert out["profile"] == [True, "ok"], out["profile"]
    tasks = [b for b in out["builds"] if b[2] is None and b[0] != out["driver_pid"]]
    kind, said = out["bad"]
    assert kind == "ConfigError" and "no such layer" in said and "RayTaskError" not in said, said
    assert [b[1] for b in tasks] == ["0"] and not [b for b in out["builds"] if b[0] == out["driver_pid"]], out


def _binding(gpus: int, workers: int) -> ClusterBinding:
    spec = ClusterSpec(name="c", nodes=(NodeSpec(name="g", cpus=4, gpus=gpus, workers=workers, chief=True),
                                        NodeSpec(name="c", cpus=4, workers=2)))
    return ClusterBinding(cluster=spec, keys={"g": "node:g", "c": "node:c"}, node_ids={})


def test_actor_options_give_gpus_to_a_nodes_first_workers_and_hide_them_from_the_rest():
    b = _binding(gpus=2, workers=3)
    assert [b.slot_gpus(f"g:{i}") for i in range(3)] == [1, 1, 0]
    assert [b.slot_gpus(f"c:{i}") for i in range(2)] == [0, 0]
    assert b.actor_options("g", 1.0, 1) == {"num_cpus": 1.0, "num_gpus": 1, "resources": {"node:g": 0.001}}
    hidden = {"runtime_env": {"env_vars": {"CUDA_VISIBLE_DEVICES": ""}}}
    assert b.actor_options("g") == {"num_cpus": 0.0, "resources": {"node:g": 0.001}, **hidden}
    assert b.actor_options("c", 2.0) == {"num_cpus": 2.0, "resources": {"node:c": 0.001}}   # no GPUs: as before


@pytest.mark.parametrize("driver", ["command line", "api"])
@pytest.mark.parametrize("given, kept", [(None, "true"), ("false", "false")])
def test_a_driver_lets_tensorflow_grow_its_gpu_memory_unless_told(monkeypatch, capsys, given, kept, driver):
    from autosync.cli import main

    monkeypatch.setenv("TF_FORCE_GPU_ALLOW_GROWTH", given or "")   # (restored after the test, whatever main sets)
    if given is None:
        monkeypatch.delenv("TF_FORCE_GPU_ALLOW_GROWTH")
    if driver == "command line":
        assert main(["builders"]) == 0
    else:   # the API's driver starts up, then refuses the model before Ray starts
        import autosync

        with pytest.raises(autosync.ConfigError, match="unknown"):
            autosync.make_trainer("zoo:no_such_model", "ps", "local")
    assert os.environ["TF_FORCE_GPU_ALLOW_GROWTH"] == kept
