"""Where a parameter-server step's time goes, on Ray calls and on the ZeroMQ data plane, against
the step's analytic lower bound, on the emulated testbed (2 nodes at 200mbit by default).

For each model, in one run on one warm worker pool, alternating for ``--rounds`` rounds so drift
hits every contender alike: ``all_reduce`` and each PS builder (``--builders``, default parallax,
ps_lb and partitioned_ps), the PS ones once per ``--variants`` (default: ``ray``, every push and
pull an actor call through Ray's object store, and ``default``, the data plane as shipped,
``psnet``; ``one_lane`` puts a link's pushes and pulls on one connection, ``whole_vars`` cuts no
variable into row blocks, ``before`` does neither, ``chunks1``/``chunks8`` change the PS
pipelining, see ``VARIANTS``). Per
trial it records the median step time and its phases as the workers see them (``compute``: the
forward and backward pass; ``sync``: everything else of the step, i.e. serializing, sending,
waiting for the other workers' pushes, the PS's apply, the reply and deserializing), what the PS
actors spent (``apply_s`` per step: the optimizer update; ``wait_s`` per step: between a step's
first and last push, i.e. waiting for the slowest sender), calls and bytes per step and worker, and
the analytic lower bound (compute plus the least time the busiest NIC needs for the step's bytes).
With ``--timeline`` each trial also records every actor's timeline (``autosync.runtime.timeline``)
and keeps its ``phases``: per actor and span, milliseconds per step (the median over the steps).

    sudo flock /tmp/autosync-testbed.lock python benchmarks/ps_step_profile.py --models ncf dlrm
    sudo flock /tmp/autosync-testbed.lock python benchmarks/ps_step_profile.py --models configs/models/lm1b_full.yaml \\
        --compute emulated --step-time 0.1

Writes ``--name``.json (default ``ps_step_profile``) with the commit and start time of the run.
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

BUILDERS = ("parallax", "ps_lb", "partitioned_ps")
# ways to run a PS trial, each the environment its session starts under: ``default`` is the data
# plane as shipped; the others are what it is compared with
VARIANTS = {
    "default": {},
    "ray": {"AUTOSYNC_PS_TRANSPORT": "ray"},          # every push and pull an actor call through Ray
    "one_lane": {"AUTOSYNC_PS_LANES": "1"},           # pushes and pulls on one connection per link
    "chunks1": {"AUTOSYNC_PS_CHUNKS": "1"},           # no pipelining: one push and one pull per actor
    "chunks8": {"AUTOSYNC_PS_CHUNKS": "8"},           # twice the default chunks per actor
    "whole_vars": {"AUTOSYNC_PS_SEGMENT": "0"},       # no variable cut into row blocks for pipelining
    "before": {"AUTOSYNC_PS_LANES": "1", "AUTOSYNC_PS_SEGMENT": "0"},   # the data plane before both
}


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--inside", action="store_true", help="measure only (inside host0 of an existing testbed)")
    p.add_argument("--models", nargs="+", default=["ncf", "dlrm"], metavar="NAME",
                   help="zoo models, or model-spec YAML files with --compute emulated (default ncf dlrm)")
    p.add_argument("--builders", nargs="+", default=list(BUILDERS), metavar="NAME", help="PS builders to profile")
    p.add_argument("--variants", nargs="+", default=["ray", "default"], choices=sorted(VARIANTS), metavar="NAME",
                   help=f"ways to run each PS builder, alternated (default: ray default; "
                        f"choices: {', '.join(VARIANTS)})")
    p.add_argument("--staleness", nargs="+", type=int, default=[0], metavar="S",
                   help="each PS builder at each of these staleness bounds (default 0; S>0 is labelled "
                        "builder/sS)")
    p.add_argument("--compute", choices=("real", "emulated"), default="real")
    p.add_argument("--step-time", type=float, default=None, metavar="S", help="emulated compute seconds per step")
    p.add_argument("--optimizer", default="sgd", help="emulated compute's optimizer (sgd, momentum, adam, adagrad)")
    p.add_argument("--rounds", type=int, default=2, help="alternations of every contender (default 2)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per trial (default 3)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per trial (default 10)")
    p.add_argument("--nodes", type=int, default=2, help="testbed nodes (default 2)")
    p.add_argument("--bandwidth", default="200mbit", help="testbed link rate (default 200mbit)")
    p.add_argument("--timeline", action="store_true",
                   help="record every actor's timeline and keep each span's milliseconds per step (phases)")
    p.add_argument("--name", default="ps_step_profile", help="result file name without .json")
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"), help="output folder")
    return p.parse_args(argv)


def _trial(runner, strategy, label: str, variant: str | None, warmup: int) -> dict:
    env = VARIANTS[variant or "default"]
    every = {k for v in VARIANTS.values() for k in v}
    for key in every:
        os.environ.pop(key, None)
    os.environ.update(env)
    try:
        trial = runner.run_one(strategy, label)
    finally:
        for key in every:
            os.environ.pop(key, None)
    # the PS's counters run over the whole trial: warm-up and timed steps
    steps = max(1, warmup + len(trial.step_times))
    stats = trial.meta.get("ps_stats") or {}
    per_step = {name: {"apply_s": s.get("apply_s", 0.0) / steps, "wait_s": s.get("wait_s", 0.0) / steps, "data_plane_calls": s.get("data_plane_calls", 0),
                       "pushes": s.get("pushes", 0), "pulls": s.get("pulls", 0)} for name, s in stats.items()}
    return {"status": trial.status, "error": trial.error or None, "median_s": trial.median if trial.ok else None,
            "median_ci95_s": list(trial.median_ci) if trial.ok and trial.median_ci else None,
            "step_times_s": [round(t, 5) for t in trial.step_times], "breakdown_s": trial.breakdown or None,
            "calls_per_step_per_worker": trial.meta.get("ray_calls_per_step_per_worker"),
            "bytes_per_step_per_worker": trial.meta.get("bytes_per_step_per_worker"), "ps": per_step,
            "phases": _phases(runner.last_timeline)}


def _phases(streams) -> dict | None:
    """``{actor: {span: ms per step}}`` of a trial's timeline (None: not recorded)."""
    from autosync.runtime.timeline import phase_table

    if not streams:
        return None
    out: dict = {}
    for row in phase_table(streams):
        out.setdefault(row["actor"], {})[row["span"]] = round(row["ms_per_step"], 3)
    return out


