"""Tune a synchronization strategy for your own model, then train with it.

    python examples/tune_and_train.py                      # local Ray, examples/my_model.py
    python examples/tune_and_train.py --cluster testbed --trials 24 --steps 200

The model comes from ``examples/my_model.py`` (any ``script.py:function`` returning a ModelDef, or
``zoo:NAME``, works the same way). Tuning measures every baseline and the strategies the search
proposes; the best one is saved as YAML and used by the Trainer for real training.
"""
from __future__ import annotations

import argparse
import os

import numpy as np

import autosync

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=os.path.join(HERE, "my_model.py") + ":build")
    ap.add_argument("--cluster", default="local")
    ap.add_argument("--trials", type=int, default=6, help="search trials (baselines come on top)")
    ap.add_argument("--steps", type=int, default=50, help="training steps with the best strategy")
    ap.add_argument("--store", default=None, help="trial store (default: ~/.cache/autosync/trials.db)")
    ap.add_argument("--out", default="best_strategy.yaml")
    args = ap.parse_args(argv)

    # one set of workers for tuning and training: the trainer reloads the tuner's instead of starting its own
    with autosync.worker_pool(args.cluster) as pool:
        result = autosync.tune(args.model, cluster=args.cluster, trials=args.trials, store=args.store,
                               steps=5, warmup=2, pool=pool)
        print(f"best strategy: {result.best_trial.origin}, {result.best_trial.median * 1e3:.1f} ms/step; "
              f"best baseline {result.best_baseline.origin}: {result.best_baseline.median * 1e3:.1f} ms/step "
              f"({result.speedup_over_best_baseline:.2f}x)")
        print(result.trials[["origin", "status", "median_s", "predicted_s"]].to_string(index=False))
        result.save(args.out)

        # train for real with the tuned strategy (a Strategy object or the YAML path both work)
        with autosync.make_trainer(args.model, result.best_strategy, args.cluster, pool=pool) as trainer:
            history = trainer.fit(steps=args.steps)
            weights = trainer.get_weights()
            model = trainer.keras_model()   # the trained weights in a Keras model here: evaluate, predict, save
    k = max(1, min(5, len(history.loss) // 2))   # the mean of the first k steps' losses, then of the last k
    print(f"trained {args.steps} steps: loss {np.mean(history.loss[:k]):.4f} -> {np.mean(history.loss[-k:]):.4f}, "
          f"median step {np.median(history.step_times) * 1e3:.1f} ms, {len(weights)} weight arrays")
    # evaluate on your held-out data; here one batch of the model's data as a single process reads it
    x, y = next(iter(autosync.load_model_def(args.model).dataset_fn(0, 1)))
    print(f"evaluated on one batch: loss {model.evaluate(x, y, verbose=0, return_dict=True)['loss']:.4f}")


if __name__ == "__main__":
    main()
