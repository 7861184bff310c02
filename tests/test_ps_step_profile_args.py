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
