"""Strategies scored per second (features + learned-simulator prediction) for a 200-variable model
on one core, on the path the search takes. Target: >= 100,000 strategies per CPU-second.

Headline: the annealer (``tuner.search.annealing.simulated_annealing``) as the tuner runs it, at the
search's defaults (``tuner.search.model_based.SearchSettings``: chains x proposals per chain x steps), end to
end — mutation, incremental features, prediction, Metropolis steps and pool — timed ``--repeats``
times (median reported: the machine is shared). Its parts are timed by wrappers around the space's
``mutate_rows`` and the scorer; "other" is the rest (pool, fingerprints, moves). The rate is
strategies per CPU-second of this process; wall-clock rates and load averages are printed next to
it.

Chain sweep: one proposal per chain for ``--steps`` steps, ``chains`` proposals scored per step.
The fast path (``IncrementalScorer``) updates each proposal's features from its chain's; the
baseline builds every proposal's rows (``Mutation.encoded``) and featurizes them from scratch.
Both score the same proposals in the same steps (their order alternates from step to step), so
the ratio is measured under the same load; each rate is the total over the steps. The mutation
(``StrategySpace.mutate_rows``, changes only) is timed apart: it is not scoring, but the annealer
pays it.

Search quality: from the same starts with the same predictor, the best predicted seconds reached
by one proposal per chain for 40 steps (the annealer's settings before proposals existed) and by
the defaults, over ``--seeds`` seeds, with each round's CPU time; the starts are the tuner's (the
best-predicted of knowledge-guided and random candidates, often near a predicted optimum
already) and uniformly random ones (how far each setting gets on its own).

    OMP_NUM_THREADS=1 python benchmarks/scoring_throughput.py [--chains 48,256,1024,4096,20000] [--steps 20]
"""
from __future__ import annotations

import os

# one core: set before numpy / xgboost load their thread pools
for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from strategy_space import ClusterSpec, ComputeProfile, ModelSpec, NodeSpec, VariableSpec  # noqa: E402
from strategy_space.encoding import EncodedStrategies  # noqa: E402
from strategy_space.space import StrategySpace  # noqa: E402
from tuner.cost_models.scoring import IncrementalScorer  # noqa: E402
from tuner.cost_models.simulator import LearnedSimulator  # noqa: E402
from tuner.features.batch import featurize  # noqa: E402
from tuner.features.incremental import IncrementalFeaturizer  # noqa: E402
from tuner.features.tables import FeatureTables  # noqa: E402
from tuner.records.dataset import featurize_trials  # noqa: E402
from tuner.search.annealing import simulated_annealing  # noqa: E402
from tuner.search.model_based import SearchSettings  # noqa: E402
from tuner.search.sampler import KnowledgeSampler  # noqa: E402
from tuner.synthetic.runner import SyntheticRunner  # noqa: E402

TARGET = 100_000
DEFAULTS = SearchSettings()
# the annealer before proposals per chain: one mutation per chain and step
ONE_PROPOSAL = dataclasses.replace(DEFAULTS, proposals=1, anneal_steps=40)
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

    def __init__(self, parts=_PARTS):
        self.cpu = dict.fromkeys(parts, 0.0)
        self.wall = dict.fromkeys(parts, 0.0)

    def run(self, part: str, fn, *args, **kwargs):
        c0, w0 = time.process_time(), time.perf_counter()
        out = fn(*args, **kwargs)
        self.cpu[part] += time.process_time() - c0
        self.wall[part] += time.perf_counter() - w0
        return out


class _TimedSpace:
    """The space as the annealer uses it (``mutate_rows``), timed."""

    def __init__(self, space: StrategySpace, clock: _Clock):
        self.space, self.clock = space, clock

    def mutate_rows(self, *args, **kwargs):
        return self.clock.run("mutation", self.space.mutate_rows, *args, **kwargs)


