"""Driver-side helpers shared by the runtime integration tests (never shipped to workers)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from strategy_space import ClusterSpec, NodeSpec
from tests import runtime_models as rm

# two nodes on this machine: partitioned strategies really get shards on two PS actors
PAIR = ClusterSpec(name="pair", nodes=(
    NodeSpec(name="node0", address="127.0.0.1", cpus=1, workers=1, chief=True),
    NodeSpec(name="node1", address="127.0.0.1", cpus=1, workers=1),
))

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def warm_pool(ray_session, cluster):
    """A worker pool bound to ``cluster`` (a generator for module fixtures: yields it, then kills
    its workers); the test models are registered to be pickled by value."""
    from autosync.runtime.binding import ClusterBinding
    from autosync.runtime.engine import WorkerPool

    ray_session.cloudpickle.register_pickle_by_value(rm)
    pool = WorkerPool(ClusterBinding.bind(cluster))
    yield pool
    pool.kill_all()


def run_cluster_script(tmp_path, script: str, timeout_s: float = 480) -> dict:
    """Run ``script`` (which builds its own ``ray.cluster_utils.Cluster``: a process may hold only
    one Ray) in a fresh interpreter and return the JSON it printed after ``RESULT ``."""
    path = tmp_path / "cluster_script.py"
    path.write_text(script)
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, str(path)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def still_running(pids, within_s: float) -> list:
    """Those of ``pids`` (processes on this machine) still running after up to ``within_s`` seconds
    (``ray.kill`` is asynchronous: an exited process not yet reaped counts as ended)."""
    deadline = time.monotonic() + within_s
    while True:
        left = []
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                        left.append(pid)
            except OSError:   # gone before the open (ENOENT) or between the open and the read (ESRCH)
                pass
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.02)
