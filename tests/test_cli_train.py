"""``autosync train`` end to end in a fresh process (embedded Ray): train with checkpoints and a
final save; bad flags refused before Ray starts; an interrupt names the checkpoint to go on from."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.test_cli_runtime import SCRIPT as RUN_SCRIPT, STRATEGY


# the tiny script model of ``autosync run``'s tests, drawing enough batches for these runs
SCRIPT = RUN_SCRIPT.replace("for _ in range(3):", "for _ in range(1000):")
assert SCRIPT != RUN_SCRIPT


def _train(tmp_path, *args, timeout=300):
    (tmp_path / "tiny.py").write_text(SCRIPT)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("RAY_ADDRESS", None)
    return subprocess.run([sys.executable, "-m", "autosync", "train", "--model", f"{tmp_path / 'tiny.py'}:tiny",
                           *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.integration
def test_train_checkpoints_and_saves(tmp_path):
    """(``--restore`` hands its directory to the Trainer, whose restores under other strategies and
    worker counts are tested in ``tests/test_runtime_reshard.py``; one run here, for CI's time.)"""
    (tmp_path / "best_strategy.yaml").write_text(STRATEGY)   # a strategy file, as tune writes one
    proc = _train(tmp_path, "--strategy", "best_strategy.yaml", "--steps", "6", "--checkpoint-dir", "ck",
                  "--checkpoint-every", "3", "--max-failures", "1", "--keep-global-batch", "--save", "final",
                  "--log-every", "2", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert (out["steps"], out["first_step"], out["global_step"], out["workers"]) == (6, 0, 6, 2)
    assert len(out["loss"]) == 6 and out["restarts"] == [] and out["strategy"]["origin"] == "file"
    assert out["checkpoint"]["path"] == "final" and out["checkpoint"]["bytes"] > 0
    assert os.path.dirname(out["checkpoint"]["weights"]).startswith("final")
    assert (tmp_path / out["checkpoint"]["weights"]).is_file()
    assert json.loads((tmp_path / "ck" / "manifest.json").read_text())["step"] == 6
    # progress on the terminal, the JSON alone on stdout
    assert "training tiny from step 0 for 6 steps on 2 workers (local)" in proc.stderr
    assert [ln.split("  ")[0] for ln in proc.stderr.splitlines() if ln.startswith("step ")] == \
        ["step 2 (2/6)", "step 4 (4/6)", "step 6 (6/6)"]


@pytest.mark.parametrize("args, said", [
    (["--steps", "4", "--elastic", "--checkpoint-dir", "ck"], "--elastic needs --max-failures >= 1"),
    (["--steps", "4", "--checkpoint-every", "2"], "--checkpoint-every needs --checkpoint-dir"),
    (["--steps", "4", "--save", "tiny.py"], "--save: checkpoint path tiny.py is a file, not a directory"),
    (["--steps", "4", "--restore", "r" * 300], "cannot be read: File name too long"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--steps", "4", "--restore", "nowhere"], "checkpoint nowhere does not exist"),
])
def test_train_refuses_bad_flags_before_ray_starts(tmp_path, args, said):
    proc = _train(tmp_path, "--strategy", "ps", *args, timeout=120)
    assert proc.returncode == 2 and said in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_train_interrupted_names_the_checkpoint_to_restore_from(monkeypatch, capsys):
    from autosync import cli
    from autosync.cli import train

    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(train, "cmd_train", interrupted)
    argv = ["train", "--model", "zoo:ncf", "--strategy", "ps", "--steps", "5"]
    assert cli.main(argv + ["--checkpoint-dir", "ck"]) == 130
    assert ("autosync train: interrupted; the last checkpoint written is in ck: --restore ck continues from it"
            in capsys.readouterr().err)
    assert cli.main(argv) == 130 and capsys.readouterr().err.strip() == "autosync train: interrupted"


def test_the_text_summary_says_each_recovery_and_where_the_checkpoint_went(capsys):
    from autosync.cli import train

    result = {"steps": 12, "global_step": 20, "wall_s": 31.25, "loss_first": 0.5, "loss_last": 0.25, "loss_window": 3,
              "step_time_s": {"median": 0.0125},
              "restarts": [{"failed_at": 5, "resumed_from": 3, "seconds": 15.46, "error": "at step 5: worker n1:0 died",
                            "without": ["n1"], "workers": 1, "parts": [[0, 1]]},
                           {"back": ["n1"], "resumed_from": 9, "workers": 2, "seconds": 14.75},
                           {"failed_at": 14, "resumed_from": 12, "seconds": 2.0, "error": "at step 14: boom"},
                           {"failed_at": 18, "resumed_from": 15, "seconds": 9.0, "workers": 2,
                            "error": "at step 18: worker n1:0 died", "replaced": ["n1"],
                            "stand_ins": {"n1": "10.0.0.9"}}],
              "checkpoint": {"path": "final", "weights": "final/step-00000020/model.weights.h5", "bytes": 3 * 2**20}}
    train._print_summary(result)
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "trained 12 steps (global step 20) in 31.2 s: loss 0.5 -> 0.25 (mean of the first and last 3 steps), "
        "median step 12.5 ms",
        "recovered: failed at step 5, resumed from 3 in 15.5 s; went on without n1 on 1 workers (the global batch "
        "kept: each draws its parts' batches): at step 5: worker n1:0 died",
        "nodes back: n1; from step 9 on 2 workers (14.8 s)",
        "recovered: failed at step 14, resumed from 12 in 2.0 s: at step 14: boom",
        "recovered: failed at step 18, resumed from 15 in 9.0 s; n1 (on 10.0.0.9) replaced: at step 18: worker n1:0 "
        "died",
        "checkpoint written to final (3.0 MiB; --restore final continues); the weights alone: "
        "final/step-00000020/model.weights.h5 (keras.Model.load_weights reads it)"]


def test_a_training_that_fails_past_its_allowance_says_so_and_where_to_go_on_from(monkeypatch, capsys, tmp_path):
    """Exit 1 with the Trainer's RuntimeError as one line, no traceback (fakes: no Ray)."""
    import contextlib
    import types

    import autosync.runtime.trainer as trainer_module
    from autosync import cli
    from autosync.cli import train

    class Failing:
        step, plan = 4, types.SimpleNamespace(replicas=("node0:0", "node0:1"))

        def __init__(self, *a, **k):
            settings.append(k)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def fit(self, *a, **k):
            raise RuntimeError("training failed 3 times, more than max_failures=2: at step 7: worker node0:1 died")

    settings = []
    monkeypatch.setattr(train, "_prepare", lambda args: (types.SimpleNamespace(name="tiny"), None,
                                                         types.SimpleNamespace(name="local")))
    monkeypatch.setattr(train, "ray_output_to_log",
                        lambda command: contextlib.nullcontext(types.SimpleNamespace(path="log")))
    monkeypatch.setattr(trainer_module, "Trainer", Failing)
    assert cli.main(["train", "--model", "m", "--strategy", "ps", "--steps", "5", "--checkpoint-dir", "ck",
                     "--max-failures", "2", "--keep-global-batch"]) == 1
    assert settings == [{"timeout_s": 600.0, "restore": None, "keep_global_batch": True}]
    err = capsys.readouterr().err
    assert ("autosync train: training failed 3 times, more than max_failures=2: at step 7: worker node0:1 died; the "
            "last checkpoint written is in ck: --restore ck continues from it") in err
    assert "Traceback" not in err and "training tiny from step 4 for 5 steps on 2 workers (local)" in err
