"""Issue 29: TensorFlow's start-up log lines are silenced unless asked for (``autosync.tflog``).

A stand-in package whose import writes what TensorFlow's does to file descriptor 2 takes
TensorFlow's place here (no TensorFlow in these tests); ``test_cli_models`` checks a real command.
"""
from __future__ import annotations

import os
import re
import sys

import pytest

from autosync import tflog

NOISE = [
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "I0000 00:00:1795585847.434709   30539 cudart_stub.cc:31] Could not find cuda drivers on your machine, "
    "GPU will not be used.",
    "W0000 00:00:1795585847.5   30539 cpu_feature_guard.cc:227] This TensorFlow binary is optimized",
    "To enable the following instructions: AVX2 FMA, in other operations, rebuild TensorFlow.",
]
KEPT = ["E0000 00:00:1795585847.6   30539 cuda_platform.cc:52] failed call to cuInit", "a line of the user's own"]


@pytest.fixture
def standin(tmp_path, monkeypatch):
    """A package ``standin_tf_<n>`` that prints TensorFlow's start-up lines (twice) and two lines
    that must survive, through file descriptor 2 as C++ code does."""
    name = "standin_tf_" + re.sub(r"\W", "_", tmp_path.name)   # a new package per test: imported once
    pkg = tmp_path / name
    pkg.mkdir()
    lines = NOISE + KEPT[:1] + NOISE + KEPT[1:]
    (pkg / "__init__.py").write_text("import os\n" + "".join(f"os.write(2, {(ln + chr(10)).encode()!r})\n" for ln in lines)
                                     + "VALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.delenv(tflog.ENV, raising=False)
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    yield name
    sys.modules.pop(name, None)


def test_the_first_import_loses_the_startup_noise_and_keeps_the_rest(standin, capfd):
    import importlib

    tflog.quiet_startup((standin,))
    assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == "2"
    module = importlib.import_module(standin)
    assert module.VALUE == 42 and module.__spec__.loader is not None
    err = capfd.readouterr().err
    assert err.splitlines() == KEPT
    # one import, then gone (a command run in this process earlier may have left one for tensorflow)
    assert not any(isinstance(f, tflog._QuietImport) and standin in f.modules for f in sys.meta_path)


def test_autosync_tf_logs_shows_everything(standin, capfd, monkeypatch):
    import importlib

    monkeypatch.setenv(tflog.ENV, "1")
    tflog.quiet_startup((standin,))
    assert "TF_CPP_MIN_LOG_LEVEL" not in os.environ
    importlib.import_module(standin)
    assert capfd.readouterr().err.splitlines() == NOISE + KEPT[:1] + NOISE + KEPT[1:]


def test_an_import_that_fails_shows_all_it_printed(tmp_path, standin, capfd):
    import importlib

    init = tmp_path / standin / "__init__.py"
    init.write_text(init.read_text() + "raise RuntimeError('broken install')\n")
    tflog.quiet_startup((standin,))
    with pytest.raises(RuntimeError, match="broken install"):
        importlib.import_module(standin)
    assert capfd.readouterr().err.splitlines() == NOISE + KEPT[:1] + NOISE + KEPT[1:]


def test_an_import_stopped_from_outside_keeps_its_startup_noise_out(tmp_path, standin, capfd):
    """The time or memory limit on the user's code (``time_limit.Overrun``), or Ctrl-C, stopping
    the import: the command says why in one line, with none of TensorFlow's start-up lines."""
    import importlib

    from autosync.time_limit import Overrun

    init = tmp_path / standin / "__init__.py"
    init.write_text(init.read_text() + "from autosync.time_limit import Overrun\nraise Overrun()\n")
    tflog.quiet_startup((standin,))
    with pytest.raises(Overrun):
        importlib.import_module(standin)
    assert capfd.readouterr().err.splitlines() == KEPT


def test_a_user_setting_of_the_cpp_log_level_is_kept(standin, monkeypatch):
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "0")
    tflog.quiet_startup((standin,))
    assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == "0"


@pytest.mark.parametrize("call", ["tune", "make_runner", "make_trainer"])
def test_the_python_api_silences_the_startup_before_it_loads_a_model(call, monkeypatch):
    """A script that calls the API before importing TensorFlow gets no start-up lines either: the
    entry points arrange it before anything can import TensorFlow (here the model name is bad, so
    the call stops right after)."""
    from autosync import api, tflog
    from strategy_space import ConfigError

    calls = []
    monkeypatch.setattr(tflog, "quiet_startup", lambda: calls.append(call))   # (through api's driver_startup)
    args = {"tune": ("zoo:no_such_model",), "make_runner": ("zoo:no_such_model",),
            "make_trainer": ("zoo:no_such_model", "no_such_strategy.yaml")}[call]
    with pytest.raises(ConfigError):
        getattr(api, call)(*args)
    assert calls   # (tune asks again in make_runner: a no-op then)
