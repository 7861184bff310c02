"""Issue 28 ("Hardening II"): the twelve cases a new user met through the public commands, each
checked where it broke. Fast tests call ``main`` in-process (Ray and TensorFlow must not load: the
conftest guard makes that an error); the few that need Ray or TensorFlow are marked integration."""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import pytest

from autosync.cli import main
from strategy_space import ConfigError, load, save
from strategy_space.builders import get_builder
from tests.conftest import REPO
from tests.fakes import three_node_cluster, tiny_model
from tuner.constraints import load_constraints


def _files(root) -> dict[str, bytes]:
    return {os.path.relpath(os.path.join(d, f), root): open(os.path.join(d, f), "rb").read()
            for d, _, fs in os.walk(root) for f in fs}


def _one_error(capsys, command: str) -> str:
    out, err = capsys.readouterr()
    assert err.startswith(f"autosync {command}: error: ") and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    return err


@pytest.fixture
def specs(tmp_path):
    save(tiny_model(profile=True), tmp_path / "model.yaml")
    save(three_node_cluster(), tmp_path / "cluster.yaml")
    save(get_builder("ps").build(tiny_model(), three_node_cluster()), tmp_path / "strategy.yaml")
    return tmp_path


# -- item 3: memory of a YAML file bounded by a stated multiple of its size --

_MEASURE = """
import resource, sys, time
from strategy_space import ConfigError, load
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.monotonic()
try:
    load(sys.argv[1], "strategy")
    outcome = "loaded"
except ConfigError as e:
    outcome = "refused"
print(outcome, time.monotonic() - t, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


@pytest.mark.parametrize("line", ["- {a: 1}\n", "- 1\n", "- [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]\n"],
                         ids=["flow-mappings", "flat-list", "nested-lists"])
def test_item3_loading_a_dense_yaml_file_costs_a_bounded_multiple_of_its_size(tmp_path, line):
    """Before: ~210 bytes of memory per byte of the file (a 10 MB list took 2.2 GB and 30 s)."""
    from strategy_space._yaml_limits import MAX_BYTES_PER_INPUT_BYTE

    path = tmp_path / "dense.yaml"
    size = 1_000_000
    path.write_text("kind: strategy\nvariables:\n" + line * (size // len(line)))
    proc = subprocess.run([sys.executable, "-c", _MEASURE, str(path)], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    outcome, seconds, grown = proc.stdout.split()
    assert outcome == "refused", proc.stderr[-2000:]
    per_byte = float(grown) / path.stat().st_size
    assert per_byte < MAX_BYTES_PER_INPUT_BYTE, f"{per_byte:.0f} bytes of memory per byte of the file"
    assert float(seconds) < 10


def test_item3_a_file_over_the_cap_is_refused_before_it_is_read(tmp_path):
    from strategy_space._yaml_limits import MAX_FILE_BYTES

    path = tmp_path / "big.yaml"
    with open(path, "w") as f:
        f.truncate(MAX_FILE_BYTES + 1)
    t = time.monotonic()
    with pytest.raises(ConfigError, match=r"MiB, more than the 4 MiB"):
        load(path, "strategy")
    assert time.monotonic() - t < 1


def test_item3_a_list_of_a_million_bad_items_stops_after_its_first_problems():
    from strategy_space import loads
    from strategy_space.strict import MAX_PROBLEMS_KEPT

    with pytest.raises(ConfigError) as info:
        loads("kind: strategy\nvariables: [" + "1, " * 300_000 + "1]\n")
    assert len(info.value.problems) == MAX_PROBLEMS_KEPT + 1
    assert "stopped reading at item 200 of 300001" in info.value.problems[-1]
