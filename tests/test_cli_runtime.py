"""``autosync run`` on a tiny script model, end to end in a fresh process (embedded Ray)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = '''
import numpy as np
from autosync.model_def import ModelDef


def build():
    import keras
    ids = keras.Input((2,), dtype="int32")
    x = keras.layers.Flatten()(keras.layers.Embedding(30, 4, name="emb")(ids))
    return keras.Model(ids, keras.layers.Dense(1, name="out")(x))


def loss():
    import keras
    return keras.losses.MeanSquaredError()


def opt():
    import keras
    return keras.optimizers.SGD(0.05)


def data(worker, num_workers):
    rng = np.random.RandomState(worker)
    for _ in range(3):
        x = rng.randint(0, 30, size=(8, 2)).astype("int32")
        yield x, (x.sum(axis=1, keepdims=True) / 60.0).astype("float32")


def tiny():
    return ModelDef(name="tiny", model_fn=build, loss_fn=loss, optimizer_fn=opt, dataset_fn=data, batch_size=8)
'''



def _strategy(dense: str) -> str:
    """The tiny model's table on a PS of node0, its dense layer synchronized by ``dense``."""
    return ("kind: strategy\nversion: 1\nvariables:\n  - {var: emb/embeddings, ps: {destination: node0}}\n"
            + "".join(f"  - {{var: out/{v}, {dense}}}\n" for v in ("kernel", "bias")))


STRATEGY = _strategy("ps: {destination: node0}")
MIXED = _strategy("all_reduce: {backend: gloo}")


