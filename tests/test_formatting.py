"""autosync.formatting: how errors and strategies are put in tables (no Ray, no TensorFlow)."""
import pytest

from autosync.formatting import headline
from strategy_space import ConfigError


@pytest.mark.parametrize("error, cell", [
    (str(ConfigError(["variable out/kernel has a constraint (MaxNorm)", "variable h/kernel has one too"])),
     "variable out/kernel has a constraint (MaxNorm) (and 1 more)"),   # was "2 problems:"
    (str(ConfigError(["a", "b", "c"])), "a (and 2 more)"),
    (str(ConfigError("one problem alone")), "one problem alone"),
    ("worker node0:0 failed: RuntimeError: boom\nTraceback ...", "worker node0:0 failed: RuntimeError: boom"),
    ("", ""),
    (None, ""),
])
def test_a_failed_trial_s_cell_heads_with_its_first_problem(error, cell):
    assert headline(error) == cell
