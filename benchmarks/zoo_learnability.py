"""Does every zoo model learn from its synthetic data? Train each small zoo model with the
``all_reduce`` baseline on ``local`` (two workers) and report, per model, its chance-level loss
(``autosync.models.chance``), the loss (mean of the last 20 steps) at checkpoints and its ratio to
chance, and the first step at which that smoothed loss fell below 70 % of chance (met or missed).

    python benchmarks/zoo_learnability.py [--models ncf dlrm ...] [--steps 500] [--out FILE.json]

Writes ``benchmarks/results/zoo_learnability.json`` (or ``--out``): per model the figures, the commit
and the start time of the run.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)

from _testbed import git_commit, write_json  # noqa: E402

MODELS = ("resnet50", "vgg16", "bert", "lm1b", "ncf", "dlrm")
TARGET = 0.7
SMOOTH = 20
CHECKPOINTS = (100, 200, 250, 300, 400, 500)


def measure(name: str, steps: int, cluster) -> dict:
    from autosync.models import chance, zoo
    from autosync.api import make_trainer
    from autosync.sources import load_model_spec
    from strategy_space.builders import get_builder

    model_def = zoo.get_model_def(name)
    spec = load_model_spec(model_def)
    strategy = get_builder("all_reduce").build(spec, cluster)
    level = chance.chance_loss(model_def)
    t0 = time.monotonic()
    with make_trainer(model_def, strategy, cluster) as trainer:
        history = trainer.fit(steps, steps_per_call=50)
    loss = np.asarray(history.loss)
    smooth = np.array([loss[max(0, i - SMOOTH + 1):i + 1].mean() for i in range(len(loss))])
    below = np.flatnonzero(smooth < TARGET * level)
    at = [s for s in CHECKPOINTS if s <= len(loss)]
    return {"model": model_def.name, "chance_loss": level, "first_loss": float(loss[0]),
            "smoothed_loss": {str(s): float(smooth[s - 1]) for s in at},
            "over_chance": {str(s): float(smooth[s - 1] / level) for s in at},
            "final_over_chance": float(smooth[-1] / level),
            "first_step_below_target": int(below[0]) + 1 if len(below) else None,
            "met": bool(len(below)), "wall_s": time.monotonic() - t0, "workers": len(cluster.devices)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "zoo_learnability.json"))
    args = ap.parse_args()
    from autosync.sources import load_cluster

    cluster = load_cluster("local")
    started, commit = time.strftime("%Y-%m-%d %H:%M:%S"), git_commit(REPO)
    record = {"meta": {"what": f"smoothed training loss (mean of {SMOOTH} steps) vs chance level, all_reduce on local",
                       "target": f"below {TARGET:.0%} of chance within {args.steps} steps", "commit": commit,
                       "run_started": started, "what_else_ran": os.environ.get("AUTOSYNC_BENCH_NOTE", "")},
              "models": {}}
    for name in args.models:
        r = measure(name, args.steps, cluster)
        record["models"][name] = {"commit": commit, "run_started": started, **r}
        shown = "  ".join(f"@{s} {r['smoothed_loss'][str(s)]:.3f} ({r['over_chance'][str(s)]:.2f})"
                          for s in (100, 250, 500) if str(s) in r["smoothed_loss"])
        print(f"{name:9s} chance {r['chance_loss']:.3f}  loss (x chance) {shown}  first below {TARGET:.0%}: "
              f"{r['first_step_below_target']}  ({'met' if r['met'] else 'MISSED'}, {r['wall_s']:.0f} s)", flush=True)
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        write_json(args.out, record)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