def measure_model(name: str, cluster, args) -> dict:
    from tune_vs_baselines import source_of

    from autosync.api import make_runner
    from autosync.runtime.binding import ClusterBinding
    from autosync.runtime.engine import WorkerPool
    from tuner.cost_models.analytic import step_lower_bound as lower_bound

    # emulated compute runs on the cluster as the runner marks it: its pool is the runner's own
    pool = WorkerPool(ClusterBinding.bind(cluster)) if args.compute == "real" else None
    runner = make_runner(source_of(name), cluster, compute=args.compute, step_time_s=args.step_time,
                         optimizer=args.optimizer, profile=args.compute == "real", warmup=args.warmup, steps=args.steps,
                         trial_timeout_s=900, pool=pool, timeline=args.timeline)
    pool = runner.pool
    out: dict = {"source": source_of(name), "trials": [], "lower_bound": {}}
    try:
        model = runner.model
        strategies = profiled_strategies(model, cluster, args.builders, args.staleness)
        builders = [k for k in strategies if k != "all_reduce"]
        for key, s in strategies.items():
            out["lower_bound"][key] = lower_bound(model, cluster, s)
        plan = []
        for _ in range(args.rounds):
            plan.append(("all_reduce", None))
            plan += [(b, v) for b in builders for v in args.variants]
        for builder, variant in plan:
            label = builder if builder == "all_reduce" else f"{builder}@{variant}"
            rec = {"label": label, "builder": builder, "env": VARIANTS[variant or "default"],
                   **_trial(runner, strategies[builder], label, variant, args.warmup)}
            out["trials"].append(rec)
            med = f"{rec['median_s'] * 1e3:.0f} ms" if rec["median_s"] else rec["error"]
            bd = {k: round(v * 1e3, 1) for k, v in (rec["breakdown_s"] or {}).items()}
            ps = {k: (round(v["apply_s"] * 1e3, 1), round(v["wait_s"] * 1e3, 1)) for k, v in rec["ps"].items()}
            print(f"  {label}: {med}, phases ms {bd}, calls/step {rec['calls_per_step_per_worker']}, "
                  f"PS (apply, wait) ms/step {ps}", flush=True)
            for actor, spans in (rec["phases"] or {}).items():
                print(f"    {actor}: " + ", ".join(f"{k} {v:.2f}" for k, v in spans.items()), flush=True)
    finally:
        pool.kill_all()
    summary = {}
    for label in sorted({t["label"] for t in out["trials"]}):
        meds = [t["median_s"] for t in out["trials"] if t["label"] == label and t["median_s"]]
        if not meds:
            summary[label] = {"median_s": None}
            continue
        builder = label.split("@")[0]
        lb = out["lower_bound"][builder]["serial_s"]
        summary[label] = {"median_s": statistics.median(meds), "repeat_medians_s": meds,
                          "vs_lower_bound": statistics.median(meds) / lb if lb else None}
    for b in builders:
        new_s = summary.get(f"{b}@default", {}).get("median_s")
        for v in args.variants:
            other_s = summary.get(f"{b}@{v}", {}).get("median_s")
            if v != "default" and other_s and new_s:
                summary[f"{b}@default"][f"speedup_vs_{v}"] = other_s / new_s
        ar = summary.get("all_reduce", {}).get("median_s")
        if ar and new_s:
            summary[f"{b}@default"]["over_all_reduce"] = new_s / ar
    out["summary"] = summary
    for label, s in summary.items():
        if s.get("median_s"):
            extra = ", ".join(f"{k} {v:.2f}" for k, v in s.items()
                              if (k in ("vs_lower_bound", "over_all_reduce") or k.startswith("speedup_vs_")) and v)
            print(f"  {label}: {s['median_s'] * 1e3:.0f} ms ({extra})", flush=True)
    return out


