"""What issuing the in-step collectives during the compute saves, with emulated compute on the
testbed (3 nodes at 100mbit by default).

GPU workers reduce the all-reduce groups of backend ``auto`` or ``graph`` inside their training
step, each collective as soon as its gradients are ready (``autosync.runtime.sync.graph``); an
emulated worker does the same while its compute sleeps (``autosync.runtime.emulated``). For each
model, on one warm worker pool, alternating for ``--rounds`` rounds so drift hits both alike, each
strategy runs with the collectives issued during the compute (``in_step``, as shipped) and after
it (``after``, ``AUTOSYNC_IN_STEP=0``: every gradient handed over when the last is ready, as
before). Strategies: the ``all_reduce`` and ``parallax`` builders, and all-reduce of every
variable in ``--groups`` fusion groups of about equal bytes in gradient-ready order, uncompressed
(``all_reduce/gN``), in fp16 (``fp16/gN``), and with PowerSGD of rank 4 (error feedback) on
the matrices and fp16 (error feedback) on the rest (``powersgd/gN``, as the dense models' tuned
strategies). Per trial: the median step, its interval, compute
and sync per step; per strategy the analytic bounds (``overlapped_s``: compute and the busiest
NIC overlapped; ``serial_s``: their sum).

    sudo flock /tmp/autosync-testbed.lock python benchmarks/in_step_overlap.py --models resnet50 vgg16

Writes ``--name``.json (default ``in_step_overlap``) with the commit and start time of the run.
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

MODES = {"in_step": {}, "after": {"AUTOSYNC_IN_STEP": "0"}}
KINDS = ("all_reduce", "parallax", "all_reduce/g", "fp16/g", "powersgd/g")   # strategy labels less the group count


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--inside", action="store_true", help="measure only (inside host0 of an existing testbed)")
    p.add_argument("--models", nargs="+", default=["resnet50", "vgg16", "bert"], metavar="NAME",
                   help="zoo models or model-spec YAML files (default resnet50 vgg16 bert)")
    p.add_argument("--only", nargs="+", metavar="KIND", choices=KINDS,
                   help=f"measure only these strategies ({', '.join(KINDS)}; default all)")
    p.add_argument("--groups", type=int, default=4, help="fusion groups of the grouped strategies (default 4)")
    p.add_argument("--step-time", type=float, default=None, metavar="S", help="emulated compute seconds per step")
    p.add_argument("--rounds", type=int, default=2, help="alternations of both modes (default 2)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per trial (default 3)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per trial (default 10)")
    p.add_argument("--nodes", type=int, default=3, help="testbed nodes (default 3)")
    p.add_argument("--bandwidth", default="100mbit", help="testbed link rate (default 100mbit)")
    p.add_argument("--name", default="in_step_overlap", help="result file name without .json")
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"), help="output folder")
    return p.parse_args(argv)


def strategies(model, cluster, groups: int) -> dict:
    """The compared strategies (module doc), by label."""
    from strategy_space import AllReduce, Strategy, VarConfig
    from strategy_space.builders import fusion_groups, get_builder

    names = [v.name for v in model.variables]
    chunk = sum(v.bytes for v in model.variables) // groups + 1
    fused = fusion_groups(model, names, chunk)

    def grouped(compressor: str, matrices: str | None = None) -> Strategy:
        # ``matrices``: the compressor of the dense variables of two dimensions or more
        def codec(n):
            v = model.var(n)
            if v.sparse or "float" not in v.dtype:   # all-gathered rows, or not a float: nothing to compress
                return "none"
            return matrices if matrices and len(v.shape) >= 2 else compressor

        return Strategy(tuple(VarConfig(n, (AllReduce(compressor=codec(n), group=fused[n]),)) for n in names),
                        origin="search")

    return {"all_reduce": get_builder("all_reduce").build(model, cluster),
            "parallax": get_builder("parallax").build(model, cluster),
            f"all_reduce/g{groups}": grouped("none"), f"fp16/g{groups}": grouped("fp16"),
            f"powersgd/g{groups}": grouped("fp16_ef", "powersgd_ef(4)")}


def measure_model(name: str, cluster, args) -> dict:
    from tune_vs_baselines import source_of

    from autosync.api import make_runner
    from tuner.cost_models.analytic import step_lower_bound

    runner = make_runner(source_of(name), cluster, compute="emulated", step_time_s=args.step_time,
                         warmup=args.warmup, steps=args.steps, trial_timeout_s=900)
    out: dict = {"source": source_of(name), "trials": [], "lower_bound": {}}
    try:
        model = runner.model
        chosen = {k: s for k, s in strategies(model, cluster, args.groups).items()
                  if not args.only or k.rstrip("0123456789") in args.only}
        out["lower_bound"] = {k: step_lower_bound(model, cluster, s) for k, s in chosen.items()}
        for _ in range(args.rounds):
            for label, strategy in chosen.items():
                for mode in MODES:
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
    """Per strategy: each mode's median of the trial medians and their range, the speedup of
    ``in_step`` over ``after`` and each against the overlapped and the serial bound."""
    summary = {}
    for label, bound in out["lower_bound"].items():
        row: dict = {}
        for mode in MODES:
            meds = [t["median_s"] for t in out["trials"] if t["label"] == label and t["mode"] == mode and t["median_s"]]
            if meds:
                m = statistics.median(meds)
                row[f"{mode}_ms"] = round(m * 1e3, 2)
                row[f"{mode}_range_ms"] = [round(min(meds) * 1e3, 2), round(max(meds) * 1e3, 2)]
                row[f"{mode}_vs_lower_bound"] = round(m / bound["overlapped_s"], 3) if bound["overlapped_s"] else None
                row[f"{mode}_vs_serial_bound"] = round(m / bound["serial_s"], 3) if bound["serial_s"] else None
        if row.get("in_step_ms") and row.get("after_ms"):
            row["speedup"] = round(row["after_ms"] / row["in_step_ms"], 3)
        summary[label] = row
    return summary


def inside(args) -> int:
    from _testbed import measure_models

    meta = {"compute": "emulated", "step_time_s": args.step_time, "groups": args.groups, "modes": MODES,
            "warmup": args.warmup, "steps": args.steps, "rounds": args.rounds, "only": args.only}
    return measure_models("in_step_overlap", REPO, args.out, args.name + ".json", args.models,
                          lambda name, cluster: measure_model(name, cluster, args), meta)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _args(argv)
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0 or args.groups < 1:
        print("in_step_overlap: --rounds, --steps and --groups must be >= 1, --warmup >= 0", file=sys.stderr)
        return 2
    return testbed_main(__file__, argv, args, inside, "in_step_overlap")


if __name__ == "__main__":
    sys.exit(main())
