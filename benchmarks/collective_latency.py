"""What one more all-reduce collective costs inside a training step beside parameter servers, on
the testbed (2 nodes at 200mbit with real compute by default), against what the analytic model
charges for it.

Per model, on one warm worker pool, alternating for ``--rounds`` rounds so drift hits them alike:
``ps_lb`` (every variable on a parameter server), ``parallax`` (the embeddings on parameter
servers, the dense variables all-reduced in the builder's fusion groups) and ``parallax/each``
(the same with every all-reduced variable in a fusion group of its own: the same bytes in more
collectives). Printed and written per model: each strategy's median of the trial medians and its
range, the analytic model's prediction of it, and the measured cost of one more collective,
(``parallax/each`` - ``parallax``) / (the groups added), and of one more ring step (a ring of W
workers takes 2(W-1) steps per collective) beside the model's ``AlphaBeta.alpha_step_s``.

    sudo flock /tmp/autosync-testbed.lock python benchmarks/collective_latency.py --models ncf
    sudo flock /tmp/autosync-testbed.lock python benchmarks/collective_latency.py --models ncf \\
        --nodes 3 --bandwidth 100mbit --compute emulated --name collective_latency_3x100mbit_emulated

Writes ``--name``.json (default ``collective_latency_2x200mbit_real``) with the commit and start
time of the run.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from _testbed import say_trial, testbed_main, trial_record  # noqa: E402 (a sibling script module)


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--inside", action="store_true", help="measure only (inside host0 of an existing testbed)")
    p.add_argument("--models", nargs="+", default=["ncf"], metavar="NAME",
                   help="zoo models or model-spec YAML files with dense and embedding variables (default ncf)")
    p.add_argument("--compute", choices=("real", "emulated"), default="real", help="worker compute (default real)")
    p.add_argument("--rounds", type=int, default=3, help="alternations of the three strategies (default 3)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per trial (default 5)")
    p.add_argument("--steps", type=int, default=30, help="timed steps per trial (default 30)")
    p.add_argument("--nodes", type=int, default=2, help="testbed nodes (default 2)")
    p.add_argument("--bandwidth", default="200mbit", help="testbed link rate (default 200mbit)")
    p.add_argument("--name", default="collective_latency_2x200mbit_real", help="result file name without .json")
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"), help="output folder")
    return p.parse_args(argv)


def strategies(model, cluster) -> dict:
    """The compared strategies (module doc), by label."""
    from strategy_space import AllReduce
    from strategy_space.builders import get_builder

    parallax = get_builder("parallax").build(model, cluster)
    groups = iter(range(10**6))
    each = tuple(dataclasses.replace(c, synchronizers=tuple(
        dataclasses.replace(s, group=next(groups)) if isinstance(s, AllReduce) else s for s in c.synchronizers))
        for c in parallax.variables)
    return {"ps_lb": get_builder("ps_lb").build(model, cluster), "parallax": parallax,
            "parallax/each": dataclasses.replace(parallax, variables=each, origin="search")}


def collectives(strategy) -> int:
    """Collectives per step: the distinct all-reduce fusion groups (each group here is uniform)."""
    from strategy_space import AllReduce

    return len({s.group for c in strategy.variables for s in c.synchronizers if isinstance(s, AllReduce)})


def summarize(trials: list[dict], predicted: dict, counts: dict, workers: int) -> dict:
    """Per strategy the median of the trial medians, their range and the prediction; then the cost
    of one more collective and of one more ring step, measured and as the model charges it."""
    from tuner.features.alpha_beta import AlphaBeta

    out: dict = {"strategies": {}}
    med = {}
    for label, seconds in predicted.items():
        meds = [t["median_s"] for t in trials if t["label"] == label and t["median_s"]]
        row = {"collectives": counts[label], "predicted_ms": round(seconds * 1e3, 2)}
        if meds:
            med[label] = statistics.median(meds)
            row.update(measured_ms=round(med[label] * 1e3, 2),
                       range_ms=[round(min(meds) * 1e3, 2), round(max(meds) * 1e3, 2)])
        out["strategies"][label] = row
    added = counts["parallax/each"] - counts["parallax"]
    steps = 2 * max(workers - 1, 0)
    if added > 0 and steps and {"parallax", "parallax/each"} <= med.keys():
        per = (med["parallax/each"] - med["parallax"]) / added
        out.update(collectives_added=added, ring_steps_per_collective=steps,
                   per_collective_ms=round(per * 1e3, 3), per_ring_step_ms=round(per / steps * 1e3, 3),
                   model_per_ring_step_ms=round(AlphaBeta().alpha_step_s * 1e3, 3),
                   model_per_collective_ms=round((predicted["parallax/each"] - predicted["parallax"]) / added * 1e3, 3))
    return out


def measure_model(name: str, cluster, args) -> dict:
    from tune_vs_baselines import source_of

    from autosync.api import make_runner
    from strategy_space.space import StrategySpace
    from tuner.cost_models.analytic import AnalyticCostModel

    # the profiled spec (measured compute time, rows per step), as ``autosync tune`` predicts from
    runner = make_runner(source_of(name), cluster, compute=args.compute, profile=True, warmup=args.warmup,
                         steps=args.steps, trial_timeout_s=900)
    out: dict = {"source": source_of(name), "trials": []}
    try:
        model = runner.model
        chosen = strategies(model, cluster)
        encoded = StrategySpace(model, cluster).encode(list(chosen.values()))
        predicted = dict(zip(chosen, AnalyticCostModel().predict_strategies(model, cluster, encoded).tolist()))
        for _ in range(args.rounds):
            for label, strategy in chosen.items():
                rec = {"label": label, **trial_record(runner.run_one(strategy, label))}
                out["trials"].append(rec)
                say_trial(label, rec)
        out["summary"] = summarize(out["trials"], predicted, {k: collectives(s) for k, s in chosen.items()},
                                   len(cluster.devices))
    finally:
        runner.pool.kill_all()
    print(f"  {out['summary']}", flush=True)
    return out


def inside(args) -> int:
    from _testbed import measure_models

    meta = {"compute": args.compute, "warmup": args.warmup, "steps": args.steps, "rounds": args.rounds}
    return measure_models("collective_latency", REPO, args.out, args.name + ".json", args.models,
                          lambda name, cluster: measure_model(name, cluster, args), meta)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _args(argv)
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0 or args.nodes < 2:
        print("collective_latency: --rounds and --steps must be >= 1, --warmup >= 0, --nodes >= 2", file=sys.stderr)
        return 2
    return testbed_main(__file__, argv, args, inside, "collective_latency")


if __name__ == "__main__":
    sys.exit(main())
