"""benchmarks/simulator_accuracy.py: a bad --splits stops before any data loads; the standard error
it reports over the splits."""
from __future__ import annotations

import importlib
import os
import sys

import numpy as np

from tests.conftest import REPO

BENCH = os.path.join(REPO, "benchmarks")


def _module():
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    return importlib.import_module("simulator_accuracy")


def test_splits_below_one_is_refused_with_exit_2(capsys, monkeypatch):
    sa = _module()
    monkeypatch.setattr(sa, "real", lambda args: (_ for _ in ()).throw(AssertionError("loaded the store")))
    assert sa.main(["--store", "builtin", "--splits", "0"]) == 2
    assert "--splits must be >= 1, got 0" in capsys.readouterr().err


def test_standard_error_of_the_split_means():
    sa = _module()
    v = [0.8, 0.84, 0.76, 0.82]
    assert np.isclose(sa._se(v), np.std(v, ddof=1) / 2.0)
    assert np.isnan(sa._se([0.8]))


def test_negative_warm_splits_is_refused_with_exit_2(capsys, monkeypatch):
    sa = _module()
    monkeypatch.setattr(sa, "real", lambda args: (_ for _ in ()).throw(AssertionError("loaded the store")))
    assert sa.main(["--store", "builtin", "--warm-splits", "-1"]) == 2
    assert "--warm-splits must be >= 0, got -1" in capsys.readouterr().err
