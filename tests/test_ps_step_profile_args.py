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


@pytest.mark.parametrize("builders", [["all_reduce"], ["ps", "nope"]])
def test_builders_that_are_not_ps_builders_exit_2_naming_them(monkeypatch, capsys, builders):
    """all_reduce is the reference, always measured: asked for as a PS builder it used to replace
    the reference's entry and fail on the staleness option; an unknown name failed with a traceback."""
    monkeypatch.syspath_prepend(BENCHMARKS)
    import ps_step_profile

    assert ps_step_profile.main(["--builders", *builders]) == 2
    err = capsys.readouterr().err
    assert f"got {builders[-1]}" in err and "ps_lb" in err and "Traceback" not in err
    assert ps_step_profile.main(["--builders", "parallax", "ps", "--staleness", "0", "2"]) == 2
    assert "parallax has none" in capsys.readouterr().err


def test_the_default_builders_build_parallax_included(monkeypatch):
    """parallax has no staleness option; at staleness 0 it is built as it is (the default
    ``--builders`` failed on it once the staleness bounds came in)."""
    monkeypatch.syspath_prepend(BENCHMARKS)
    import ps_step_profile
    from tests.fakes import three_node_cluster, tiny_model

    got = ps_step_profile.profiled_strategies(tiny_model(), three_node_cluster(), list(ps_step_profile.BUILDERS), [0])
    assert list(got) == ["all_reduce", *ps_step_profile.BUILDERS]


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