def _autosync(*args, timeout=300):
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("RAY_ADDRESS", None)
    return subprocess.run([sys.executable, "-m", "autosync", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _run_tiny(tmp_path, strategy: str, *args, timeout=300):
    """``autosync run`` of the tiny script model with ``strategy`` (YAML text) and ``args``."""
    (tmp_path / "tiny.py").write_text(SCRIPT)
    (tmp_path / "s.yaml").write_text(strategy)
    return _autosync("run", "--model", f"{tmp_path / 'tiny.py'}:tiny", "--strategy", str(tmp_path / "s.yaml"), *args,
                     timeout=timeout)


@pytest.mark.integration
def test_run_prints_measurement_json(tmp_path):
    """Run by the ps builder's name (``--strategy ps``: on ``local``, every variable on node0's PS,
    the file the other tests run)."""
    (tmp_path / "tiny.py").write_text(SCRIPT)
    proc = _autosync("run", "--model", f"{tmp_path / 'tiny.py'}:tiny", "--strategy", "ps", "--cluster", "local",
                     "--steps", "6", "--max-steps", "30", "--warmup", "1", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["status"] == "ok" and 6 <= out["steps"] <= 30   # more steps only while the interval is wide
    lo, hi = out["step_time_s"]["median_ci95"]
    assert 0 < lo <= out["step_time_s"]["median"] <= hi
    assert 0 < out["step_time_s"]["median"] <= out["step_time_s"]["p90"]
    assert out["samples_per_s"] > 0 and out["batch_size"] == 16
    assert out["ray_calls_per_step_per_worker"] == 2 and out["startup_s"] > 0
    assert "warning" not in proc.stderr   # each worker drew its own data


@pytest.mark.integration
def test_run_warns_on_the_terminal_when_every_worker_draws_the_same_data(tmp_path):
    """A ``dataset_fn`` that ignores the worker's index (``data_check``): said on the terminal
    when the command ends (stderr goes to Ray's log while it runs), and the run goes on."""
    (tmp_path / "same.py").write_text(SCRIPT.replace("np.random.RandomState(worker)", "np.random.RandomState(0)"))
    proc = _autosync("run", "--model", f"{tmp_path / 'same.py'}:tiny", "--strategy", "ps", "--cluster", "local",
                     "--steps", "3", "--max-steps", "3", "--warmup", "1", "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["status"] == "ok", proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if "warning" in line]
    assert len(said) == 1 and said[0].startswith("autosync run: warning: model tiny: workers node0:0, node0:1 all "
                                                 "drew the same first batch from dataset_fn"), proc.stderr[-3000:]
    assert "ds.shard(n, i)" in said[0]


@pytest.mark.integration
def test_bad_strategy_file_exits_2_with_message(tmp_path):
    (tmp_path / "tiny.py").write_text(SCRIPT)
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: strategy\nversion: 1\nvariables:\n  - {var: emb/embeddings, ps: {destinaton: node0}}\n")
    proc = _autosync("run", "--model", f"{tmp_path / 'tiny.py'}:tiny", "--strategy", str(bad), "--json")
    assert proc.returncode == 2
    assert "destinaton" in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stdout == ""

    missing = _autosync("run", "--model", f"{tmp_path / 'tiny.py'}:tiny", "--strategy", str(tmp_path / "nope.yaml"))
    assert missing.returncode == 2 and "is neither a strategy YAML file nor a builder's name" in missing.stderr
    assert "ps, " in missing.stderr   # the builders are listed


@pytest.mark.integration
def test_run_writes_timeline(tmp_path):
    trace_path = tmp_path / "trace.json"
    proc = _run_tiny(tmp_path, MIXED, "--steps", "8", "--precision", "0", "--warmup", "1", "--timeline", str(trace_path),
                     "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    trace = json.loads(trace_path.read_text())
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert sorted(names.values()) == ["ps@node0", "worker 0 (node0)", "worker 1 (node0)"]
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    by_actor = {label: {e["name"] for e in spans if names[e["pid"]] == label} for label in names.values()}
    assert {"pull", "compute", "ps push", "allreduce", "collective"} <= by_actor["worker 0 (node0)"]
    assert {"push", "pushes in", "apply", "serve pull"} <= by_actor["ps@node0"]
    # 1 warm-up + 8 timed steps + the untimed last one: a compute span each, in step order, after
    # that step's pull and before its push
    w0 = sorted((e for e in spans if names[e["pid"]] == "worker 0 (node0)"), key=lambda e: e["ts"])
    computes = [e for e in w0 if e["name"] == "compute"]
    assert [e["args"]["step"] for e in computes] == list(range(10))
    for c in computes:
        step = c["args"]["step"]
        pull = next(e for e in w0 if e["name"] == "pull" and e["args"]["step"] == step)
        push = next(e for e in w0 if e["name"] == "ps push" and e["args"]["step"] == step)
        assert pull["ts"] + pull["dur"] <= c["ts"] + 1 and c["ts"] + c["dur"] <= push["ts"] + 1
    applies = [e for e in spans if names[e["pid"]] == "ps@node0" and e["name"] == "apply"]
    assert sorted(e["args"]["step"] for e in applies) == list(range(10))   # one update per step
    # the printed phases: per actor and span, no more per step than the whole step takes
    phases = out["timeline"]["phases"]
    median_ms = out["step_time_s"]["median"] * 1e3
    compute = next(r for r in phases if r["actor"] == "worker 1 (node0)" and r["span"] == "compute")
    assert compute["count"] == 10 and 0 < compute["ms_per_step"] < median_ms
    assert trace["otherData"]["model"] == "tiny" and out["timeline"]["path"] == str(trace_path)


def test_timeline_to_a_missing_folder_exits_2_before_ray(tmp_path):
    (tmp_path / "s.yaml").write_text(STRATEGY)
    proc = _autosync("run", "--model", "zoo:ncf", "--strategy", str(tmp_path / "s.yaml"),
                     "--timeline", str(tmp_path / "no" / "trace.json"), timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--timeline" in proc.stderr and "folder does not exist" in proc.stderr


@pytest.mark.integration
def test_a_trial_that_fails_says_no_timeline_was_written(tmp_path):
    trace_path = tmp_path / "trace.json"
    proc = _run_tiny(tmp_path, STRATEGY, "--timeout", "0.001", "--timeline", str(trace_path))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "trial timeout" in proc.stderr and f"no timeline written to {trace_path}" in proc.stderr
    assert not trace_path.exists()


@pytest.mark.integration
def test_run_writes_timeline_with_emulated_compute(tmp_path):
    """The emulated worker records its spans too: its compute is the step time it was given, and
    the dense layer's all-reduce (backend auto: in the step on GPU workers) runs during it."""
    trace_path = tmp_path / "trace.json"
    proc = _run_tiny(tmp_path, _strategy("all_reduce: {backend: auto}"), "--compute", "emulated", "--step-time", "0.02",
                     "--steps", "6", "--precision", "0", "--warmup", "1", "--timeline", str(trace_path), "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    phases = {(r["actor"], r["span"]): r for r in json.loads(proc.stdout)["timeline"]["phases"]}
    for w in ("worker 0 (node0)", "worker 1 (node0)"):
        assert phases[(w, "compute")]["count"] == 8 and 19 <= phases[(w, "compute")]["ms_per_step"] < 30
        assert phases[(w, "ps push")]["count"] == 8 and phases[(w, "pull")]["count"] == 8
        assert phases[(w, "allreduce (in step)")]["count"] == 8 and phases[(w, "update")]["count"] == 8
    assert phases[("ps@node0", "apply")]["count"] == 8
    trace = json.loads(trace_path.read_text())
    assert {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"} == {
        "ps@node0", "worker 0 (node0)", "worker 1 (node0)"}
