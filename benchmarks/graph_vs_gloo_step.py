"""Training step time with all-reduce inside the graph vs the numpy path over gloo, and the share
of the in-graph all-reduce time hidden behind the backward pass.

For each model, the ``all_reduce`` builder's strategy runs twice on the same cluster in one run:
backend ``gloo`` (gradients copied out of the graph, one gloo collective per fusion group, numpy
optimizer) and backend ``graph`` (TensorFlow collectives inside the training step, Keras
optimizer in the graph). Prints the median step time of each, the ratio gloo / graph (> 1: graph
is faster), and, for graph, the share of collective time that ran before the last gradient op
ended (TensorFlow's profiler on one step of each worker, mean over workers).

No target: issue 15 asks for the hidden share per model; the speed target of that issue is on
the testbed against Ray Train (baselines_vs_peer.py).

    python benchmarks/graph_vs_gloo_step.py [--models resnet50 vgg16 ncf] [--size small]
        [--cluster local] [--steps 10] [--warmup 3] [--chunk-bytes N] [--json out.json]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

from _rows import commit, write_rows

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def measure(model: str, backend: str, cluster, pool, steps: int, warmup: int, chunk_bytes: int | None) -> dict:
    import ray

    from autosync.runtime.sync.graph_trace import overlap_from_trace, trace_step
    from autosync.runtime.plan import model_spec_from_vars
    from autosync.runtime.trainer import Trainer
    from autosync.sources import load_model_def
    from strategy_space.builders import get_builder

    md = load_model_def(model)
    pool.ensure(md, cluster.devices)
    spec = model_spec_from_vars(md.name, pool.description["variables"], md.batch_size)
    options = {"chunk_bytes": chunk_bytes} if chunk_bytes else {}
    strategy = get_builder("all_reduce", backend=backend, **options).build(spec, cluster)
    with Trainer(md, strategy, cluster, pool=pool, timeout_s=900) as trainer:
        trainer.fit(steps=warmup)
        history = trainer.fit(steps=steps, steps_per_call=steps)
        row = {"median_s": statistics.median(history.step_times), "groups": len(trainer.plan.ar_groups)}
        if backend == "graph":
            with tempfile.TemporaryDirectory() as tmp:
                traces = ray.get([w.__ray_call__.remote(trace_step, os.path.join(tmp, f"w{i}"))
                                  for i, w in enumerate(trainer.session.workers)], timeout=900)
            row["hidden_share"] = statistics.mean(overlap_from_trace(t)["hidden_share"] for t in traces)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["resnet50", "vgg16", "ncf"])
    ap.add_argument("--size", default="small", help="zoo size variant (default small)")
    ap.add_argument("--cluster", default="local")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--chunk-bytes", type=int, help="fusion group size (default: the builder's); smaller "
                    "groups let early ones overlap the backward pass")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)

    from autosync.runtime.engine import WorkerPool
    from autosync.sources import load_cluster

    started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    at_commit = commit()
    cluster = load_cluster(args.cluster)
    rows = []
    for name in args.models:
        model = f"zoo:{name}?size={args.size}"
        pool = WorkerPool.shared_or_new(cluster)
        try:
            res = {b: measure(model, b, cluster, pool, args.steps, args.warmup, args.chunk_bytes) for b in ("gloo", "graph")}
        finally:
            pool.kill_all()
        rows.append({"model": model, "cluster": cluster.name, "gloo_s": res["gloo"]["median_s"],
                     "graph_s": res["graph"]["median_s"], "speedup": res["gloo"]["median_s"] / res["graph"]["median_s"],
                     "hidden_share": res["graph"]["hidden_share"], "groups": res["graph"]["groups"],
                     "chunk_bytes": args.chunk_bytes, "steps": args.steps, "commit": at_commit, "started_utc": started})
        pool.binding.close()
    print(f"{'model':<22} {'gloo s':>8} {'graph s':>8} {'gloo/graph':>10} {'hidden':>7} {'groups':>6}")
    for r in rows:
        print(f"{r['model']:<22} {r['gloo_s']:>8.3f} {r['graph_s']:>8.3f} {r['speedup']:>10.2f} "
              f"{r['hidden_share']:>7.0%} {r['groups']:>6}")
    print(f"commit {at_commit}, started {started} UTC, cluster {cluster.name}")
    write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
