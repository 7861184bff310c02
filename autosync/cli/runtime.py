"""Commands that run on Ray: ``run`` (measure one strategy) and ``baselines`` (every builder)."""
from __future__ import annotations

import json
import math
import os
import sys

from autosync.cli.raylog import ray_output_to_log
from autosync.formatting import headline, table
from autosync.sources import CLUSTER_FORMS, TRAINABLE_FORMS
from strategy_space import validate
from strategy_space.errors import ConfigError


def _add_common(p) -> None:
    p.add_argument("--model", required=True, metavar="M", help=f"trainable model: {TRAINABLE_FORMS}")
    p.add_argument("--cluster", default="local", metavar="C", help=f"cluster: {CLUSTER_FORMS} (default local)")
    p.add_argument("--steps", type=int, default=10, metavar="N", help="timed steps per trial (default 10)")
    p.add_argument("--warmup", type=int, default=2, metavar="N", help="untimed warm-up steps (default 2)")
    p.add_argument("--timeout", type=float, default=300.0, metavar="S",
                   help="limit per trial in seconds (default 300); reading the model in this process may take as "
                        "long (or AUTOSYNC_MODEL_TIMEOUT seconds, where set)")
    add_precision_flags(p)
    add_compute_flags(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def add_precision_flags(p) -> None:
    """``--precision`` and ``--max-steps`` (shared with ``tune``)."""
    p.add_argument("--precision", type=float, default=0.03, metavar="F",
                   help="after --steps, measure until the 95%% interval of the median step time is within "
                        "+-F of it (default 0.03; 0 measures exactly --steps steps)")
    p.add_argument("--max-steps", type=int, default=200, metavar="N",
                   help="cap on timed steps per trial with --precision (default 200)")


def add_compute_flags(p) -> None:
    """``--compute``, ``--step-time`` and ``--optimizer`` (shared with ``tune``)."""
    p.add_argument("--compute", choices=("real", "emulated"), default="real",
                   help="real: workers run the model with TensorFlow (default); emulated: workers wait the "
                        "model's profiled compute time asleep and send synthetic gradients of its exact shapes "
                        "and sparsity (--model may then be a model-spec YAML)")
    p.add_argument("--step-time", type=float, metavar="S",
                   help="emulated compute per step in seconds (default: the spec's profile.step_time_s, or "
                        "measured for a trainable model); the testbed's --dilation multiplies it")
    p.add_argument("--optimizer", default="sgd", metavar="NAME",
                   help="optimizer of emulated compute: sgd (default), momentum, adam or adagrad")


def compute_settings(args) -> dict:
    """RayRunner keywords from ``--compute``/``--step-time``/``--optimizer``."""
    return {"compute": args.compute, "step_time_s": args.step_time, "optimizer": args.optimizer}


def precision_settings(args) -> dict:
    """RayRunner keywords from ``--precision``/``--max-steps``.

    Raises:
        ConfigError: out-of-range values.
    """
    if not 0 <= args.precision < 1:
        raise ConfigError(f"--precision must be a fraction in [0, 1) such as 0.03 (0: off), got {args.precision}")
    if args.max_steps < args.steps:
        raise ConfigError(f"--max-steps ({args.max_steps}) must be >= --steps ({args.steps})")
    return {"precision": args.precision or None, "max_steps": args.max_steps}


def _prepare(args):
    """Everything that can be checked before Ray starts: the flags, the model (loaded, its
    optimizer checked, its ModelSpec built here; with emulated compute the synthetic model) and
    the cluster. Returns (ModelDef, ModelSpec, ClusterSpec) as the runner will use them."""
    from autosync.runtime.emulated import check_emulated_settings
    from autosync.runtime.optimizers import check_model_optimizer
    from autosync.runtime.binding import check_cluster_start
    from autosync.runtime.runner import check_real_compute, emulated_setup
    from autosync.sources import load_cluster, load_emulated_model, load_model_def, load_model_spec

    if args.steps < 1 or args.warmup < 0:
        raise ConfigError(f"--steps must be >= 1 and --warmup >= 0, got --steps {args.steps} --warmup {args.warmup}")
    if not args.timeout > 0:
        raise ConfigError(f"--timeout must be > 0 seconds, got {args.timeout}")
    precision_settings(args)
    cluster = load_cluster(args.cluster)
    check_cluster_start(cluster)
    if args.compute == "emulated":
        check_emulated_settings(args.step_time, args.optimizer)   # before the model is read
        model_def, cluster, spec = emulated_setup(load_emulated_model(args.model, args.step_time), cluster, None,
                                                  args.step_time, args.optimizer)
        return model_def, spec, cluster
    check_real_compute(args.compute, cluster, args.step_time)
    model_def = load_model_def(args.model)
    check_model_optimizer(model_def)
    return model_def, load_model_spec(model_def), cluster


def _runner(args, model_def, spec, cluster, **settings):
    from autosync.runtime.runner import RayRunner

    return RayRunner(model_def, cluster, warmup=args.warmup, steps=args.steps, trial_timeout_s=args.timeout,
                     model_spec=spec, **precision_settings(args), **compute_settings(args), **settings)


def _record(trial) -> dict:
    d = trial.summary()
    d["batch_size"] = trial.batch_size
    d["startup_s"] = trial.meta.get("startup_s")
    d["ray_calls_per_step_per_worker"] = trial.meta.get("ray_calls_per_step_per_worker")
    return d


def _fmt(seconds) -> str:
    return "-" if seconds is None or not math.isfinite(seconds) else f"{seconds * 1e3:.1f} ms"


def cmd_run(args) -> int:
    from autosync.runtime.runner import load_failure
    from autosync.sources import load_strategy_for
    from strategy_space.builders import BUILDERS

    # a file is read (a bad one refused) before the model is built; a builder's name builds for the model
    named = args.strategy in BUILDERS and not os.path.exists(os.path.expanduser(args.strategy))
    strategy = None if named else load_strategy_for(args.strategy, None, None)
    if args.timeline:
        from autosync.runtime import timeline

        timeline.check_path(args.timeline, "--timeline")
    model_def, spec, cluster = _prepare(args)
    if named:
        strategy = load_strategy_for(args.strategy, spec, cluster)
    try:   # a strategy for another model or cluster fails here, before Ray starts
        validate(strategy, spec, cluster)
    except ConfigError as e:
        raise e.with_source(args.strategy) from None
    with ray_output_to_log("run") as log, _runner(args, model_def, spec, cluster,
                                                  timeline=bool(args.timeline)) as runner:
        trial = runner.run([strategy], origins=[strategy.origin or "file"])[0]
        if trial.status == "failed" and not runner.loaded:   # the model's code raised in the workers: as in tune
            raise load_failure(model_def, cluster, trial.error)
        streams = runner.last_timeline
    phases = _write_timeline(args.timeline, streams, trial, spec, cluster) if args.timeline and streams else None
    if args.json:
        extra = {"timeline": {"path": args.timeline, "phases": phases}} if phases is not None else {}
        print(json.dumps(_record(trial) | {"ray_log": log.path} | extra, indent=2))
    elif trial.ok:
        ci = trial.median_ci
        rows = [("median step", _fmt(trial.median)),
                ("95% interval of the median", f"{_fmt(ci[0])} .. {_fmt(ci[1])}" if ci else "- (fewer than 6 steps)"),
                ("timed steps", str(len(trial.step_times))), ("p90 step", _fmt(trial.p90)),
                ("samples/s", f"{trial.samples_per_s:.1f}"),
                ("compute / sync per step", f"{_fmt(trial.breakdown['compute'])} / {_fmt(trial.breakdown['sync'])}"),
                ("ray calls per step per worker", f"{trial.meta['ray_calls_per_step_per_worker']:g}"),
                ("start-up", f"{trial.meta['startup_s']:.2f} s")]
        print(table(["measure", "value"], rows))
        if phases is not None:
            print(f"\ntimeline written to {args.timeline} (open it in ui.perfetto.dev or chrome://tracing); "
                  f"per step (median over steps):")
            print(table(["actor", "span", "spans", "ms per step"],
                        [(r["actor"], r["span"], str(r["count"]), f"{r['ms_per_step']:.2f}") for r in phases],
                        right=(2, 3)))
    else:
        print(f"autosync run: trial {trial.status}: {trial.error}", file=sys.stderr)
    if args.timeline and phases is None:
        print(f"autosync run: no timeline written to {args.timeline}: the trial {trial.status} before its steps "
              f"were collected", file=sys.stderr)
    return 0 if trial.ok else 1


def _write_timeline(path: str, streams: dict, trial, spec, cluster) -> list[dict]:
    """Write the trial's timeline as a Chrome trace to ``path``; returns its per-step phase table."""
    from autosync.runtime import timeline

    return timeline.save(path, streams, {"model": spec.name, "cluster": cluster.name, "strategy_origin": trial.origin,
                                         "status": trial.status, "median_step_s": trial.median if trial.ok else None})


def cmd_baselines(args) -> int:
    from autosync.runtime.plan import SyncPlan
    from tuner.search.baseline_runs import measure_baselines

    model_def, spec, cluster = _prepare(args)

    def runnable(strategy) -> None:
        SyncPlan.build(validate(strategy, spec, cluster), spec, cluster)

    with ray_output_to_log("baselines"), _runner(args, model_def, spec, cluster) as runner:
        runs = measure_baselines(runner, check=runnable, retries=1)
    records = []
    for r in runs:
        if r.unsupported:
            rec = {"status": "not supported", "error": r.unsupported, "step_time_s": None, "samples_per_s": None}
        else:
            rec = _record(r.trial)
        rec = {"builder": r.builder, **rec, "same_as": r.same_as, "attempts": r.attempts,
               "first_error": r.first_error or None}
        records.append(rec)
    records.sort(key=lambda r: (r["step_time_s"] is None, (r["step_time_s"] or {}).get("median", 0.0)))
    if args.json:
        print(json.dumps(records, indent=2))
        return 0

    def note(r) -> str:
        if r["same_as"]:
            return f"same strategy as {r['same_as']} (one measurement)"
        text = headline(r.get("error"))
        if r["attempts"] > 1:
            text = (f"failed twice: {text}" if r["status"] != "ok"
                    else f"ok on the retry; first run: {headline(r['first_error'])}")
        return text[:110]

    rows = [(r["builder"], r["status"], _fmt((r["step_time_s"] or {}).get("median")),
             _fmt((r["step_time_s"] or {}).get("p90")),
             f"{r['samples_per_s']:.1f}" if r["samples_per_s"] else "-", note(r)) for r in records]
    print(table(["builder", "status", "median step", "p90 step", "samples/s", "note"], rows, right=(2, 3, 4)))
    return 0


def register(sub) -> None:
    p = sub.add_parser("run", help="run one strategy on Ray and measure its step time")
    _add_common(p)
    p.add_argument("--strategy", required=True, metavar="FILE|BUILDER",
                   help="strategy YAML file, or a builder's name (ps, all_reduce, ...: the strategy `autosync build` "
                        "makes for this model and cluster)")
    p.add_argument("--timeline", metavar="FILE",
                   help="record what every worker and parameter server does each step (pull, compute, push, "
                        "all-reduce, apply, ...) and write it to FILE as a Chrome trace (ui.perfetto.dev, "
                        "chrome://tracing); the time per step of each is printed too")
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("baselines", help="run every baseline builder's strategy on Ray, fastest first (builders "
                                         "with the same strategy share one measurement; a failed one is retried once)")
    _add_common(p)
    p.set_defaults(func=cmd_baselines)
