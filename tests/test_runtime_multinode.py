"""On a real multi-node Ray cluster (ray.cluster_utils.Cluster), PS shard actors and workers run
on the nodes the strategy names, missing nodes or CPUs fail early with a clear ConfigError, and a
node that leaves fails the trials that need it at once.

The cluster runs in a subprocess: this test session already has its own Ray, and a process may
hold only one.
"""
from __future__ import annotations

import pytest

from tests.runtime_helpers import run_cluster_script

pytestmark = pytest.mark.integration

SCRIPT = r'''
import json, os, sys
import ray
from ray.cluster_utils import Cluster

from tests import runtime_models as rm
from strategy_space import ClusterSpec, NodeSpec, ConfigError
from strategy_space.builders import get_builder
from autosync.runtime.binding import ClusterBinding
from autosync.runtime.runner import RayRunner

cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
cluster.add_node(num_cpus=1, resources={"host0": 1})
node1 = cluster.add_node(num_cpus=1, resources={"host1": 1})
ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
cluster.wait_for_nodes()
ray.cloudpickle.register_pickle_by_value(rm)
out = {}
spec = ClusterSpec(name="two", nodes=(
    NodeSpec(name="n0", cpus=1, workers=1, resource="host0", chief=True),
    NodeSpec(name="n1", cpus=1, workers=1, resource="host1")))
for name, bad in {
    "missing": ClusterSpec(name="bad", nodes=(NodeSpec(name="n9", cpus=1, resource="host9"),)),
    "cpus": ClusterSpec(name="big", nodes=(NodeSpec(name="n0", cpus=4, workers=2, resource="host0"),)),
}.items():
    try:
        ClusterBinding.bind(bad)
        out[name] = None
    except ConfigError as e:
        out[name] = str(e)
runner = RayRunner(rm.model_def("sgd", learning_rate=0.1), spec, warmup=1, steps=2, trial_timeout_s=180)
strategy = get_builder("partitioned_ps", min_partition_bytes=1).build(runner.model, spec)
trial = runner.run([strategy])[0]
out["status"], out["error"] = trial.status, trial.error
out["placement"] = trial.meta.get("placement")
out["node_ids"] = runner.binding.node_ids
out["calls"] = trial.meta.get("ray_calls_per_step_per_worker")
out["lost_before"] = runner.lost_nodes()
cluster.remove_node(node1)   # the node goes: a trial that needs it fails at once, naming it
import time
t0 = time.monotonic()
while not runner.lost_nodes() and time.monotonic() - t0 < 120:
    time.sleep(0.5)
out["lost"] = runner.lost_nodes()
t0 = time.monotonic()
again = runner.run([strategy])[0]
out["after_loss"] = [again.status, again.error, time.monotonic() - t0]
runner.close()
ray.shutdown()
cluster.shutdown()
print("RESULT " + json.dumps(out))
'''


def test_ps_shards_and_workers_are_placed_on_their_nodes(tmp_path):
    out = run_cluster_script(tmp_path, SCRIPT)

    assert "requested Ray resource 'host9'" in out["missing"] and "fix by" in out["missing"]
    assert "requested 4 CPUs" in out["cpus"] and "available 1" in out["cpus"]

    assert out["status"] == "ok", out["error"]
    ids = out["node_ids"]
    assert ids["n0"] != ids["n1"]
    ps = {p["name"]: p["node_id"] for p in out["placement"]["ps"]}
    assert ps == {"ps@n0": ids["n0"], "ps@n1": ids["n1"]}
    assert [w["node_id"] for w in out["placement"]["workers"]] == [ids["n0"], ids["n1"]]
    assert out["calls"] == 4  # one push + one pull to each of the two PS actors
    # a node that leaves: Ray reports it dead, the runner says which, and a trial needing it fails
    # at once with that reason instead of waiting out the trial limit (180 s here)
    assert out["lost_before"] == [] and out["lost"] == ["n1"]
    status, error, seconds = out["after_loss"]
    assert status == "failed" and error.startswith("not run: node(s) n1 left the Ray cluster"), error
    assert seconds < 30
