"""``benchmarks/held_step_prediction.py``: measured clipped/plain step ratios read from a
``ps_step_profile`` result, beside what the cost model predicts for the same model with and without
``global_clipnorm``."""
from __future__ import annotations

import json
import os
import sys

import pytest

from tests.conftest import REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import held_step_prediction as H  # noqa: E402


def _trial(builder, median_s, status="ok"):
    return {"builder": builder, "status": status, "median_s": median_s}


def _measured(tmp_path):
    """Two runs, each the plain zoo model and its clipped copy (``clipped_models.py``), one model
    order per run; a failed trial and the all-reduce baseline are left out of the ratios."""
    runs = {}
    for i, (commit, order) in enumerate((("abc1234", 1), ("abc1234", -1))):
        models = {"ncf": {"trials": [_trial("ps", 0.006 + i * 1e-3), _trial("partitioned_ps", 0.008),
                                     _trial("all_reduce", 0.004)]},
                  "/x/benchmarks/clipped_models.py:ncf": {"trials": [_trial("ps", 0.009 + i * 1e-3),
                                                                     _trial("partitioned_ps", 0.0088),
                                                                     _trial("ps", 1.0, status="failed")]}}
        runs[f"run_{i + 1}"] = {"commit": commit, "run_started": f"2026-11-28 0{i}:00:00",
                                "models": dict(list(models.items())[::order])}
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"runs": runs}))
    return str(path)


def test_measured_ratios_pair_each_builder_plain_with_clipped(tmp_path):
    got, runs = H.measured_ratios(_measured(tmp_path))
    assert sorted(got) == ["partitioned_ps", "ps"]
    assert got["ps"] == {"plain": pytest.approx([6.0, 7.0]), "clipped": pytest.approx([9.0, 10.0])}
    assert got["partitioned_ps"]["clipped"] == pytest.approx([8.8, 8.8])
    assert [r["run_started"] for r in runs] == ["2026-11-28 00:00:00", "2026-11-28 01:00:00"]


def test_a_held_single_ps_is_predicted_slower_than_a_held_partitioned_one(tmp_path, capsys):
    """On the shipped dataset's ncf group (2 nodes at 200 Mbit/s): a held step pipelines nothing, so
    global clipping costs the one PS node (whose tables pipelined) more than a PS partitioned over
    both nodes (whose pushes and pulls use both directions of each link at once already)."""
    out = tmp_path / "o.json"
    assert H.main(["--measured", _measured(tmp_path), "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["builders"]
    assert rows["ps"]["measured_ratio"] == pytest.approx(9.5 / 6.5)
    assert rows["ps"]["analytic_ratio"] > 1.2 and rows["partitioned_ps"]["analytic_ratio"] > 1.0
    for kind in ("analytic_ratio", "simulator_ratio"):
        assert rows["ps"][kind] > rows["partitioned_ps"][kind] + 0.1, kind
    assert "ncf-small on testbed, 2 nodes at 0.2 Gbit/s" in capsys.readouterr().out


def test_emulated_measurements_of_a_model_spec_and_runs_without_a_clipped_copy(tmp_path):
    """With ``--compute emulated --model-spec``: the spec's own (GPU-measured) compute, no CPU
    contention; a single PS's held step is still predicted dearer than a partitioned one's. A run
    that does not pair a plain model with a clipped copy is refused, not silently averaged."""
    spec = os.path.join(REPO, "configs", "models", "nvidia-h200", "ncf-small.yaml")
    out = tmp_path / "o.json"
    assert H.main(["--measured", _measured(tmp_path), "--compute", "emulated", "--model-spec", spec,
                   "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["compute"] == "emulated" and got["builders"]["ps"]["analytic_ratio"] > 1.2
    data = json.loads(open(_measured(tmp_path)).read())
    data["runs"]["run_1"]["models"].pop("/x/benchmarks/clipped_models.py:ncf")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(SystemExit, match="one plain model and its clipped copy"):
        H.measured_ratios(str(bad))
