"""What pushing to the parameter servers from inside the step saves, with emulated compute on the
testbed (3 nodes at 100mbit,1gbit,1gbit by default: one slow node, as the heterogeneous run where
the serialized push was found).

A strategy that mixes parameter servers with all-reduce reduced inside the step (``parallax``: the
embeddings on PS, the dense variables all-reduced by GPU workers in their step) used to push the
PS gradients once the step's last collective had ended; now the push leaves as soon as its
gradients exist, beside the collectives (``autosync.runtime.sync.early_push``). For each model, on
one warm worker pool, alternating for ``--rounds`` rounds so drift hits both alike, ``parallax``
runs with the push from inside the step (``early``, as shipped) and after it (``after``,
``AUTOSYNC_EARLY_PUSH=0``), and ``ps_lb`` (no collective: nothing changes) as the yardstick.
Per trial: the median step, its interval, compute and sync per step; per strategy the analytic
bounds (``overlapped_s``: compute and the busiest NIC overlapped; ``serial_s``: their sum).

    sudo flock /tmp/autosync-testbed.lock python benchmarks/early_push.py --models dlrm ncf lm1b

Writes ``--name``.json (default ``early_push``) with the commit and start time of the run.
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

from _testbed import say_summary, say_trial, testbed_main, trial_in_mode  # noqa: E402 (a sibling script module)

MODES = {"early": {}, "after": {"AUTOSYNC_EARLY_PUSH": "0"}}
BUILDERS = ("parallax", "ps_lb")


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--inside", action="store_true", help="measure only (inside host0 of an existing testbed)")
    p.add_argument("--models", nargs="+", default=["dlrm", "ncf", "lm1b"], metavar="NAME",
                   help="zoo models or model-spec YAML files (default dlrm ncf lm1b)")
    p.add_argument("--step-time", type=float, default=None, metavar="S", help="emulated compute seconds per step")
    p.add_argument("--rounds", type=int, default=3, help="alternations of both modes (default 3)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per trial (default 3)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per trial (default 20)")
    p.add_argument("--nodes", type=int, default=3, help="testbed nodes (default 3)")
    p.add_argument("--bandwidth", default="100mbit,1gbit,1gbit",
                   help="testbed link rates, one or one per node (default 100mbit,1gbit,1gbit)")
    p.add_argument("--name", default="early_push", help="result file name without .json")
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"), help="output folder")
    return p.parse_args(argv)


def measure_model(name: str, cluster, args) -> dict:
    from tune_vs_baselines import source_of

    from autosync.api import make_runner
    from strategy_space.builders import get_builder
    from tuner.cost_models.analytic import step_lower_bound

    runner = make_runner(source_of(name), cluster, compute="emulated", step_time_s=args.step_time,
                         warmup=args.warmup, steps=args.steps, trial_timeout_s=900)
    out: dict = {"source": source_of(name), "links_gbps": [n.bandwidth_gbps for n in cluster.nodes],
                 "trials": [], "lower_bound": {}}
    try:
        model = runner.model
        chosen = {b: get_builder(b).build(model, cluster) for b in BUILDERS}
        out["lower_bound"] = {k: step_lower_bound(model, cluster, s) for k, s in chosen.items()}
        for _ in range(args.rounds):
            for label, strategy in chosen.items():
                for mode in MODES if label == "parallax" else ("early",):
                    rec = {"label": label, "mode": mode,
                           **trial_in_mode(runner, strategy, f"{label}@{mode}", MODES, mode)}
                    out["trials"].append(rec)
                    say_trial(f"{label}@{mode}", rec)
    finally:
        runner.pool.kill_all()
    out["summary"] = summarize(out)
    say_summary(out["summary"])
    return out


def summarize(out: dict) -> dict:
    """Per strategy and mode: the median of the trial medians and their range, each against the
    overlapped bound; ``speedup``: ``after`` over ``early``; ``vs_ps_lb``: ``ps_lb`` over each."""
    summary = {}
    for (label, mode) in [("parallax", "early"), ("parallax", "after"), ("ps_lb", "early")]:
        meds = [t["median_s"] for t in out["trials"] if t["label"] == label and t["mode"] == mode and t["median_s"]]
        if not meds:
            continue
        m, bound = statistics.median(meds), out["lower_bound"][label]["overlapped_s"]
        summary[f"{label}@{mode}"] = {"median_ms": round(m * 1e3, 2),
                                      "range_ms": [round(min(meds) * 1e3, 2), round(max(meds) * 1e3, 2)],
                                      "vs_lower_bound": round(m / bound, 3) if bound else None}
    early, after, ps = (summary.get(k, {}).get("median_ms")
                        for k in ("parallax@early", "parallax@after", "ps_lb@early"))
    if early and after:
        summary["parallax@early"]["speedup"] = round(after / early, 3)
    for key in ("parallax@early", "parallax@after"):
        if ps and key in summary:
            summary[key]["vs_ps_lb"] = round(ps / summary[key]["median_ms"], 3)
    return summary


def inside(args) -> int:
    from _testbed import measure_models

    meta = {"compute": "emulated", "step_time_s": args.step_time, "modes": MODES,
            "warmup": args.warmup, "steps": args.steps, "rounds": args.rounds}
    return measure_models("early_push", REPO, args.out, args.name + ".json", args.models,
                          lambda name, cluster: measure_model(name, cluster, args), meta)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _args(argv)
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0:
        print("early_push: --rounds and --steps must be >= 1, --warmup >= 0", file=sys.stderr)
        return 2
    return testbed_main(__file__, argv, args, inside, "early_push")


if __name__ == "__main__":
    sys.exit(main())
