"""``autosync probe``: the statistical efficiency of one strategy (``autosync.probe``)."""
from __future__ import annotations

import json
from pathlib import Path

from autosync.cli.paths import check_output_file
from autosync.cli.raylog import ray_output_to_log
from autosync.formatting import table
from autosync.sources import CLUSTER_FORMS, TRAINABLE_FORMS
from strategy_space.errors import ConfigError
from tuner.records.goodput import DEFAULT_PROBE_STEPS, lossy_parts

# loss-curve points the table shows (the JSON has every step)
SHOWN_POINTS = 8


def cmd_probe(args) -> int:
    from autosync.api import default_store_path
    from autosync.probe import prepare_probe, probe_strategy
    from autosync.runtime.binding import check_cluster_start
    from autosync.sources import load_cluster
    from tuner.records.store import TrialStore, check_store_file

    if args.steps < 10:
        raise ConfigError(f"--steps must be >= 10 (the loss is smoothed over a tenth of them), got {args.steps}")
    if not args.timeout > 0:
        raise ConfigError(f"--timeout must be > 0 seconds, got {args.timeout}")
    check_output_file(args.store, "--store")
    store_path = Path(args.store) if args.store else default_store_path()
    check_store_file(store_path)   # a damaged store fails now, untouched
    cluster = load_cluster(args.cluster)
    check_cluster_start(cluster)
    with ray_output_to_log("probe"):
        # everything is checked (the model built to validate the strategy) before a file is written
        model_def, spec, strategy, cluster = prepare_probe(args.model, args.strategy, cluster, steps=args.steps)
        parts = lossy_parts(strategy)
        if parts.lossless:   # trains as one process: nothing to measure, nothing stored
            result, e = None, None
        else:
            store_path.parent.mkdir(parents=True, exist_ok=True)
            with TrialStore(store_path) as store:
                result, e = probe_strategy(model_def, spec, strategy, cluster, steps=args.steps, seed=args.seed,
                                           store=store, timeout_s=args.timeout)
    out = {
        "strategy": args.strategy,
        "lossy_parts": parts.describe(),
        "statistical_efficiency": 1.0 if e is None else e.value,
        "interval": [1.0, 1.0] if e is None else [e.low, e.high],
        "probed": e is not None,
        "source": "lossless: trains as one process, not measured" if e is None else e.source,
        "steps": 0 if result is None else result.steps,
        "seed": None if result is None else result.seed,
        "workers": len(cluster.devices),
        "cluster": cluster.name,
        "candidate_loss": [] if result is None else list(result.candidate_loss),
        "twin_loss": [] if result is None else list(result.twin_loss),
        "candidate_wall_s": None if result is None else result.candidate_wall_s,
        "twin_wall_s": None if result is None else result.twin_wall_s,
        "note": "" if e is None else e.note,
    }
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    if e is None:
        print(f"{args.strategy} is lossless (no compressor, synchronous PS with staleness 0): it trains as one "
              f"process on the global batch, statistical efficiency 1 (not probed)")
        return 0
    print(f"{args.strategy}: {parts.describe()}")
    print(f"statistical efficiency {e.value:.3f} (95 % interval {e.low:.3f} to {e.high:.3f}; {e.source}), "
          f"{result.steps} steps on {out['workers']} workers of {cluster.name}, seed {result.seed}")
    k = len(result.candidate_loss)
    idx = sorted({min(k - 1, round(i * (k - 1) / (SHOWN_POINTS - 1))) for i in range(SHOWN_POINTS)})
    rows = [(str(i + 1), f"{result.candidate_loss[i]:.4f}", f"{result.twin_loss[i]:.4f}") for i in idx]
    print(table(["step", "loss (strategy)", "loss (lossless twin)"], rows, right=(0, 1, 2)))
    print(f"a step of this strategy is worth {e.value:.2f} lossless steps: compare strategies by step time / "
          f"{e.value:.2f} (--json prints every step's loss)")
    return 0


def register(sub) -> None:
    p = sub.add_parser("probe", help="statistical efficiency of a strategy's lossy parts (compressors, staleness)")
    p.add_argument("--model", required=True, metavar="M", help=f"trainable model: {TRAINABLE_FORMS}")
    p.add_argument("--strategy", required=True, metavar="FILE|BUILDER",
                   help="strategy YAML file, or a builder's name (ps, all_reduce, ...: lossless, so E = 1)")
    p.add_argument("--cluster", default="local", metavar="C",
                   help=f"cluster: {CLUSTER_FORMS} (default local); a compressor's effect does not depend on the "
                        f"network, so any cluster with the same number of workers gives it; staleness is probed "
                        f"on the target")
    p.add_argument("--steps", type=int, default=DEFAULT_PROBE_STEPS, metavar="K",
                   help=f"steps each of the strategy and its lossless twin trains (default {DEFAULT_PROBE_STEPS})")
    p.add_argument("--seed", type=int, metavar="N", help="seed of initial weights and (zoo) data (default: the model's)")
    p.add_argument("--store", metavar="FILE",
                   help="trial store the probe is cached in (default: ~/.cache/autosync/trials.db, as tune's)")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S", help="limit per training in seconds (default 600)")
    p.add_argument("--json", action="store_true", help="print JSON (every step's loss) instead of a table")
    p.set_defaults(func=cmd_probe)
