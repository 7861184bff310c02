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


def test_projected_time_to_target_divides_the_steps_by_the_efficiency():
    got = T.projected(150, {"tuned": (0.1, 0.5), "best_baseline": (0.3, 1.0), "unknown": (None, 1.0),
                            "unprobed": (0.2, None)})["contenders"]
    # a strategy half as efficient per step needs twice the steps: 300 x 0.1 s against 150 x 0.3 s
    assert got["tuned"]["steps_to_target"] == pytest.approx(300)
    assert got["tuned"]["time_to_target_s"] == pytest.approx(30.0)
    assert got["best_baseline"]["time_to_target_s"] == pytest.approx(45.0)
    assert got["unknown"]["time_to_target_s"] is None and got["unprobed"]["steps_to_target"] is None


def test_the_lossy_strategy_the_goodput_rule_turned_down_races_only_when_it_would_have_won(monkeypatch):
    from types import SimpleNamespace as NS

    import tuner.records.goodput as goodput

    monkeypatch.setattr(goodput, "lossy_parts", lambda s: NS(describe=lambda: f"lossy {s}"))
    tvb = importlib.import_module("tune_vs_baselines")
    eff = {"fast_bad": NS(value=0.6, low=0.5, high=0.7, probed=True),       # 0.1 / 0.6 = 0.167 s
           "slower_bad": NS(value=0.9, low=0.8, high=1.0, probed=True),     # 0.2 / 0.9 = 0.222 s
           "good": NS(value=0.97, low=0.9, high=1.0, probed=True)}          # above the guard
    trials = {k: NS(strategy=k, origin="search", median=m) for k, m in
              (("fast_bad", 0.1), ("slower_bad", 0.2), ("good", 0.19), ("base", 0.3))}

    def outcome(quality="goodput"):
        return NS(quality=quality, min_efficiency=0.95, measured=lambda: trials,
                  efficiency_of=lambda s: eff.get(s, NS(value=1.0, probed=False)),
                  figure=lambda t: t.median / eff.get(t.strategy, NS(value=1.0)).value)

    got = tvb.best_rejected_lossy(outcome(), trials["good"])   # recommended: 0.19 / 0.97 = 0.196 s
    assert got["strategy"] == "fast_bad" and got["goodput_s"] == pytest.approx(0.1 / 0.6)
    assert got["lossy_parts"] == "lossy fast_bad" and got["statistical_efficiency"] == 0.6
    # nothing turned down beats a recommendation of 0.15 s per lossless step; step quality has no guard
    assert tvb.best_rejected_lossy(outcome(), NS(strategy="base", median=0.15)) is None
    assert tvb.best_rejected_lossy(outcome("step"), trials["good"]) is None


def test_time_to_target_verdicts_use_the_measurement_and_fall_back_to_the_projection():
    tvb = importlib.import_module("tune_vs_baselines")
    measured = {"speedup_vs_best_baseline": 1.35, "intervals_overlap": True, "speedup_vs_peer": 1.4,
                "contenders": {"ray_train": {}}}
    checks = {what: ok for what, ok, _ in tvb.time_to_target_checks(
        {"embedding_heavy": True, "time_to_target": measured, "time_to_target_projected": {"speedup_vs_best_baseline": 2.0}})}
    assert checks == {"time to target (measured) >= 1.0x the best baseline": True,
                      "time to target (measured) >= 1.3x the best baseline, intervals apart": False,   # overlap
                      "time to target >= 1.5x Ray Train": False}
    projected = tvb.time_to_target_checks({"embedding_heavy": False,
                                           "time_to_target_projected": {"speedup_vs_best_baseline": 0.9}})
    assert [(what, ok) for what, ok, _ in projected] == [("time to target (projected) >= 1.0x the best baseline", False)]
    assert tvb.time_to_target_checks({"embedding_heavy": True}) == []


def test_the_lower_bound_verdict_holds_real_compute_to_1_5x_and_emulated_to_1_3x():
    tvb = importlib.import_module("tune_vs_baselines")

    def verdict(compute, ratio):
        r = {"model": "toy", "compute": compute, "embedding_heavy": False, "speedup_vs_best_baseline": 1.0,
             "speedup_vs_peer": None, "tune": {"trials_to_within_5pct": 3}, "vs_lower_bound": ratio}
        return [line for line in tvb.verdicts({"models": {"toy": r}}) if "lower bound" in line][0]

    assert verdict("real", 1.4).endswith("1.40x -> MET") and "<= 1.5x" in verdict("real", 1.4)
    assert verdict("emulated", 1.4).endswith("1.40x -> MISSED") and "<= 1.3x" in verdict("emulated", 1.4)


def test_a_results_meta_names_a_store_beside_it_by_its_file_name(tmp_path):
    """The result file and its trial store travel together (a scratch folder, then
    ``benchmarks/results``): the meta names the store by its file name, not a scratch path."""
    tvb = importlib.import_module("tune_vs_baselines")
    out = tmp_path / "out"
    assert tvb.store_label(str(out / "run.db"), str(out)) == "run.db"
    assert tvb.store_label(os.path.join(str(out), "..", "out", "run.db"), str(out) + "/") == "run.db"
    elsewhere = str(tmp_path / "stores" / "run.db")
    assert tvb.store_label(elsewhere, str(out)) == elsewhere
