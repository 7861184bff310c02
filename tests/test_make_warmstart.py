"""benchmarks/make_warmstart.py's shapes: testbed shapes and the one-node ``local`` cluster."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import make_warmstart  # noqa: E402


@pytest.mark.parametrize("shape, ok", [("2x200mbit", True), ("3x100mbit:emulated", True), ("local", True),
                                       ("local:emulated", True), ("local:gpu", False), ("localhost", False),
                                       ("x200mbit", False)])
def test_shapes(shape, ok):
    assert bool(make_warmstart.TESTBED_RE.match(shape) or make_warmstart.LOCAL_RE.match(shape)) == ok


def test_bad_shapes_and_models_exit_2_saying_what_is_valid(capsys):
    assert make_warmstart.main(["--testbeds", "local", "lan", "--models", "ncf"]) == 2
    err = capsys.readouterr().err
    assert "testbeds ['lan']" in err and "local[:COMPUTE]" in err
    assert make_warmstart.main(["--testbeds", "local", "--models", "gpt5"]) == 2
    assert "models ['gpt5']" in capsys.readouterr().err
