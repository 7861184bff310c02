"""``autosync train``: train a model with a strategy (the one ``tune`` recommends, a file, a
builder's name) for real, with checkpoints and recovery from failures: ``autosync.make_trainer``'s
``Trainer`` from the command line, as ``horovodrun`` or a Ray Train script would run it."""
from __future__ import annotations

import json
import sys
import time

import numpy as np

from autosync.cli.raylog import ray_output_to_log, terminal
from autosync.sources import CLUSTER_FORMS, TRAINABLE_FORMS
from strategy_space import validate
from strategy_space.errors import ConfigError

# progress lines a run prints when --log-every is not given
PROGRESS_LINES = 20


def _prepare(args):
    """Everything checked before Ray starts: the flags, the model (its optimizer, its ModelSpec
    built here), the cluster, the strategy against both, and ``--restore``'s checkpoint (by the
    Trainer, before its workers start). Returns (ModelDef, Strategy, ClusterSpec)."""
    from autosync.runtime.checkpoint import CheckpointStore
    from autosync.runtime.optimizers import check_model_optimizer
    from autosync.runtime.binding import check_cluster_start
    from autosync.runtime.trainer import check_fit
    from autosync.sources import load_cluster, load_model_def, load_model_spec, load_strategy_for
    from strategy_space.builders import strategy_or_builder

    if not args.timeout > 0:
        raise ConfigError(f"--timeout must be > 0 seconds, got {args.timeout}")
    if args.log_every is not None and args.log_every < 1:
        raise ConfigError(f"--log-every must be >= 1 (steps), got {args.log_every}")
    if args.steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {args.steps}")
    try:
        check_fit(args.steps, 10, args.checkpoint_every, args.checkpoint_dir, args.max_failures, args.elastic)
    except ConfigError as e:   # said with the flags' names
        text = str(e)
        for name in ("checkpoint_every", "checkpoint_dir", "max_failures", "elastic"):
            text = text.replace(name, "--" + name.replace("_", "-"))
        raise ConfigError(text) from None
    for flag, path in (("--save", args.save), ("--checkpoint-dir", args.checkpoint_dir)):
        if path is not None:   # where a checkpoint cannot go is found before any training
            try:
                CheckpointStore(path).check_writable()
            except ConfigError as e:
                raise ConfigError(f"{flag}: {e}") from None
    if args.restore is not None:   # a missing or damaged checkpoint is found before the model loads
        CheckpointStore(args.restore).read()
    cluster = load_cluster(args.cluster)
    check_cluster_start(cluster)
    strategy = strategy_or_builder(args.strategy)   # a bad file or name is said before the model is built
    model_def = load_model_def(args.model)
    check_model_optimizer(model_def)
    spec = load_model_spec(model_def)
    strategy = load_strategy_for(strategy, spec, cluster)
    try:   # a strategy for another model or cluster fails here, before Ray starts
        validate(strategy, spec, cluster)
    except ConfigError as e:
        raise e.with_source(args.strategy) from None
    return model_def, strategy, cluster


def _progress(first: int, total: int, every: int, out):
    """A ``fit`` callback that prints a line every ``every`` of the ``total`` steps from global step
    ``first`` (and at the last) to ``out``: the mean loss and median step time since the last line."""
    seen: dict[int, tuple[float, float]] = {}   # by step: a step redone after a restart counts once

    def report(step: int, logs: dict) -> None:
        seen[step] = (logs["loss"], logs["step_time_s"])
        done = step + 1 - first
        if done % every == 0 or done == total:
            recent = [seen[s] for s in range(max(first, step + 1 - every), step + 1) if s in seen]
            loss = float(np.mean([x for x, _ in recent]))
            ms = float(np.median([t for _, t in recent])) * 1e3
            print(f"step {step + 1} ({done}/{total})  loss {loss:.5g}  step {ms:.1f} ms", file=out, flush=True)
    return report


