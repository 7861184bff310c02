"""Peak memory of the full-size embedding models training with a PS/Parallax strategy, real compute.

For each model (default ``ncf`` and ``dlrm`` at ``size=full``), on the ``local`` cluster (one node,
2 workers): a few steps of the given builder's strategy, while a sampler thread sums the memory
of this driver and every process it started (Ray's GCS, raylet, workers, PS actors) every 0.2 s:
RSS (counts the shared object-store pages once per process that maps them) and PSS (shares them
out: the machine's real use). The run stops early, killing those processes, when PSS passes
``--limit-gib``, and says so. Writes ``full_models_memory.json`` with the commit and start time.

    python benchmarks/full_models_memory.py --models ncf dlrm --builder parallax --steps 3
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
GIB = 1 << 30


def _memory(pids: list[int]) -> tuple[int, int]:
    """(RSS, PSS) bytes summed over ``pids`` (from /proc/PID/smaps_rollup)."""
    rss = pss = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Rss:"):
                        rss += int(line.split()[1]) * 1024
                    elif line.startswith("Pss:"):
                        pss += int(line.split()[1]) * 1024
        except OSError:
            continue
    return rss, pss


class Sampler(threading.Thread):
    """Peak RSS/PSS of this process tree; kills the tree's other processes past ``limit`` bytes."""

    def __init__(self, limit: int):
        super().__init__(daemon=True)
        self.limit, self.peak_rss, self.peak_pss, self.over = limit, 0, 0, False
        self.processes = 0
        self._halt = threading.Event()

    def run(self):
        from autosync.runtime.reaper import descendants

        me = os.getpid()
        while not self._halt.wait(0.2):
            pids = [me] + descendants(me)
            rss, pss = _memory(pids)
            self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)
            self.processes = max(self.processes, len(pids))
            if pss > self.limit and not self.over:
                self.over = True
                for pid in pids:
                    if pid != me:
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except OSError:
                            pass

    def stop(self):
        self._halt.set()
        self.join()


def measure(name: str, builder: str, steps: int, limit: int) -> dict:
    import ray

    from autosync.runtime.runner import RayRunner
    from strategy_space.builders import get_builder

    sampler = Sampler(limit)
    sampler.start()
    t0 = time.monotonic()
    rec = {"source": f"zoo:{name}?size=full", "builder": builder}
    try:
        runner = RayRunner(rec["source"], "local", warmup=1, steps=steps, trial_timeout_s=900)
        model = runner.model
        rec["parameter_bytes"] = sum(v.bytes for v in model.variables)
        rec["sparse_bytes"] = sum(v.bytes for v in model.variables if v.sparse)
        trial = runner.run_one(get_builder(builder).build(model, runner.cluster), builder)
        rec.update(status=trial.status, error=trial.error or None, median_s=trial.median if trial.ok else None,
                   full_pull=trial.meta.get("full_pull"),
                   bytes_per_step_per_worker=trial.meta.get("bytes_per_step_per_worker"))
    except Exception as e:  # noqa: BLE001 - recorded: an out-of-memory stop is a result
        rec.update(status="error", error=f"{type(e).__name__}: {e}".splitlines()[0][:300])
    finally:
        try:
            runner.pool.kill_all()
        except Exception:  # noqa: BLE001
            pass
        ray.shutdown()
        sampler.stop()
    rec.update(peak_rss_gib=round(sampler.peak_rss / GIB, 2), peak_pss_gib=round(sampler.peak_pss / GIB, 2),
               processes=sampler.processes, stopped_over_limit=sampler.over, wall_s=round(time.monotonic() - t0, 1))
    return rec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["ncf", "dlrm"], choices=["ncf", "dlrm", "lm1b"])
    p.add_argument("--builder", default="parallax", help="strategy builder (default parallax)")
    p.add_argument("--steps", type=int, default=3, help="timed steps (default 3, after 1 warm-up)")
    p.add_argument("--limit-gib", type=float, default=16.0, help="stop a run whose PSS passes this (default 16)")
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"), help="output folder")
    args = p.parse_args(argv)
    if args.steps < 1 or args.limit_gib <= 0:
        print("full_models_memory: --steps must be >= 1 and --limit-gib > 0", file=sys.stderr)
        return 2
    from _testbed import git_commit, write_json

    started, commit = time.strftime("%Y-%m-%d %H:%M:%S"), git_commit(REPO)
    results = {"meta": {"commit": commit, "started": started, "cluster": "local (1 node, 2 workers)",
                        "steps": args.steps, "limit_gib": args.limit_gib}, "models": {}}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "full_models_memory.json")
    for name in args.models:
        rec = measure(name, args.builder, args.steps, int(args.limit_gib * GIB))
        results["models"][name] = {"run_started": started, "commit": commit, **rec}
        print(json.dumps({name: rec}), flush=True)
        write_json(path, results)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
