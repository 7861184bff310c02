"""Issue 17 regressions at the command line: what a new user's run broke (in-process ``main``)."""
from __future__ import annotations

import os

import pytest

from autosync.cli import main
from strategy_space import save
from tests.fakes import three_node_cluster, tiny_model


def _files(root) -> dict[str, bytes]:
    return {os.path.relpath(os.path.join(d, f), root): open(os.path.join(d, f), "rb").read()
            for d, _, fs in os.walk(root) for f in fs}


def _one_error(capsys, command: str) -> str:
    err = capsys.readouterr().err
    assert err.startswith(f"autosync {command}: error: ") and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize("content", [b"SQLite format 3\x00" + b"\x00" * 200, os.urandom(3000),
                                     b"just some notes\n"], ids=["truncated", "random", "text"])
@pytest.mark.parametrize("argv", [["report", "--store", "{db}", "--out", "{tmp}/report"],
                                  ["tune", "--store", "{db}", "--warm-start", "none", "--out", "{tmp}/best.yaml"],
                                  ["tune", "--resume", "--store", "{db}", "--warm-start", "none"],
                                  ["simulate", "--eval", "{db}"]],
                         ids=["report", "tune", "tune-resume", "simulate-eval"])
def test_a_damaged_store_is_one_message_exit_2_and_left_untouched(tmp_path, capsys, content, argv):
    """Issue 17, item 2."""
    db = tmp_path / "trials.db"
    db.write_bytes(content)
    before = _files(tmp_path)
    code = main([a.format(db=db, tmp=tmp_path) for a in argv])
    err = _one_error(capsys, argv[0])
    assert code == 2 and "not a readable AutoSync trial store" in err and str(db) in err
    assert _files(tmp_path) == before   # nothing written, nothing changed, no report folder


@pytest.mark.parametrize("argv", [["report", "--store", ""], ["tune", "--store", "", "--trials", "0"]],
                         ids=["report", "tune"])
