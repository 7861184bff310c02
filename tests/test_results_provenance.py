"""Issue 17: the committed benchmark results say which run measured each entry (the README's and the
benchmarks page's headline tables are checked against the files they are built from in
tests/test_headline_table.py)."""
from __future__ import annotations

import json
import os

import pytest

from tests.conftest import REPO

RESULTS = os.path.join(REPO, "benchmarks", "results")
FILES = sorted(f for f in os.listdir(RESULTS) if f.endswith(".json"))


def _entries(data) -> tuple[dict, bool]:
    """The per-entry records of a result file and whether each entry is a run of its own:
    ``models``, ``entries`` or ``transports`` (one entry per model or measured configuration, normally of one
    run), ``runs`` (one entry per run, e.g. per testbed shape), a list of rows (each recording its
    run); a file of none of these kinds is one run as a whole."""
    if isinstance(data, list):
        return {f"row {i}": row for i, row in enumerate(data)}, True
    for key in ("models", "entries", "transports"):
        if isinstance(data.get(key), dict):
            return data[key], False
    if isinstance(data.get("runs"), dict):
        return data["runs"], True
    return {"(whole file)": data}, False


@pytest.mark.parametrize("name", FILES)
def test_every_entry_records_its_run_or_says_it_is_unknown(name):
    with open(os.path.join(RESULTS, name)) as f:
        data = json.load(f)
    runs = set()
    entries, per_run = _entries(data)
    for model, entry in entries.items():
        keys = [k for k in ("run_started", "started", "started_at", "started_utc") if k in entry]
        assert keys and "commit" in entry, f"{name}: {model} has no start time/commit"
        started = entry[keys[0]]
        if started is None or entry["commit"] is None:
            assert entry.get("provenance"), f"{name}: {model}: unknown provenance must be said in 'provenance'"
        runs.add(started)
    if len(runs) > 1 and not per_run:
        assert isinstance(data, dict) and data.get("meta", {}).get("mixed_runs"), f"{name} holds entries of several runs without saying so"

