"""tuner and strategy_space import without TensorFlow and Ray."""
from __future__ import annotations

import pkgutil
import subprocess
import sys

import tuner


def test_tuner_modules_import_without_tf_or_ray():
    # every module of every sub-package (walk_packages imports the packages, not their modules)
    mods = ["strategy_space"] + [m.name for m in pkgutil.walk_packages(tuner.__path__, "tuner.")]
    code = ("import sys, importlib\n"
            f"for m in {mods!r}:\n"
            "    importlib.import_module(m)\n"
            "bad = [m for m in ('tensorflow', 'ray', 'keras') if m in sys.modules]\n"
            "assert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert len(mods) >= 10
