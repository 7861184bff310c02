"""``benchmarks/early_push.py``: bad arguments exit 2 before any testbed starts; the summary's ratios."""
from __future__ import annotations

import os

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--steps", "0"], ["--warmup", "-1"]])
def test_bad_numbers_exit_2_naming_the_rule(monkeypatch, capsys, argv):
    monkeypatch.syspath_prepend(BENCHMARKS)
    import early_push

    assert early_push.main(argv) == 2
    assert "--rounds and --steps must be >= 1" in capsys.readouterr().err


def test_summary_compares_the_modes_and_the_yardstick(monkeypatch):
    monkeypatch.syspath_prepend(BENCHMARKS)
    import early_push

    trials = [{"label": label, "mode": mode, "median_s": t} for label, mode, t in (
        ("parallax", "early", 0.030), ("parallax", "after", 0.040), ("parallax", "early", 0.034),
        ("parallax", "after", 0.044), ("parallax", "after", None), ("ps_lb", "early", 0.024))]
    bounds = {"parallax": {"overlapped_s": 0.01}, "ps_lb": {"overlapped_s": 0.012}}
    got = early_push.summarize({"trials": trials, "lower_bound": bounds})
    early, after, ps = got["parallax@early"], got["parallax@after"], got["ps_lb@early"]
    assert early["median_ms"] == pytest.approx(32.0) and after["range_ms"] == [40.0, 44.0]
    assert early["speedup"] == pytest.approx(42 / 32, abs=1e-3) and "speedup" not in after
    assert early["vs_ps_lb"] == pytest.approx(24 / 32, abs=1e-3)
    assert after["vs_ps_lb"] == pytest.approx(24 / 42, abs=1e-3)
    assert early["vs_lower_bound"] == pytest.approx(3.2) and ps["vs_lower_bound"] == pytest.approx(2.0)


def test_a_trial_in_a_mode_runs_under_that_modes_environment_and_leaves_none_behind(monkeypatch):
    monkeypatch.syspath_prepend(BENCHMARKS)
    from _testbed import trial_in_mode

    from strategy_space.builders import get_builder
    from tests.fakes import three_node_cluster, tiny_model
    from tuner.records.trial import Trial

    seen = []

    class Runner:
        def run_one(self, strategy, label):
            seen.append(os.environ.get("AUTOSYNC_EARLY_PUSH"))
            if label == "boom":
                raise RuntimeError("trial broke")
            return Trial(strategy, "m", "c", "failed", error="not measured")

    modes = {"early": {}, "after": {"AUTOSYNC_EARLY_PUSH": "0"}}
    strategy = get_builder("ps").build(tiny_model(), three_node_cluster())
    monkeypatch.setenv("AUTOSYNC_EARLY_PUSH", "stale")
    rec = trial_in_mode(Runner(), strategy, "a", modes, "after")
    assert rec["status"] == "failed" and rec["error"] == "not measured"
    trial_in_mode(Runner(), strategy, "b", modes, "early")
    with pytest.raises(RuntimeError, match="trial broke"):
        trial_in_mode(Runner(), strategy, "boom", modes, "after")
    assert seen == ["0", None, "0"] and "AUTOSYNC_EARLY_PUSH" not in os.environ
