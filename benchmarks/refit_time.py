"""One tuning round's refit: re-reading the store every round (before) against the in-memory
training set (after), on the shipped warm-start dataset plus a store of 200 trials of the target.

Before (``Predictor.refit(store, prior)`` up to commit 97572fa): each round read every group of the
store (every trial row, JSON-parsed, strategies YAML-parsed once per open store), merged them with
the warm-start groups (hashing every trial), looked every trial's feature row up in a cache, stacked
the arrays, then fitted. After (``ModelBasedTuner``): the round's new trials are featurized into the
``TrainingSet``, its arrays stacked, then fitted. The fit (``Predictor.fit``) is the same code in
both. The run's trials reach the training set as ``History`` entries carrying the feature rows their
proposals were scored with (``ModelBasedTuner.refit``), so "after" times that path; "after,
featurizing" also encodes and featurizes the round's trials (resumed trials, proposals without rows).
The script times the data step and the whole refit for each, over ``--rounds`` rounds that add
``--batch`` new trials each, and prints medians and their ratio.

    python benchmarks/refit_time.py --out benchmarks/results/refit_time.json
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._rows import commit, write_rows  # noqa: E402
from strategy_space.space import StrategySpace  # noqa: E402
from tuner.cost_models.predictor import Predictor  # noqa: E402
from tuner.features.batch import featurize  # noqa: E402
from tuner.features.tables import FeatureTables  # noqa: E402
from tuner.records.history import History  # noqa: E402
from tuner.search.base import Proposal  # noqa: E402
from tuner.records.dataset import build_trial_set, store_groups  # noqa: E402
from tuner.records.store import TrialStore  # noqa: E402
from tuner.records.training_set import TrainingSet  # noqa: E402
from tuner.records.warmstart import load_warm_start, merge_groups  # noqa: E402
from tuner.synthetic.runner import SyntheticRunner, candidate_strategies, random_cluster, random_model  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store-trials", type=int, default=200, help="target trials in the store at start")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch", type=int, default=4, help="new trials per round")
    p.add_argument("--out", help="JSON file for the result")
    args = p.parse_args(argv)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    rng = np.random.default_rng(0)   # a generated target model and cluster (tuner.synthetic.runner)
    model, cluster = random_model(rng, "target"), random_cluster(rng, "target")
    prior = load_warm_start("builtin")
    n_new = args.rounds * args.batch
    strategies = candidate_strategies(model, cluster, np.random.default_rng(0), args.store_trials + n_new)
    trials = SyntheticRunner(model, cluster, seed=1).run(strategies)
    start, arriving = trials[:args.store_trials], trials[args.store_trials:]
    rows = {"before": {"data_s": [], "refit_s": []}, "after": {"data_s": [], "refit_s": []},
            "after_featurizing": {"data_s": []}}
    proposals = _scored_proposals(model, cluster, arriving)   # as the annealer scored them, before the round
    with tempfile.TemporaryDirectory() as d, TrialStore(os.path.join(d, "s.db")) as store:
        store.add_many(start, model, cluster)
        # after: the store is read once, at start (not timed: both read it once at start)
        training, featurizing = TrainingSet(), TrainingSet()
        for t in (training, featurizing):
            t.add_groups(prior)
            t.add_groups(store_groups(store))
        history = History(model, cluster)
        cache: dict = {}
        build_trial_set(merge_groups(prior, store_groups(store)), cache)   # before: its cache, warm
        before, after = Predictor(model, cluster), Predictor(model, cluster)
        for r in range(args.rounds):
            new = arriving[r * args.batch:(r + 1) * args.batch]
            store.add_many(new, model, cluster)
            history.add(new, proposals[r * args.batch:(r + 1) * args.batch])   # the loop, as trials arrive
            t0 = time.perf_counter()
            data = build_trial_set([g for g in merge_groups(prior, store_groups(store)) if g[2]], cache)
            t1 = time.perf_counter()
            before.fit(data)
            t2 = time.perf_counter()
            training.add_entries(model, cluster, history.entries)
            data_after = training.trial_set()
            t3 = time.perf_counter()
            after.fit(data_after)
            t4 = time.perf_counter()
            featurizing.add(model, cluster, new)
            data_featurizing = featurizing.trial_set()
            t5 = time.perf_counter()
            for d in (data_after, data_featurizing):
                assert np.array_equal(data.X, d.X) and np.array_equal(data.y, d.y)
            rows["before"]["data_s"].append(t1 - t0)
            rows["before"]["refit_s"].append(t2 - t0)
            rows["after"]["data_s"].append(t3 - t2)
            rows["after"]["refit_s"].append(t4 - t2)
            rows["after_featurizing"]["data_s"].append(t5 - t4)
    med = {k: {m: float(np.median(v)) for m, v in d.items()} for k, d in rows.items()}
    result = {"benchmark": "refit_time", "commit": commit(), "started_at": started,
              "load_average_at_start": load_at_start,   # what else ran: the 1/5/15-min load before the run
              "model": model.name, "cluster": cluster.name, "warm_start_trials": sum(len(ts) for _, _, ts in prior), "store_trials": args.store_trials,
              "rounds": args.rounds, "batch": args.batch, "training_rows": len(data_after),
              "median_s": med, "rounds_s": rows,
              "data_speedup": med["before"]["data_s"] / med["after"]["data_s"],
              "refit_speedup": med["before"]["refit_s"] / med["after"]["refit_s"]}
    print(f"refit of one round, {result['training_rows']} training rows ({result['warm_start_trials']} warm-start "
          f"trials + {args.store_trials} stored + {args.batch}/round), median of {args.rounds} rounds:")
    print(f"  data step: before {med['before']['data_s'] * 1e3:8.1f} ms   after {med['after']['data_s'] * 1e3:8.1f} ms"
          f"   x{result['data_speedup']:.1f}")
    print(f"  data step featurizing the round's trials (resumed trials): "
          f"{med['after_featurizing']['data_s'] * 1e3:.1f} ms")
    print(f"  refit:     before {med['before']['refit_s'] * 1e3:8.1f} ms   after {med['after']['refit_s'] * 1e3:8.1f} ms"
          f"   x{result['refit_speedup']:.2f}")
    write_rows(args.out, [result])
    return 0


def _scored_proposals(model, cluster, trials) -> list[Proposal]:
    """The arriving trials' proposals with the encoded and feature rows the search scored them with."""
    encoded = StrategySpace(model, cluster).encode([t.strategy for t in trials])
    X = featurize(FeatureTables.from_specs(model, cluster), encoded)
    return [Proposal(t.strategy, "search", encoded=encoded.take([i]), features=X[i]) for i, t in enumerate(trials)]


if __name__ == "__main__":
    sys.exit(main())
