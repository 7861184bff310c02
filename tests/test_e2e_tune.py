"""The main job end to end on real Ray and TensorFlow: `autosync tune` on a small zoo model on
`local`, then a run killed mid-way and finished with --resume."""
from __future__ import annotations

import glob
import json
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time

import pytest

from strategy_space import load_strategy, validate

pytestmark = pytest.mark.integration
# fixed step counts and short efficiency probes keep it short
ARGS = ["--model", "zoo:ncf", "--cluster", "local", "--steps", "4", "--warmup", "1", "--precision", "0",
        "--probe-steps", "30"]


def _env():
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    return env


def _tune(tmp_path, *extra, timeout=400):   # under the per-test limit (pytest.ini), with the wait below
    return subprocess.run([sys.executable, "-m", "autosync", "tune", *ARGS, *extra], capture_output=True, text=True,
                          cwd=tmp_path, env=_env(), timeout=timeout)


def _count(db) -> int:
    try:
        with sqlite3.connect(db, timeout=5) as c:
            return c.execute("SELECT COUNT(*) FROM trials").fetchone()[0]
    except sqlite3.Error:
        return 0


def test_tune_ends_with_a_valid_strategy_no_worse_than_the_best_baseline(tmp_path):
    r = _tune(tmp_path, "--trials", "8", "--store", "t.db", "--out", "best.yaml", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(r.stdout)
    from strategy_space.builders import BUILDERS

    assert s["trials"] == 8 and s["baseline_trials"] >= 3  # on one node several builders coincide
    assert set(s["speedup_over_baselines"]) == set(BUILDERS)  # yet every builder is reported
    # the speed-up is the best baseline's pooled median over the recommendation's; the recommendation
    # is the best baseline itself unless a searched strategy beat it beyond the noise
    # (by default in goodput: step time / statistical efficiency; a baseline is lossless)
    assert s["quality"] == "goodput" and s["ranked_by"].startswith("goodput")
    assert s["speedup_over_best_baseline"] == pytest.approx(s["best_baseline_step_time_s"] / s["best_goodput_s"])
    assert s["best_goodput_s"] == pytest.approx(s["best_step_time_s"] / s["statistical_efficiency"])
    assert s["efficiency_probed"] == (s["lossy_parts"] != "lossless")
    assert isinstance(s["efficiency_note"], str) and s["efficiency_source"] in ("lossless", "probe", "cache")
    assert s["best_measurements"] == 3 and s["confirm_trials"] >= 2
    if s["best_origin"] != s["best_baseline"]:
        assert s["best_origin"] in ("search", "explore") and s["speedup_over_best_baseline"] > 1.0
    from autosync.sources import load_cluster
    from tuner.records.store import TrialStore

    with TrialStore(tmp_path / "t.db") as store:
        (mfp, cfp, n), = store.groups()
        model = store.model(mfp)
        assert n == s["total_trials"]
    validate(load_strategy(tmp_path / "best.yaml"), model, load_cluster("local"))


def test_killed_run_resumes_without_repeating_trials(tmp_path):
    db = tmp_path / "k.db"
    # lossless only and no confirmation: resuming is about the trial store, not probes or re-measurements
    quick = ["--trials", "4", "--quality", "exact", "--confirm", "0", "--store", str(db), "--out", "b.yaml"]
    cmd = [sys.executable, "-m", "autosync", "tune", *ARGS, *quick]
    p = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    deadline = time.monotonic() + 150
    while _count(db) < 4 and time.monotonic() < deadline and p.poll() is None:
        time.sleep(1)
    assert p.poll() is None, "the run ended before it could be killed"
    os.killpg(p.pid, signal.SIGKILL)  # the driver and everything it started, mid-run
    p.wait(30)
    for log in glob.glob(os.path.join(tempfile.gettempdir(), f"autosync-tune-{p.pid}-*.log")):
        os.remove(log)   # the killed driver's log of Ray's output (a killed process cannot remove it)
    killed_at = _count(db)
    assert killed_at >= 4
    r = _tune(tmp_path, *quick, "--resume", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(r.stdout)
    from tuner.records.store import TrialStore

    with TrialStore(db) as store:
        trials = [t for t in store.trials() if t.run_id == s["run_id"]]
    assert len(trials) == s["total_trials"] >= killed_at          # the first run's trials are part of it
    fps = [t.strategy.fingerprint for t in trials if t.role != "confirm"]
    assert len(fps) == len(set(fps)), "a strategy was measured twice (outside confirmation)"
    assert sum(t.role == "search" for t in trials) == 4


def test_tune_with_emulated_compute_ranks_by_goodput_with_real_compute_probes(tmp_path):
    """The README's emulated mode on a zoo model: step times come from its compute profile, and the
    goodput summary says efficiencies would be probed with real compute of the trainable model."""
    r = _tune(tmp_path, "--compute", "emulated", "--trials", "2", "--confirm", "0", "--warm-start", "none",
              "--store", "e.db", "--out", "e.yaml", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(r.stdout)
    assert s["quality"] == "goodput" and "probed with real compute of the trainable model" in s["lossy_note"]
    assert s["best_goodput_s"] == pytest.approx(s["best_step_time_s"] / s["statistical_efficiency"])
    assert s["efficiency_probed"] == (s["lossy_parts"] != "lossless")
    from autosync.sources import load_cluster
    from tuner.records.store import TrialStore

    with TrialStore(tmp_path / "e.db") as store:
        (mfp, _, n), = store.groups()
        assert n == s["total_trials"]
        validate(load_strategy(tmp_path / "e.yaml"), store.model(mfp), load_cluster("local"))


def test_tune_of_a_model_spec_probes_lossy_parts_on_a_trainable_stand_in(tmp_path):
    """`autosync tune` of a model-spec YAML (GPU-profiled, no code) with emulated compute and
    --probe-model: lossy parts are proposed, their efficiencies rest on the stand-in (said)."""
    spec = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "models",
                        "nvidia-h200", "ncf-small.yaml")
    argv = [a if a != "zoo:ncf" else spec for a in ARGS]
    r = subprocess.run([sys.executable, "-m", "autosync", "tune", *argv, "--compute", "emulated", "--probe-model",
                        "zoo:ncf", "--trials", "2", "--confirm", "0", "--warm-start", "none", "--store", "s.db",
                        "--out", "s.yaml", "--json"], capture_output=True, text=True, cwd=tmp_path, env=_env(),
                       timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(r.stdout)
    assert "stand-in model zoo:ncf" in s["lossy_note"] and "ncf-small" in s["lossy_note"], s["lossy_note"]
    assert s["efficiency_probed"] == (s["lossy_parts"] != "lossless")
    # without a stand-in, a spec has nothing to probe with: lossy parts are not proposed, and why is said
    r = subprocess.run([sys.executable, "-m", "autosync", "tune", *argv, "--compute", "emulated", "--trials", "0",
                        "--confirm", "0", "--warm-start", "none", "--store", "n.db", "--out", "n.yaml", "--json"],
                       capture_output=True, text=True, cwd=tmp_path, env=_env(), timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "--probe-model" in json.loads(r.stdout)["lossy_note"]


def test_a_run_stopped_by_sigterm_says_so_and_exits_143(tmp_path):
    """A job scheduler stops a job with SIGTERM: Ray's driver handler made it sys.exit(15), status
    15 and no word. The command now says it was terminated and how to continue, exit 143 as a
    terminated process; the trials measured are in the store."""
    db = tmp_path / "t.db"
    cmd = [sys.executable, "-m", "autosync", "tune", *ARGS, "--trials", "30", "--quality", "exact", "--store", str(db)]
    p = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 150
    while _count(db) < 2 and time.monotonic() < deadline and p.poll() is None:
        time.sleep(1)
    assert p.poll() is None, "the run ended before it could be stopped"
    p.send_signal(signal.SIGTERM)   # the driver alone, as a scheduler signals the job's main process
    _, err = p.communicate(timeout=120)
    assert p.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "autosync tune: terminated (SIGTERM); the trials measured so far are in its store: the same command " \
           "with --resume continues the run" in err
    assert "Traceback" not in err and _count(db) >= 2


def test_a_time_budget_spent_on_the_start_leaves_the_baselines_alone(tmp_path):
    """``--time-budget`` end to end: it counts from the start of the run, so a budget the start
    itself outlasts measures the baselines (always) and searches nothing."""
    r = _tune(tmp_path, "--compute", "emulated", "--trials", "6", "--time-budget", "0.5", "--confirm", "0",
              "--warm-start", "none", "--store", "b.db", "--out", "b.yaml", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(r.stdout)
    assert s["stop_reason"] == "time" and s["trials"] == 0 and s["baseline_trials"] >= 3, s
