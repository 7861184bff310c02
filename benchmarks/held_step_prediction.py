"""What the cost model predicts a held step costs, against what one cost when measured (#26).

With the optimizer's ``global_clipnorm`` a synchronous PS step is held: no shard is updated before
every push of the step is in and the workers have sent the scale (``autosync/runtime/ps_clip.py``),
so the pulls no longer overlap the pushes and one more round trip is paid. A model spec says so
(``ModelSpec.global_clipnorm``) and the features count it (``tuner.features.batch``).

This script takes a committed measurement of plain vs clipped steps (default
``results/ps_held_step_2x200mbit.json``: ``benchmarks/ps_step_profile.py`` on the same model with and
without ``global_clipnorm``, per builder) and prints, per builder, the measured clipped/plain step
ratio beside the predicted one: the analytic model with its physical constants, and the learned
simulator fitted on the shipped warm-start dataset (which holds no clipped model: the clipped
spec is a group it never saw). The model and cluster are the dataset's group of the measured
model on the measured shape (``--model``, ``--cluster-nodes``, ``--bandwidth-gbps``). Nothing is
measured again; the file records the commit and start of the measurement it reads.

    python benchmarks/held_step_prediction.py [--measured F] [--compute real|emulated] [--model-spec YAML]
        [--json out.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _testbed import write_json  # noqa: E402
from strategy_space.builders import get_builder  # noqa: E402
from strategy_space.space import StrategySpace  # noqa: E402
from strategy_space.yaml_io import load  # noqa: E402
from tuner.cost_models.analytic import AnalyticCostModel  # noqa: E402
from tuner.cost_models.simulator import LearnedSimulator  # noqa: E402
from tuner.features.batch import featurize  # noqa: E402
from tuner.features.tables import FeatureTables  # noqa: E402
from tuner.records.dataset import build_trial_set  # noqa: E402
from tuner.records.warmstart import load_warm_start  # noqa: E402

DEFAULT_MEASURED = os.path.join(REPO, "benchmarks", "results", "ps_held_step_2x200mbit.json")


def measured_ratios(path: str) -> tuple[dict, list]:
    """Per builder: the plain and clipped medians (ms) of every run in the file, and the runs'
    (commit, start). A run holds one plain model and its clipped copy (``clipped`` in its name:
    ``benchmarks/clipped_models.py``, or a model-spec YAML named so)."""
    with open(path) as f:
        data = json.load(f)
    out, runs = {}, []
    for run in data["runs"].values():
        runs.append({"commit": run["commit"], "run_started": run["run_started"]})
        kinds = {name: "clipped" if "clipped" in os.path.basename(name) else "plain" for name in run["models"]}
        if sorted(kinds.values()) != ["clipped", "plain"]:
            raise SystemExit(f"{path}: a run must hold one plain model and its clipped copy (a name with "
                             f"'clipped'), got {sorted(run['models'])}")
        for name, model in run["models"].items():
            kind = kinds[name]
            for t in model["trials"]:
                if t["status"] == "ok" and t["builder"] != "all_reduce":
                    out.setdefault(t["builder"], {"plain": [], "clipped": []})[kind].append(t["median_s"] * 1e3)
    return out, runs


def predicted_ratios(builders: list[str], model_name: str, nodes: int, gbps: float, compute: str = "real",
                     spec_path: str | None = None) -> dict:
    """Predicted plain and clipped step times per builder. The cluster is the dataset's testbed
    group of ``model_name`` on ``nodes`` nodes at ``gbps`` with real compute (marked ``compute``);
    the model is that group's, or the model-spec YAML ``spec_path`` (without global clipping)."""
    groups = load_warm_start("builtin")
    match = [(m, c) for m, c, _ in groups if m.name == model_name and len(c.nodes) == nodes
             and all(n.bandwidth_gbps == gbps for n in c.nodes) and c.compute == "real"]
    if not match:
        raise SystemExit(f"the warm-start dataset has no group of {model_name} on {nodes} nodes at {gbps} Gbit/s")
    model, cluster = match[0]
    cluster = dataclasses.replace(cluster, compute=compute)
    if spec_path:
        model = dataclasses.replace(load(spec_path), global_clipnorm=False)
    clipped = dataclasses.replace(model, global_clipnorm=True)
    data = build_trial_set(groups)
    simulator = LearnedSimulator(random_state=0).fit(data.X, data.y)
    strategies = [get_builder(b).build(model, cluster) for b in builders]
    enc = StrategySpace(model, cluster).encode(strategies)
    out = {}
    for kind, spec in (("plain", model), ("clipped", clipped)):
        X = featurize(FeatureTables.from_specs(spec, cluster), enc)
        for b, a, s in zip(builders, AnalyticCostModel().predict(X), simulator.predict(X)):
            out.setdefault(b, {})[kind] = {"analytic_ms": float(a) * 1e3, "simulator_ms": float(s) * 1e3}
    return {"model": model.name, "cluster": f"{cluster.name}, {nodes} nodes at {gbps:g} Gbit/s", "builders": out}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--measured", default=DEFAULT_MEASURED)
    ap.add_argument("--model", default="ncf-small", help="the warm-start group's model name")
    ap.add_argument("--cluster-nodes", type=int, default=2)
    ap.add_argument("--bandwidth-gbps", type=float, default=0.2)
    ap.add_argument("--compute", choices=("real", "emulated"), default="real", help="the measurement's compute")
    ap.add_argument("--model-spec", help="predict for this model-spec YAML (the measured plain one) instead of "
                                         "the dataset group's model")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    commit = subprocess.run(["git", "-C", REPO, "describe", "--always", "--dirty"], capture_output=True,
                            text=True).stdout.strip()
    measured, runs = measured_ratios(args.measured)
    pred = predicted_ratios(sorted(measured), args.model, args.cluster_nodes, args.bandwidth_gbps, args.compute,
                            args.model_spec)
    print(f"{pred['model']} on {pred['cluster']}; measured: {os.path.relpath(args.measured, REPO)} "
          f"({', '.join(r['commit'] + ' ' + r['run_started'] for r in runs)})")
    print(f"  {'builder':<16} {'measured plain -> clipped ms':>30} {'ratio':>6}   {'analytic ratio':>14} "
          f"{'simulator ratio':>15}")
    rows = {}
    for b, m in sorted(measured.items()):
        mp, mc = statistics.median(m["plain"]), statistics.median(m["clipped"])
        p = pred["builders"][b]
        ra = p["clipped"]["analytic_ms"] / p["plain"]["analytic_ms"]
        rs = p["clipped"]["simulator_ms"] / p["plain"]["simulator_ms"]
        rows[b] = {"measured_plain_ms": mp, "measured_clipped_ms": mc, "measured_ratio": mc / mp,
                   "analytic_ratio": ra, "simulator_ratio": rs, "predicted": p}
        print(f"  {b:<16} {mp:>14.2f} -> {mc:>6.2f} (n={len(m['plain'])}) {mc / mp:>6.2f}   {ra:>14.2f} {rs:>15.2f}")
    if args.json:
        write_json(args.json, {"what": __doc__.split("\n\n")[0], "commit": commit, "run_started": started,
                               "compute": args.compute, "model_spec": args.model_spec,
                               "measured_file": os.path.relpath(args.measured, REPO), "measured_runs": runs,
                               "model": pred["model"], "cluster": pred["cluster"], "builders": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
