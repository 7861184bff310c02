"""AutoSync on a real 3-node Ray cluster with shaped links (the emulated testbed; needs root).

One testbed (3 hosts, 1gbit) for the module, always torn down. A driver runs inside host0, as
``autosync testbed exec`` runs one, on ``--cluster testbed``:

* correctness: PS and all-reduce strategies (gloo and the object-store backend) train the tiny
  sparse-embedding model across the three Ray nodes exactly like one process on the global batch;
* bandwidth: for a dense model with an 8.4 MB gradient, the median step time of a PS and an
  all-reduce strategy grows when the links are shaped from 1gbit down to 200mbit, and at 200mbit
  it is at least the time the bytes every worker must receive need on its link.

The driver keeps its workers between phases: it prints one ``RESULT {json}`` line per phase and
waits on stdin while the test reshapes the links from outside the namespaces.
"""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time

import numpy as np
import pytest

from autosync.testbed import Testbed, netns, ray_nodes
from autosync.testbed.config import SWITCH_NS, host_ns
from tests import multinode_models as mm
from tests import runtime_models as rm
from tests.conftest import require_testbed_host

pytestmark = pytest.mark.multinode

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NODES = 3
STEPS = 4
WAIT_FOR_OTHER_TESTBED_S = 240.0
PHASE_TIMEOUT_S = 300.0
# (builder, options) trained for correctness: a PS, an all-reduce on gloo, and Parallax (sparse
# embedding on PS, dense variables all-reduced) on the object-store backend
CORRECTNESS = [
    ("partitioned_ps", {"min_partition_bytes": 1}),
    ("all_reduce", {"backend": "gloo", "chunk_bytes": 64}),
    ("parallax", {"backend": "objectstore"}),
]
# (builder, options) timed at each bandwidth
TIMED = [("partitioned_ps", {}), ("all_reduce", {"backend": "gloo"})]
ROUNDS = ["1gbit", "200mbit", "1gbit", "200mbit"]

DRIVER = r'''
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
import numpy as np
import ray
from tests import multinode_models as mm, runtime_models as rm
ray.cloudpickle.register_pickle_by_value(rm)
ray.cloudpickle.register_pickle_by_value(mm)
from autosync.sources import load_cluster
from autosync.runtime.binding import ClusterBinding
from autosync.runtime.engine import WorkerPool
from autosync.runtime.plan import model_spec_from_vars
from autosync.runtime.runner import RayRunner
from autosync.runtime.trainer import Trainer
from strategy_space.builders import get_builder

cfg = json.loads(sys.argv[2])

def emit(phase, payload):
    print("RESULT " + json.dumps({"phase": phase, **payload}), flush=True)

cluster = load_cluster("testbed")
binding = ClusterBinding.bind(cluster)        # ray.init(address=RAY_ADDRESS): the testbed head
pool = WorkerPool(binding)
ip_of = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}

md = rm.model_def("adam", learning_rate=0.05)
pool.ensure(md, cluster.devices, time.monotonic() + 300)
spec = model_spec_from_vars(md.name, pool.description["variables"], md.batch_size)
trained = {}
for name, options in cfg["correctness"]:
    strategy = get_builder(name, **options).build(spec, cluster)
    with Trainer(md, strategy, cluster, pool=pool, timeout_s=180) as trainer:
        history = trainer.fit(steps=cfg["steps"], steps_per_call=2)
        weights = trainer.get_weights()
        infos = ray.get([w.info.remote() for w in trainer.session.workers])
        plan = trainer.plan
        trained[name] = {
            "weights": [w.tolist() for w in weights],
            "loss": history.loss,
            "worker_ips": [ip_of[i["node_id"]] for i in infos],
            "ps_nodes": sorted({p.node for p in plan.ps_actors}),
            "backends": list(plan.backends),
            "ar_groups": len(plan.ar_groups),
        }
emit("correctness", {"cluster": cluster.to_dict(),
                     "trained": trained})

dense = mm.model_def()
runner = RayRunner(dense, cluster, warmup=cfg["warmup"], steps=cfg["timed_steps"], pool=pool, trial_timeout_s=240)
strategies = {name: get_builder(name, **options).build(runner.model, cluster) for name, options in cfg["timed"]}
bandwidth = cfg["bandwidth"]
while True:
    out = {}
    for name, strategy in strategies.items():
        trial = runner.run_one(strategy, name)
        out[name] = {"status": trial.status, "error": trial.error,
                     "median": trial.median if trial.ok else None,
                     "step_times": list(trial.step_times), "breakdown": trial.breakdown}
    emit("timing", {"bandwidth": bandwidth, "results": out,
                    "gradient_bytes": sum(v.bytes for v in runner.model.variables)})
    line = sys.stdin.readline().split()
    if not line or line[0] != "bandwidth":
        break
    bandwidth = line[1]
pool.kill_all()
ray.shutdown()
'''


def _wait_for_free_namespaces() -> None:
    """Skip, saying why, where the testbed cannot run (fail in CI: ``require_testbed_host``); wait
    while another testbed holds the names."""
    require_testbed_host()
    names = [host_ns(i) for i in range(NODES)] + [SWITCH_NS]
    deadline = time.monotonic() + WAIT_FOR_OTHER_TESTBED_S
    while True:
        taken = [ns for ns in names if netns.namespace_exists(ns)]
        if not taken:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"namespaces {taken} still exist after {WAIT_FOR_OTHER_TESTBED_S:.0f} s: another testbed "
                        f"is up (or a leftover one); tear it down with `autosync testbed down`")
        time.sleep(5)


