"""``benchmarks/sparse_allreduce.py``: bad arguments exit 2 before any testbed starts; the
summary's ratios against the reference measured in the same run; a failed strategy is said so."""
from __future__ import annotations

import os

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--steps", "0"], ["--warmup", "-1"]])
def test_bad_numbers_exit_2_naming_the_rule(monkeypatch, capsys, argv):
    monkeypatch.syspath_prepend(BENCHMARKS)
    import sparse_allreduce

    assert sparse_allreduce.main(argv) == 2
    assert "--rounds and --steps must be >= 1" in capsys.readouterr().err


def test_the_inside_half_outside_a_testbed_exits_2(monkeypatch, capsys):
    monkeypatch.syspath_prepend(BENCHMARKS)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    import sparse_allreduce

    assert sparse_allreduce.main(["--inside"]) == 2
    assert "inside the testbed's host0" in capsys.readouterr().err


def test_summary_compares_each_strategy_with_the_reference_and_the_bounds(monkeypatch):
    monkeypatch.syspath_prepend(BENCHMARKS)
    import sparse_allreduce

    trials = [{"label": label, "median_s": t} for label, t in
              (("ps_lb", 0.010), ("all_reduce", 0.021), ("ps_lb", 0.012), ("all_reduce", 0.019),
               ("parallax", None), ("all_reduce", None))]
    bound = {"overlapped_s": 0.004, "serial_s": 0.005}
    got = sparse_allreduce.summarize({"trials": trials, "lower_bound": {k: bound for k in ("all_reduce", "parallax",
                                                                                          "ps_lb")}})
    assert got["ps_lb"]["ms"] == pytest.approx(11.0) and got["ps_lb"]["vs_ps_lb"] == 1.0
    row = got["all_reduce"]
    assert row["ms"] == pytest.approx(20.0) and row["range_ms"] == [19.0, 21.0]
    assert row["vs_ps_lb"] == pytest.approx(20 / 11, abs=1e-3)
    assert row["vs_lower_bound"] == pytest.approx(5.0) and row["vs_serial_bound"] == pytest.approx(4.0)
    assert got["parallax"] == {"failed": True}


def test_a_trial_is_kept_and_printed_with_its_median_or_its_error(monkeypatch, capsys):
    from types import SimpleNamespace

    monkeypatch.syspath_prepend(BENCHMARKS)
    from _testbed import say_trial, trial_record

    ok = SimpleNamespace(status="ok", error="", ok=True, median=0.0123, median_ci=(0.012, 0.0126),
                         step_times=[0.0121234, 0.0125], breakdown={"compute": 0.001, "sync": 0.0113})
    rec = trial_record(ok)
    assert rec["median_s"] == 0.0123 and rec["median_ci95_s"] == [0.012, 0.0126] and rec["error"] is None
    assert rec["step_times_s"] == [0.01212, 0.0125]
    failed = trial_record(SimpleNamespace(status="failed", error="worker died", ok=False, median=None, median_ci=None,
                                          step_times=[], breakdown={}))
    assert failed["median_s"] is None and failed["breakdown_s"] is None
    say_trial("ps_lb", rec)
    say_trial("all_reduce", failed)
    out = capsys.readouterr().out.splitlines()
    assert out == ["  ps_lb: 12.3 ms, phases ms {'compute': 1.0, 'sync': 11.3}", "  all_reduce: worker died, phases ms {}"]
