"""On a real multi-node Ray cluster (ray.cluster_utils.Cluster), PS shard actors and workers run
on the nodes the strategy names, missing nodes or CPUs fail early with a clear ConfigError, a
node that leaves fails the trials that need it at once, and an elastic ``fit`` goes on without it,
keeping the global batch, and takes its replacement back: the weights of the uninterrupted run.

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
md = rm.model_def("adam", learning_rate=0.01)
runner = RayRunner(md, spec, warmup=1, steps=2, trial_timeout_s=180)
strategy = get_builder("partitioned_ps", min_partition_bytes=1).build(runner.model, spec)
trial = runner.run([strategy])[0]
out["status"], out["error"] = trial.status, trial.error
out["placement"] = trial.meta.get("placement")
out["node_ids"] = runner.binding.node_ids
out["calls"] = trial.meta.get("ray_calls_per_step_per_worker")
out["lost_before"] = runner.lost_nodes()
out["answering_before"] = runner.binding.answering(["n0", "n1"])   # every raylet accepts a connection
# an elastic fit on the runner's warm workers: node n1 goes after step 5, the fit goes on on n0 alone
# from the checkpoint of step 3, its PS shards moved there
import tempfile
import numpy as np
from autosync.runtime.trainer import Trainer
# then a node with n1's label joins (an autoscaler's replacement) after step 7: at the checkpoint of
# step 9 the fit takes it back, under the strategy it was given, on 2 workers again
changes = []
def leave_and_come_back(step, logs):
    if step == 4 and not changes:
        cluster.remove_node(node1)
        changes.append(("removed", step))
    if step == 6 and len(changes) == 1:
        cluster.add_node(num_cpus=1, resources={"host1": 1})
        cluster.wait_for_nodes()
        changes.append(("added", step))
with Trainer(md, strategy, spec, timeout_s=180, pool=runner.pool, keep_global_batch=True) as trainer:
    history = trainer.fit(11, callbacks=[leave_and_come_back], steps_per_call=1, checkpoint_every=3,
                          checkpoint_dir=tempfile.mkdtemp(), max_failures=1, elastic=True)
    out["restarts"] = history.restarts
    out["losses"] = len(history.loss)
    out["after"] = [trainer.cluster.node_names, trainer.strategy.fingerprint == strategy.fingerprint, trainer.step]
    weights = trainer.get_weights()
def diff(expected):
    return max(float(np.abs(a - b).max() / (np.abs(b).max() + 1e-12)) for a, b in zip(weights, expected))
out["elastic_diff"] = diff(rm.reference_weights(md, 2, 11))   # what an uninterrupted run would hold
out["shrunk_diff"] = diff(rm.reference_weights(md, 2, 3, then=((1, 6), (2, 2))))   # the global batch not kept
import time
t0 = time.monotonic()
while not runner.lost_nodes() and time.monotonic() - t0 < 120:
    time.sleep(0.5)
out["lost"] = runner.lost_nodes()
out["answering_after"] = [runner.binding.answering(["n0"]), runner.binding.answering(["n0", "n1"])]
t0 = time.monotonic()
again = runner.run([strategy])[0]
out["after_loss"] = [again.status, again.error, time.monotonic() - t0]
runner.close()
ray.shutdown()
cluster.shutdown()
print("RESULT " + json.dumps(out))
'''


def test_ps_shards_and_workers_are_placed_on_their_nodes_and_an_elastic_fit_goes_on_without_one(tmp_path):
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
    # elastic: the node's loss is one failure, recovered from on the node left (the optimizer state
    # re-cut for the shards moved there), which draws both workers' batches (the global batch kept);
    # its replacement is taken back at the next checkpoint after it joined: the weights are those of
    # the uninterrupted run, one process on 2 workers' batches for 11 steps
    restart, back = out["restarts"]
    assert restart["failed_at"] == 5 and restart["resumed_from"] == 3, restart
    assert restart["without"] == ["n1"] and restart["workers"] == 1 and restart["seconds"] > 0, restart
    assert restart["parts"] == [[0, 1]] and "parts" not in back, restart
    assert "died (its node left the Ray cluster" in restart["error"], restart
    assert back["back"] == ["n1"] and back["resumed_from"] == 9 and back["workers"] == 2, back
    assert out["after"] == [["n0", "n1"], True, 11] and out["losses"] == 11
    assert out["elastic_diff"] < 1e-5 < out["shrunk_diff"], out
    assert out["lost_before"] == [] and out["lost"] == ["n1"]
    assert out["answering_before"] is True and out["answering_after"] == [True, False]
    status, error, seconds = out["after_loss"]
    assert status == "failed" and error.startswith("not run: node(s) n1 left the Ray cluster"), error
    assert seconds < 30
