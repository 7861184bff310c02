"""Run a benchmark script inside an emulated testbed it brings up (and always tears down).

A script has two halves: the measuring half runs as a driver inside the testbed's host0 (``--inside``,
``RAY_ADDRESS`` set by ``autosync testbed exec``), the outer half brings the testbed up and re-runs
the script there with the same arguments, less the ones only the outer half reads.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Sequence


def write_json(path: str, data: dict, default=None) -> None:
    """Write ``data`` as JSON atomically (partial results survive an interruption, never half-written);
    says once when git ignores the file (``_rows.warn_if_ignored``). ``default``: as ``json.dump``'s."""
    try:
        from _rows import warn_if_ignored
    except ImportError:   # imported as benchmarks._testbed
        from benchmarks._rows import warn_if_ignored

    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=default)
    os.replace(tmp, path)
    warn_if_ignored(path)


def git_commit(repo: str) -> str:
    """The commit the measuring code is at (``-dirty`` when it had uncommitted changes), for the
    provenance every result entry records; ``unknown`` outside a git checkout."""
    import subprocess

    r = subprocess.run(["git", "-C", repo, "describe", "--always", "--dirty", "--abbrev=7", "--exclude=*"],
                       capture_output=True, text=True)
    return r.stdout.strip() or "unknown"


def warm_start_groups(store: str, prog: str):
    """The (model, cluster, trials) groups of ``store`` (builtin: the shipped dataset, or a trial
    store file), or None after saying on stderr, as ``prog``, why it cannot be read."""
    from strategy_space.errors import ConfigError
    from tuner.records.warmstart import load_warm_start

    try:
        return load_warm_start(store)
    except ConfigError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return None


def strip_flags(argv: Sequence[str], flags: set[str]) -> list[str]:
    """``argv`` without ``flags`` and their values (``--flag v`` or ``--flag=v``; flags that take
    several values, ``--flag a b``, lose all of them)."""
    out, skipping = [], False
    for a in argv:
        if a.startswith("-"):
            skipping = a.split("=")[0] in flags
            if skipping:
                skipping = "=" not in a
                continue
        elif skipping:
            continue
        out.append(a)
    return out


def trial_record(trial) -> dict:
    """What a benchmark keeps of one measured trial: status, error, median and its interval, the
    step times and the phases per step."""
    return {"status": trial.status, "error": trial.error or None, "median_s": trial.median if trial.ok else None,
            "median_ci95_s": list(trial.median_ci) if trial.ok and trial.median_ci else None,
            "step_times_s": [round(t, 5) for t in trial.step_times], "breakdown_s": trial.breakdown or None}


def trial_in_mode(runner, strategy, label: str, modes: dict, mode: str) -> dict:
    """``trial_record`` of ``strategy`` run under the environment ``modes[mode]`` sets (mode name ->
    variables); every variable any mode sets is cleared before and after."""
    keys = {k for env in modes.values() for k in env}
    for key in keys:
        os.environ.pop(key, None)
    os.environ.update(modes[mode])
    try:
        trial = runner.run_one(strategy, label)
    finally:
        for key in keys:
            os.environ.pop(key, None)
    return trial_record(trial)


def say_trial(label: str, rec: dict) -> None:
    """Print one ``trial_record``: its median (or error) and phases in ms."""
    phases = {k: round(v * 1e3, 1) for k, v in (rec["breakdown_s"] or {}).items()}
    med = f"{rec['median_s'] * 1e3:.1f} ms" if rec["median_s"] else rec["error"]
    print(f"  {label}: {med}, phases ms {phases}", flush=True)


def say_summary(summary: dict) -> None:
    """Print a per-strategy summary, one line each."""
    for label, s in summary.items():
        print(f"  {label}: " + ", ".join(f"{k} {v}" for k, v in s.items()), flush=True)


def run_in_testbed(script: str, argv: Sequence[str], *, nodes: int, bandwidth: str, outer_flags: set[str],
                   extra: Sequence[str] = (), name: str = "benchmark") -> int:
    """Bring a testbed of ``nodes`` x ``bandwidth`` (1 CPU each) up, run ``script --inside`` with
    ``argv`` (less ``outer_flags``) plus ``extra`` in host0, tear it down; the exit code."""
    from autosync.testbed import Testbed
    from strategy_space.errors import ConfigError

    try:
        with Testbed(nodes=nodes, bandwidth=bandwidth, cpus_per_node=1, object_store_mb=1000) as tb:
            print(f"testbed up: {nodes} nodes at {tb.config.links}", flush=True)
            cmd = [sys.executable, os.path.abspath(script), "--inside", *strip_flags(argv, outer_flags), *extra]
            return tb.exec(cmd).returncode
    except ConfigError as e:
        print(f"{name}: {e}", file=sys.stderr)
        return 2


def testbed_main(script: str, argv: Sequence[str], args, inside, name: str) -> int:
    """The end of a per-model testbed benchmark's ``main``: ``inside(args)`` with ``--inside``, else
    the script run inside a testbed it brings up (``--nodes``, ``--bandwidth``; ``--out`` made
    absolute for the inner half)."""
    if args.inside:
        return inside(args)
    return run_in_testbed(script, argv, nodes=args.nodes, bandwidth=args.bandwidth, name=name,
                          outer_flags={"--nodes", "--bandwidth", "--out"}, extra=["--out", os.path.abspath(args.out)])


def measure_models(name: str, repo: str, out_dir: str, json_name: str, models, measure, meta: dict) -> int:
    """The ``--inside`` half of a per-model benchmark: join the testbed's Ray, run
    ``measure(model, cluster)`` for each model and write ``{"meta": ..., "models": ...}`` to
    ``out_dir/json_name`` after each one (every entry and the meta with the run's commit and start
    time); the exit code."""
    import time

    import ray

    from autosync.sources import load_cluster
    from autosync.testbed import format_rate

    if not os.environ.get("RAY_ADDRESS"):
        print(f"{name} --inside runs inside the testbed's host0 (`autosync testbed exec`)", file=sys.stderr)
        return 2
    cluster = load_cluster("testbed")
    ray.init(address=os.environ["RAY_ADDRESS"], logging_level="ERROR", log_to_driver=False)
    started, commit = time.strftime("%Y-%m-%d %H:%M:%S"), git_commit(repo)
    results = {"meta": {"nodes": len(cluster.nodes), "commit": commit, "run_started": started,
                        "bandwidth": format_rate(round(cluster.nodes[0].bandwidth_gbps * 1e9)),
                        "what_else_ran": os.environ.get("AUTOSYNC_BENCH_NOTE", ""), **meta}, "models": {}}
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, json_name)
    for model in models:
        print(f"{model}:", flush=True)
        results["models"][model] = {"run_started": started, "commit": commit, **measure(model, cluster)}
        write_json(path, results)
    ray.shutdown()
    print(f"wrote {path}")
    return 0
