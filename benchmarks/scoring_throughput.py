"""Strategies scored per second (features + learned-simulator prediction) for a 200-variable model
on one core, on the path the search takes. Target: >= 100,000 strategies/s.

The annealer (``tuner.search.simulated_annealing``) scores one mutation of every chain per step.
Its fast path, ``IncrementalScorer``, updates each proposal's features from its parent's
(``tuner.incremental``); the baseline featurizes every proposal from scratch (``featurize``).
Both score the same proposals in the same steps (their order alternates from step to step), so
the ratio is measured under the same load. Rates are strategies per second of this process's CPU
time (the machine is shared: wall-clock rates and the load average are printed next to them);
each is the total over ``--steps`` steps, not a best case. The proposals' mutation itself
(``StrategySpace.mutate_encoded``) is timed apart: it is not scoring, but the annealer pays it.

    OMP_NUM_THREADS=1 python benchmarks/scoring_throughput.py [--chains 48,256,1024,4096,20000] [--steps 20]
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
from tuner.dataset import featurize_trials  # noqa: E402
from tuner.features import FeatureTables, featurize  # noqa: E402
from tuner.incremental import IncrementalFeaturizer  # noqa: E402
from tuner.search import IncrementalScorer, simulated_annealing  # noqa: E402
from tuner.simulator import LearnedSimulator  # noqa: E402
from tuner.synthetic import SyntheticRunner  # noqa: E402

TARGET = 100_000
_PARTS = ("mutate", "fast_features", "fast_predict", "full_features", "full_predict")


def model_200(rng) -> ModelSpec:
    vs = []
    for i in range(99):
        a, b = int(rng.integers(64, 1024)), int(rng.integers(64, 1024))
        vs += [VariableSpec(f"l{i}/kernel", (a, b)), VariableSpec(f"l{i}/bias", (b,))]
    vs += [VariableSpec("emb0", (100000, 64), sparse=True, rows_per_step=2000),
           VariableSpec("emb1", (50000, 32), sparse=True, rows_per_step=1000)]
    return ModelSpec("bench200", tuple(vs), 64, ComputeProfile(step_time_s=0.2))


class _Clock:
    """CPU and wall seconds accumulated per part."""

    def __init__(self):
        self.cpu = dict.fromkeys(_PARTS, 0.0)
        self.wall = dict.fromkeys(_PARTS, 0.0)

    def run(self, part: str, fn, *args):
        c0, w0 = time.process_time(), time.perf_counter()
        out = fn(*args)
        self.cpu[part] += time.process_time() - c0
        self.wall[part] += time.perf_counter() - w0
        return out


def anneal_steps(space, tables, sim, chains: int, steps: int, rng, temp: float = 0.01):
    """``steps`` annealing steps of ``chains`` chains, every proposal scored on both paths.

    Returns:
        (clock, strategies scored per path, predictions that differ between the paths).
    """
    clock = _Clock()
    cur = space.sample_encoded(rng, chains)
    fast = IncrementalScorer(IncrementalFeaturizer(tables), sim.predict)
    cur_s = np.log(fast.reset(cur))
    differ = 0
    for step in range(steps):
        prop = clock.run("mutate", space.mutate_encoded, cur, rng)

        def run_fast():
            return clock.run("fast_predict", sim.predict, clock.run("fast_features", fast.featurizer.propose, prop))

        def run_full():
            return clock.run("full_predict", sim.predict, clock.run("full_features", featurize, tables, prop))

        if step % 2:
            full_s, fast_s = run_full(), run_fast()
        else:
            fast_s, full_s = run_fast(), run_full()
        differ += int(np.count_nonzero(fast_s != full_s))
        prop_s = np.log(fast_s)
        accept = (prop_s < cur_s) | (rng.random(chains) < np.exp(-(prop_s - cur_s) / temp))
        fast.accept(accept)
        for f in cur.field_names():
            getattr(cur, f)[accept] = getattr(prop, f)[accept]
        cur_s = np.where(accept, prop_s, cur_s)
    return clock, chains * steps, differ


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chains", default="48,256,1024,4096,20000",
                    help="comma-separated chain counts (strategies scored per step); the search uses 48")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--train-trials", type=int, default=40)
    ap.add_argument("--anneal-steps", type=int, default=40,
                    help="steps of the end-to-end annealer run (48 chains, as tuning.SearchSettings)")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    model = model_200(rng)
    cluster = ClusterSpec("c4x2", tuple(NodeSpec(f"n{i}", workers=2, bandwidth_gbps=10.0) for i in range(4)))
    space = StrategySpace(model, cluster)
    # a simulator trained on a few synthetic trials of this group (accuracy is not the point here);
    # its prediction cost grows with the size of its trees, hence with the training set
    n_train = args.train_trials
    trials = SyntheticRunner(model, cluster, seed=0).run(
        [space.decode(space.sample_encoded(rng, n_train), i) for i in range(n_train)])
    X, y = featurize_trials(model, cluster, trials)
    sim = LearnedSimulator(n_jobs=1).fit(X, y)
    tables = FeatureTables.from_specs(model, cluster)
    sim.predict(featurize(tables, space.sample_encoded(rng, 512)))   # warm up
    trees = len(sim.booster_.get_dump()) if sim.booster_ is not None else 0
    load0 = os.getloadavg()
    print(f"model: {len(model.variables)} variables; cluster: 4 nodes x 2 workers; simulator: {n_train} training "
          f"trials, {trees} trees, max_depth {sim.max_depth}; threads: OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}")
    print(f"load average at start {load0[0]:.1f} / {load0[1]:.1f} / {load0[2]:.1f} (1 / 5 / 15 min) on "
          f"{os.cpu_count()} cores")
    print("rates in strategies per CPU-second [per wall-second]; features+predict, then each part alone")
    header = (f"{'chains':>6} {'steps':>5}  {'fast path':>21} {'full recompute':>21} {'ratio':>5}  "
              f"{'fast feat':>9} {'full feat':>9} {'predict':>9}  {'mutate':>8}  {'predictions differing':>21}")
    print(header)
    fast_rates = {}
    for chains in [int(c) for c in args.chains.split(",")]:
        clock, n, differ = anneal_steps(space, tables, sim, chains, args.steps, rng)
        c, w = clock.cpu, clock.wall
        fast_c = n / (c["fast_features"] + c["fast_predict"])
        fast_w = n / (w["fast_features"] + w["fast_predict"])
        full_c = n / (c["full_features"] + c["full_predict"])
        full_w = n / (w["full_features"] + w["full_predict"])
        fast_rates[chains] = fast_c
        print(f"{chains:>6} {args.steps:>5}  {fast_c:>10,.0f} [{fast_w:>8,.0f}] {full_c:>10,.0f} [{full_w:>8,.0f}] "
              f"{fast_c / full_c:>5.2f}  {n / c['fast_features']:>9,.0f} {n / c['full_features']:>9,.0f} "
              f"{2 * n / (c['fast_predict'] + c['full_predict']):>9,.0f}  {n / c['mutate']:>8,.0f}  "
              f"{f'{differ} of {n:,}':>21}")
    # the annealer end to end at the search's settings: scoring from scratch vs incrementally
    init = space.sample_encoded(np.random.default_rng(1), 48)
    ends = {}
    for name, score in (("full recompute", lambda e: sim.predict(featurize(tables, e))),
                        ("fast path", IncrementalScorer(IncrementalFeaturizer(tables), sim.predict))):
        c0, w0 = time.process_time(), time.perf_counter()
        simulated_annealing(space, score, init, np.random.default_rng(2), steps=args.anneal_steps)
        ends[name] = (time.process_time() - c0, time.perf_counter() - w0)
    load1 = os.getloadavg()
    print(f"annealer end to end, 48 chains x {args.anneal_steps} steps (mutation, scoring, pool): "
          + "; ".join(f"{k} {cpu:.2f} CPU-s [{wall:.2f} s]" for k, (cpu, wall) in ends.items()))
    print(f"load average at end {load1[0]:.1f} / {load1[1]:.1f} / {load1[2]:.1f}")
    for chains, rate in fast_rates.items():
        print(f"fast path, {chains} chains: {rate:,.0f} strategies/s (target >= {TARGET:,}: "
              f"{'MET' if rate >= TARGET else 'MISSED'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
