"""``autosync plan`` against measurements it never saw: for each model of the given tune result
files (the newest entry per model, as the README's tables take them), the plan for that model and
cluster, made with the warm-start dataset less every group of that model (an unseen model, as a
user planning a new one has), is compared with what the run measured of every baseline builder:
pairwise order agreement of predicted vs measured step times (pairs measured closer than 5 %
excluded), the median error of each builder's step time relative to the measured best baseline
(|predicted ratio / measured ratio - 1|), whether the predicted best baseline was the measured
one (or measured within 5 % of it), and the plan's best predicted step against the tuned step the
run measured. ``plan`` is the plan as the command makes it (its predictor chosen by
``planning._transfer_scorer``); ``learned`` forces the learned simulator's step times, ``analytic``
the untouched analytic model's (no warm start).

Compute: a model-spec YAML without a profile uses the estimate from its parameters, as the run
did; a zoo model's profile is measured here (the run measured its own on this machine).

    python benchmarks/plan_vs_measured.py benchmarks/results/headline_3x100mbit_emulated*.json \\
        [--out benchmarks/results/plan_vs_measured.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MIN_GAP = 0.05


def newest_entries(results: dict[str, dict]) -> dict[str, tuple[str, dict]]:
    """Model -> (file, entry) of the newest run of each model that measured its baselines."""
    out: dict[str, tuple[str, dict]] = {}
    for path, res in results.items():
        for name, r in res["models"].items():
            if any(c.get("role") == "baseline" for c in r.get("curve", ())):
                if name not in out or r["run_started"] > out[name][1]["run_started"]:
                    out[name] = (path, r)
    return out


def testbed_cluster(meta: dict):
    """The ClusterSpec the run's testbed had (emulated compute marked as the runner marks it)."""
    from autosync.testbed.config import TestbedConfig
    from autosync.testbed.state import cluster_spec

    spec = cluster_spec(TestbedConfig(nodes=int(meta["nodes"]), bandwidth=meta["bandwidth"],
                                      cpus_per_node=int(meta.get("cpus_per_node", 1))))
    return dataclasses.replace(spec, compute=meta.get("compute", "real"))


def score(predicted: dict[str, float], measured: dict[str, float]) -> dict:
    """Order agreement, ratio errors and best-baseline hit of ``predicted`` against ``measured``
    (builder -> seconds, over the builders both have)."""
    names = sorted(set(predicted) & set(measured))
    agree = pairs = 0
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if max(measured[a], measured[b]) / min(measured[a], measured[b]) < 1 + MIN_GAP:
                continue
            pairs += 1
            agree += (predicted[a] < predicted[b]) == (measured[a] < measured[b])
    best = min(names, key=measured.get)
    errors = {n: abs((predicted[n] / predicted[best]) / (measured[n] / measured[best]) - 1) for n in names if n != best}
    picked = min(names, key=predicted.get)
    return {"builders": len(names), "pairs": pairs, "order": agree / pairs if pairs else None,
            "median_ratio_error": statistics.median(errors.values()) if errors else None,
            "ratio_errors": errors, "measured_best": best, "predicted_best": picked,
            "best_hit": measured[picked] <= (1 + MIN_GAP) * measured[best]}


def by_builder(plan) -> dict[str, float]:
    """Builder -> predicted seconds (aliases share their strategy's)."""
    out = {}
    for p in plan.ranked:
        if p.origin != "search":
            for name in [p.origin] + list(p.aliases):
                out[name] = p.predicted_s
    return out


