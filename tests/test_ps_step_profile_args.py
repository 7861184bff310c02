"""``benchmarks/ps_step_profile.py``'s arguments: bad ones exit 2 before any testbed starts."""
from __future__ import annotations

import os

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


@pytest.mark.parametrize("argv", [["--staleness", "0", "-1"], ["--rounds", "0"], ["--warmup", "-1"]])
def test_bad_numbers_exit_2_naming_the_rule(monkeypatch, capsys, argv):
    monkeypatch.syspath_prepend(BENCHMARKS)
    import ps_step_profile

    assert ps_step_profile.main(argv) == 2
    assert "--warmup and --staleness >= 0" in capsys.readouterr().err


def test_each_ps_builder_is_profiled_at_each_staleness_bound(monkeypatch):
    monkeypatch.syspath_prepend(BENCHMARKS)
    import ps_step_profile
    from strategy_space import PS
    from tests.fakes import three_node_cluster, tiny_model

    got = ps_step_profile.profiled_strategies(tiny_model(), three_node_cluster(), ["ps", "partitioned_ps"], [0, 2])
    assert list(got) == ["all_reduce", "ps", "ps/s2", "partitioned_ps", "partitioned_ps/s2"]
    for key, strategy in got.items():
        bounds = {p.staleness for v in strategy.variables for p in v.synchronizers if isinstance(p, PS)}
        assert bounds == (set() if key == "all_reduce" else {2 if key.endswith("/s2") else 0}), key
