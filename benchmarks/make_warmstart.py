"""Make the warm-start dataset AutoSync ships (``tuner/data/warmstart.db.gz``) by measuring trials on
the emulated testbed.

For each testbed shape (``--testbeds 3x1gbit 4x500mbit``: nodes x link rate, 1 CPU per node) and
each small zoo model, one tuning run (``autosync.tune``, no warm start of its own, the store shared
across models so later models already learn from earlier ones) with a large exploration share, so
the dataset holds the baselines, the tuner's own picks and random strategies. Every trial lands in
``--store`` as it is measured (an interrupted run keeps what it measured; re-running adds to it).
``--pack`` then writes the compacted, gzip-compressed copy into the package.

Needs root (the testbed)::

    sudo python benchmarks/make_warmstart.py --testbeds 3x1gbit --trials 24
    sudo python benchmarks/make_warmstart.py --testbeds 4x500mbit --trials 16
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
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

MODELS = ("ncf", "dlrm", "lm1b", "resnet50", "bert", "vgg16")   # cheapest first
DEFAULT_STORE = os.path.join(REPO, "benchmarks", "results", "warmstart.db")
TESTBED_RE = re.compile(r"^(\d+)x(\w+)$")


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--inside", action="store_true", help="measure only (inside host0 of an existing testbed)")
    p.add_argument("--testbeds", nargs="+", default=["3x1gbit"], metavar="NxRATE",
                   help="testbed shapes to measure on, one after the other (default 3x1gbit)")
    p.add_argument("--models", nargs="+", default=list(MODELS), metavar="NAME", help="zoo models (default: all six)")
    p.add_argument("--trials", type=int, default=24, help="search trials per model, on top of the baselines")
    p.add_argument("--epsilon", type=float, default=0.5, help="share of each round drawn at random (default 0.5)")
    p.add_argument("--time-per-model", type=float, default=600.0, help="time budget per model, s (default 600)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per trial (default 2)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per trial (default 6)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--store", default=DEFAULT_STORE, help="trial store to grow")
    p.add_argument("--pack", action="store_true", help="write --store, compacted and gzipped, to --packed")
    p.add_argument("--packed", default=None, help="default: tuner/data/warmstart.db.gz")
    return p.parse_args(argv)


def inside(args) -> int:
    from autosync.api import tune
    from strategy_space.errors import ConfigError
    from tuner.tuning import SearchSettings

    if not os.environ.get("RAY_ADDRESS"):
        print("make_warmstart --inside runs inside the testbed's host0 (see the module doc)", file=sys.stderr)
        return 2
    os.makedirs(os.path.dirname(os.path.abspath(args.store)), exist_ok=True)
    for i, name in enumerate(args.models):
        t0 = time.monotonic()
        print(f"{name}:", flush=True)

        def show(trial, outcome):
            got = f"{trial.median * 1e3:.1f} ms" if trial.ok else f"{trial.status}: {trial.error[:120]}"
            print(f"  {len(outcome.trials):3d} {trial.meta.get('role', '')[:6]:6s} {trial.origin:24s} {got}", flush=True)

        try:
            result = tune(f"zoo:{name}", "testbed", trials=args.trials, time_budget_s=args.time_per_model,
                          store=args.store, steps=args.steps, warmup=args.warmup, trial_timeout_s=180.0,
                          patience=10**6, warm_start="none", on_trial=show,
                          settings=SearchSettings(epsilon=args.epsilon, seed=args.seed + i))
            s = result.summary()
            print(f"  -> {s['total_trials']} trials in {time.monotonic() - t0:.0f} s, best {s['best_step_time_s'] * 1e3:.1f} ms "
                  f"({s['best_origin']}), {s['speedup_over_best_baseline']:.2f}x the best baseline", flush=True)
        except ConfigError as e:
            print(f"  -> {name} gave no usable trial: {e}", flush=True)
    return 0


def pack(store: str, packed: str) -> int:
    """Copy ``store`` (consistent snapshot), VACUUM it, gzip it atomically into ``packed``."""
    from tuner.store import TrialStore

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
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _args(argv)
    if args.pack:
        from tuner.warmstart import BUILTIN_PATH

        return pack(args.store, args.packed or str(BUILTIN_PATH))
    unknown = [m for m in args.models if m not in MODELS]
    bad = [t for t in args.testbeds if not TESTBED_RE.match(t)]
    if unknown or bad or args.trials < 0 or args.steps < 1 or not 0 <= args.epsilon <= 1:
        print(f"bad arguments: models {unknown} (valid: {', '.join(MODELS)}), testbeds {bad} (form NxRATE, "
              f"e.g. 3x1gbit), --trials >= 0, --steps >= 1, 0 <= --epsilon <= 1", file=sys.stderr)
        return 2
    if args.inside:
        return inside(args)
    from _testbed import run_in_testbed

    for shape in args.testbeds:
        nodes, rate = TESTBED_RE.match(shape).groups()
        rc = run_in_testbed(__file__, argv, nodes=int(nodes), bandwidth=rate, name="make_warmstart",
                            outer_flags={"--testbeds", "--store"}, extra=["--store", os.path.abspath(args.store)])
        if rc:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
