"""``autosync models`` and ``autosync inspect`` run as a user would: ``python -m autosync``."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from strategy_space import load_model_spec

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "examples", "my_model.py")


def _autosync(*args: str, cwd: str = REPO, env: dict | None = None) -> subprocess.CompletedProcess:
    env = env if env is not None else dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    return subprocess.run([sys.executable, "-m", "autosync", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=300)


@pytest.mark.integration
def test_inspect_script_with_profile_and_out_round_trips(tmp_path):
    from autosync.models import ingest, script

    out = tmp_path / "model.yaml"
    r = _autosync("inspect", "--model", f"{EXAMPLE}:build", "--profile", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "user_embedding/embeddings" in r.stdout and "10000x32" in r.stdout
    assert "TOTAL" in r.stdout and "ms per step (forward+backward, median) on cpu:" in r.stdout
    loaded = load_model_spec(out)
    fresh = ingest.model_spec_from_def(script.load_model_def(EXAMPLE, "build"))
    assert loaded.variables == fresh.variables and loaded.batch_size == fresh.batch_size == 64
    assert loaded.profile is not None and loaded.profile.step_time_s > 0
    # the exported YAML is itself a model source, and inspecting it needs no TensorFlow work
    again = tmp_path / "again.yaml"
    r = _autosync("inspect", "--model", str(out), "--out", str(again))
    assert r.returncode == 0, r.stderr[-2000:]
    assert load_model_spec(again) == loaded


@pytest.mark.integration
def test_inspect_zoo_model_prints_sparse_rows():
    # as a user runs it: no TF_CPP_MIN_LOG_LEVEL of ours, so TensorFlow's start-up lines are the command's to silence
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "AUTOSYNC_TF_LOGS")}
    r = _autosync("inspect", "--model", "zoo:ncf", env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    # issue 29: none of TensorFlow's start-up lines (absl's notice, the CUDA probe, CPU features), once or twice
    assert r.stderr == "", r.stderr[-2000:]
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("gmf_user_embedding/embeddings"))
    assert "6040x16" in line and "yes" in line
    assert "model ncf-small: batch size 256 per worker" in r.stdout
    # Adam at a constant rate (the numpy rules, with the summed squares): rows summed per worker
    assert "parameter-server pushes: a sparse gradient's repeated rows summed by each worker" in r.stdout
    # Adam's m and v: what the memory check counts with each shard
    assert "optimizer state: 2 array(s) of each variable's size" in r.stdout and "(3.6 MiB for the whole model)" in r.stdout


MIXED_SCRIPT = """
import functools

import keras

from autosync.model_def import ModelDef
from tests import runtime_models as rm

keras.mixed_precision.set_global_policy("mixed_float16")


def build():
    return ModelDef(name="mixed", model_fn=rm.build_model, loss_fn=rm.mse,
                    optimizer_fn=functools.partial(rm.make_optimizer, "adam", learning_rate=0.05),
                    dataset_fn=rm.make_batches, batch_size=8, seed=7)
"""


@pytest.mark.integration
def test_inspect_says_a_mixed_float16_script_holds_its_steps(tmp_path):
    path = tmp_path / "mixed.py"
    path.write_text(MIXED_SCRIPT)
    r = _autosync("inspect", "--model", f"{path}:build")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "held steps: the optimizer clips by the global norm or scales the loss dynamically" in r.stdout, r.stdout
    path.write_text(MIXED_SCRIPT.replace("mixed_float16", "mixed_bfloat16"))   # no loss scaling: nothing held
    r = _autosync("inspect", "--model", f"{path}:build")
    assert r.returncode == 0 and "held steps" not in r.stdout, r.stderr[-2000:]


def test_models_lists_the_zoo_without_building():
    r = _autosync("models", "--no-build")
    assert r.returncode == 0, r.stderr[-2000:]
    for name in ("resnet50", "vgg16", "bert", "lm1b", "ncf", "dlrm"):
        assert any(ln.startswith(name) for ln in r.stdout.splitlines())
    assert "zoo:NAME?size=full" in r.stdout


def test_script_without_the_function_exits_2_with_a_clear_message(tmp_path):
    path = tmp_path / "model.py"
    path.write_text("def make():\n    return 1\n")
    r = _autosync("inspect", "--model", f"{path}:build")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert "autosync inspect: error:" in r.stderr and "has no function 'build' (functions defined there: make)" in r.stderr


def test_function_returning_the_wrong_type_exits_2_with_a_clear_message(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent("""
        def build():
            return {"name": "not a ModelDef"}
    """))
    r = _autosync("inspect", "--model", f"{path}:build")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert "build() returned dict, not a ModelDef" in r.stderr and "autosync.ModelDef(name=" in r.stderr


def test_unknown_zoo_model_exits_2():
    r = _autosync("inspect", "--model", "zoo:alexnet")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "valid models: resnet50, vgg16, bert, lm1b, ncf, dlrm" in r.stderr


@pytest.mark.integration
def test_inspect_of_a_model_whose_second_build_fails_exits_2(tmp_path):
    # a sparse model's row reads are found on a second build, which is the user's code too
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent("""
        import numpy as np
        import keras
        import autosync

        CALLS = []

        def _model():
            CALLS.append(1)
            if len(CALLS) > 1:
                raise RuntimeError("the second build fails")
            return keras.Sequential([keras.Input((2,), dtype="int32"), keras.layers.Embedding(100, 4),
                                     keras.layers.Flatten(), keras.layers.Dense(1)])

        def _data(i, n):
            while True:
                yield np.zeros((8, 2), "int32"), np.zeros((8, 1), "float32")

        def build():
            return autosync.ModelDef(name="second", model_fn=_model, loss_fn=lambda: "mse", batch_size=8,
                                     optimizer_fn=lambda: keras.optimizers.SGD(0.1), dataset_fn=_data)
    """))
    r = _autosync("inspect", "--model", f"{path}:build")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert ("autosync inspect: error: ModelDef second: building the model a second time to find its row reads "
            "failed: RuntimeError: the second build fails") in r.stderr


GREEDY_SCRIPT = """
import numpy as np

from autosync.model_def import ModelDef

KEPT = []


def make_model():
    import keras   # here, not at the top: the script's import would count TensorFlow's (0.4 GiB)

    for _ in range(192):   # 8 MiB at a time, as a size typed too large fills a buffer: 1.5 GiB at most
        KEPT.append(np.ones(8 << 20, np.uint8))
    return keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])


def optimizer():
    import keras

    return keras.optimizers.SGD(0.1)


def batches(i, n):
    while True:
        yield np.ones((4, 2), np.float32), np.ones((4, 1), np.float32)


def build():
    return ModelDef(name="greedy", model_fn=make_model, loss_fn=lambda: "mse", optimizer_fn=optimizer,
                    dataset_fn=batches, batch_size=4)
"""


@pytest.mark.integration
def test_inspect_of_a_model_past_the_memory_limit_exits_2_saying_what_to_lower(tmp_path):
    (tmp_path / "greedy.py").write_text(GREEDY_SCRIPT)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", AUTOSYNC_MODEL_MEMORY="768m")
    r = _autosync("inspect", "--model", f"{tmp_path / 'greedy.py'}:build", env=env)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.startswith("autosync inspect: error: ModelDef greedy: building the model and one gradient on its "
                               "first batch took more than the 0.8 GiB of memory it may take "
                               "(AUTOSYNC_MODEL_MEMORY=768m): "), r.stderr[-2000:]
    assert "greedy.py:" in r.stderr and "in make_model; is a size in it" in r.stderr and "Traceback" not in r.stderr
