"""``autosync calibrate`` on real Ray: the local cluster (integration) and a 2-node emulated
testbed with shaped links, described by Ray itself (``--cluster ray``) (multinode: needs root; wrap in `flock /tmp/autosync-testbed.lock`)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from strategy_space import ClusterSpec, NodeSpec, load
from tests.conftest import require_testbed_host

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = (4096, 65536, 1 << 20, 8 << 20)


@pytest.mark.integration
def test_calibrate_measures_local_and_writes_a_loadable_spec(ray_session, tmp_path):
    from autosync.calibrate import calibrate
    from strategy_space import save

    local = ClusterSpec("local", (NodeSpec("node0", address="127.0.0.1", cpus=2, workers=2, chief=True),))
    cal_cluster = calibrate(local, sizes=SIZES, reps=3)
    cal = cal_cluster.calibration
    assert cal.workers == 2 and cal.backend in ("gloo", "objectstore")
    assert [b for b, _ in cal.allreduce] == list(SIZES) == [b for b, _ in cal.ps_round_trip]
    # each figure is a measurement: 8 MiB take at least what moving them costs at 50 GB/s, faster
    # than this machine copies memory (the PS round trip moves them twice). Not "8 MiB slower than
    # 4 KiB": a CI run had the other xdist worker's load stretch 4 KiB to 9.69 ms beside 9.69 ms
    floor = SIZES[-1] / 50e9
    assert cal.allreduce[-1][1] > floor and cal.ps_round_trip[-1][1] > 2 * floor, (cal.allreduce, cal.ps_round_trip)
    assert all(0 < t < 60 for _, t in cal.allreduce + cal.ps_round_trip)
    path = tmp_path / "local.yaml"
    save(cal_cluster, path)
    back = load(path, "cluster")
    assert back == cal_cluster and back.fingerprint == local.fingerprint


@pytest.mark.integration
def test_the_calibrate_command_writes_a_calibrated_spec_and_says_what_it_measured(tmp_path):
    """``autosync calibrate --cluster local --out F`` as the README gives it, in a fresh process:
    exit 0, the summary line on stderr, and a spec at F that loads with its measured curves."""
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("RAY_ADDRESS", None)
    out = tmp_path / "cluster.yaml"
    r = subprocess.run([sys.executable, "-m", "autosync", "calibrate", "--cluster", "local", "--out", str(out),
                        "--reps", "3"], cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "calibrated local: " in r.stderr and "PS round trip" in r.stderr and f"wrote {out}" in r.stderr
    cal = load(out, "cluster").calibration
    assert cal is not None and cal.workers == 2 and len(cal.allreduce) == len(cal.ps_round_trip) >= 4


@pytest.mark.integration
def test_calibrate_needs_two_worker_slots():
    from autosync.calibrate import calibrate
    from strategy_space import ConfigError

    one = ClusterSpec("one", (NodeSpec("node0", workers=1),))
    with pytest.raises(ConfigError, match="a collective needs at least two"):
        calibrate(one)


RATE_MBIT = 200
PAYLOAD_PER_FRAME = 1448 / 1514   # TCP payload / bytes htb counts per frame (MTU 1500, timestamps)
DRIVER = r'''
import json, sys
sys.path.insert(0, sys.argv[1])
from autosync.calibrate import bus_bandwidth_gbps, calibrate
from autosync.sources import load_cluster
# --cluster ray: the running Ray cluster (RAY_ADDRESS) described by Ray itself, no YAML
described = load_cluster("ray")
cluster = calibrate(described, sizes=(4096, 1 << 20, 16 << 20, 32 << 20), backend="gloo")   # the default 5 reps, as `autosync calibrate` measures
print("RESULT " + json.dumps({"busbw_gbps": bus_bandwidth_gbps(cluster.calibration),
                              "calibration": cluster.calibration.to_dict(),
                              "described": described.to_dict(), "testbed": load_cluster("testbed").to_dict()}), flush=True)
'''


@pytest.mark.multinode
def test_calibrate_on_two_shaped_nodes_finds_the_shaped_rate(tmp_path):
    """2 hosts at 200mbit each way: the all-reduce bus bandwidth at 32 MiB is the shaped rate's
    payload, less at most what a busy 2-core machine takes from the 1-CPU ranks (a 2-worker ring
    sends each byte of the buffer once each way over each link)."""
    require_testbed_host()
    from autosync.testbed import Testbed, ray_nodes
    from autosync.testbed.config import host_ns

    tb = Testbed(nodes=2, bandwidth=f"{RATE_MBIT}mbit", cpus_per_node=1, object_store_mb=400, state_dir=tmp_path)
    try:
        tb.up()
        script = tmp_path / "driver.py"
        script.write_text(DRIVER)
        t0 = time.monotonic()
        out = subprocess.run(ray_nodes.in_namespace(host_ns(0), [sys.executable, str(script), REPO]), env=tb.env(),
                             cwd=REPO, capture_output=True, text=True, timeout=480)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
        assert line, f"no result after {time.monotonic() - t0:.0f} s (exit {out.returncode}): {out.stderr[-3000:]}"
    finally:
        tb.down()
    result = json.loads(line[len("RESULT "):])
    # the Ray cluster's own description has the testbed's nodes: addresses, CPUs, a worker each, host0 as chief
    described, testbed = result["described"]["nodes"], result["testbed"]["nodes"]
    assert [(n["address"], n["cpus"], n["workers"]) for n in described] == \
        [(n["address"], n["cpus"], n["workers"]) for n in testbed]
    assert [n.get("chief", False) for n in described] == [True, False]
    busbw = result["busbw_gbps"] * 1e3
    # what the shaper lets through is frames: TCP over a 1500-byte MTU with timestamps carries 1448
    # bytes of payload in 1514 counted bytes, so the link moves at most ~95.6 % of its rate in data
    payload = RATE_MBIT * PAYLOAD_PER_FRAME
    print(f"\n2 nodes at {RATE_MBIT}mbit ({payload:.1f} Mbit/s of payload): all-reduce bus bandwidth "
          f"{busbw:.1f} Mbit/s at 32 MiB")
    # no faster than the wire; no more than 20 % under it (measured 188.8 idle, 182.9 beside a busy
    # process, 176.7 and 166.7 in CI runs beside another test: the 1-CPU ranks lose turns on a 2-core
    # machine). Still a check of the shaping and of the bus-bandwidth formula: an unshaped link reads
    # Gbit/s, a ring counted once instead of twice each way reads half
    assert 0.80 * payload <= busbw <= 1.03 * payload, \
        f"bus bandwidth {busbw:.1f} Mbit/s vs {payload:.1f} Mbit/s of payload on a {RATE_MBIT}mbit link"