def test_an_empty_store_path_is_refused_not_read_as_the_default_store(tmp_path, capsys, monkeypatch, argv):
    """``report --store ''`` wrote the report of the default store's latest run."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert main(argv) == 2
    assert "--store ''" in _one_error(capsys, argv[0])
    assert not (tmp_path / "cache").exists()


RMSPROP_SCRIPT = '''
import functools
import keras
import numpy as np
from autosync.model_def import ModelDef

def make_model():
    x = keras.Input((4,))
    return keras.Model(x, keras.layers.Dense(1, name="out")(x))

def make_optimizer():
    return keras.optimizers.RMSprop(learning_rate=lambda: 0.01)

def batches(worker_index, num_workers):
    rng = np.random.default_rng(worker_index)
    while True:
        yield rng.normal(size=(8, 4)).astype("float32"), rng.normal(size=(8, 1)).astype("float32")

def build():
    return ModelDef(name="rms", model_fn=make_model, loss_fn=lambda: keras.losses.MeanSquaredError(),
                    optimizer_fn=make_optimizer, dataset_fn=batches, batch_size=8)
'''


@pytest.fixture
def rmsprop_model(tmp_path, monkeypatch):
    """A user's script model with an optimizer the runtime cannot run (a callable learning rate); Ray must
    not start."""
    script = tmp_path / "rms_model.py"
    script.write_text(RMSPROP_SCRIPT)

    def no_ray(*a, **k):
        raise AssertionError("Ray was started before the optimizer was checked")

    import autosync.runtime.runner as runner_module

    monkeypatch.setattr(runner_module, "RayRunner", no_ray)
    return f"{script}:build"


@pytest.mark.integration
def test_an_unsupported_optimizer_is_refused_up_front_by_every_command_with_one_message(
        rmsprop_model, tmp_path, capsys):
    """Issue 17, item 4: tune, run and baselines refuse before Ray starts, with the same message,
    which does not blame parameter servers (all-reduce strategies use the same update rules);
    inspect warns and succeeds."""
    strategy = tmp_path / "s.yaml"
    strategy.write_text("kind: strategy\nversion: 1\nvariables:\n- var: out/kernel\n  all_reduce: {}\n"
                        "- var: out/bias\n  all_reduce: {}\n")
    messages = []
    for argv in (["tune", "--model", rmsprop_model, "--warm-start", "none", "--store", str(tmp_path / "t.db")],
                 ["run", "--model", rmsprop_model, "--strategy", str(strategy)],
                 ["baselines", "--model", rmsprop_model]):
        assert main(argv) == 2, argv
        err = _one_error(capsys, argv[0])
        messages.append(err.split(": error: ", 1)[1])
        assert "learning_rate=<lambda> is a callable" in err and "parameter servers" not in err.split(";")[0], err
    assert len(set(messages)) == 1, messages
    assert not (tmp_path / "t.db").exists()
    assert main(["inspect", "--model", rmsprop_model]) == 0
    captured = capsys.readouterr()
    assert "out/kernel" in captured.out
    assert "warning:" in captured.err and "learning_rate=<lambda> is a callable" in captured.err
    assert "Traceback" not in captured.err


@pytest.mark.integration
def test_the_trainer_refuses_an_unsupported_optimizer_before_ray_starts(rmsprop_model, tmp_path, monkeypatch):
    """Issue 17, item 4, for the Python API: the same message as the commands, and no worker pool
    (so no Ray) is created."""
    import autosync.runtime.trainer as trainer_module
    from autosync.api import make_trainer
    from strategy_space.errors import ConfigError

    def no_pool(*a, **k):
        raise AssertionError("a worker pool was made before the optimizer was checked")

    monkeypatch.setattr(trainer_module.WorkerPool, "shared_or_new", no_pool)
    strategy = tmp_path / "s.yaml"
    strategy.write_text("kind: strategy\nversion: 1\nvariables:\n- var: out/kernel\n  all_reduce: {}\n"
                        "- var: out/bias\n  all_reduce: {}\n")
    with pytest.raises(ConfigError, match="learning_rate=<lambda> is a callable"):
        make_trainer(rmsprop_model, str(strategy), "local")


def test_an_unknown_compressor_is_said_once_per_value_naming_the_variables(tmp_path, capsys):
    """Issue 17, item 7."""
    bad = tmp_path / "s.yaml"
    bad.write_text("kind: strategy\nversion: 1\nvariables:\n"
                   + "".join(f"- var: v{i}\n  all_reduce: {{compressor: zip}}\n" for i in range(4))
                   + "- var: w\n  all_reduce: {compressor: zap}\n")
    assert main(["show", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("'zip'") == 1 and err.count("'zap'") == 1 and "Traceback" not in err
    assert "variables v0, v1, v2, v3: all_reduce: compressor 'zip'" in err
    assert "variable w.all_reduce: compressor 'zap'" in err


def test_a_directory_given_as_a_file_is_called_a_directory(tmp_path, capsys):
    """Issue 17, item 7."""
    assert main(["show", str(tmp_path)]) == 2
    err = _one_error(capsys, "show")
    assert "is a directory" in err and "not found" not in err
    assert main(["simulate", "--eval", str(tmp_path)]) == 2
    assert "is a directory" in _one_error(capsys, "simulate")


def test_tune_help_says_a_model_spec_needs_emulated_compute(capsys, monkeypatch):
    """Issue 17, item 7: the help offers a model-spec YAML only with the mode that accepts it."""
    monkeypatch.setenv("COLUMNS", "400")
    with pytest.raises(SystemExit):
        main(["tune", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "model-spec YAML holds no code to train, so it is tuned only with --compute emulated" in text


def test_the_help_and_the_readme_give_the_same_model_syntax(capsys, monkeypatch):
    """Issue 29, item 5: `autosync tune --help` and the README's model table agree on the zoo form."""
    from autosync.sources import ZOO_FORM

    monkeypatch.setenv("COLUMNS", "400")
    for command in ("tune", "run", "inspect", "probe"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert ZOO_FORM in " ".join(capsys.readouterr().out.split()), command
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")) as f:
        readme = f.read()
    assert f"| `{ZOO_FORM.replace('|', chr(92) + '|')}` |" in readme   # (a | inside a table cell is escaped)


@pytest.mark.integration
def test_run_reports_a_strategy_for_another_model_before_ray_starts(rmsprop_model, tmp_path, capsys, monkeypatch):
    """Issue 17, item 7 (the optimizer check is bypassed so the strategy check is what fails)."""
    import autosync.runtime.optimizers as optimizers

    monkeypatch.setattr(optimizers, "check_model_optimizer", lambda model_def: None)
    strategy = tmp_path / "s.yaml"
    strategy.write_text("kind: strategy\nversion: 1\nvariables:\n- var: emb/embeddings\n  all_reduce: {}\n")
    assert main(["run", "--model", rmsprop_model, "--strategy", str(strategy)]) == 2
    err = capsys.readouterr().err
    assert str(strategy) in err and "emb/embeddings" in err and "Traceback" not in err


@pytest.mark.integration
def test_a_bad_count_before_xla_compiles_is_refused_before_ray_starts(rmsprop_model, tmp_path, capsys, monkeypatch):
    """AUTOSYNC_KERAS_XLA_AFTER is read where updates run; a typo is said by the command up front."""
    monkeypatch.setenv("AUTOSYNC_KERAS_XLA_AFTER", "later")
    assert main(["baselines", "--model", "zoo:ncf"]) == 2
    err = _one_error(capsys, "baselines")
    assert "AUTOSYNC_KERAS_XLA_AFTER='later': give a count of updates (0 compiles from the first) or 'off'" in err, err
