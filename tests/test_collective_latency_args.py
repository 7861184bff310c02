"""``benchmarks/collective_latency.py``: bad arguments exit 2 before any testbed starts; the
compared strategies are valid and differ only in their fusion groups; the summary's arithmetic."""
from __future__ import annotations

import os

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--nodes", "1"], ["--warmup", "-1"]])
def test_bad_numbers_exit_2_naming_the_rule(monkeypatch, capsys, argv):
    monkeypatch.syspath_prepend(BENCHMARKS)
    import collective_latency

    assert collective_latency.main(argv) == 2
    assert "--nodes >= 2" in capsys.readouterr().err


def test_each_all_reduced_variable_gets_its_own_group_and_nothing_else_changes(monkeypatch):
    monkeypatch.syspath_prepend(BENCHMARKS)
    import collective_latency
    from strategy_space import PS, AllReduce, validate
    from tests.fakes import three_node_cluster, tiny_model

    model, cluster = tiny_model(), three_node_cluster()
    got = collective_latency.strategies(model, cluster)
    assert list(got) == ["ps_lb", "parallax", "parallax/each"]
    for s in got.values():
        validate(s, model, cluster)
    one, each = got["parallax"], got["parallax/each"]
    ar = [s for c in each.variables for s in c.synchronizers if isinstance(s, AllReduce)]
    assert ar and collective_latency.collectives(each) == len(ar) > collective_latency.collectives(one)
    for a, b in zip(one.variables, each.variables):
        for x, y in zip(a.synchronizers, b.synchronizers):
            assert type(x) is type(y) and (x == y if isinstance(x, PS) else x.backend == y.backend)
    assert all(isinstance(s, PS) for c in got["ps_lb"].variables for s in c.synchronizers)


def test_summary_takes_the_cost_of_a_collective_from_the_difference(monkeypatch):
    monkeypatch.syspath_prepend(BENCHMARKS)
    import collective_latency
    from tuner.features.alpha_beta import AlphaBeta

    trials = [{"label": l, "median_s": t} for l, t in (("ps_lb", 0.010), ("parallax", 0.013), ("parallax/each", 0.019),
                                                      ("ps_lb", 0.011), ("parallax", 0.014), ("parallax/each", 0.018),
                                                      ("parallax/each", None))]
    predicted = {"ps_lb": 0.006, "parallax": 0.0062, "parallax/each": 0.0072}
    got = collective_latency.summarize(trials, predicted, {"ps_lb": 0, "parallax": 1, "parallax/each": 6}, workers=2)
    assert got["strategies"]["parallax/each"]["measured_ms"] == pytest.approx(18.5)
    assert got["strategies"]["parallax/each"]["range_ms"] == [18.0, 19.0]
    assert got["per_collective_ms"] == pytest.approx((18.5 - 13.5) / 5, abs=1e-3)
    assert got["per_ring_step_ms"] == pytest.approx(0.5, abs=1e-3) and got["ring_steps_per_collective"] == 2
    assert got["model_per_collective_ms"] == pytest.approx(0.2, abs=1e-3)
    assert got["model_per_ring_step_ms"] == pytest.approx(AlphaBeta().alpha_step_s * 1e3)
