"""PS pipelining on vs off, against all-reduce, on the emulated testbed (2 nodes at 200mbit by default).

For each model, in one run on one warm worker pool: all-reduce, then the model's PS strategy
(``--ps-builder``, default partitioned_ps for vgg16 and parallax for lm1b) with pipelining off
(``AUTOSYNC_PS_CHUNKS=1``: one push and one pull call per PS actor) and on (the runtime default),
alternating for ``--rounds`` rounds so drift hits both alike. Prints each trial's median step time,
the PS/all-reduce ratios and every PS actor's ``wait_s``/``chunk_wait_s``; writes
``ps_overlap.json`` with the commit and start time of the run.

Needs root (the testbed)::

    sudo flock /tmp/autosync-testbed.lock python benchmarks/ps_overlap.py --models vgg16 lm1b
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

PS_BUILDER = {"vgg16": "partitioned_ps", "lm1b": "parallax", "ncf": "parallax", "dlrm": "parallax"}
JSON_NAME = "ps_overlap.json"


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--inside", action="store_true", help="measure only (inside host0 of an existing testbed)")
    p.add_argument("--models", nargs="+", default=["vgg16", "lm1b"], metavar="NAME",
                   help=f"zoo models (default vgg16 lm1b; one of {', '.join(PS_BUILDER)})")
    p.add_argument("--rounds", type=int, default=2, help="alternations of pipelining off/on (default 2)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per trial (default 2)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per trial (default 8)")
    p.add_argument("--nodes", type=int, default=2, help="testbed nodes (default 2)")
    p.add_argument("--bandwidth", default="200mbit", help="testbed link rate (default 200mbit)")
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"), help="output folder")
    return p.parse_args(argv)


def _trial(runner, strategy, label: str, chunks: str | None) -> dict:
    if chunks is None:
        os.environ.pop("AUTOSYNC_PS_CHUNKS", None)
    else:
        os.environ["AUTOSYNC_PS_CHUNKS"] = chunks
    trial = runner.run_one(strategy, label)
    os.environ.pop("AUTOSYNC_PS_CHUNKS", None)
    stats = trial.meta.get("ps_stats") or {}
    return {"status": trial.status, "error": trial.error or None, "median_s": trial.median if trial.ok else None,
            "step_times_s": [round(t, 5) for t in trial.step_times], "breakdown_s": trial.breakdown or None,
            "ray_calls_per_step_per_worker": trial.meta.get("ray_calls_per_step_per_worker"),
            "bytes_per_step_per_worker": trial.meta.get("bytes_per_step_per_worker"),
            "ps_stats": stats}


def measure_model(name: str, cluster, args) -> dict:
    from baselines_vs_peer import model_source

    from autosync.runtime.binding import ClusterBinding
    from autosync.api import make_runner
    from autosync.runtime.engine import WorkerPool
    from strategy_space.builders import get_builder

    source, _ = model_source(name)
    pool = WorkerPool(ClusterBinding.bind(cluster))
    runner = make_runner(source, cluster, warmup=args.warmup, steps=args.steps, trial_timeout_s=300, pool=pool)
    out = {"source": source, "ps_builder": PS_BUILDER[name], "trials": []}
    try:
        model = runner.model
        ar = get_builder("all_reduce").build(model, cluster)
        ps = get_builder(PS_BUILDER[name]).build(model, cluster)
        plan = [("all_reduce", ar, None)]
        for _ in range(args.rounds):
            plan += [("ps_pipelining_off", ps, "1"), ("ps_pipelining_on", ps, None)]
        plan.append(("all_reduce", ar, None))
        for label, strategy, chunks in plan:
            rec = {"label": label, **_trial(runner, strategy, label, chunks)}
            out["trials"].append(rec)
            waits = {k: (round(v["wait_s"], 3), [round(w, 3) for w in v.get("chunk_wait_s", [])])
                     for k, v in rec["ps_stats"].items()}
            med = f"{rec['median_s'] * 1e3:.0f} ms" if rec["median_s"] else rec["error"]
            print(f"  {label}: {med}, calls/step {rec['ray_calls_per_step_per_worker']}, "
                  f"wait_s (step, per chunk) {waits}", flush=True)
    finally:
        pool.kill_all()
    summary = {}
    for label in ("all_reduce", "ps_pipelining_off", "ps_pipelining_on"):
        meds = [t["median_s"] for t in out["trials"] if t["label"] == label and t["median_s"]]
        summary[label] = statistics.median(meds) if meds else None
    if summary["all_reduce"]:
        for label in ("ps_pipelining_off", "ps_pipelining_on"):
            if summary[label]:
                summary[f"{label}_over_all_reduce"] = summary[label] / summary["all_reduce"]
    out["summary"] = summary
    print("  summary: " + ", ".join(f"{k} {v:.3f}" for k, v in summary.items() if v), flush=True)
    return out


def inside(args) -> int:
    from _testbed import measure_models

    meta = {"warmup": args.warmup, "steps": args.steps, "rounds": args.rounds}
    return measure_models("ps_overlap", REPO, args.out, JSON_NAME, args.models,
                          lambda name, cluster: measure_model(name, cluster, args), meta)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _args(argv)
    unknown = [m for m in args.models if m not in PS_BUILDER]
    if unknown or args.rounds < 1 or args.steps < 1 or args.warmup < 0:
        print(f"ps_overlap: models must be among {', '.join(PS_BUILDER)} (got {unknown or args.models}), "
              f"--rounds and --steps >= 1, --warmup >= 0", file=sys.stderr)
        return 2
    if args.inside:
        return inside(args)
    from _testbed import run_in_testbed

    return run_in_testbed(__file__, argv, nodes=args.nodes, bandwidth=args.bandwidth, name="ps_overlap",
                          outer_flags={"--nodes", "--bandwidth", "--out"}, extra=["--out", os.path.abspath(args.out)])


if __name__ == "__main__":
    sys.exit(main())
