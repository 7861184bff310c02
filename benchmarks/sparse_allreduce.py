"""What all-reducing embedding tables costs beside parameter servers, on the testbed (2 nodes at
200mbit, real compute, by default).

An all-reduced sparse variable is all-gathered as (row ids, values) and every worker applies the
update to its own copy (``autosync.runtime.sync.allreduce``), then writes into its model what its
next step reads. For each model, on one warm worker pool, alternating for ``--rounds`` rounds so
drift hits all alike: the ``all_reduce``, ``parallax`` and ``ps_lb`` builders' strategies (``ps_lb``
is the embedding models' best baseline: the ratios are against it, measured in the same run).
Per trial: the median step, its interval, compute and sync per step; per strategy the analytic
bounds (with the model's compute measured at the start of the run). The code measured is the checkout's: run it from two commits to compare them.

    sudo flock /tmp/autosync-testbed.lock python benchmarks/sparse_allreduce.py --models ncf dlrm

Appends one run, keyed by its start time and with its commit, to ``--name``.json (default
``sparse_allreduce_2x200mbit_real``): runs of different commits sit side by side, never merged.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from _testbed import say_summary, say_trial, testbed_main, trial_record  # noqa: E402 (a sibling script module)

BUILDERS = ("all_reduce", "parallax", "ps_lb")
REFERENCE = "ps_lb"


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--inside", action="store_true", help="measure only (inside host0 of an existing testbed)")
    p.add_argument("--models", nargs="+", default=["ncf", "dlrm"], metavar="NAME",
                   help="zoo models or model-spec YAML files (default ncf dlrm)")
    p.add_argument("--compute", choices=("real", "emulated"), default="real", help="worker compute (default real)")
    p.add_argument("--rounds", type=int, default=2, help="alternations of the strategies (default 2)")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps per trial (default 10)")
    p.add_argument("--steps", type=int, default=100, help="timed steps per trial (default 100)")
    p.add_argument("--nodes", type=int, default=2, help="testbed nodes (default 2)")
    p.add_argument("--bandwidth", default="200mbit", help="testbed link rate (default 200mbit)")
    p.add_argument("--name", default="sparse_allreduce_2x200mbit_real", help="result file name without .json")
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"), help="output folder")
    return p.parse_args(argv)


def measure_model(name: str, cluster, args) -> dict:
    from tune_vs_baselines import source_of

    from autosync.api import make_runner
    from strategy_space.builders import get_builder
    from tuner.cost_models.analytic import step_lower_bound

    # profile: the bounds' compute is the model's, measured here (as the headline measures it)
    runner = make_runner(source_of(name), cluster, compute=args.compute, profile=True, warmup=args.warmup,
                         steps=args.steps, trial_timeout_s=600)
    out: dict = {"source": source_of(name), "trials": [], "lower_bound": {}}
    try:
        model = runner.model
        chosen = {b: get_builder(b).build(model, cluster) for b in BUILDERS}
        out["lower_bound"] = {b: step_lower_bound(model, cluster, s) for b, s in chosen.items()}
        for _ in range(args.rounds):
            for label, strategy in chosen.items():
                rec = {"label": label, **trial_record(runner.run_one(strategy, label))}
                out["trials"].append(rec)
                say_trial(label, rec)
    finally:
        runner.pool.kill_all()
    out["summary"] = summarize(out)
    say_summary(out["summary"])
    return out


def summarize(out: dict) -> dict:
    """Per strategy: the median of its trial medians and their range, against ``REFERENCE``'s
    (measured in the same run: > 1 is slower) and against the overlapped and the serial bound."""
    meds = {label: [t["median_s"] for t in out["trials"] if t["label"] == label and t["median_s"]]
            for label in out["lower_bound"]}
    ref = statistics.median(meds[REFERENCE]) if meds.get(REFERENCE) else None
    summary = {}
    for label, bound in out["lower_bound"].items():
        if not meds[label]:
            summary[label] = {"failed": True}
            continue
        m = statistics.median(meds[label])
        summary[label] = {
            "ms": round(m * 1e3, 2), "range_ms": [round(min(meds[label]) * 1e3, 2), round(max(meds[label]) * 1e3, 2)],
            f"vs_{REFERENCE}": round(m / ref, 3) if ref else None,
            "vs_lower_bound": round(m / bound["overlapped_s"], 3) if bound["overlapped_s"] else None,
            "vs_serial_bound": round(m / bound["serial_s"], 3) if bound["serial_s"] else None}
    return summary


def inside(args) -> int:
    if not os.environ.get("RAY_ADDRESS"):
        print("sparse_allreduce --inside runs inside the testbed's host0 (`autosync testbed exec`)", file=sys.stderr)
        return 2
    import ray

    from _testbed import git_commit, write_json

    from autosync.sources import load_cluster
    from autosync.testbed import format_rate

    cluster = load_cluster("testbed")
    ray.init(address=os.environ["RAY_ADDRESS"], logging_level="ERROR", log_to_driver=False)
    started, commit = time.strftime("%Y-%m-%d %H:%M:%S"), git_commit(REPO)
    path = os.path.join(args.out, args.name + ".json")
    run = {"commit": commit, "run_started": started, "nodes": len(cluster.nodes),
           "bandwidth": format_rate(round(cluster.nodes[0].bandwidth_gbps * 1e9)), "compute": args.compute,
           "warmup": args.warmup, "steps": args.steps, "rounds": args.rounds,
           "what_else_ran": os.environ.get("AUTOSYNC_BENCH_NOTE", ""), "models": {}}
    os.makedirs(args.out, exist_ok=True)
    for model in args.models:
        print(f"{model}:", flush=True)
        run["models"][model] = {"commit": commit, "run_started": started, **measure_model(model, cluster, args)}
        # earlier runs (other commits) stay as they were: each run is kept under its own start
        data = {"what": __doc__.split("\n\n")[0], "runs": {}}
        if os.path.exists(path):
            with open(path) as f:
                data = json.load(f)
        data["runs"][started] = run
        write_json(path, data)
    ray.shutdown()
    print(f"wrote {path}")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _args(argv)
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0:
        print("sparse_allreduce: --rounds and --steps must be >= 1, --warmup >= 0", file=sys.stderr)
        return 2
    return testbed_main(__file__, argv, args, inside, "sparse_allreduce")


if __name__ == "__main__":
    sys.exit(main())