def inside(args) -> int:
    from _testbed import measure_models
    from autosync.runtime.psnet import TRANSPORT

    meta = {"compute": args.compute, "step_time_s": args.step_time, "default_transport": TRANSPORT,
            "variants": {v: VARIANTS[v] for v in args.variants}, "optimizer": args.optimizer,
            "warmup": args.warmup, "steps": args.steps, "rounds": args.rounds, "timeline": args.timeline}
    return measure_models("ps_step_profile", REPO, args.out, args.name + ".json", args.models,
                          lambda name, cluster: measure_model(name, cluster, args), meta)


def profiled_strategies(model, cluster, builders, staleness) -> dict:
    """``all_reduce`` (the reference), then each PS builder at each staleness bound, keyed
    ``builder`` (staleness 0) or ``builder/sS``."""
    from strategy_space.builders import get_builder

    out = {"all_reduce": get_builder("all_reduce").build(model, cluster)}
    for b in builders:
        for s in staleness:
            # a builder without the option (parallax) keeps its synchronous PS at staleness 0
            options = {"staleness": int(s)} if s else {}
            out[b if s == 0 else f"{b}/s{s}"] = get_builder(b, **options).build(model, cluster)
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _args(argv)
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0 or min(args.staleness) < 0:
        print("ps_step_profile: --rounds and --steps must be >= 1, --warmup and --staleness >= 0", file=sys.stderr)
        return 2
    from strategy_space.builders import BUILDERS, builder_options

    ps_builders = [b for b in BUILDERS if "all_reduce" not in b]
    wrong = [b for b in args.builders if b not in ps_builders]
    if wrong:
        print(f"ps_step_profile: --builders takes builders with parameter servers ({', '.join(ps_builders)}), got "
              f"{', '.join(wrong)}; all_reduce is measured beside them as the reference", file=sys.stderr)
        return 2
    fixed = [b for b in args.builders if "staleness" not in builder_options(b)]
    if max(args.staleness) > 0 and fixed:
        print(f"ps_step_profile: --staleness above 0 needs builders with a staleness option; {', '.join(fixed)} "
              f"has none", file=sys.stderr)
        return 2
    if args.inside:
        return inside(args)
    from _testbed import run_in_testbed

    return run_in_testbed(__file__, argv, nodes=args.nodes, bandwidth=args.bandwidth, name="ps_step_profile",
                          outer_flags={"--nodes", "--bandwidth", "--out"}, extra=["--out", os.path.abspath(args.out)])


if __name__ == "__main__":
    sys.exit(main())
