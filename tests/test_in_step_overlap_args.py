"""``benchmarks/in_step_overlap.py``: bad arguments exit 2 before any testbed starts; the compared
strategies are valid and grouped as said; the summary's ratios."""
from __future__ import annotations

import os

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--groups", "0"], ["--warmup", "-1"]])
def test_bad_numbers_exit_2_naming_the_rule(monkeypatch, capsys, argv):
    monkeypatch.syspath_prepend(BENCHMARKS)
    import in_step_overlap

    assert in_step_overlap.main(argv) == 2
    assert "--groups must be >= 1" in capsys.readouterr().err


def test_the_grouped_strategies_are_valid_and_compress_as_named(monkeypatch):
    monkeypatch.syspath_prepend(BENCHMARKS)
    import in_step_overlap
    from strategy_space import validate
    from tests.fakes import three_node_cluster, tiny_model

    model, cluster = tiny_model(), three_node_cluster()
    got = in_step_overlap.strategies(model, cluster, 2)
    assert list(got) == ["all_reduce", "parallax", "all_reduce/g2", "fp16/g2", "powersgd/g2"]
    for s in got.values():
        validate(s, model, cluster)
    for label, dense_matrix, other in (("fp16/g2", "fp16", "fp16"), ("powersgd/g2", "powersgd_ef(4)", "fp16_ef")):
        for c in got[label].variables:
            v, (sync,) = model.var(c.name), c.synchronizers
            want = "none" if v.sparse or "float" not in v.dtype else dense_matrix if len(v.shape) >= 2 else other
            assert sync.compressor == want
    assert len({c.synchronizers[0].group for c in got["all_reduce/g2"].variables}) == 2


def test_summary_compares_the_modes_and_the_bounds(monkeypatch):
    monkeypatch.syspath_prepend(BENCHMARKS)
    import in_step_overlap

    trials = [{"label": "s", "mode": m, "median_s": t} for m, t in
              (("in_step", 0.04), ("after", 0.05), ("in_step", 0.042), ("after", 0.048), ("after", None))]
    got = in_step_overlap.summarize({"trials": trials, "lower_bound": {"s": {"overlapped_s": 0.02, "serial_s": 0.04}}})
    row = got["s"]
    assert row["in_step_ms"] == pytest.approx(41.0) and row["after_ms"] == pytest.approx(49.0)
    assert row["after_range_ms"] == [48.0, 50.0] and row["speedup"] == pytest.approx(49 / 41, abs=1e-3)
    assert row["in_step_vs_lower_bound"] == pytest.approx(2.05) and row["after_vs_serial_bound"] == pytest.approx(1.225)
