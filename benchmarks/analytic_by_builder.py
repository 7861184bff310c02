"""Where the analytic cost model misses: measured / predicted step time of every ok trial in a
trial store, its median per (shape, model) group and per builder (baselines by name, the search's
picks as ``search``), and over the whole store. A builder whose ratio stands apart from the others'
in its groups is work the model does not count.

    python benchmarks/analytic_by_builder.py [--store builtin] [--out FILE]

``--out`` adds this run (commit, start, store) to FILE under its own key and keeps the runs already
there: a run of another commit stays beside it, never merged into it.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _testbed import git_commit, warm_start_groups, write_json  # noqa: E402
from tuner.features.batch import COL  # noqa: E402
from tuner.records.dataset import featurize_trials  # noqa: E402


def shape_of(cluster) -> str:
    if cluster.name != "testbed":
        return f"{cluster.name}:{cluster.compute}"
    return f"{len(cluster.nodes)}x{cluster.nodes[0].bandwidth_gbps * 1000:g}mbit:{cluster.compute}"


def ratios(groups) -> dict:
    """``{"groups": {"SHAPE MODEL": {"all": median, BUILDER: median, ...}}, "overall": {BUILDER: median}}``
    of measured / analytic step time (the search's own picks, explorations included, as ``search``)."""
    per_group, overall = {}, collections.defaultdict(list)
    for model, cluster, trials in groups:
        ok = [t for t in trials if t.ok]
        X, y = featurize_trials(model, cluster, ok)
        if not len(y):
            continue
        r = y / X[:, COL["analytic_s"]]
        by = collections.defaultdict(list)
        for t, value in zip(ok, r):
            by["search" if t.origin == "explore" else t.origin].append(float(value))
        per_group[f"{shape_of(cluster)} {model.name}"] = {"all": float(np.median(r)),
                                                         **{b: float(np.median(v)) for b, v in sorted(by.items())}}
        for b, v in by.items():
            overall[b] += v
    return {"groups": per_group, "overall": {b: float(np.median(v)) for b, v in sorted(overall.items())}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", default="builtin", help="builtin (the shipped dataset) or a trial store file")
    ap.add_argument("--out", help="add this run to this JSON file")
    args = ap.parse_args(argv)
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    groups = warm_start_groups(args.store, "analytic_by_builder")
    if groups is None:
        return 2
    got = ratios(groups)
    print("measured / analytic step time, median per group (all trials, then per builder):")
    for key, row in got["groups"].items():
        rest = "  ".join(f"{b} {v:.2f}" for b, v in row.items() if b != "all")
        print(f"  {key:36s} {row['all']:.2f} | {rest}")
    print("over the store: " + "  ".join(f"{b} {v:.2f}" for b, v in got["overall"].items()))
    if args.out:
        data = {"what": "measured / analytic step time per group and builder (benchmarks/analytic_by_builder.py)",
                "runs": {}}
        if os.path.exists(args.out):
            with open(args.out) as f:
                data = json.load(f)
        commit = git_commit(REPO)
        data["runs"][f"{commit}@{started}"] = {"commit": commit, "run_started": started, "store": args.store, **got}
        write_json(args.out, data)
        print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
