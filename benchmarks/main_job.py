"""The README's main job, ``autosync tune`` with every default, run ``--repeats`` times, each from an
empty cache (``XDG_CACHE_HOME`` a fresh folder), as a new user runs it: wall time, trials, and the
first search round against the slowest baseline (issue 27: no trial of the first round slower than
1.5x the slowest baseline). The figures come from the run's own trial store.

    python benchmarks/main_job.py --repeats 3 --out benchmarks/results/main_job_local.json

Run it on an otherwise idle machine: the job's two workers share its cores.
"""
from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._rows import commit  # noqa: E402
from benchmarks._testbed import write_json  # noqa: E402
from tuner.records.goodput import lossy_parts  # noqa: E402
from tuner.records.store import TrialStore  # noqa: E402


def shape_of(strategy) -> str:
    """What a strategy is made of, in a few words (which trial of a first round was slow)."""
    from strategy_space import PS

    syncs = [s for v in strategy.variables for s in v.synchronizers]
    ps = [s for s in syncs if isinstance(s, PS)]
    ar = [s for s in syncs if not isinstance(s, PS)]
    split = sum(len(v.synchronizers) > 1 for v in strategy.variables)
    return (f"{len(ps)} PS shards on {len({s.destination for s in ps})} nodes, {len(ar)} all-reduced in "
            f"{len({s.group for s in ar})} groups, {split} partitioned variables; {lossy_parts(strategy).describe()}")


def first_round(store_path: str, batch: int) -> dict:
    """The run's baselines and its first ``batch`` search trials, in measured order."""
    with TrialStore(store_path) as store:
        trials = sorted(store.trials(), key=lambda t: t.finished_at)
    base = [t for t in trials if t.role == "baseline" and t.ok]
    search = [t for t in trials if t.role == "search"]
    first = search[:batch]
    slowest = max(t.median for t in base)
    ms = [round(t.median * 1e3, 1) if t.ok else None for t in first]
    worst = max((t.median if t.ok else float("inf")) for t in first)
    return {"slowest_baseline_ms": round(slowest * 1e3, 1), "trials_ms": ms,
            "worst_vs_slowest_baseline": round(worst / slowest, 2),
            "baselines": {t.strategy.origin or "?": round(t.median * 1e3, 1) for t in base},
            "trials": [shape_of(t.strategy) for t in first],
            "search_trials_ms": [round(t.median * 1e3, 1) if t.ok else None for t in search],
            "search_worst_vs_slowest_baseline": round(max((t.median if t.ok else float("inf")) for t in search)
                                                      / slowest, 2)}


def one_run(timeout_s: float, batch: int) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        load = os.getloadavg()[0]
        t0 = time.monotonic()
        # the console script of the Python running this (its venv need not be on PATH)
        script = os.path.join(os.path.dirname(sys.executable), "autosync")
        p = subprocess.run([script if os.path.exists(script) else "autosync", "tune"],
                           env={**os.environ, "XDG_CACHE_HOME": cache}, capture_output=True, text=True,
                           timeout=timeout_s)
        wall = time.monotonic() - t0
        row = {"run_started": started, "commit": commit(), "load_average_at_start": round(load, 2),
               "wall_s": round(wall, 1), "exit_code": p.returncode,
               "stdout": p.stdout.strip().splitlines()}
        store = os.path.join(cache, "autosync", "trials.db")
        if p.returncode == 0 and os.path.exists(store):
            row["first_round"] = first_round(store, batch)
        else:
            row["stderr_tail"] = p.stderr[-2000:]
        return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4, help="search trials per round (the default tune's)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    ap.add_argument("--out")
    args = ap.parse_args()
    runs = {}
    for i in range(args.repeats):
        row = one_run(args.timeout, args.batch)
        runs[row["run_started"]] = {**row, "machine": f"{os.cpu_count()}-core machine; nothing else ran"}
        fr = row.get("first_round", {})
        print(f"run {i + 1}: {row['wall_s']:.0f} s, exit {row['exit_code']}, first round {fr.get('trials_ms')} ms, "
              f"worst {fr.get('worst_vs_slowest_baseline')}x the slowest baseline "
              f"({fr.get('slowest_baseline_ms')} ms); whole search worst {fr.get('search_worst_vs_slowest_baseline')}x",
              flush=True)
    worst = [r["first_round"]["worst_vs_slowest_baseline"] for r in runs.values() if "first_round" in r]
    walls = [r["wall_s"] for r in runs.values()]
    print(f"first round worst vs slowest baseline: {worst} (target <= 1.5); wall median {np.median(walls):.0f} s "
          f"(range {min(walls):.0f}-{max(walls):.0f})")
    if args.out:
        doc = {"what": "the README's main job (`autosync tune`, every default: zoo:ncf small on local, 2 workers, "
                       "12 search trials, builtin warm start, goodput), each run from an empty cache; "
                       "benchmarks/main_job.py",
               "runs": runs}
        write_json(args.out, doc)


if __name__ == "__main__":
    main()