def one(name: str, path: str, r: dict, meta: dict, groups: list, top: int) -> dict:
    from autosync.planning import plan
    from autosync.sources import load_model_spec

    source = r["source"]
    spec = load_model_spec(source, profile=not source.endswith((".yaml", ".yml")))
    cluster = testbed_cluster(meta)
    measured = {c["origin"]: c["median_s"] for c in r["curve"] if c.get("role") == "baseline" and c.get("median_s")}
    unseen = [g for g in groups if g[0].name != spec.name]
    plans = {"plan": plan(spec, cluster, top=top, warm_start=unseen),
             "learned": plan(spec, cluster, top=top, warm_start=unseen, scorer="learned"),
             "analytic": plan(spec, cluster, top=top, warm_start=[])}
    tuned = r["tune"]["best_step_time_s"]
    # the measured run's own commit and start (this file's run is at its top)
    out = {"file": os.path.basename(path), "measured_run_started": r["run_started"], "measured_commit": r["commit"],
           "model": spec.name, "cluster": cluster.name, "compute_s": plans["plan"].compute_s,
           "warm_start_groups": len(unseen), "measured": measured}
    for label, p in plans.items():
        predicted = by_builder(p)
        out[label] = {**score(predicted, measured), "predicted": predicted, "predictor": p.predictor,
                      "best_predicted_s": p.best.predicted_s, "best_predicted": p.best.origin,
                      "best_predicted_vs_tuned_measured": p.best.predicted_s / tuned}
    out["tuned_measured_s"] = tuned
    return out


def main(argv=None) -> int:
    from _testbed import git_commit, write_json

    from tuner.records.warmstart import load_warm_start

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="tune_vs_baselines result JSON files")
    ap.add_argument("--top", type=int, default=3, help="searched strategies per plan (default 3)")
    ap.add_argument("--out", help="write the figures as JSON to FILE")
    args = ap.parse_args(argv)
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    results = {}
    for path in args.files:
        with open(path) as f:
            results[path] = json.load(f)
    groups = load_warm_start("builtin")
    models = {}
    print(f"{'model':<18} {'file':<56} {'pairs':>5} {'plan: order':>11} {'ratio err':>9} {'best hit':>8} "
          f"{'learned':>7} {'err':>5} {'analytic':>8} {'err':>5}  plan quotes")
    for name, (path, r) in sorted(newest_entries(results).items()):
        m = models[name] = one(name, path, r, results[path]["meta"], groups, args.top)
        pl, le, an = m["plan"], m["learned"], m["analytic"]

        def f(x):
            return "-" if x is None else f"{x:.2f}"
        print(f"{m['model']:<18} {m['file']:<56} {pl['pairs']:>5} {f(pl['order']):>11} {f(pl['median_ratio_error']):>9} "
              f"{str(pl['best_hit']):>8} {f(le['order']):>7} {f(le['median_ratio_error']):>5} {f(an['order']):>8} "
              f"{f(an['median_ratio_error']):>5}  {pl['predictor'].split(' (')[0]}")
    overall = {}
    for label in ("plan", "learned", "analytic"):
        pairs = sum(m[label]["pairs"] for m in models.values())
        agree = sum(m[label]["pairs"] * m[label]["order"] for m in models.values() if m[label]["order"] is not None)
        errors = [e for m in models.values() for e in m[label]["ratio_errors"].values()]
        overall[label] = {"pairs": pairs, "order": agree / pairs if pairs else None,
                          "median_ratio_error": statistics.median(errors) if errors else None,
                          "best_hits": sum(m[label]["best_hit"] for m in models.values()), "models": len(models)}
        o = overall[label]
        print(f"overall {label}: order {o['order']:.3f} over {pairs} pairs, median ratio error "
              f"{o['median_ratio_error']:.3f}, best baseline picked {o['best_hits']}/{len(models)}")
    commit = git_commit(REPO)
    for m in models.values():   # every entry is this run's (the measured run's own: measured_*)
        m.update(commit=commit, run_started=started)
    if args.out:
        write_json(args.out, {"commit": commit, "run_started": started,
                              "what_else_ran": os.environ.get("AUTOSYNC_BENCH_NOTE", ""),
                              "meta": {"files": [os.path.basename(p) for p in args.files], "top": args.top,
                                       "min_gap": MIN_GAP, "warm_start": "builtin less the model's own groups"},
                              "overall": overall, "models": models})
    return 0


if __name__ == "__main__":
    sys.exit(main())