def cmd_train(args) -> int:
    from autosync.runtime.trainer import Trainer

    model_def, strategy, cluster = _prepare(args)
    began, failed = time.perf_counter(), None
    with ray_output_to_log("train") as log, Trainer(model_def, strategy, cluster, timeout_s=args.timeout,
                                                    restore=args.restore,
                                                    keep_global_batch=args.keep_global_batch) as trainer:
        first = trainer.step
        every = args.log_every or -(-args.steps // PROGRESS_LINES)
        out = terminal()
        print(f"training {model_def.name} from step {first} for {args.steps} steps on "
              f"{len(trainer.plan.replicas)} workers ({cluster.name})", file=out, flush=True)
        try:
            history = trainer.fit(args.steps, callbacks=[_progress(first, args.steps, every, out)],
                                  checkpoint_every=args.checkpoint_every, checkpoint_dir=args.checkpoint_dir,
                                  max_failures=args.max_failures, elastic=args.elastic)
        except RuntimeError as e:   # a failure past --max-failures, or one it cannot recover from: said, not a traceback
            failed = e
        else:
            saved = trainer.save(args.save) if args.save else None
            result = _summary(trainer, history, first, began, saved)
            result["ray_log"] = log.path
    if failed is not None:
        where = (f"; the last checkpoint written is in {args.checkpoint_dir}: --restore {args.checkpoint_dir} "
                 f"continues from it" if args.checkpoint_dir else "")
        print(f"autosync train: {failed}{where}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    _print_summary(result)
    return 0


def _named(nodes: list, restart: dict) -> str:
    """``nodes`` of a ``History.restarts`` entry, each with the address of the Ray node that stands in for it."""
    stand = restart.get("stand_ins", {})
    return ", ".join(f"{n} (on {stand[n]})" if n in stand else n for n in nodes)


def _print_summary(result: dict) -> None:
    """The text ``train`` prints at the end (``_summary``'s figures)."""
    print(f"trained {result['steps']} steps (global step {result['global_step']}) in {result['wall_s']:.1f} s: "
          f"loss {result['loss_first']:.5g} -> {result['loss_last']:.5g} (mean of the first and last "
          f"{result['loss_window']} steps), median step {result['step_time_s']['median'] * 1e3:.1f} ms")
    for r in result["restarts"]:
        if "back" in r:
            print(f"nodes back: {_named(r['back'], r)}; from step {r['resumed_from']} on {r['workers']} workers "
                  f"({r['seconds']:.1f} s)")
            continue
        kept = " (the global batch kept: each draws its parts' batches)" if r.get("parts") else ""
        moved = (f"; went on without {', '.join(r['without'])} on {r['workers']} workers{kept}" if "without" in r
                 else f"; {_named(r['replaced'], r)} replaced" if "replaced" in r else "")
        print(f"recovered: failed at step {r['failed_at']}, resumed from {r['resumed_from']} in {r['seconds']:.1f} s"
              f"{moved}: {r['error']}")
    saved = result["checkpoint"]
    if saved is not None:
        print(f"checkpoint written to {saved['path']} ({saved['bytes'] / 2**20:.1f} MiB; --restore {saved['path']} "
              f"continues); the weights alone: {saved['weights']} (keras.Model.load_weights reads it)")


def _summary(trainer, history, first: int, began: float, saved) -> dict:
    """What ``--json`` prints: the run's steps, losses, step times, recoveries and checkpoint."""
    losses, times = history.loss, history.step_times
    window = max(1, min(10, len(losses) // 4))
    return {
        "model": trainer.model_def.name, "cluster": trainer.cluster.name, "workers": len(trainer.plan.replicas),
        "strategy": {"origin": trainer.strategy.origin or "file", "fingerprint": trainer.strategy.fingerprint},
        "steps": len(losses), "first_step": first, "global_step": trainer.step,
        "loss": [float(x) for x in losses], "loss_window": window,
        "loss_first": float(np.mean(losses[:window])), "loss_last": float(np.mean(losses[-window:])),
        "step_time_s": {"median": float(np.median(times)), "p90": float(np.percentile(times, 90))},
        "wall_s": time.perf_counter() - began, "restarts": history.restarts,
        "checkpoint": None if saved is None else {"path": str(saved.path), "weights": str(saved.weights_path),
                                                  "bytes": saved.bytes, "seconds": saved.seconds},
    }


def register(sub) -> None:
    p = sub.add_parser("train", help="train a model with a strategy (tune's best_strategy.yaml, a file or a "
                                     "builder), with checkpoints and recovery from failures")
    p.add_argument("--model", required=True, metavar="M", help=f"trainable model: {TRAINABLE_FORMS}")
    p.add_argument("--strategy", required=True, metavar="FILE|BUILDER",
                   help="strategy YAML file (autosync tune writes best_strategy.yaml), or a builder's name")
    p.add_argument("--cluster", default="local", metavar="C", help=f"cluster: {CLUSTER_FORMS} (default local)")
    p.add_argument("--steps", type=int, required=True, metavar="N", help="steps to train (each: every worker one "
                                                                         "batch, then synchronization)")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S",
                   help="limit for each round trip to the workers, start-up included in the first (default 600)")
    p.add_argument("--restore", metavar="DIR", help="continue from this checkpoint (its step, optimizer state and "
                                                    "data positions), under any strategy and number of workers")
    p.add_argument("--checkpoint-dir", metavar="DIR", help="where --checkpoint-every writes checkpoints (and "
                                                           "recovery restarts from)")
    p.add_argument("--checkpoint-every", type=int, metavar="N", help="write a checkpoint every N global steps")
    p.add_argument("--max-failures", type=int, default=0, metavar="K",
                   help="recover from K worker or parameter-server failures by restarting from the last "
                        "checkpoint (default 0: a failure ends the run)")
    p.add_argument("--elastic", action="store_true",
                   help="when a node leaves the Ray cluster, go on without it (its PS shards moved to the nodes "
                        "left, fewer workers) or on its replacement, counted in --max-failures; take it back at a "
                        "checkpoint once it is back")
    p.add_argument("--keep-global-batch", action="store_true",
                   help="on fewer workers than before (--restore of a checkpoint of more, --elastic without a node), "
                        "each worker also draws the batches of the workers it stands for, so that training goes on "
                        "as the uninterrupted run would (steps then compute more); default: the global batch "
                        "shrinks with the workers")
    p.add_argument("--save", metavar="DIR", help="write a checkpoint here at the end (its model.weights.h5 loads "
                                                 "with keras.Model.load_weights)")
    p.add_argument("--log-every", type=int, metavar="N",
                   help=f"print a progress line every N steps (default: about {PROGRESS_LINES} lines)")
    p.add_argument("--json", action="store_true", help="print a JSON summary (losses, step times, recoveries, "
                                                       "checkpoint) instead of text")
    p.set_defaults(func=cmd_train)
