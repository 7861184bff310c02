"""A parameter server's update of its row-updated variables, whole against finished from an update
ahead (``autosync/runtime/update_ahead.py``), on the zoo models' shapes, in one process.

All variables of a model sit on one PS that gets two workers' gradients per step (the rows of
two batches for each embedding). Per model and optimizer it prints the median milliseconds of:
``whole``, the update as it runs without an update ahead (what a step waits for after its last
push); ``finish``, the update when the update ahead is already done (what a step then waits for);
``ahead``, the update ahead itself, run before (the window a step needs between its first and
last push to hide it: on a PS with a core to spare that is the time the pushes take to arrive).

    python benchmarks/update_ahead.py [--models ncf ncf?size=full ...] [--steps N] [--out FILE]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

OPTIMIZERS = {"adam": {"class": "Adam", "learning_rate": 1e-3},
              "momentum": {"class": "SGD", "learning_rate": 0.01, "momentum": 0.9}}


def shapes_of(name: str) -> tuple[list, int]:
    """(shape, sparse) of every trainable variable of a zoo model, and its batch size."""
    import keras

    from autosync.models import zoo

    md = zoo.get_model_def(name)
    model = md.model_fn()
    sparse = {id(layer.embeddings) for layer in model.layers if isinstance(layer, keras.layers.Embedding)}
    return [(tuple(v.shape), id(v) in sparse) for v in model.trainable_variables], md.batch_size


def measure(shapes: list, rows: int, config: dict, steps: int, warmup: int) -> dict:
    from autosync.runtime.optimizers import make_optimizer

    out = {}
    for mode in ("whole", "ahead"):
        rng = np.random.default_rng(0)
        o = make_optimizer(config)
        params = {i: rng.standard_normal(s).astype(np.float32) for i, (s, _) in enumerate(shapes)}
        for key, value in params.items():
            o.add_variable(key, value)
            o.adopt(params, key)
        sparse = [i for i, (_, is_sparse) in enumerate(shapes) if is_sparse]
        apply_s, ahead_s = [], []
        for step in range(warmup + steps):
            grads = {i: (np.sort(rng.integers(0, s[0], rows)), rng.standard_normal((rows,) + s[1:]).astype(np.float32),
                         None) if is_sparse else rng.standard_normal(s).astype(np.float32)
                     for i, (s, is_sparse) in enumerate(shapes)}
            if mode == "ahead":
                t0 = time.perf_counter()
                o.update_ahead(step, params, sparse)
                o.wait_ahead()
                ahead_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            o.apply(step, params, grads)
            apply_s.append(time.perf_counter() - t0)
        out["whole" if mode == "whole" else "finish"] = statistics.median(apply_s[warmup:]) * 1e3
        if ahead_s:
            out["ahead"] = statistics.median(ahead_s[warmup:]) * 1e3
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["ncf", "ncf?size=full", "bert", "dlrm", "lm1b"])
    p.add_argument("--optimizers", nargs="+", default=sorted(OPTIMIZERS), choices=sorted(OPTIMIZERS))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", help="write the table as JSON to FILE")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        print("update_ahead: --steps must be >= 1 and --warmup >= 0", file=sys.stderr)
        return 2
    from _testbed import git_commit, write_json

    started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    results = {}
    print("model | optimizer | table rows touched / rows | whole ms | finish ms | whole / finish | ahead ms")
    for name in args.models:
        shapes, batch = shapes_of(name)
        rows = 2 * batch
        table_rows = sum(s[0] for s, is_sparse in shapes if is_sparse)
        for opt in args.optimizers:
            r = measure(shapes, rows, OPTIMIZERS[opt], args.steps, args.warmup)
            results[f"{name}/{opt}"] = {**r, "rows_per_table": rows, "table_rows": table_rows}
            print(f"{name} | {opt} | {rows} / {table_rows} | {r['whole']:.2f} | {r['finish']:.2f} | "
                  f"{r['whole'] / r['finish']:.2f}x | {r['ahead']:.2f}", flush=True)
    if args.out:
        write_json(args.out, {"commit": git_commit(REPO), "run_started": started,
                              "what_else_ran": os.environ.get("AUTOSYNC_BENCH_NOTE", ""),
                              "meta": {"steps": args.steps, "warmup": args.warmup, "workers": 2}, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
