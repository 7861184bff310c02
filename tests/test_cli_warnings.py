"""AutoSync's own warnings on the command line: said as the command's (``autosync CMD: warning:``),
on the terminal even while Ray's output goes to a log; the data warning when the command ends;
other libraries' warnings as Python shows them."""
from __future__ import annotations

import os
import warnings

import autosync.models
from autosync.cli import _warnings
from autosync.cli.raylog import ray_output_to_log
from autosync.runtime.data_check import DivergedWarning, SameDataWarning

OURS = os.path.join(os.path.dirname(autosync.models.__file__), "ingest.py")


def _as_python_shows(message, category, filename, lineno, file=None, line=None):
    """Python's own way of showing a warning, on file descriptor 2 (pytest records them instead)."""
    os.write(2, warnings.formatwarning(message, category, filename, lineno, line).encode())


def test_autosyncs_own_warning_reaches_the_terminal_while_rays_output_goes_to_a_log(capfd):
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = _as_python_shows
        with _warnings("tune"), ray_output_to_log("tune") as log:
            warnings.warn_explicit("model m: bn normalizes with synchronized=True", UserWarning, OURS, 10)
            warnings.warn_explicit("the same first batch", SameDataWarning, OURS, 20)
            warnings.warn_explicit("its loss became nan", DivergedWarning, OURS, 21)
            warnings.warn_explicit("a library's own notice", DeprecationWarning, "/elsewhere/lib.py", 30)
            out, err = capfd.readouterr()
            assert out == ""
            # said at once, on the terminal, as the command's own line: no file, line or category
            assert err == "autosync tune: warning: model m: bn normalizes with synchronized=True\n"
        log_path = log.path
    out, err = capfd.readouterr()
    # the library's warning went where Ray's output goes (the log, named), the data warning comes last
    assert log_path is not None and "autosync tune: Ray's own messages are in" in err
    assert err.rstrip("\n").splitlines()[-2:] == ["autosync tune: warning: the same first batch",
                                                 "autosync tune: warning: its loss became nan"]
    with open(log_path) as f:
        logged = f.read()
    os.remove(log_path)
    assert "DeprecationWarning: a library's own notice" in logged and "synchronized" not in logged


def test_outside_a_ray_block_autosyncs_warning_is_one_line_on_stderr_and_others_keep_pythons_form(capfd):
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = _as_python_shows
        with _warnings("inspect"):
            warnings.warn_explicit("model m: the loss does not depend on 2 trainable variable(s)", UserWarning,
                                   OURS, 10)
            warnings.warn_explicit("a library's own notice", UserWarning, "/elsewhere/lib.py", 30)
    out, err = capfd.readouterr()
    lines = err.splitlines()
    assert out == "" and lines[0] == "autosync inspect: warning: model m: the loss does not depend on 2 trainable " \
                                     "variable(s)"
    assert "/elsewhere/lib.py:30: UserWarning: a library's own notice" in err
    assert "ingest.py" not in err