class Driver:
    """The driver process inside host0, spoken to over its stdin/stdout."""

    def __init__(self, tb: Testbed, script, config: dict, log_path):
        self.log = open(log_path, "w")
        cmd = [sys.executable, str(script), REPO, json.dumps(config)]
        self.proc = subprocess.Popen(ray_nodes.in_namespace(host_ns(0), cmd), env=tb.env(), cwd=REPO,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.log_path = log_path

    def result(self, timeout_s: float = PHASE_TIMEOUT_S) -> dict:
        """The next ``RESULT`` line, parsed."""
        deadline = time.monotonic() + timeout_s
        seen = []
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 5)
            if not ready:
                if self.proc.poll() is not None:
                    break
                continue
            line = self.proc.stdout.readline()
            if not line:
                break
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT "):])
            seen.append(line)
        self.log.flush()
        with open(self.log_path) as f:
            err = f.read()[-4000:]
        pytest.fail(f"no result from the driver in host0 (exit code {self.proc.poll()}); stdout: "
                    f"{''.join(seen)[-2000:]}\nstderr: {err}")

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 3-node testbed at 1gbit and a driver in host0 that trained the correctness strategies;
    yields ``{"tb", "driver", "correctness"}``. The testbed is always torn down and the namespace
    list restored."""
    _wait_for_free_namespaces()
    before = netns.list_namespaces()
    directory = tmp_path_factory.mktemp("testbed")
    tb = Testbed(nodes=NODES, bandwidth="1gbit", cpus_per_node=1, object_store_mb=300, state_dir=directory)
    driver = None
    try:
        t0 = time.monotonic()
        tb.up()
        print(f"\ntestbed up in {time.monotonic() - t0:.1f} s")
        script = directory / "driver.py"
        script.write_text(DRIVER)
        config = {"correctness": CORRECTNESS, "timed": TIMED, "steps": STEPS, "warmup": 2, "timed_steps": 5,
                  "bandwidth": "1gbit"}
        driver = Driver(tb, script, config, directory / "driver.stderr")
        correctness = driver.result()
        assert correctness["phase"] == "correctness"
        yield {"tb": tb, "driver": driver, "correctness": correctness}
    finally:
        if driver is not None:
            driver.close()
        report = tb.down()
        print(f"\ntestbed down in {report.seconds:.1f} s")
        after = netns.list_namespaces()
        assert after == before, f"namespaces after teardown {after} != before {before}"


@pytest.mark.parametrize("builder", [name for name, _ in CORRECTNESS])
def test_strategy_trains_like_one_process_across_three_nodes(run, builder):
    got = run["correctness"]["trained"][builder]
    # the workers really ran on the three hosts, in order
    assert got["worker_ips"] == ["10.77.0.1", "10.77.0.2", "10.77.0.3"]
    md = rm.model_def("adam", learning_rate=0.05)
    expected = rm.reference_weights(md, num_workers=NODES, steps=STEPS)
    weights = [np.asarray(w, dtype=e.dtype) for w, e in zip(got["weights"], expected)]
    assert len(weights) == len(expected) and len(got["loss"]) == STEPS
    for i, (w, e) in enumerate(zip(weights, expected)):
        assert w.shape == e.shape and np.allclose(w, e, rtol=1e-5, atol=1e-6), (builder, i, np.abs(w - e).max())
    initial = rm.reference_weights(md, num_workers=NODES, steps=0)
    assert any(not np.allclose(a, b) for a, b in zip(weights, initial))  # training moved the weights
    if builder == "partitioned_ps":
        assert got["ps_nodes"] == ["host0", "host1", "host2"] and not got["backends"]
    elif builder == "all_reduce":
        assert got["backends"] == ["gloo"] and got["ar_groups"] >= 2 and not got["ps_nodes"]
    else:
        assert got["backends"] == ["objectstore"] and got["ps_nodes"]


def test_step_time_grows_when_bandwidth_shrinks(run):
    """Two rounds at each rate, interleaved (1gbit, 200mbit, 1gbit, 200mbit), so that a change in
    the machine's load during the test hits both rates alike; medians over the pooled steps."""
    tb, driver = run["tb"], run["driver"]
    rounds = [driver.result()]
    for bandwidth in ROUNDS[1:]:
        tb.shape(bandwidth)
        assert tb.cluster_spec.nodes[1].bandwidth_gbps == pytest.approx(0.2 if bandwidth == "200mbit" else 1.0)
        driver.send(f"bandwidth {bandwidth}")
        rounds.append(driver.result())
    driver.send("quit")
    assert [r["bandwidth"] for r in rounds] == ROUNDS
    grad = rounds[0]["gradient_bytes"]
    assert grad == mm.parameter_bytes()
    steps: dict = {}
    for r in rounds:
        for name, res in r["results"].items():
            assert res["status"] == "ok", (name, r["bandwidth"], res["error"])
            steps.setdefault((name, r["bandwidth"]), []).extend(res["step_times"])
    median = {key: float(np.median(v)) for key, v in steps.items()}
    print("\nmedian step of the 8.4 MB dense model on 3 nodes: " + "; ".join(
        f"{name}: {median[(name, '1gbit')] * 1e3:.0f} ms at 1gbit, {median[(name, '200mbit')] * 1e3:.0f} ms at 200mbit"
        for name, _ in TIMED))
    # every worker must receive at least the 2/3 of the gradient that the other two nodes hold
    # (PS: its pull from the two remote shards; ring all-reduce: 4/3 of it); at 200 Mbit/s:
    floor_s = (NODES - 1) / NODES * grad * 8 / 200e6
    for name, _ in TIMED:
        fast, slow = median[(name, "1gbit")], median[(name, "200mbit")]
        assert slow > 1.3 * fast, (name, fast, slow, steps)
        assert slow > 0.8 * floor_s, (name, slow, floor_s)
