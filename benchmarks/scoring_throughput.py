"""Strategies scored per second (features + learned-simulator prediction) for a 200-variable model
on one core. Target: >= 100,000 strategies/s.

Best of ``--repeats`` timed passes over one batch (the machine is shared: the load average is
printed next to the rates). The simulator is trained on ``--train-trials`` synthetic trials of this
(model, cluster); its prediction cost grows with the size of its trees, hence with the training set.

    OMP_NUM_THREADS=1 python benchmarks/scoring_throughput.py [--batch 20000] [--train-trials 40]
"""
from __future__ import annotations

import os

# one core: set before numpy / xgboost load their thread pools
for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from strategy_space import ClusterSpec, ComputeProfile, ModelSpec, NodeSpec, VariableSpec  # noqa: E402
from strategy_space.space import StrategySpace  # noqa: E402
from tuner.features import FeatureTables, featurize  # noqa: E402
from tuner.simulator import LearnedSimulator  # noqa: E402
from tuner.synthetic import SyntheticRunner  # noqa: E402
from tuner.dataset import featurize_trials  # noqa: E402


def model_200(rng) -> ModelSpec:
    vs = []
    for i in range(99):
        a, b = int(rng.integers(64, 1024)), int(rng.integers(64, 1024))
        vs += [VariableSpec(f"l{i}/kernel", (a, b)), VariableSpec(f"l{i}/bias", (b,))]
    vs += [VariableSpec("emb0", (100000, 64), sparse=True, rows_per_step=2000),
           VariableSpec("emb1", (50000, 32), sparse=True, rows_per_step=1000)]
    return ModelSpec("bench200", tuple(vs), 64, ComputeProfile(step_time_s=0.2))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--train-trials", type=int, default=40)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    model = model_200(rng)
    cluster = ClusterSpec("c4x2", tuple(NodeSpec(f"n{i}", workers=2, bandwidth_gbps=10.0) for i in range(4)))
    space = StrategySpace(model, cluster)
    # a simulator trained on a few synthetic trials of this group (accuracy is not the point here)
    n_train = args.train_trials
    trials = SyntheticRunner(model, cluster, seed=0).run(
        [space.decode(space.sample_encoded(rng, n_train), i) for i in range(n_train)])
    X, y = featurize_trials(model, cluster, trials)
    sim = LearnedSimulator(n_jobs=1).fit(X, y)
    tables = FeatureTables.from_specs(model, cluster)
    enc = space.sample_encoded(rng, args.batch)
    sim.predict(featurize(tables, enc.take(slice(0, 512))))
    load0 = os.getloadavg()[0]
    best_f = best_p = best_all = np.inf
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        F = featurize(tables, enc)
        t1 = time.perf_counter()
        sim.predict(F)
        t2 = time.perf_counter()
        best_f, best_p, best_all = min(best_f, t1 - t0), min(best_p, t2 - t1), min(best_all, t2 - t0)
    n = len(enc)
    trees = len(sim.booster_.get_dump()) if sim.booster_ is not None else 0
    print(f"model: {len(model.variables)} variables; cluster: 4 nodes x 2 workers; batch {n}; best of {args.repeats}; "
          f"threads: OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}; load average {load0:.1f} -> {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} cores")
    print(f"simulator: {n_train} training trials, {trees} trees, max_depth {sim.max_depth}")
    print(f"features only:          {n / best_f:>10,.0f} strategies/s")
    print(f"simulator predict only: {n / best_p:>10,.0f} strategies/s")
    print(f"features + simulator:   {n / best_all:>10,.0f} strategies/s  (target >= 100,000: "
          f"{'MET' if n / best_all >= 100000 else 'MISSED'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
