"""How repeatable a trial is on one testbed shape, with real or emulated compute.

For one shape (compute, nodes, link rate) and one model: ``--strategies`` (5 baseline builders by
default) measured ``--repeats`` times each, interleaved (repeat 1 of every strategy, then repeat
2, ...), every trial to the runner's precision target (95 % interval of the median within +-3 %,
capped). Prints per strategy the repeat medians, their CV (repeat-to-repeat noise) and how many
trials reached the precision target; then the shape's median and worst CV against the target
(CV <= 0.03) and the spread between the fastest and the slowest strategy. Results are merged into
``--out`` (one entry per shape and model, each with the commit and start time of its run).

``--cpuset`` confines each testbed node's processes (and, inherited, their children) to core
``i mod cores`` right after the testbed comes up, to measure whether that lowers the noise when
nodes outnumber cores.

Needs root. One shape per run; hold the testbed lock::

    flock /tmp/autosync-testbed.lock python benchmarks/trial_noise.py --compute real --nodes 2 \\
        --bandwidth 200mbit --model zoo:bert
    flock /tmp/autosync-testbed.lock python benchmarks/trial_noise.py --compute emulated --nodes 3 \\
        --bandwidth 100mbit --model zoo:bert --step-time 0.05
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

STRATEGIES = ("ps", "ps_lb", "partitioned_ps", "all_reduce", "parallax")
TARGET_CV = 0.03
OUTER_FLAGS = {"--nodes", "--bandwidth", "--cpuset"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--compute", choices=("real", "emulated"), default="real")
    p.add_argument("--nodes", type=int, default=2, help="testbed nodes (default 2)")
    p.add_argument("--bandwidth", default="200mbit", help="testbed link rate (default 200mbit)")
    p.add_argument("--model", default="zoo:bert", help="model source (default zoo:bert, the small one)")
    p.add_argument("--step-time", type=float, help="emulated compute per step (default: measured profile)")
    p.add_argument("--strategies", nargs="+", default=list(STRATEGIES), help="baseline builders (default 5)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="first batch of timed steps")
    p.add_argument("--max-steps", type=int, default=100)
    p.add_argument("--max-measure-s", type=float, default=25.0, help="cap on the timed seconds of one trial")
    p.add_argument("--budget-min", type=float, default=12.0,
                   help="start no trial after this many minutes (keeps the testbed hold short)")
    p.add_argument("--cpuset", action="store_true", help="pin node i's processes to core i mod cores")
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "trial_noise.json"))
    p.add_argument("--inside", action="store_true", help="measure only (inside host0 of a running testbed)")
    p.add_argument("--shape-note", default="", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def cv(values: list[float]) -> float | None:
    """Sample standard deviation over the mean (None with fewer than two values)."""
    return statistics.stdev(values) / statistics.mean(values) if len(values) >= 2 else None


def summarize(per: dict[str, list[dict]]) -> dict:
    """CV of the repeat medians per strategy, their median and worst, and the spread between the
    fastest and slowest strategy (by the median of its repeats)."""
    rows = {}
    for name, trials in per.items():
        medians = [t["median_s"] for t in trials if t["status"] == "ok"]
        rows[name] = {"medians_s": medians, "cv": cv(medians),
                      "median_s": statistics.median(medians) if medians else None,
                      "reached": sum(1 for t in trials if t.get("reached")), "trials": len(trials),
                      "steps": [t.get("steps") for t in trials], "ci95_s": [t.get("ci95_s") for t in trials]}
    cvs = [r["cv"] for r in rows.values() if r["cv"] is not None]
    meds = [r["median_s"] for r in rows.values() if r["median_s"]]
    return {"strategies": rows, "median_cv": statistics.median(cvs) if cvs else None,
            "worst_cv": max(cvs) if cvs else None,
            "spread": max(meds) / min(meds) if len(meds) >= 2 else None,
            "target_cv": TARGET_CV,
            "meets_target": (statistics.median(cvs) <= TARGET_CV) if cvs else None}


def inside(args) -> int:
    from autosync.api import make_runner
    from strategy_space import validate
    from strategy_space.builders import get_builder

    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    commit = _commit()   # of the code this run measures, not of whatever HEAD is when it ends
    load_start = os.getloadavg()[0]
    t0 = time.monotonic()
    runner = make_runner(args.model, "testbed", warmup=args.warmup, steps=args.steps, trial_timeout_s=240.0,
                         precision=0.03, max_steps=args.max_steps, max_measure_s=args.max_measure_s,
                         compute=args.compute, step_time_s=args.step_time)
    per: dict[str, list[dict]] = {s: [] for s in args.strategies}
    stopped = None
    try:
        model, cluster = runner.model, runner.cluster
        strategies = {s: validate(get_builder(s).build(model, cluster), model, cluster) for s in args.strategies}
        for r in range(args.repeats):
            for name, strategy in strategies.items():
                if time.monotonic() - t0 > args.budget_min * 60:
                    stopped = f"budget of {args.budget_min:g} min reached before repeat {r + 1} of {name}"
                    break
                t = runner.run_one(strategy, name)
                m = t.meta.get("measure", {})
                per[name].append({"status": t.status, "median_s": t.median if t.ok else None,
                                  "ci95_s": list(t.median_ci) if t.ok and t.median_ci else None,
                                  "steps": len(t.step_times), "reached": m.get("reached"),
                                  "error": t.error[:200] or None})
                print(f"  repeat {r + 1} {name:16s} " + (f"{t.median * 1e3:8.1f} ms  {len(t.step_times):3d} steps  "
                      f"+-{(m.get('halfwidth') or math.inf) * 100:.1f} %" if t.ok else f"{t.status}: {t.error[:120]}"),
                      flush=True)
            if stopped:
                break
    finally:
        runner.close()
    summary = summarize(per)
    entry = {"commit": commit, "started_at": started, "compute": args.compute, "nodes": len(cluster.nodes),
             "bandwidth_gbps": cluster.nodes[0].bandwidth_gbps, "model": args.model,
             "step_time_s": runner.model_def.step_time_s if args.compute == "emulated" else None,
             "cores": os.cpu_count(), "cpuset": bool(args.shape_note == "cpuset"),
             # other work on the machine competes with real compute: the load says how much
             "loadavg_1min_start_end": [round(load_start, 2), round(os.getloadavg()[0], 2)],
             "repeats": args.repeats, "warmup": args.warmup, "steps": args.steps, "max_steps": args.max_steps,
             "wall_s": round(time.monotonic() - t0, 1), "stopped": stopped, **summary}
    print(render(entry))
    _merge(args.out, entry)
    print(f"results merged into {args.out}")
    return 0


def shape_key(e: dict) -> str:
    return (f"{e['compute']}:{e['nodes']}x{e['bandwidth_gbps'] * 1000:g}mbit:{e['model']}"
            + (":cpuset" if e.get("cpuset") else ""))


def render(e: dict) -> str:
    from autosync.formatting import table

    def pct(x):
        return "-" if x is None else f"{x * 100:.1f} %"

    rows = [(name, " ".join(f"{m * 1e3:.0f}" for m in r["medians_s"]), pct(r["cv"]), f"{r['reached']}/{r['trials']}",
             "/".join(str(s) for s in r["steps"])) for name, r in e["strategies"].items()]
    head = table(["strategy", "repeat medians (ms)", "CV", "precise", "steps"], rows, right=(2, 3))
    verdict = "meets" if e["meets_target"] else "MISSES"
    spread = "-" if e["spread"] is None else f"{e['spread']:.2f}x"
    return (f"{shape_key(e)}\n{head}\nmedian CV {pct(e['median_cv'])} (worst {pct(e['worst_cv'])}): {verdict} the "
            f"target CV <= {TARGET_CV}; fastest-to-slowest spread {spread}; {e['wall_s']:.0f} s")


def _merge(path: str, entry: dict) -> None:
    from _testbed import write_json

    data = {"runs": {}}
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
    data.setdefault("runs", {})[shape_key(entry)] = entry
    write_json(path, data)


def _commit() -> str:
    import subprocess

    r = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() or "unknown"


def pin_nodes(namespaces, cores: int) -> dict:
    """Confine every thread of every process in namespace i to core ``i mod cores`` (children
    started later inherit it). Returns ``{namespace: core}``."""
    from autosync.testbed import netns

    out = {}
    for i, ns in enumerate(namespaces):
        core = i % cores
        for pid in netns.pids(ns):
            for tid in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else ():
                try:
                    os.sched_setaffinity(int(tid), {core})
                except OSError:
                    pass  # the thread ended meanwhile
        out[ns] = core
    return out


def outer(args, argv) -> int:
    from autosync.testbed import Testbed
    from strategy_space.errors import ConfigError

    from _testbed import strip_flags

    try:
        with Testbed(nodes=args.nodes, bandwidth=args.bandwidth, cpus_per_node=1, object_store_mb=1000) as tb:
            print(f"testbed up: {args.nodes} nodes at {tb.config.links}", flush=True)
            extra = []
            if args.cpuset:
                print(f"pinned: {pin_nodes(tb.state.namespaces, os.cpu_count() or 1)}", flush=True)
                extra = ["--shape-note", "cpuset"]
            cmd = [sys.executable, os.path.abspath(__file__), "--inside", *strip_flags(argv, OUTER_FLAGS), *extra]
            return tb.exec(cmd).returncode
    except ConfigError as e:
        print(f"trial_noise: {e}", file=sys.stderr)
        return 2


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.inside:
        if not os.environ.get("RAY_ADDRESS"):
            print("trial_noise --inside runs inside the testbed's host0 (see the module doc)", file=sys.stderr)
            return 2
        return inside(args)
    return outer(args, argv)


if __name__ == "__main__":
    sys.exit(main())
