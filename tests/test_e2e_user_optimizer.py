"""`autosync tune` end to end on `local` on a user's script whose optimizer is RMSprop with a
cosine-decay schedule (run by the Keras optimizer itself wherever updates happen), with an
embedding whose repeated rows' slices RMSprop squares one by one (sent unsummed), and a dataset
that weighs its examples ((inputs, targets, sample_weight) batches)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

SCRIPT = '''
import keras
import numpy as np
from autosync.model_def import ModelDef

def make_model():
    x, ids = keras.Input((8,)), keras.Input((4,), dtype="int32")
    e = keras.layers.Flatten()(keras.layers.Embedding(30, 4, name="emb")(ids))
    h = keras.layers.Dense(16, activation="relu", name="hidden")(keras.layers.Concatenate()([x, e]))
    return keras.Model([x, ids], keras.layers.Dense(1, name="out")(h))

def make_optimizer():
    schedule = keras.optimizers.schedules.CosineDecay(0.01, decay_steps=100, warmup_target=0.02, warmup_steps=5)
    return keras.optimizers.RMSprop(learning_rate=schedule)

def batches(worker_index, num_workers):
    rng = np.random.default_rng(worker_index)
    while True:
        x = rng.normal(size=(16, 8)).astype("float32")
        ids = rng.integers(0, 30, size=(16, 4)).astype("int32")   # rows repeat in a batch
        y = x.sum(axis=1, keepdims=True) + ids.mean(axis=1, keepdims=True) / 30
        yield (x, ids), y, rng.uniform(0.5, 2.0, size=16).astype("float32")   # weighted, as fit takes it

def build():
    return ModelDef(name="rms_cosine", model_fn=make_model, loss_fn=lambda: keras.losses.MeanSquaredError(),
                    optimizer_fn=make_optimizer, dataset_fn=batches, batch_size=16)
'''


def test_tune_on_a_script_with_rmsprop_and_a_cosine_schedule(tmp_path):
    (tmp_path / "rms_model.py").write_text(SCRIPT)
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    # every Keras update compiled by XLA from the first (a training run's tier; trials this short
    # stay traced by default), so the compiled path runs on Ray's actors end to end
    env["AUTOSYNC_KERAS_XLA_AFTER"] = "0"
    r = subprocess.run([sys.executable, "-m", "autosync", "tune", "--model", "rms_model.py:build", "--cluster", "local",
                        "--steps", "3", "--warmup", "1", "--precision", "0", "--trials", "2", "--store", "t.db",
                        "--out", "best.yaml", "--json",
                        # about the optimizer, not compression: no lossy candidate, no probe, no re-measurement
                        "--quality", "exact", "--confirm", "0"],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout)
    assert summary["trials"] == 2 and (tmp_path / "best.yaml").exists(), summary
    from tuner.records.store import TrialStore

    with TrialStore(tmp_path / "t.db") as store:
        trials = store.trials()
    # every trial ran, the baselines' parameter servers and all-reduce alike
    assert trials and all(t.status == "ok" for t in trials), [t.error for t in trials if t.status != "ok"]
    ps = [s for t in trials for s in (t.meta.get("ps_stats") or {}).values()]
    assert ps and all(s["compiled"] >= 4 and s["xla_fallbacks"] == 0 for s in ps), ps


def test_inspect_says_the_embedding_is_pushed_slice_by_slice(tmp_path, capsys):
    import re

    from autosync.cli import main

    (tmp_path / "rms_model.py").write_text(SCRIPT)
    assert main(["inspect", "--model", f"{tmp_path / 'rms_model.py'}:build"]) == 0
    out = capsys.readouterr().out
    assert "parameter-server pushes: every slice of a sparse gradient" in out and "(RMSprop)" in out, out
    slices, rows = map(int, re.search(r"emb/embeddings: (\d+) slices for (\d+) rows", out).groups())
    assert slices == 16 * 4 and rows < slices   # a batch of 16 reads 4 ids each, of 30 rows
