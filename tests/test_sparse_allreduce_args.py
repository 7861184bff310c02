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