class _TimedScorer:
    """An IncrementalScorer whose features and predictions are timed apart."""

    def __init__(self, scorer: IncrementalScorer, clock: _Clock):
        self.scorer, self.clock = scorer, clock

    def reset(self, e):
        return self.scorer.reset(e)

    def propose(self, m):
        X = self.clock.run("features", self.scorer.featurizer.propose, m)
        return self.clock.run("predict", self.scorer.predict, X)

    def accept(self, chosen):
        self.scorer.accept(chosen)


def tuner_starts(space, tables, sim, settings: SearchSettings, seed: int) -> EncodedStrategies:
    """The annealer's starts as ``ModelBasedTuner.next_batch`` picks them (no trials measured yet):
    the best-predicted of knowledge-guided and uniformly random candidates."""
    rng = np.random.default_rng(seed)
    cand = EncodedStrategies.concat([KnowledgeSampler(space).sample(rng, settings.candidates),
                                     space.sample_encoded(rng, settings.candidates)])
    order = np.argsort(sim.predict(featurize(tables, cand)), kind="stable")
    return cand.take(order[:settings.chains])


def anneal_round(space, tables, sim, init, settings: SearchSettings, seed: int):
    """One round's annealing at ``settings``, timed by part.

    Returns:
        (the pool, the clock, CPU seconds, wall seconds, strategies scored).
    """
    clock = _Clock(("mutation", "features", "predict"))
    scorer = _TimedScorer(IncrementalScorer(IncrementalFeaturizer(tables), sim.predict), clock)
    c0, w0 = time.process_time(), time.perf_counter()
    pool = simulated_annealing(_TimedSpace(space, clock), scorer, init, np.random.default_rng(seed),
                               steps=settings.anneal_steps, proposals=settings.proposals)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    return pool, clock, cpu, wall, len(init) * settings.proposals * settings.anneal_steps


def sweep_steps(space, tables, sim, chains: int, steps: int, rng, temp: float = 0.01):
    """``steps`` annealing steps of ``chains`` chains (one proposal each), every proposal scored
    on both paths.

    Returns:
        (clock, strategies scored per path, predictions that differ between the paths).
    """
    clock = _Clock()
    cur = space.sample_encoded(rng, chains)
    fast = IncrementalScorer(IncrementalFeaturizer(tables), sim.predict)
    cur_s = np.log(fast.reset(cur))
    differ = 0
    for step in range(steps):
        m = clock.run("mutate", space.mutate_rows, cur, np.arange(chains), rng)

        def run_fast():
            return clock.run("fast_predict", sim.predict, clock.run("fast_features", fast.featurizer.propose, m))

        def run_full():   # a scorer without the chains' state builds every proposal's rows
            X = clock.run("full_features", lambda: featurize(tables, m.encoded))
            return clock.run("full_predict", sim.predict, X)

        if step % 2:
            full_s, fast_s = run_full(), run_fast()
        else:
            fast_s, full_s = run_fast(), run_full()
        differ += int(np.count_nonzero(fast_s != full_s))
        prop_s = np.log(fast_s)
        accept = (prop_s < cur_s) | (rng.random(chains) < np.exp(-(prop_s - cur_s) / temp))
        fast.accept(np.where(accept, np.arange(chains), -1))
        moved = np.flatnonzero(accept)
        moved_to = m.take(moved)
        for f in cur.field_names():
            getattr(cur, f)[moved] = getattr(moved_to, f)
        cur_s = np.where(accept, prop_s, cur_s)
    return clock, chains * steps, differ


