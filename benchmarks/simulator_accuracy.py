"""Ranking accuracy of the analytic model, the learned simulator and the ranker on synthetic trials.

Generates trials with the flow-level simulation (tuner.netsim) for many (model, cluster) groups,
then prints pairwise accuracy, Kendall tau and top-1 regret within groups (held-out trials) and
leave-one-model-out. Targets: pairwise accuracy >= 0.90 within a group, >= 0.80 leave-one-model-out.

    python benchmarks/simulator_accuracy.py [--models 8] [--clusters 3] [--per-group 30] [--seed 0]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tuner.dataset import build_trial_set  # noqa: E402
from tuner.evaluation import evaluate, format_table  # noqa: E402
from tuner.synthetic import make_dataset  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=int, default=8)
    ap.add_argument("--clusters", type=int, default=3)
    ap.add_argument("--per-group", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    groups = make_dataset(args.models, args.clusters, args.per_group, seed=args.seed)
    data = build_trial_set(groups)
    t1 = time.perf_counter()
    print(f"synthetic set: {len(data.keys)} groups, {len(set(data.model_names))} models, {len(data)} ok trials "
          f"({t1 - t0:.1f} s to simulate)")
    rows = evaluate(data, seed=args.seed)
    print(format_table(rows))
    for r in rows:
        target = 0.90 if r["protocol"] == "within" else 0.80
        r["met"] = r["pairwise_acc"] >= target
    best = {p: max((r for r in rows if r["protocol"] == p), key=lambda r: r["pairwise_acc"]) for p in ("within", "lomo")}
    for p, r in best.items():
        target = 0.90 if p == "within" else 0.80
        print(f"target {p}: pairwise >= {target:.2f}: best {r['method']} {r['pairwise_acc']:.3f} -> "
              f"{'MET' if r['met'] else 'MISSED'}")
    print(f"total {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
