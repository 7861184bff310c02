"""Statistical efficiency of lossy strategies on the zoo, and how much it depends on the seed.

For each small zoo model and each compressor, the model's all-reduce strategy with that compressor on
every compressible dense variable is probed (``autosync.probe.TrainingProber``: it and its lossless
twin train K steps from the same start on the same data) with two seeds on the ``local`` cluster (a
compressor's effect does not depend on the network). Printed per model and compressor: E and its
interval per seed, the difference between the seeds (target: within 0.05) and the probe's wall time.

    python benchmarks/probe_efficiency.py [--models ncf bert] [--compressors "powersgd(4)" fp16]
        [--seeds 0 1] [--steps 200] [--workers 2] [--json]

``--json`` writes ``benchmarks/results/probe_efficiency.json`` (every entry with the commit and the
start time of the run; ``what_else_ran`` from ``AUTOSYNC_BENCH_NOTE``).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)

from _testbed import git_commit, write_json  # noqa: E402

SMALL_MODELS = ("ncf", "dlrm", "lm1b", "bert", "resnet50", "vgg16")
COMPRESSORS = ("powersgd(4)", "fp16")


def compressed(strategy, spec, compressor: str):
    """``strategy`` (all-reduce everywhere) with ``compressor`` on every dense float matrix."""
    from strategy_space import AllReduce, Strategy, VarConfig

    dense = {v.name for v in spec.variables if v.is_float and not v.sparse and len(v.shape) >= 2}
    out = []
    for c in strategy.variables:
        syncs = tuple(dataclasses.replace(s, compressor=compressor) if isinstance(s, AllReduce) and c.name in dense
                      else s for s in c.synchronizers)
        out.append(VarConfig(c.name, syncs, c.axis))
    return Strategy(tuple(out), strategy.replicas, origin=f"all_reduce+{compressor}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(SMALL_MODELS))
    p.add_argument("--compressors", nargs="+", default=list(COMPRESSORS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    from autosync.models.ingest import model_spec_from_def
    from autosync.probe import TrainingProber
    from autosync.runtime.engine import WorkerPool
    from autosync.sources import load_model_def, local_cluster
    from strategy_space.builders import get_builder
    from tuner.records.goodput import lossy_parts

    cluster = local_cluster(args.workers)
    started, commit = time.strftime("%Y-%m-%d %H:%M:%S"), git_commit(REPO)
    results = {"meta": {"cluster": f"local, {args.workers} workers", "steps": args.steps, "seeds": args.seeds,
                        "commit": commit, "run_started": started,
                        "what_else_ran": os.environ.get("AUTOSYNC_BENCH_NOTE", ""),
                        "target": "E within 0.05 across two seeds"}, "models": {}}
    path = os.path.join(HERE, "results", "probe_efficiency.json")
    pool = WorkerPool.shared_or_new(cluster)
    try:
        for name in args.models:
            md = load_model_def(f"zoo:{name}")
            spec = model_spec_from_def(md)
            base = get_builder("all_reduce").build(spec, cluster)
            entry = {"commit": commit, "run_started": started, "compressors": {}}
            strategies = {c: compressed(base, spec, c) for c in args.compressors}
            strategies = {c: st for c, st in strategies.items() if not lossy_parts(st).lossless}
            per = {c: {} for c in strategies}
            for seed in args.seeds:
                # one prober per seed: the lossless curve is trained once and serves every compressor
                prober = TrainingProber(md, spec, cluster, steps=args.steps, seed=seed, pool=pool)
                t0 = time.perf_counter()
                twin = prober.twin(base)
                twin_s = time.perf_counter() - t0
                for comp, strategy in strategies.items():
                    t0 = time.perf_counter()
                    r = prober.probe(strategy)
                    e = r.efficiency
                    row = {"efficiency": e.value, "interval": [e.low, e.high],
                           "probe_wall_s": round(time.perf_counter() - t0 + twin_s, 1),
                           "candidate_final_loss": sum(r.candidate_loss[-20:]) / 20,
                           "twin_final_loss": sum(twin.twin_loss[-20:]) / 20,
                           "twin_first_loss": sum(twin.twin_loss[:5]) / 5,
                           # the curves, so the estimate can be recomputed from the measurement
                           "candidate_loss": [round(x, 5) for x in r.candidate_loss],
                           "twin_loss": [round(x, 5) for x in twin.twin_loss]}
                    per[comp][str(seed)] = row
                    print(f"{name:9s} {comp:12s} seed {seed}: E {e.value:.3f} [{e.low:.3f}, {e.high:.3f}]  loss "
                          f"{row['twin_first_loss']:.3f} -> twin {row['twin_final_loss']:.3f}, strategy "
                          f"{row['candidate_final_loss']:.3f}  (probe {row['probe_wall_s']:.0f} s with the twin)",
                          flush=True)
            for comp, per_seed in per.items():
                values = [v["efficiency"] for v in per_seed.values()]
                spread = max(values) - min(values)
                entry["compressors"][comp] = {"lossy_parts": lossy_parts(strategies[comp]).describe(),
                                              "seeds": per_seed, "seed_spread": spread, "met": spread <= 0.05}
                print(f"{name:9s} {comp:12s} spread across seeds {spread:.3f} "
                      f"({'met' if spread <= 0.05 else 'MISSED'} <= 0.05)", flush=True)
            results["models"][name] = entry
            if args.json:
                write_json(path, results)
    finally:
        pool.kill_all()
        pool.binding.close()
    if args.json:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
