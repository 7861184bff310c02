"""What ``autosync.worker_pool`` saves a script that tunes and then trains: the same script with one
set of workers for both (``pool``) and with the trainer starting its own (``separate``), each run
in a fresh Python process from nothing (its own embedded Ray), the two alternated.

    python benchmarks/worker_pool.py --repeats 3 --out benchmarks/results/worker_pool_local.json

Per run: the tune's wall time, the trainer's start (``make_trainer`` until it is ready to fit:
workers and parameter servers up, the model loaded), the first ``fit`` call (its first steps pay
the workers' first graph traces) and the whole script; the ratio printed is separate over pool,
medians of the same run. Run it on an otherwise idle machine: the workers share its cores.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks._rows import commit  # noqa: E402
from benchmarks._testbed import write_json  # noqa: E402

# one run, in its own process: tune, then train with the best strategy, timing each part
SCRIPT = r'''
import contextlib, json, sys, time
t0 = time.monotonic()
import autosync
model, cluster, trials, steps, store, mode = sys.argv[1:7]
trials, steps = int(trials), int(steps)
out = {}
with (autosync.worker_pool(cluster) if mode == "pool" else contextlib.nullcontext()) as pool:
    t = time.monotonic()
    result = autosync.tune(model, cluster=cluster, trials=trials, store=store, steps=5, warmup=2, pool=pool)
    out["tune_s"] = time.monotonic() - t
    t = time.monotonic()
    with autosync.make_trainer(model, result.best_strategy, cluster, pool=pool) as trainer:
        out["trainer_start_s"] = time.monotonic() - t
        t = time.monotonic()
        trainer.fit(steps=steps)
        out["first_fit_s"] = time.monotonic() - t
out["script_s"] = time.monotonic() - t0
print("RESULT " + json.dumps(out))
'''


def one_run(mode: str, args, scratch: str) -> dict:
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    store = os.path.join(scratch, f"{mode}-{started}.db")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": REPO}
    env.pop("RAY_ADDRESS", None)
    p = subprocess.run([sys.executable, "-c", SCRIPT, args.model, args.cluster, str(args.trials), str(args.steps),
                        store, mode], env=env, capture_output=True, text=True, timeout=args.timeout)
    row = {"mode": mode, "run_started": started, "commit": commit(), "exit_code": p.returncode,
           "load_average_at_start": None}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        row["stderr_tail"] = p.stderr[-2000:]
        return row
    row.update({k: round(v, 2) for k, v in json.loads(lines[-1][len("RESULT "):]).items()})
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.path.join(REPO, "examples", "my_model.py") + ":build")
    ap.add_argument("--cluster", default="local")
    ap.add_argument("--trials", type=int, default=1, help="search trials (the baselines come on top)")
    ap.add_argument("--steps", type=int, default=20, help="training steps of the first fit")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each mode, alternated")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    ap.add_argument("--scratch", default="/tmp/autosync-worker-pool-bench")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    os.makedirs(args.scratch, exist_ok=True)
    run_started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    rows = []
    for i in range(args.repeats):
        for mode in (("separate", "pool") if i % 2 == 0 else ("pool", "separate")):
            load = os.getloadavg()[0]
            t = time.monotonic()
            row = one_run(mode, args, args.scratch)
            row["load_average_at_start"] = round(load, 2)
            rows.append(row)
            print(f"{mode:8s} run {i + 1}: exit {row['exit_code']}, " + ", ".join(
                f"{k} {row[k]:.1f}" for k in ("tune_s", "trainer_start_s", "first_fit_s", "script_s") if k in row)
                + f" ({time.monotonic() - t:.0f} s)", flush=True)
    failed = [r for r in rows if r["exit_code"] != 0 or "script_s" not in r]
    summary = {}
    for key in ("tune_s", "trainer_start_s", "first_fit_s", "script_s"):
        by = {m: [r[key] for r in rows if r["mode"] == m and key in r] for m in ("separate", "pool")}
        if all(by.values()):
            med = {m: float(np.median(v)) for m, v in by.items()}
            summary[key] = {"separate": med["separate"], "pool": med["pool"],
                            "separate_range": [min(by["separate"]), max(by["separate"])],
                            "pool_range": [min(by["pool"]), max(by["pool"])],
                            "saved_s": med["separate"] - med["pool"]}
            print(f"{key}: separate {med['separate']:.1f} s [{min(by['separate']):.1f}-{max(by['separate']):.1f}], "
                  f"pool {med['pool']:.1f} s [{min(by['pool']):.1f}-{max(by['pool']):.1f}], "
                  f"saved {med['separate'] - med['pool']:.1f} s")
    if "script_s" in summary:
        s = summary["script_s"]
        print(f"whole script: separate / pool = {s['separate'] / s['pool']:.2f}x")
    if args.out:
        write_json(args.out, {
            "what": "a script that tunes then trains (benchmarks/worker_pool.py): autosync.worker_pool (one set of "
                    "workers) vs the trainer starting its own, each run a fresh process with its own embedded Ray, "
                    "modes alternated; medians and ranges over the repeats",
            "commit": commit(), "run_started": run_started,
            "what_else_ran": f"{os.cpu_count()}-core machine; nothing else ran",
            "settings": {"model": os.path.relpath(args.model, REPO) if args.model.startswith(REPO) else args.model,
                         "cluster": args.cluster, "trials": args.trials, "steps": args.steps,
                         "repeats": args.repeats},
            "summary": summary, "runs": rows})
    if failed:
        print(f"{len(failed)} run(s) failed: {[r['mode'] + ' ' + r['run_started'] for r in failed]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
