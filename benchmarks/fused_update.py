"""An all-reduce channel's local optimizer update per step: every dense variable of a model updated
one numpy-rule call at a time (before) against its small variables updated together in one buffer
(``autosync.runtime.fused``, after), both in the same run, alternating, on one core.

The variables are those of the model specs given (their dense variables, as ``all_reduce`` holds
them), with random gradients; the update is ``NumpyOptimizer.apply`` as the channel calls it. Prints
the median update time of each path, its spread over ``--repeats`` rounds, and their ratio.

    python benchmarks/fused_update.py --out benchmarks/results/fused_update.json
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from autosync.runtime.optimizers import make_optimizer  # noqa: E402
from benchmarks._rows import commit, write_rows  # noqa: E402
from strategy_space.yaml_io import load  # noqa: E402

SPECS = ["nvidia-h200/resnet50-small", "nvidia-h200/bert-small", "nvidia-h200/resnet50-full",
         "nvidia-h200/bert-full"]
OPTIMIZERS = {"sgd": {"class": "SGD", "learning_rate": 0.01},
              "momentum": {"class": "SGD", "learning_rate": 0.01, "momentum": 0.9},
              "adam": {"class": "Adam", "learning_rate": 0.001},
              "adagrad": {"class": "Adagrad", "learning_rate": 0.01}}


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--specs", nargs="+", default=SPECS, help="model specs under configs/models (default: %(default)s)")
    p.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=list(OPTIMIZERS))
    p.add_argument("--steps", type=int, default=50, help="timed updates per round (default 50)")
    p.add_argument("--repeats", type=int, default=5, help="rounds, each path in turn (default 5)")
    p.add_argument("--out", help="JSON file for the rows")
    p.add_argument("--what-else-ran", default="not said", help="what else ran on the machine (recorded in each row)")
    return p.parse_args(argv)


def _setup(shapes: list, config: dict, fuse: bool, seed: int = 0):
    rng = np.random.default_rng(seed)
    params = {(i, 0): rng.normal(size=s).astype(np.float32) for i, s in enumerate(shapes)}
    opt = make_optimizer({"name": config["class"].lower(), **config})
    opt.fuse_small = fuse
    for key, value in params.items():
        opt.add_variable(key, value)
    grads = [{k: rng.normal(size=np.shape(v)).astype(np.float32) * np.float32(1e-3) for k, v in params.items()}
             for _ in range(4)]
    return opt, params, grads


def _time(opt, params, grads, steps: int, start: int) -> float:
    """Median seconds of one update over ``steps`` updates (after ``start`` earlier ones)."""
    times = []
    for i in range(steps):
        g = grads[i % len(grads)]
        t0 = time.perf_counter()
        opt.apply(start + i, params, g)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main(argv=None) -> int:
    args = _args(argv)
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    rows = []
    for name in args.specs:
        spec = load(os.path.join(REPO, "configs", "models", f"{name}.yaml"))
        shapes = [tuple(v.shape) for v in spec.variables if not v.sparse]
        for kind in args.optimizers:
            paths = {fuse: _setup(shapes, OPTIMIZERS[kind], fuse) for fuse in (False, True)}
            for fuse, (opt, params, grads) in paths.items():   # first updates: slots, copies, the buffer
                _time(opt, params, grads, 3, 0)
            medians: dict = {False: [], True: []}
            for r in range(args.repeats):
                for fuse in ((False, True) if r % 2 == 0 else (True, False)):
                    opt, params, grads = paths[fuse]
                    medians[fuse].append(_time(opt, params, grads, args.steps, 3 + r * args.steps))
            before, after = float(np.median(medians[False])), float(np.median(medians[True]))
            row = {"spec": name, "optimizer": kind, "dense_variables": len(shapes),
                   "small_variables": sum(1 for s in shapes if int(np.prod(s)) <= 1 << 15),
                   "per_variable_ms": before * 1e3, "fused_ms": after * 1e3,
                   "per_variable_ms_range": [min(medians[False]) * 1e3, max(medians[False]) * 1e3],
                   "fused_ms_range": [min(medians[True]) * 1e3, max(medians[True]) * 1e3],
                   "speedup": before / after, "steps": args.steps, "repeats": args.repeats,
                   "commit": commit(), "run_started": started, "what_else_ran": args.what_else_ran}
            rows.append(row)
            print(f"{name:28s} {kind:8s} {len(shapes):4d} vars ({row['small_variables']:3d} small): "
                  f"per variable {row['per_variable_ms']:7.3f} ms [{row['per_variable_ms_range'][0]:.3f}-"
                  f"{row['per_variable_ms_range'][1]:.3f}], fused {row['fused_ms']:7.3f} ms "
                  f"[{row['fused_ms_range'][0]:.3f}-{row['fused_ms_range'][1]:.3f}]: {row['speedup']:.2f}x", flush=True)
    write_rows(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