def _shape(s: SearchSettings) -> str:
    return f"{s.chains} chains x {s.proposals} proposal{'s' * (s.proposals > 1)} x {s.anneal_steps} steps"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chains", default="48,256,1024,4096,20000",
                    help="comma-separated chain counts of the sweep (strategies scored per step, one proposal each)")
    ap.add_argument("--steps", type=int, default=20, help="steps per sweep entry")
    ap.add_argument("--train-trials", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3, help="timed annealing rounds at the defaults")
    ap.add_argument("--seeds", type=int, default=5, help="seeds of the search-quality comparison")
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

    # ---- headline: the annealer at the search's defaults, end to end -------------------------
    print(f"\nannealer at the search's defaults (tuning.SearchSettings: {_shape(DEFAULTS)}), end to end; "
          f"strategies per CPU-second [per wall-second]:")
    init = tuner_starts(space, tables, sim, DEFAULTS, seed=1)
    rates = []
    for r in range(args.repeats):
        _, clock, cpu, wall, n = anneal_round(space, tables, sim, init, DEFAULTS, seed=2 + r)
        rates.append(n / cpu)
        parts = ", ".join(f"{k} {v:.2f}" for k, v in clock.cpu.items())
        print(f"  round {r + 1}: {n:,} strategies in {cpu:.2f} CPU-s [{wall:.2f} s]: {n / cpu:>9,.0f} [{n / wall:,.0f}]"
              f"  (CPU-s: {parts}, other {cpu - sum(clock.cpu.values()):.2f}; scoring alone "
              f"{n / (clock.cpu['features'] + clock.cpu['predict']):,.0f}/s)")
    headline = float(np.median(rates))

    # ---- chain sweep: one proposal per chain, fast path vs full recompute --------------------
    print("\nchain sweep, one proposal per chain: features+predict, then each part alone; strategies per "
          "CPU-second [per wall-second]")
    print(f"{'chains':>6} {'steps':>5}  {'fast path':>21} {'full recompute':>21} {'ratio':>5}  "
          f"{'fast feat':>9} {'full feat':>9} {'predict':>9}  {'mutate':>8}  {'predictions differing':>21}")
    fast_rates = {}
    for chains in [int(c) for c in args.chains.split(",")]:
        clock, n, differ = sweep_steps(space, tables, sim, chains, args.steps, rng)
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

    # ---- search quality: one proposal per chain vs the defaults, same starts and predictor ----
    print(f"\nsearch quality over {args.seeds} seeds, same predictor and starts: best predicted seconds of the pool "
          f"(mean over seeds), mean of its 8 best, CPU-s per round (median)")
    for starts in ("the tuner's", "random"):
        results = {}
        for name, settings in (("one proposal per chain", ONE_PROPOSAL), ("defaults", DEFAULTS)):
            best, top8, cpus = [], [], []
            for seed in range(args.seeds):
                start = (tuner_starts(space, tables, sim, settings, seed=100 + seed) if starts == "the tuner's"
                         else space.sample_encoded(np.random.default_rng(100 + seed), settings.chains))
                pool, _, cpu, _, n = anneal_round(space, tables, sim, start, settings, seed=200 + seed)
                best.append(pool.predicted[0])
                top8.append(pool.predicted[:8].mean())
                cpus.append(cpu)
            results[name] = np.array(best)
            print(f"  {starts + ' starts':>19}, {name:>22} ({_shape(settings)}, {n:,} scored): best "
                  f"{np.mean(best):.4f} s, 8 best {np.mean(top8):.4f} s, {np.median(cpus):.2f} CPU-s per round")
        old, new = results["one proposal per chain"], results["defaults"]
        print(f"  {starts + ' starts':>19}: defaults better on {int((new < old).sum())}, equal on "
              f"{int((new == old).sum())}, worse on {int((new > old).sum())} of {args.seeds} seeds; best predicted "
              f"{np.mean(new) / np.mean(old) - 1:+.1%}")

    load1 = os.getloadavg()
    print(f"\nload average at end {load1[0]:.1f} / {load1[1]:.1f} / {load1[2]:.1f}")
    print(f"search's defaults ({_shape(DEFAULTS)}), end to end: {headline:,.0f} strategies/CPU-s, median of "
          f"{args.repeats} (target >= {TARGET:,}: {'MET' if headline >= TARGET else 'MISSED'})")
    for chains, rate in fast_rates.items():
        print(f"sweep, fast path, {chains} chains x 1 proposal: {rate:,.0f} strategies/s (target >= {TARGET:,}: "
              f"{'MET' if rate >= TARGET else 'MISSED'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
