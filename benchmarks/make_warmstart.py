"""Make the warm-start dataset AutoSync ships (``tuner/data/warmstart.db.gz``) by measuring trials on
the emulated testbed, on shapes where the network, not this machine's CPU, decides.

A shape is ``NxRATE[:COMPUTE]``: N nodes (1 CPU each) with links shaped to RATE, and real
(TensorFlow) or emulated compute (workers wait the profiled compute time and send synthetic
gradients; see ``autosync.runtime.emulated``). Real compute needs no more nodes than cores.
``local[:COMPUTE]`` is the built-in ``local`` cluster on this machine, no testbed: one node, two
workers sharing its cores, what ``autosync tune`` runs by default.
For each shape and each model, one tuning run (``autosync.tune``, no warm start of its own, the
store shared across models so later models already learn from earlier ones) with a large
exploration share, so the dataset holds the baselines, the tuner's own picks and random
strategies; every trial is measured to a precision (95 % interval of its median within +-3 %, or
a step cap). The tuner's confirmation re-measures its best strategy and best baseline; on top of
that ``--repeat`` more strategies per group (the slowest and a middle one) are measured twice more,
so every group holds several strategies measured three times on purpose and the dataset's noise
ceiling is known (``benchmarks/simulator_accuracy.py --store`` prints it). Every trial lands in
``--store`` as it is measured (an interrupted run keeps what it measured; re-running adds to it).
``--pack`` then writes the compacted, gzip-compressed copy into the package.

Needs root (the testbed); hold the testbed lock::

    flock /tmp/autosync-testbed.lock python benchmarks/make_warmstart.py \\
        --testbeds 2x200mbit 2x100mbit 3x200mbit:emulated 3x100mbit:emulated local --trials 10
    python benchmarks/make_warmstart.py --pack          # -> tuner/data/warmstart.db.gz
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import shutil
import sqlite3
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

MODELS = ("ncf", "dlrm", "lm1b", "resnet50", "bert", "vgg16")   # cheapest first
DEFAULT_STORE = os.path.join(REPO, "benchmarks", "results", "warmstart.db")
TESTBED_RE = re.compile(r"^(\d+)x(\w+?)(?::(real|emulated))?$")
LOCAL_RE = re.compile(r"^local(?::(real|emulated))?$")   # this machine, no testbed: the main job's cluster


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--inside", action="store_true", help="measure only (inside host0 of an existing testbed)")
    p.add_argument("--testbeds", nargs="+", default=["2x200mbit"], metavar="NxRATE[:COMPUTE]",
                   help="testbed shapes to measure on, one after the other (default 2x200mbit; COMPUTE is "
                        "real, the default, or emulated)")
    p.add_argument("--compute", choices=("real", "emulated"), default="real", help=argparse.SUPPRESS)
    p.add_argument("--cluster", default="testbed", help=argparse.SUPPRESS)
    p.add_argument("--repeat", type=int, default=2,
                   help="strategies per group measured twice more on purpose, besides the confirmation (default 2)")
    p.add_argument("--max-steps", type=int, default=40, help="timed-step cap of the precision target (default 40)")
    p.add_argument("--models", nargs="+", default=list(MODELS), metavar="NAME", help="zoo models (default: all six)")
    p.add_argument("--trials", type=int, default=24, help="search trials per model, on top of the baselines")
    p.add_argument("--epsilon", type=float, default=0.5, help="share of each round drawn at random (default 0.5)")
    p.add_argument("--time-per-model", type=float, default=600.0, help="time budget per model, s (default 600)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per trial (default 2)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per trial (default 6)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--store", default=DEFAULT_STORE, help="trial store to grow")
    p.add_argument("--pack", action="store_true", help="write --store, compacted and gzipped, to --packed")
    p.add_argument("--packed", default=None, help="default: tuner/data/warmstart.db.gz")
    p.add_argument("--measured-by", help="with --pack: the commit whose code measured --store (recorded in the "
                   "noise summary; a store does not keep it)")
    p.add_argument("--noise-out", default=os.path.join(REPO, "benchmarks", "results", "warmstart_noise.json"),
                   help="with --pack: where the per-shape noise summary goes (default %(default)s)")
    return p.parse_args(argv)


def inside(args) -> int:
    from autosync.api import make_runner, tune
    from strategy_space.errors import ConfigError
    from tuner.search.model_based import SearchSettings

    if args.cluster == "testbed" and not os.environ.get("RAY_ADDRESS"):
        print("make_warmstart --inside runs inside the testbed's host0 (see the module doc)", file=sys.stderr)
        return 2
    os.makedirs(os.path.dirname(os.path.abspath(args.store)), exist_ok=True)
    for i, name in enumerate(args.models):
        t0 = time.monotonic()
        print(f"{name} ({args.compute} compute):", flush=True)

        def show(trial, outcome=None):
            got = f"{trial.median * 1e3:.1f} ms" if trial.ok else f"{trial.status}: {trial.error[:120]}"
            n = len(outcome.trials) if outcome else "+"
            print(f"  {n:>3} {trial.role[:7]:7s} {trial.origin:24s} {got}", flush=True)

        runner = None
        try:
            # real compute: the profiled spec (compute time, rows per step), as ``tune`` builds it for its
            # own runner: the workers' own description carries no profile
            runner = make_runner(f"zoo:{name}", args.cluster, warmup=args.warmup, steps=args.steps, trial_timeout_s=180.0,
                                 precision=0.03, max_steps=args.max_steps, compute=args.compute, profile=True)
            # the runner's cluster: with emulated compute it records the compute mode
            result = tune(f"zoo:{name}", runner.cluster, trials=args.trials, time_budget_s=args.time_per_model,
                          store=args.store, patience=10**6, warm_start="none", on_trial=show, runner=runner,
                          settings=SearchSettings(epsilon=args.epsilon, explore_ratio=None,
                                                  explore_from_round=1, seed=args.seed + i))
            s = result.summary()
            print(f"  -> {s['total_trials']} trials in {time.monotonic() - t0:.0f} s, best {s['best_step_time_s'] * 1e3:.1f} ms "
                  f"({s['best_origin']}), {s['speedup_over_best_baseline']:.2f}x the best baseline", flush=True)
            repeat(runner, result, args.repeat, args.store, show)
        except ConfigError as e:
            print(f"  -> {name} gave no usable trial: {e}", flush=True)
        finally:
            if runner is not None:
                runner.close()
    return 0


def repeat(runner, result, count: int, store_path: str, show) -> None:
    """Measure ``count`` more strategies of the run twice more each (role ``repeat``): the slowest
    ok one and ones from the middle of the ranking, skipping those the confirmation already
    measured three times; stored like the run's own trials."""
    import dataclasses
    import statistics

    from tuner.records.store import TrialStore

    outcome = result.outcome
    times: dict[str, list] = {}
    for t in outcome.trials:
        if t.ok:
            times.setdefault(t.strategy.canonical(result.cluster).fingerprint, []).append(t)
    once = sorted((ts for ts in times.values() if len(ts) == 1), key=lambda ts: ts[0].median)
    picks = []
    if once:
        picks.append(once[-1])
        picks += [once[j] for j in sorted({len(once) * k // (count + 1) for k in range(1, count + 1)})
                  if once[j] is not once[-1]]
    with TrialStore(store_path) as store:
        for [first] in picks[:count]:
            for _ in range(2):
                [t] = runner.run([first.strategy], [first.origin])
                t = dataclasses.replace(t, run_id=outcome.run_id, role="repeat")
                store.add(t, result.model, result.cluster)
                show(t)
    spread = [statistics.stdev([t.median for t in ts]) / statistics.mean([t.median for t in ts])
              for ts in times.values() if len(ts) >= 3]
    if spread:
        print(f"  confirmation repeats: CV {', '.join(f'{c * 100:.1f} %' for c in spread)}", flush=True)


def pack(store: str, packed: str, noise_out: str | None = None, measured_by: str | None = None) -> int:
    """Copy ``store`` (consistent snapshot), VACUUM it, gzip it atomically into ``packed``."""
    from tuner.records.store import TrialStore

    if not os.path.isfile(store):
        print(f"make_warmstart --pack: no store at {store}; measure first", file=sys.stderr)
        return 2
    os.makedirs(os.path.dirname(os.path.abspath(packed)), exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        copy = os.path.join(tmp, "warmstart.db")
        src, dst = sqlite3.connect(store), sqlite3.connect(copy)
        src.backup(dst)
        src.close()
        dst.execute("PRAGMA journal_mode=DELETE")
        dst.execute("VACUUM")
        dst.close()
        with TrialStore(copy) as s:
            groups, n = s.groups(), len(s)
            names = {fp: s.model(fp).name for fp, _, _ in groups}
            ok = sum(1 for t in s.trials() if t.ok)
        tmp_out = packed + ".tmp"
        with open(copy, "rb") as f, gzip.open(tmp_out, "wb", compresslevel=9) as g:
            shutil.copyfileobj(f, g)
        os.replace(tmp_out, packed)
        raw = os.path.getsize(copy)
    per = {}
    for mfp, cfp, count in groups:
        per.setdefault(names[mfp], []).append(count)
    print(f"packed {n} trials ({ok} ok) in {len(groups)} groups: {json.dumps(per)}")
    print(f"{packed}: {os.path.getsize(packed) / 2**20:.2f} MiB (raw {raw / 2**20:.2f} MiB)")
    shapes = noise_summary(store)
    print("repeat-to-repeat noise per shape and model (std of log step time over repeats of one strategy):")
    print_noise(shapes)
    if noise_out:
        import datetime

        from _testbed import git_commit, write_json

        stamp = lambda ts: datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).isoformat(timespec="seconds")  # noqa: E731
        first = min(r["first"] for m in shapes.values() for r in m.values())
        write_json(noise_out, {
            "what": "noise of the shipped warm-start dataset, per testbed shape and model, from its own repeats",
            "dataset": os.path.relpath(packed, REPO), "trials": n, "ok": ok,
            # the dataset's measurement began then; the packing run (this file) is recorded apart
            "run_started": stamp(first), "measured_until": stamp(max(r["last"] for m in shapes.values() for r in m.values())),
            "commit": measured_by or "unknown (not given with --measured-by)", "packed_by_commit": git_commit(REPO),
            "packed_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "shapes": shapes})
        print(f"noise summary written to {noise_out}")
    return 0


def noise_summary(store: str) -> dict:
    """Per testbed shape (cluster fingerprint) and model: how far repeated measurements of one
    strategy (canonical form) stray: the std of log step time over repeats (~ the CV), its median
    over the strategies measured more than once, and the trials' own interval half-widths."""
    import statistics

    import numpy as np

    from tuner.records.dataset import store_groups
    from tuner.records.store import TrialStore

    shapes: dict = {}
    with TrialStore(store) as s:
        for model, cluster, trials in store_groups(s):
            ok = [t for t in trials if t.ok]
            by: dict = {}
            for t in ok:
                by.setdefault(t.strategy.canonical(cluster).fingerprint, []).append(t.median)
            sds = [float(np.std(np.log(v), ddof=1)) for v in by.values() if len(v) >= 2]
            half = [t.meta.get("measure", {}).get("halfwidth") for t in ok]
            half = [h for h in half if h is not None]
            key = (f"local:{cluster.compute}" if cluster.name == "local" else
                   f"{len(cluster.nodes)}x{cluster.nodes[0].bandwidth_gbps * 1000:g}mbit:{cluster.compute}")
            shapes.setdefault(key, {})[model.name] = {
                "trials": len(ok), "strategies": len(by), "repeated": len(sds),
                "repeat_cv_median": statistics.median(sds) if sds else None,
                "repeat_cv_worst": max(sds) if sds else None,
                "halfwidth_median": statistics.median(half) if half else None,
                "first": min(t.started_at for t in trials), "last": max(t.finished_at for t in trials)}
    return shapes


def print_noise(shapes: dict) -> None:
    for shape, models in shapes.items():
        print(f"{shape}:")
        for name, r in models.items():
            cv = "-" if r["repeat_cv_median"] is None else f"{r['repeat_cv_median'] * 100:.1f} % (worst {r['repeat_cv_worst'] * 100:.1f} %)"
            hw = "-" if r["halfwidth_median"] is None else f"+-{r['halfwidth_median'] * 100:.1f} %"
            print(f"  {name:16s} {r['trials']:3d} trials, {r['strategies']:2d} strategies, {r['repeated']} repeated: "
                  f"repeat CV {cv}; a trial's 95 % interval {hw}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _args(argv)
    if args.pack:
        from tuner.records.warmstart import BUILTIN_PATH

        return pack(args.store, args.packed or str(BUILTIN_PATH), args.noise_out, args.measured_by)
    unknown = [m for m in args.models if m not in MODELS]
    bad = [t for t in args.testbeds if not (TESTBED_RE.match(t) or LOCAL_RE.match(t))]
    cores = os.cpu_count() or 1
    crowded = [t for t in args.testbeds if TESTBED_RE.match(t) and TESTBED_RE.match(t).group(3) != "emulated"
               and int(TESTBED_RE.match(t).group(1)) > cores]
    if (unknown or bad or crowded or args.trials < 0 or args.steps < 1 or args.repeat < 0
            or not 0 <= args.epsilon <= 1):
        print(f"bad arguments: models {unknown} (valid: {', '.join(MODELS)}), testbeds {bad} (form NxRATE[:COMPUTE], "
              f"e.g. 2x200mbit or 3x100mbit:emulated, or local[:COMPUTE]), real-compute testbeds with more nodes than the {cores} cores "
              f"{crowded} (the CPU would decide, not the network: use :emulated), --trials >= 0, --steps >= 1, "
              f"--repeat >= 0, 0 <= --epsilon <= 1", file=sys.stderr)
        return 2
    if args.inside:
        return inside(args)
    from _testbed import run_in_testbed

    for shape in args.testbeds:
        if LOCAL_RE.match(shape):
            rc = inside(argparse.Namespace(**{**vars(args), "cluster": "local",
                                              "compute": LOCAL_RE.match(shape).group(1) or "real"}))
            if rc:
                return rc
            continue
        nodes, rate, compute = TESTBED_RE.match(shape).groups()
        rc = run_in_testbed(__file__, argv, nodes=int(nodes), bandwidth=rate, name="make_warmstart",
                            outer_flags={"--testbeds", "--store", "--compute"},
                            extra=["--store", os.path.abspath(args.store), "--compute", compute or "real"])
        if rc:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
