"""``benchmarks/analytic_by_builder.py``: measured / predicted step time per group and builder."""
from __future__ import annotations

import importlib
import json
import os
import sys

import pytest

from tuner.synthetic.runner import make_dataset

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
A = importlib.import_module("analytic_by_builder")


def test_ratios_per_group_and_builder_are_measured_over_predicted():
    groups = make_dataset(n_models=1, n_clusters_each=1, per_group=10, seed=3, include_configs=False)
    got = A.ratios(groups)
    [(key, row)] = got["groups"].items()
    assert "parallax" in row and row["all"] > 0
    # a world twice as slow as measured doubles every ratio
    import dataclasses

    slow = [(m, c, [dataclasses.replace(t, step_times=tuple(2 * x for x in t.step_times)) for t in ts])
            for m, c, ts in groups]
    assert A.ratios(slow)["groups"][key]["parallax"] == pytest.approx(2 * row["parallax"])


def test_runs_are_kept_apart_and_a_bad_store_exits_2(tmp_path, capsys):
    out = tmp_path / "r.json"
    out.write_text(json.dumps({"what": "x", "runs": {"old@t": {"commit": "old"}}}))
    assert A.main(["--out", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert "old@t" in runs and len(runs) == 2
    new = next(v for k, v in runs.items() if k != "old@t")
    assert new["store"] == "builtin" and new["overall"]["all_reduce"] > 0 and new["run_started"]
    bad = tmp_path / "bad.db"
    bad.write_text("not a store")
    assert A.main(["--store", str(bad)]) == 2
    assert "analytic_by_builder:" in capsys.readouterr().err
