"""The README's Python example, ``examples/tune_and_train.py``, run as a user runs it: tune the
example model on ``local``, save the best strategy, train with it (real Ray and TensorFlow)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from strategy_space import load_strategy

pytestmark = pytest.mark.integration
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tune_and_train_example_tunes_saves_and_trains(tmp_path):
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    out = tmp_path / "best.yaml"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "examples", "tune_and_train.py"), "--trials", "1",
                           "--steps", "3", "--store", str(tmp_path / "t.db"), "--out", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("best strategy: ") and "ms/step; best baseline" in lines[0], proc.stdout
    assert any(line.split()[:2] == ["search", "ok"] for line in lines), proc.stdout   # the trials table
    assert lines[-2].startswith("trained 3 steps: loss ") and lines[-2].endswith("7 weight arrays"), proc.stdout
    assert lines[-1].startswith("evaluated on one batch: loss "), proc.stdout   # Trainer.keras_model
    assert load_strategy(out).variables   # the best strategy, saved as YAML
