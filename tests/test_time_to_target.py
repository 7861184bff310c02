"""The time-to-target rules of the headline benchmark (``benchmarks/_time_to_target.py``): when a
run counts as at the target and from when its time is counted."""
from __future__ import annotations

import importlib
import os
import sys

import pytest

from tests.conftest import REPO

BENCH = os.path.join(REPO, "benchmarks")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)
T = importlib.import_module("_time_to_target")


def test_the_target_counts_on_the_mean_of_a_full_window():
    losses = [5.0, 1.0, 4.0, 3.0, 2.0, 2.0, 1.0]
    assert T.crossing(losses, 1.0, 1) == 1          # one step is enough with a window of one
    # means of three: 3.33, 2.67, 3.0, 2.33, 1.67 (at indices 2 to 6)
    assert T.crossing(losses, 2.0, 3) == 6
    assert T.crossing(losses, 2.5, 3) == 5
    assert T.crossing(losses, 2.67, 3) == 3
    assert T.crossing(losses, 0.5, 2) is None
    assert T.crossing([0.1, 0.1], 1.0, 3) is None   # a low loss before the window is full does not count


def test_time_to_target_runs_from_the_end_of_the_first_step():
    run = {"losses": [3.0, 2.0, 1.0, 1.0, 0.5], "ends": [10.0, 10.5, 11.0, 11.5, 12.0]}
    got = T._outcome(run, 1.0, 2)
    assert got["reached"] and got["steps_to_target"] == 4 and got["time_to_target_s"] == pytest.approx(1.5)
    assert got["median_step_s"] == pytest.approx(0.5)
    missed = T._outcome(run, 0.1, 2)
    assert not missed["reached"] and missed["time_to_target_s"] is None
    assert missed["final_smoothed_loss"] == pytest.approx(0.75)
