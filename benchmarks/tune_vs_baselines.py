"""The main job measured: AutoSync's tuned strategy vs the best baseline builder vs Ray Train's
TensorflowTrainer (MultiWorkerMirroredStrategy), per model, on the emulated testbed.

For each model, in one run on the same testbed (``--nodes`` nodes, 1 CPU each, links shaped to
``--bandwidth``; ``--compute emulated`` for workers that wait the profiled compute time, as GPU
nodes look to their CPUs and NICs):

1. ``autosync.tune`` with up to ``--trials`` search trials (every baseline builder is measured
   first). Its warm start is the shipped dataset **without any trial of this model** (on any
   cluster), so the figure is transfer to an unseen model, not recall; ``--warm-start builtin``
   gives the product default instead, ``none`` a cold start. ``--cold`` tunes once more from a
   cold start (same seed, separate store) to compare trials-to-within-5 %.
2. Confirmation: the tuned strategy and the best baseline are measured again, ``--confirm`` times
   each, interleaved, on fresh workers: picking the fastest of many noisy measurements flatters
   the winner, so the speed-ups are computed from these re-measurements (medians over repeats),
   each with a 95 % interval (t-interval of the log repeat medians).
3. The analytic lower bound of the tuned strategy's step: the larger of its compute and the least
   time the busiest NIC needs for the bytes the strategy moves (communication entirely hidden
   behind compute; their sum, the step with no overlap at all, is kept for reference).
4. The peer (real compute only): Ray Train's TensorflowTrainer on the same model, per-worker batch
   and nodes, measured ``--peer-repeats`` times with a long warm-up; its repeat spread is reported.

``--models`` takes zoo names and model-spec YAML files (``configs/models/*.yaml``; emulated compute
only). Prints a table (targets: >= 1.3x the best baseline with non-overlapping intervals and >= 1.5x
the peer on the embedding-heavy models, >= 1.0x the peer on dense ones, never slower than the best
baseline, <= 1.5x the lower bound with real compute and <= 1.3x emulated, within 5 % of the final
best in <= 50 trials and fewer warm than cold) and writes ``--name``.json and .png (tuning curves)
into ``--out``; the trials go to ``--store``.

    flock /tmp/autosync-testbed.lock python benchmarks/tune_vs_baselines.py --nodes 2 \\
        --bandwidth 200mbit --name tune_vs_baselines_2x200mbit_real
    flock /tmp/autosync-testbed.lock python benchmarks/tune_vs_baselines.py --nodes 3 \\
        --bandwidth 100mbit --compute emulated --name tune_vs_baselines_3x100mbit_emulated
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from _time_to_target import log_t_interval  # noqa: E402 (a sibling script module, importable from here)
from tuner.cost_models.analytic import step_lower_bound as lower_bound  # noqa: E402

MODELS = ("ncf", "dlrm", "lm1b", "resnet50", "bert", "vgg16")
EMBEDDING_HEAVY_SHARE = 0.3     # sparse (embedding) share of the parameters that makes a model embedding-heavy
TARGETS = {"vs_best_baseline_embedding": 1.3, "vs_peer_embedding": 1.5, "vs_peer_dense": 1.0, "trials": 50,
           "lower_bound": {"real": 1.5, "emulated": 1.3}}


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--inside", action="store_true", help="measure only (inside host0 of an existing testbed)")
    p.add_argument("--models", nargs="+", default=list(MODELS), metavar="NAME",
                   help="zoo model names or model-spec YAML files (default: the six small zoo models)")
    p.add_argument("--compute", choices=("real", "emulated"), default="real",
                   help="real TensorFlow workers (default) or emulated compute (no peer then)")
    p.add_argument("--step-time", type=float, default=None, metavar="S",
                   help="emulated compute of a model-spec YAML that has no profile: seconds per step (default: "
                        "the simulator's estimate from its parameters, tuner.features.tables.estimate_compute_s)")
    p.add_argument("--cold", action="store_true", help="also tune from a cold start, to compare trials to 5 %%")
    p.add_argument("--peer-repeats", type=int, default=2, help="measurements of the peer (default 2)")
    p.add_argument("--name", default="tune_vs_baselines", help="result file name, without .json (default %(default)s)")
    p.add_argument("--trials", type=int, default=50, help="search trials per model (default 50)")
    p.add_argument("--patience", type=int, default=5, help="stop after this many rounds without improvement")
    p.add_argument("--warm-start", default="lomo",
                   help="lomo (shipped dataset without the tuned model; default), builtin, none, or a store file")
    p.add_argument("--confirm", type=int, default=3, help="re-measurements of tuned and best baseline (default 3)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per trial (default 3)")
    p.add_argument("--steps", type=int, default=10, help="first batch of timed steps per trial (default 10; then "
                   "more until the median's 95 %% interval is within +-3 %%, at most --max-steps)")
    p.add_argument("--max-steps", type=int, default=60)
    p.add_argument("--trial-timeout", type=float, default=300.0, metavar="S",
                   help="limit for one trial, start-up included (default %(default)g s; a full-size dense model "
                        "at 100mbit needs a minute a step)")
    p.add_argument("--no-peer", action="store_true", help="skip Ray Train's TensorflowTrainer")
    p.add_argument("--nodes", type=int, default=2, help="testbed nodes (default 2)")
    p.add_argument("--bandwidth", default="200mbit", help="testbed link rate (default 200mbit)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quality", choices=("goodput", "exact", "step"), default="goodput",
                   help="what the tuning ranks by (autosync tune --quality; default goodput)")
    p.add_argument("--probe-steps", type=int, default=200, help="steps of each efficiency probe (default 200)")
    p.add_argument("--probe-model", action="append", default=[], metavar="NAME=MODEL",
                   help="emulated compute: probe the efficiencies of model NAME (as given to --models) on the "
                        "trainable stand-in MODEL (autosync tune --probe-model), e.g. "
                        "configs/models/nvidia-h200/lm1b-full.yaml=zoo:lm1b; repeatable")
    p.add_argument("--time-to-target", type=int, default=0, metavar="STEPS",
                   help="also time to a target loss: the loss the best baseline reaches after STEPS steps, "
                        "reached by the tuned strategy, the best baseline and the peer (measured with real "
                        "compute); projected from the step times and the probed efficiency (both computes; "
                        "default 0: neither)")
    p.add_argument("--ttt-repeats", type=int, default=3, help="runs of each contender to the target (default 3)")
    p.add_argument("--ttt-window", type=int, default=20, help="steps the loss is averaged over (default 20)")
    p.add_argument("--ttt-cap", type=float, default=3.0,
                   help="a run stops unreached after this many times STEPS (default 3)")
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"), help="output folder")
    p.add_argument("--store", default=None, help="trial store (default: OUT/NAME.db)")
    p.add_argument("--merge", action="store_true", help="keep the other models of an existing JSON in --out")
    return p.parse_args(argv)


def _warm_groups(source: str, model_name: str):
    from tuner.records.warmstart import load_warm_start

    if source == "lomo":
        return load_warm_start("builtin", exclude_models=[model_name])
    return load_warm_start(source)


def store_label(store_path: str, out: str) -> str:
    """How a result's meta names its trial store: the file name alone where the store lies in the
    result's own folder (the two travel together, e.g. from a scratch folder into
    ``benchmarks/results``), else the path as given."""
    if os.path.dirname(os.path.abspath(store_path)) == os.path.abspath(out):
        return os.path.basename(store_path)
    return store_path


def source_of(name: str) -> str:
    """``zoo:NAME`` for a zoo name, the name itself for a model-spec YAML or a ``script.py:function``."""
    return name if name.endswith((".yaml", ".yml")) or ".py:" in name else f"zoo:{name}"


def stand_ins(pairs: list, models: list) -> dict:
    """--probe-model's NAME=MODEL pairs as a dict; ValueError for a malformed pair or a NAME not
    given to --models."""
    out = {}
    for pair in pairs:
        name, sep, model = pair.partition("=")
        if not (sep and name and model):
            raise ValueError(f"--probe-model takes NAME=MODEL (a name given to --models, then a trainable model), "
                             f"got {pair!r}")
        if name not in models:
            raise ValueError(f"--probe-model {pair}: {name} is not among --models")
        out[name] = model
    return out


def confirm(runner, strategies: dict, repeats: int, say) -> dict:
    """Median step time of each strategy over ``repeats`` interleaved trials on fresh workers,
    with the 95 % interval of each trial and of the repeats."""
    got: dict = {k: [] for k in strategies}
    intervals: dict = {k: [] for k in strategies}
    for r in range(repeats):
        for key, strategy in strategies.items():
            t = runner.run_one(strategy, key)
            got[key].append(t.median if t.ok else None)
            intervals[key].append(list(t.median_ci) if t.ok and t.median_ci else None)
            say(f"  confirm {r + 1}/{repeats} {key}: " + (f"{t.median * 1e3:.1f} ms" if t.ok else t.error[:160]))
    return {k: {"medians_s": v, "median_ci95_s": intervals[k],
                "median_s": statistics.median([x for x in v if x]) if any(v) else None,
                "repeats_ci95_s": log_t_interval(v)}
            for k, v in got.items()}


def tune_once(name: str, runner, args, store_path: str, warm, say) -> tuple:
    from autosync.api import tune
    from tuner.search.model_based import SearchSettings

    curve: list = []

    def on_trial(trial, outcome):
        best = outcome.best
        curve.append({"n": len(outcome.trials), "role": trial.role, "origin": trial.origin,
                      "median_s": trial.median if trial.ok else None,
                      "predicted_s": trial.predicted_s, "best_s": best.median if best else None})
        say(f"  {len(outcome.trials):3d} {trial.role[:6]:6s} {trial.origin:24s} "
            + (f"{trial.median * 1e3:8.1f} ms" if trial.ok else f"{trial.status}: {trial.error[:100]}")
            + (f"   best {best.median * 1e3:.1f} ms" if best else ""))

    t0 = time.monotonic()
    def on_probe(trial, e):
        say(f"  probe {trial.origin}: efficiency {e.value:.3f} [{e.low:.3f}, {e.high:.3f}] ({e.source}) {e.note[:100]}")

    result = tune(source_of(name), runner.cluster, trials=args.trials, store=store_path, patience=args.patience,
                  warm_start=warm, on_trial=on_trial, runner=runner, settings=SearchSettings(seed=args.seed),
                  quality=args.quality, probe_steps=args.probe_steps, on_probe=on_probe,
                  probe_model=stand_ins(args.probe_model, args.models).get(name))
    summary = result.summary()
    out = {k: summary[k] for k in ("best_step_time_s", "best_origin", "best_baseline", "best_baseline_step_time_s",
                                   "speedup_over_best_baseline", "step_speedup_over_best_baseline", "trials",
                                   "baseline_trials", "total_trials", "failed_trials", "trials_to_within_5pct",
                                   "stop_reason", "run_id", "quality", "statistical_efficiency",
                                   "statistical_efficiency_interval", "efficiency_probed", "lossy_parts", "lossy_note",
                                   "probes", "probe_seconds")}
    out["wall_s"] = round(time.monotonic() - t0, 1)
    return result, out, curve


def spec_step_time(name: str, args) -> dict | None:
    """The emulated compute time of a model-spec YAML without a profile: ``--step-time`` or the
    simulator's estimate from its parameters (said in the result); None where the spec has a
    profile or the model is trainable (its compute is measured)."""
    if args.compute != "emulated" or not name.endswith((".yaml", ".yml")):
        return None
    from autosync.sources import load_model_spec
    from tuner.features.tables import ESTIMATE_FLOPS, estimate_compute_s

    spec = load_model_spec(name)
    if spec.profile is not None:
        return None
    if args.step_time is not None:
        return {"s": args.step_time, "source": "--step-time"}
    return {"s": estimate_compute_s(spec), "source": f"estimate, not measured: 6 flops per dense parameter per "
            f"sample plus the touched rows, at {ESTIMATE_FLOPS / 1e9:g} GFLOP/s (tuner.features.tables.estimate_compute_s)"}


def measure_model(name: str, cluster, args, store_path: str, say) -> dict:
    import _peer

    from autosync.api import make_runner

    step_time = spec_step_time(name, args)
    # real compute: the profiled spec, as ``tune`` builds it (the workers' own description has no profile)
    runner = make_runner(source_of(name), cluster, warmup=args.warmup, steps=args.steps, trial_timeout_s=args.trial_timeout,
                         precision=0.03, max_steps=args.max_steps, compute=args.compute, profile=True,
                         step_time_s=step_time["s"] if step_time else None)
    try:
        spec, cluster = runner.model, runner.cluster   # with emulated compute the cluster records it
        out: dict = {"model": spec.name, "source": source_of(name), "compute": args.compute,
                     "parameter_bytes": spec.total_bytes, "sparse_share": spec.sparse_share,
                     "embedding_heavy": spec.sparse_share >= EMBEDDING_HEAVY_SHARE, "step_time": step_time}
        if step_time:
            say(f"  emulated compute {step_time['s'] * 1e3:.1f} ms per step ({step_time['source']})")
        warm = _warm_groups(args.warm_start, spec.name)
        out["warm_start"] = {"source": args.warm_start, "groups": len(warm),
                             "trials": sum(len(t) for _, _, t in warm), "models": sorted({m.name for m, _, _ in warm})}
        say(f"  warm start {args.warm_start}: {out['warm_start']['trials']} trials of {out['warm_start']['models']}")
        result, out["tune"], out["curve"] = tune_once(name, runner, args, store_path, warm, say)
        out["tune_wall_s"] = out["tune"]["wall_s"]
        if args.cold:
            say("  cold start (no warm start), same seed:")
            cold_store = store_path[:-3] + "_cold.db" if store_path.endswith(".db") else store_path + "_cold"
            _, out["cold"], out["cold_curve"] = tune_once(name, runner, args, cold_store, "none", say)
        out["baselines_s"] = {b: (t.median if t.ok else None) for b, t in result.baselines.items()}
        base_name = out["tune"]["best_baseline"]
        tuned = result.best_strategy
        base = result.baselines[base_name].strategy
        if tuned.canonical(cluster) == base.canonical(cluster):
            say(f"  the tuned strategy is the best baseline ({base_name}): re-measuring it alone")
            conf = confirm(runner, {"tuned": tuned}, args.confirm, say)
            conf["best_baseline"] = conf["tuned"]
        else:
            conf = confirm(runner, {"tuned": tuned, "best_baseline": base}, args.confirm, say)
        out["confirm"] = conf
        out["lower_bound"] = lower_bound(result.model, cluster, tuned)
    finally:
        runner.close()
    tuned_s, base_s = conf["tuned"]["median_s"], conf["best_baseline"]["median_s"]
    out["speedup_vs_best_baseline"] = base_s / tuned_s if tuned_s and base_s else None
    # goodput: the tuned strategy's step over its statistical efficiency (the baselines are lossless)
    e = out["tune"]["statistical_efficiency"]
    out["statistical_efficiency"] = e
    out["goodput_speedup_vs_best_baseline"] = (base_s * e / tuned_s) if tuned_s and base_s and e else None
    out["probe_share_of_tune"] = out["tune"]["probe_seconds"] / out["tune_wall_s"] if out["tune_wall_s"] else None
    ti, bi = conf["tuned"]["repeats_ci95_s"], conf["best_baseline"]["repeats_ci95_s"]
    out["intervals_overlap"] = None if not (ti and bi) or conf["tuned"] is conf["best_baseline"] \
        else not (ti[1] < bi[0] or bi[1] < ti[0])
    # the bound is the overlapped one (compute and the busiest NIC at once): compute plus NIC time is
    # not a bound, a strategy that overlaps communication with the backward pass runs under it
    out["vs_lower_bound"] = tuned_s / out["lower_bound"]["overlapped_s"] if tuned_s else None
    out["vs_serial_bound"] = tuned_s / out["lower_bound"]["serial_s"] if tuned_s else None
    out["peer"] = None
    if args.compute == "real" and not args.no_peer:
        t1 = time.monotonic()
        runs = []
        for r in range(args.peer_repeats):
            # a long warm-up: MWMS builds its collectives lazily and its first steps are slow
            peer = _peer.measure_peer(source_of(name), cluster, warmup=max(args.warmup, 8), steps=max(args.steps, 12),
                                      timeout_s=600)
            runs.append(peer)
            say(f"  ray_train_mwms {r + 1}/{args.peer_repeats}: {peer['status']} "
                + (f"median {peer['median'] * 1e3:.1f} ms" if peer["status"] == "ok" else (peer.get("error") or "")[:200]))
        ok = [p["median"] for p in runs if p["status"] == "ok"]
        out["peer"] = {"status": "ok" if ok else "failed", "medians_s": ok,
                       "median_s": statistics.median(ok) if ok else None,
                       "repeat_spread": (max(ok) / min(ok) - 1) if len(ok) >= 2 else None,
                       "error": None if ok else (runs[-1].get("error") if runs else "not run"),
                       "wall_s": round(time.monotonic() - t1, 1)}
    peer_s = (out["peer"] or {}).get("median_s")
    out["speedup_vs_peer"] = peer_s / tuned_s if peer_s and tuned_s else None
    if args.time_to_target:
        out["time_to_target_projected"] = project_time_to_target(out, args.time_to_target, say)
        if args.compute == "real":
            rejected = best_rejected_lossy(result.outcome, result.best_trial)
            out["time_to_target"] = measure_time_to_target(name, cluster, tuned, base, base_name, args, say,
                                                           rejected=rejected)
    return out


def best_rejected_lossy(outcome, recommended) -> dict | None:
    """The lossy strategy the goodput rule turned down for a probed efficiency under its
    ``min_efficiency`` that would otherwise have been recommended: the least median / E among
    those, if it beats the recommendation's figure. Racing it to the target shows what the
    guard costs or saves. None when there is none (or the run ranked by step time)."""
    from tuner.records.goodput import lossy_parts

    if outcome.quality == "step" or recommended is None:
        return None
    found = None
    for t in outcome.measured().values():
        e = outcome.efficiency_of(t.strategy)
        if e is None or not e.probed or not 0 < e.value < outcome.min_efficiency:
            continue
        if found is None or t.median / e.value < found[0]:
            found = (t.median / e.value, t, e)
    if found is None or not found[0] < outcome.figure(recommended):
        return None
    goodput_s, t, e = found
    return {"strategy": t.strategy, "origin": t.origin, "lossy_parts": lossy_parts(t.strategy).describe(),
            "median_s": t.median, "statistical_efficiency": e.value, "efficiency_interval": [e.low, e.high],
            "goodput_s": goodput_s, "recommended_goodput_s": outcome.figure(recommended),
            "min_efficiency": outcome.min_efficiency}


def project_time_to_target(out: dict, steps: int, say) -> dict:
    """Time to target from the confirmed step times and the tuned strategy's probed efficiency
    (the baselines are lossless): the figure emulated compute can give, and with real compute a
    check of the projection against the measurement."""
    from _time_to_target import projected

    conf = out["confirm"]
    got = projected(steps, {"tuned": (conf["tuned"]["median_s"], out["statistical_efficiency"]),
                            "best_baseline": (conf["best_baseline"]["median_s"], 1.0)})
    tuned_t = got["contenders"]["tuned"]["time_to_target_s"]
    base_t = got["contenders"]["best_baseline"]["time_to_target_s"]
    got["speedup_vs_best_baseline"] = base_t / tuned_t if tuned_t and base_t else None
    say(f"  time to target, projected from {steps} steps: tuned {_s(tuned_t)}, best baseline {_s(base_t)}: "
        f"{_x(got['speedup_vs_best_baseline'])}")
    return got


def measure_time_to_target(name: str, cluster, tuned, base, base_name: str, args, say, rejected=None) -> dict:
    """Time to the best baseline's loss after ``--time-to-target`` steps (``_time_to_target``);
    ``rejected`` (``best_rejected_lossy``) races too, as ``rejected_lossy``."""
    from _time_to_target import time_to_target

    same = tuned.canonical(cluster) == base.canonical(cluster)
    contenders = {"tuned": tuned} if same else {"tuned": tuned, "best_baseline": base}
    if rejected:
        contenders["rejected_lossy"] = rejected["strategy"]
        say(f"  also racing the lossy strategy the goodput rule turned down ({rejected['lossy_parts']}: "
            f"{rejected['median_s'] * 1e3:.1f} ms at E {rejected['statistical_efficiency']:.2f} < "
            f"{rejected['min_efficiency']})")
    t0 = time.monotonic()
    ttt = time_to_target(source_of(name), cluster, base, contenders, steps=args.time_to_target,
                         window=args.ttt_window, cap=int(args.ttt_cap * args.time_to_target),
                         repeats=args.ttt_repeats, peer=not args.no_peer, say=say)
    ttt["best_baseline_name"] = base_name
    ttt["tuned_is_best_baseline"] = same
    c = ttt["contenders"]
    if same:
        c["best_baseline"] = c["tuned"]
    tuned_t, base_t = c["tuned"]["time_to_target_s"], c["best_baseline"]["time_to_target_s"]
    peer_t = c.get("ray_train", {}).get("time_to_target_s")
    ttt["speedup_vs_best_baseline"] = base_t / tuned_t if base_t and tuned_t else None
    ttt["speedup_vs_peer"] = peer_t / tuned_t if peer_t and tuned_t else None
    ti, bi = c["tuned"]["time_to_target_ci95_s"], c["best_baseline"]["time_to_target_ci95_s"]
    ttt["intervals_overlap"] = None if same or not (ti and bi) else not (ti[1] < bi[0] or bi[1] < ti[0])
    if rejected:
        ttt["rejected_lossy"] = {k: v for k, v in rejected.items() if k != "strategy"}
        rej_t = c["rejected_lossy"]["time_to_target_s"]
        ttt["rejected_lossy"]["speedup_vs_tuned"] = tuned_t / rej_t if tuned_t and rej_t else None
    ttt["wall_s"] = round(time.monotonic() - t0, 1)
    say(f"  time to target: tuned {_s(tuned_t)}, best baseline {_s(base_t)}, ray_train {_s(peer_t)}: "
        f"{_x(ttt['speedup_vs_best_baseline'])} the best baseline, {_x(ttt['speedup_vs_peer'])} the peer")
    return ttt


def _s(seconds) -> str:
    return "-" if seconds is None else f"{seconds:.1f} s"


def _ms(s) -> str:
    return "-" if s is None or not math.isfinite(s) else f"{s * 1e3:.0f}"


def _x(r) -> str:
    return "-" if r is None else f"{r:.2f}x"


def render_table(results: dict) -> str:
    from autosync.formatting import table

    def ci(c):
        return "-" if not c.get("repeats_ci95_s") else "-".join(_ms(x) for x in c["repeats_ci95_s"])

    rows = []
    for name, r in results["models"].items():
        t, c = r["tune"], r["confirm"]
        cold = r.get("cold") or {}
        rows.append([r.get("model", name) + (" (emb)" if r["embedding_heavy"] else ""), t["best_origin"],
                     f"{_ms(c['tuned']['median_s'])} [{ci(c['tuned'])}]", f"{t['best_baseline']}",
                     f"{_ms(c['best_baseline']['median_s'])} [{ci(c['best_baseline'])}]",
                     _ms((r["peer"] or {}).get("median_s")), _ms(r["lower_bound"]["overlapped_s"]),
                     _x(r["speedup_vs_best_baseline"]), _x(r.get("goodput_speedup_vs_best_baseline")),
                     "-" if r.get("statistical_efficiency") is None else f"{r['statistical_efficiency']:.2f}",
                     _x(r["speedup_vs_peer"]), _x(r.get("vs_lower_bound")),
                     f"{t['trials_to_within_5pct']}/{t['total_trials']}",
                     f"{cold.get('trials_to_within_5pct', '-')}/{cold.get('total_trials', '-')}"])
    headers = ["model", "tuned origin", "tuned ms [95 %]", "best baseline", "baseline ms [95 %]", "peer ms",
               "bound ms", "vs baseline (step)", "vs baseline (goodput)", "E", "vs peer", "vs bound", "to 5% warm",
               "to 5% cold"]
    return table(headers, rows, right=tuple(range(2, len(headers))))


def verdicts(results: dict) -> list[str]:
    lines = []
    for name, r in results["models"].items():
        vb, vp, n = r["speedup_vs_best_baseline"], r["speedup_vs_peer"], r["tune"]["trials_to_within_5pct"]
        checks = [("not slower than the best baseline (>= 0.97x: 3 % noise allowance)", vb is not None and vb >= 0.97,
                   _x(vb))]
        if r["embedding_heavy"]:
            checks.append((">= 1.3x the best baseline, intervals apart",
                           vb is not None and vb >= TARGETS["vs_best_baseline_embedding"]
                           and r.get("intervals_overlap") is False, f"{_x(vb)}, overlap {r.get('intervals_overlap')}"))
        if r.get("peer"):
            want = TARGETS["vs_peer_embedding" if r["embedding_heavy"] else "vs_peer_dense"]
            checks.append((f">= {want:.1f}x the peer", vp is not None and vp >= want, _x(vp)))
        checks += time_to_target_checks(r)
        lb, want_lb = r.get("vs_lower_bound"), TARGETS["lower_bound"][r.get("compute", "real")]
        checks.append((f"<= {want_lb}x the analytic lower bound", lb is not None and lb <= want_lb, _x(lb)))
        checks.append((f"within 5 % of its best in <= {TARGETS['trials']} trials", n is not None and n <= TARGETS["trials"],
                       str(n)))
        if r.get("cold"):
            nc = r["cold"]["trials_to_within_5pct"]
            checks.append(("fewer trials to 5 % warm than cold", n is not None and nc is not None and n < nc,
                           f"{n} vs {nc}"))
        for what, ok, value in checks:
            lines.append(f"{r.get('model', name)}: {what}: {value} -> {'MET' if ok else 'MISSED'}")
    return lines


def time_to_target_checks(r: dict) -> list:
    """The headline's time-to-target targets for one model: measured where real compute trained
    it, projected otherwise; (what, met, value) each."""
    measured, proj = r.get("time_to_target"), r.get("time_to_target_projected")
    if not (measured or proj):
        return []
    kind = "measured" if measured else "projected"
    v = (measured or proj)["speedup_vs_best_baseline"]
    checks = [(f"time to target ({kind}) >= 1.0x the best baseline", v is not None and v >= 1.0, _x(v))]
    if r["embedding_heavy"]:
        apart = measured.get("intervals_overlap") is False if measured else None
        checks.append((f"time to target ({kind}) >= {TARGETS['vs_best_baseline_embedding']}x the best baseline"
                       + (", intervals apart" if measured else ""),
                       v is not None and v >= TARGETS["vs_best_baseline_embedding"] and apart is not False,
                       f"{_x(v)}" + (f", overlap {measured.get('intervals_overlap')}" if measured else "")))
    if measured and "ray_train" in measured.get("contenders", {}):
        want = TARGETS["vs_peer_embedding" if r["embedding_heavy"] else "vs_peer_dense"]
        vp = measured.get("speedup_vs_peer")
        checks.append((f"time to target >= {want:.1f}x Ray Train", vp is not None and vp >= want, _x(vp)))
    return checks


def render_png(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(results["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(3.2 * len(models), 3.4), squeeze=False)
    for ax, name in zip(axes[0], models):
        r = results["models"][name]
        xs = [c["n"] for c in r["curve"] if c["best_s"]]
        ax.step(xs, [c["best_s"] * 1e3 for c in r["curve"] if c["best_s"]], where="post", label="tuned (best so far)")
        ax.scatter([c["n"] for c in r["curve"] if c["median_s"]], [c["median_s"] * 1e3 for c in r["curve"] if c["median_s"]],
                   s=6, alpha=0.4, label="trial")
        base = r["tune"]["best_baseline_step_time_s"]
        if base:
            ax.axhline(base * 1e3, color="tab:red", ls="--", lw=1, label="best baseline")
        peer = (r["peer"] or {}).get("median_s")
        if peer:
            ax.axhline(peer * 1e3, color="black", ls=":", lw=1, label="Ray Train MWMS")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("trials")
        ax.set_yscale("log")
    axes[0][0].set_ylabel("step time, ms")
    axes[0][0].legend(fontsize=6)
    meta = results["meta"]
    fig.suptitle(f"AutoSync tuning on {meta['nodes']} testbed nodes at {meta['bandwidth']}, {meta['compute']} compute "
                 f"(warm start: {meta['warm_start']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def inside(args) -> int:
    import ray

    import _peer
    from _testbed import git_commit, write_json
    from autosync.sources import load_cluster
    from autosync.testbed import format_rate

    if not os.environ.get("RAY_ADDRESS"):
        print("tune_vs_baselines --inside runs inside the testbed's host0 (see the module doc)", file=sys.stderr)
        return 2
    cluster = load_cluster("testbed")
    os.makedirs(args.out, exist_ok=True)
    store_path = args.store or os.path.join(args.out, f"{args.name}.db")
    ray.init(address=os.environ["RAY_ADDRESS"], logging_level="ERROR", log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(_peer)
    rates = [format_rate(round(n.bandwidth_gbps * 1e9)) for n in cluster.nodes]
    results = {"meta": {"nodes": len(cluster.nodes),   # one rate, or each node's where they differ
                        "bandwidth": rates[0] if len(set(rates)) == 1 else ",".join(rates),
                        "cpus_per_node": cluster.nodes[0].cpus, "compute": args.compute, "warm_start": args.warm_start, "trials": args.trials,
                        "patience": args.patience, "confirm": args.confirm, "warmup": args.warmup, "steps": args.steps,
                        "trial_timeout_s": args.trial_timeout,
                        "started": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                        "ray": ray.__version__, "store": store_label(store_path, args.out),
                        "what_else_ran": os.environ.get("AUTOSYNC_BENCH_NOTE", "")},
               "models": {}}
    path = os.path.join(args.out, f"{args.name}.json")
    if args.merge and os.path.exists(path):
        with open(path) as f:
            results["models"] = {m: r for m, r in json.load(f)["models"].items() if m not in args.models}
    t_all = time.monotonic()
    commit = git_commit(REPO)   # of the code this run imports, not of whatever HEAD is when an entry is written
    for name in args.models:
        t0 = time.monotonic()
        print(f"{name}:", flush=True)
        try:
            r = measure_model(name, cluster, args, store_path, lambda line: print(line, flush=True))
        except Exception as e:  # noqa: BLE001 - one model's failure must not cost the others' figures
            import traceback

            traceback.print_exc()
            print(f"  {name}: FAILED: {type(e).__name__}: {e}", flush=True)
            continue
        r["wall_s"] = round(time.monotonic() - t0, 1)
        # provenance per entry: a --merge file holds entries of several runs
        r["commit"], r["run_started"] = commit, results["meta"]["started"]
        r["measured_at"] = time.strftime("%Y-%m-%d %H:%M:%S")
        results["models"][name] = r
        results["meta"]["wall_s"] = round(time.monotonic() - t_all, 1)
        write_json(path, results)   # partial results survive an interruption
    ray.shutdown()
    print()
    print(render_table(results))
    print("\n".join(verdicts(results)))
    png = os.path.join(args.out, f"{args.name}.png")
    render_png(results, png)
    print(f"\nwrote {path} and {png} ({results['meta']['wall_s']:.0f} s in all)")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _args(argv)
    unknown = [m for m in args.models if m not in MODELS and not (m.endswith((".yaml", ".yml")) and os.path.isfile(m))]
    yaml_real = [m for m in args.models if m.endswith((".yaml", ".yml")) and args.compute == "real"]
    bad_step = args.step_time is not None and not (math.isfinite(args.step_time) and 0 <= args.step_time < 3600)
    if unknown or yaml_real or bad_step or args.trials < 0 or args.steps < 1 or args.confirm < 1 or args.peer_repeats < 1:
        print(f"bad arguments: models {unknown} (valid: {', '.join(MODELS)} or an existing model-spec YAML), "
              f"model-spec YAMLs with real compute {yaml_real} (a spec has no weights to train: use --compute emulated), "
              f"--step-time between 0 and 3600 seconds, "
              f"--trials >= 0, --steps >= 1, --confirm >= 1, --peer-repeats >= 1", file=sys.stderr)
        return 2
    if args.time_to_target < 0 or args.ttt_repeats < 1 or args.ttt_window < 1 or args.ttt_cap < 1:
        print("bad arguments: --time-to-target STEPS >= 0, --ttt-repeats >= 1, --ttt-window >= 1, --ttt-cap >= 1",
              file=sys.stderr)
        return 2
    if not args.trial_timeout > 0:
        print(f"bad arguments: --trial-timeout must be > 0 seconds, got {args.trial_timeout:g}", file=sys.stderr)
        return 2
    try:
        stand_ins(args.probe_model, args.models)
    except ValueError as e:
        print(f"bad arguments: {e}", file=sys.stderr)
        return 2
    if args.probe_model and args.compute != "emulated":
        print("bad arguments: --probe-model needs --compute emulated (real compute probes the model itself)",
              file=sys.stderr)
        return 2
    if args.compute == "real" and args.nodes > (os.cpu_count() or 1):
        print(f"bad arguments: {args.nodes} nodes with real compute on {os.cpu_count()} cores: the CPU would decide, not "
              f"the network; use --nodes <= {os.cpu_count()} or --compute emulated", file=sys.stderr)
        return 2
    if args.inside:
        return inside(args)
    from _testbed import run_in_testbed

    return run_in_testbed(__file__, argv, nodes=args.nodes, bandwidth=args.bandwidth, name="tune_vs_baselines",
                          outer_flags={"--nodes", "--bandwidth", "--out"},
                          extra=["--out", os.path.abspath(args.out)])


if __name__ == "__main__":
    sys.exit(main())
