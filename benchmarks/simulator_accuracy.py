"""Ranking accuracy of the analytic model, the learned simulator and the ranker on synthetic trials.

Generates trials with the flow-level simulation (tuner.synthetic.netsim) for many (model, cluster) groups,
then prints pairwise accuracy, Kendall tau and top-1 regret within groups (held-out trials) and
leave-one-model-out. Targets: pairwise accuracy >= 0.90 within a group, >= 0.80 leave-one-model-out.

Pairwise accuracy is printed over all pairs (strict) and over the pairs whose measured times differ
by more than ``--tol`` (5 %): one measured step time carries the truth's noise (per-step noise,
node jitter, stragglers), so a pair closer than that is ordered by the noise. The synthetic world
knows each strategy's noiseless step time, so every prediction is also scored against it (``truth``
columns: does it order the strategies right?), and the noise ceiling says how far any predictor can
go against the measurements: the noiseless truth itself scored as a prediction of them.

    python benchmarks/simulator_accuracy.py [--models 8] [--clusters 3] [--per-group 30] [--seed 0]

``--store builtin`` (or a trial store file) scores the same methods on real measured trials instead
(the shipped testbed dataset): within a group (``within``: 40 % of every group held out at once,
``--splits``; ``warm``: that share of one group at a time with every other group whole, as a tuning
run has the shipped dataset beside its own trials, ``--warm-splits``), leave-one-model-out, and
leave-one-group-out (a new
(model, cluster) with only the other groups to learn from, i.e. what a warm start buys before the
target's first trial; ``analytic (default)`` is the cold start it is compared with). Repeated
measurements of one strategy are pooled into one row, and their spread gives the noise ceiling.
Targets there: pairwise >= 0.85 within a group, >= 0.80 for an unseen model, median step-time
error <= 15 %. ``--out FILE`` records the table with the commit and start time of the run.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tuner.cost_models.evaluation import evaluate, format_table, predictors, score_groups, splits  # noqa: E402
from tuner.cost_models.predictor import search_order  # noqa: E402
from tuner.records.dataset import build_trial_set  # noqa: E402
from tuner.synthetic.runner import make_dataset, noiseless_step_s  # noqa: E402


def noiseless_truth(groups, data) -> np.ndarray:
    """The noiseless step time of every row of ``data`` (ok trials, in ``build_trial_set`` order)."""
    parts = []
    for model, cluster, trials in groups:
        ok = [t for t in trials if t.ok]
        if not ok:
            continue
        gid = data.keys.index((model.fingerprint, cluster.fingerprint))
        if (data.group == gid).sum() != len(ok):
            raise RuntimeError(f"group {model.name} on {cluster.name}: some ok trial was not featurized")
        parts.append(noiseless_step_s(model, cluster, [t.strategy for t in ok]))
    return np.concatenate(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=int, default=8)
    ap.add_argument("--clusters", type=int, default=3)
    ap.add_argument("--per-group", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tol", type=float, default=0.05, help="relative gap for the pairwise beyond-noise column")
    ap.add_argument("--store", help="score real trials instead: builtin (the shipped dataset) or a trial store file")
    ap.add_argument("--out", help="with --store: write the table and the targets to this JSON file")
    ap.add_argument("--splits", type=int, default=20,
                    help="with --store: random within-group splits averaged (a split scores 3-5 strategies per "
                         "group: one split's mean strays by ~0.04)")
    ap.add_argument("--warm-splits", type=int, default=10,
                    help="with --store: random splits of the warm protocol (within a group, every other group "
                         "whole: one fit per group and split, ~45 s a split on 2 cores; 0 skips it; default 10)")
    args = ap.parse_args(argv)
    if args.splits < 1:
        print(f"simulator_accuracy: --splits must be >= 1, got {args.splits}", file=sys.stderr)
        return 2
    if args.warm_splits < 0:
        print(f"simulator_accuracy: --warm-splits must be >= 0, got {args.warm_splits}", file=sys.stderr)
        return 2
    if args.store:
        return real(args)
    t0 = time.perf_counter()
    groups = make_dataset(args.models, args.clusters, args.per_group, seed=args.seed)
    data = build_trial_set(groups)
    t1 = time.perf_counter()
    print(f"synthetic set: {len(data.keys)} groups, {len(set(data.model_names))} models, {len(data)} ok trials "
          f"({t1 - t0:.1f} s to simulate)")
    truth = noiseless_truth(groups, data)
    rows = evaluate(data, _methods(groups, args.seed), seed=args.seed, tol=args.tol, truth=truth)
    print(format_table(rows))
    # the ceiling: the noiseless truth itself as the prediction of the same held-out measurements
    (_, test), = splits(data, "within", args.seed)
    part = data.subset(test)
    scored = np.array(score_groups(truth[test], part, args.tol))[:, :4]   # no truth columns: it is the truth
    ceiling = np.nanmean(scored, axis=0)
    print(f"noise ceiling (within, same held-out trials, the noiseless truth as the prediction): pairwise "
          f"{ceiling[0]:.3f}, pw>{args.tol:.0%} {ceiling[3]:.3f}; noise of one trial: "
          f"{np.std(np.log(data.y / truth)):.3f} (std of log measured / true)")
    for p, target in (("within", 0.90), ("lomo", 0.80)):
        for key, label in (("pairwise_acc", "all pairs, measured"),
                           ("pairwise_acc_tol", f"pairs > {args.tol:.0%} apart, measured"),
                           ("pairwise_truth", "all pairs, noiseless truth"),
                           ("pairwise_truth_tol", f"pairs > {args.tol:.0%} apart, noiseless truth")):
            r = max((r for r in rows if r["protocol"] == p), key=lambda r: r[key])
            print(f"target {p}: pairwise >= {target:.2f} ({label}): best {r['method']} {r[key]:.3f} -> "
                  f"{'MET' if r[key] >= target else 'MISSED'}")
    print(f"total {time.perf_counter() - t0:.1f} s")
    return 0


def _methods(groups, seed: int) -> dict:
    """The compared predictors, and ``search``: what the search follows (``Predictor.order``, its
    scorers judged on the group's own training trials)."""
    specs = {(m.fingerprint, c.fingerprint): (m, c) for m, c, _ in groups}
    return predictors(seed=seed) | {"search": search_order(specs, seed)}


def _split_means(data, groups, args, protocol: str, n: int) -> list[dict]:
    """``evaluate``'s rows of ``protocol`` (within or warm) averaged over ``n`` random splits, with
    the standard error of each method's pairwise mean over the splits."""
    rows = [evaluate(data, _methods(groups, args.seed + seed), seed=args.seed + seed, tol=args.tol,
                     protocols=(protocol,)) for seed in range(n)]
    keys = ("pairwise_acc", "pairwise_acc_tol", "kendall_tau", "top1_regret", "abs_error")
    def by_group(i):   # each group's pairwise, averaged over the splits that scored it
        seen: dict[int, list] = {}
        for rr in rows:
            for g, v in rr[i]["group_pairwise"].items():
                seen.setdefault(g, []).append(v)
        return {g: float(np.nanmean(v)) for g, v in seen.items()}

    return [{**r, **{k: float(np.mean([rr[i][k] for rr in rows])) for k in keys}, "group_pairwise": by_group(i),
             "splits": n, "pairwise_acc_se": _se([rr[i]["pairwise_acc"] for rr in rows])}
            for i, r in enumerate(rows[0])]


def _by_group(table: list[dict], groups, data, method: str = "search") -> dict:
    """Per protocol, ``method``'s pairwise accuracy of every group, worst first (model, cluster,
    nodes, Gbit/s, compute, strategies, pairwise)."""
    spec = {(m.fingerprint, c.fingerprint): (m, c) for m, c, _ in groups}
    sizes = np.bincount(data.group, minlength=len(data.keys))
    out = {}
    for r in table:
        if r["method"] == method:
            rows = []
            for g, v in r["group_pairwise"].items():
                m, c = spec[data.keys[g]]
                rows.append({"model": m.name, "cluster": c.name, "nodes": len(c.nodes),
                             "gbps": c.nodes[0].bandwidth_gbps, "compute": c.compute,
                             "strategies": int(sizes[g]), "pairwise": v})
            out[r["protocol"]] = sorted(rows, key=lambda x: x["pairwise"])
    return out


def _se(values) -> float:
    """Standard error of the mean of ``values`` (NaN for fewer than two)."""
    v = np.asarray(values, dtype=float)
    return float(v.std(ddof=1) / np.sqrt(len(v))) if len(v) >= 2 else float("nan")


def real(args) -> int:
    import datetime

    from _testbed import warm_start_groups
    from tuner.cost_models.evaluation import group_noise, merge_repeats, noise_ceiling, repeat_noise

    t0 = time.perf_counter()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    groups = warm_start_groups(args.store, "simulator_accuracy")
    if groups is None:
        return 2
    raw = build_trial_set(groups)
    # repeats of one strategy pooled into one row: identical features, so a repeat on both sides of a
    # split would be scored as a prediction; their spread is the noise of one measurement
    data, deviations = merge_repeats(raw)
    sigma = repeat_noise(deviations)
    sizes = np.bincount(data.group)
    shapes = sorted({c.name + (f" ({c.compute} compute)" if getattr(c, "compute", None) else "")
                     for _, c, _ in groups})
    print(f"real trials ({args.store}): {len(data.keys)} groups, {len(set(data.model_names))} models, {len(raw)} ok "
          f"trials = {len(data)} distinct strategies ({sizes.min()}-{sizes.max()} per group); clusters: "
          f"{', '.join(shapes)}; {time.perf_counter() - t0:.1f} s to load")
    ceiling = noise_ceiling(data, sigma, seed=args.seed)
    ceiling_tol = noise_ceiling(data, sigma, tol=args.tol, seed=args.seed)
    print(f"noise of one measurement (repeats, {len(deviations)} measurements of repeated strategies): "
          f"{sigma:.3f} (std of log step time); noise ceiling: pairwise {ceiling:.3f}, pw>{args.tol:.0%} "
          f"{ceiling_tol:.3f} (the noiseless truth scored against one measurement with that noise)")
    # each group's own noise where its repeats say it (>= 6 repeated measurements), else the pooled
    own = group_noise(raw)
    known = np.isfinite(own)
    ceiling_own = noise_ceiling(data, np.where(known, own, sigma), seed=args.seed)
    if known.any():
        print(f"with each group's own noise ({known.sum()} of {len(known)} groups from their own repeats, "
              f"{own[known].min():.3f}-{own[known].max():.3f}; the rest the pooled noise): noise ceiling "
              f"pairwise {ceiling_own:.3f}")
    within = _split_means(data, groups, args, "within", args.splits)
    warm = _split_means(data, groups, args, "warm", args.warm_splits) if args.warm_splits else []
    for name, part, n in (("within", within, args.splits), ("warm", warm, args.warm_splits)):
        if part:
            print(f"{name}: the mean of {n} random splits (40 % of each group held out"
                  + ("" if name == "within" else "; one group at a time, every other group whole")
                  + "); standard error of the pairwise mean over the splits: "
                  + ", ".join(f"{r['method']} {r['pairwise_acc_se']:.3f}" for r in part))
    table = within + warm + evaluate(data, _methods(groups, args.seed), seed=args.seed, tol=args.tol,
                              protocols=("lomo", "logo"))
    print(format_table(table))
    worst = _by_group(table, groups, data)
    for p in ("within", "warm"):
        if p in worst:
            print(f"{p}: the search's worst groups: " + "; ".join(
                f"{w['model']} on {w['cluster']} {w['nodes']}x{w['gbps'] * 1000:g}mbit {w['compute']} "
                f"({w['strategies']} strategies) {w['pairwise']:.2f}" for w in worst[p][:5]))
    verdicts = []
    for p, target in (("within", 0.85), ("warm", 0.85), ("lomo", 0.80)):
        if not any(r["protocol"] == p for r in table):
            continue
        r = max((r for r in table if r["protocol"] == p), key=lambda r: r["pairwise_acc"])
        verdicts.append({"target": f"{p} pairwise >= {target:.2f}", "best": r["method"], "value": r["pairwise_acc"],
                         "met": bool(r["pairwise_acc"] >= target)})
    r = min((r for r in table if r["protocol"] == "within" and np.isfinite(r["abs_error"])),
            key=lambda r: r["abs_error"])
    verdicts.append({"target": "within median |step-time error| <= 15 %", "best": r["method"],
                     "value": r["abs_error"], "met": bool(r["abs_error"] <= 0.15)})
    for v in verdicts:
        print(f"target {v['target']} (real trials; noise ceiling {ceiling:.3f}): best {v['best']} {v['value']:.3f} -> "
              f"{'MET' if v['met'] else 'MISSED'}")
    if args.out:
        from _testbed import git_commit, write_json

        write_json(args.out, {"commit": git_commit(REPO), "started_at": started, "store": args.store,
                              "groups": len(data.keys), "trials": len(raw), "strategies": len(data),
                              "clusters": shapes, "within_splits": args.splits, "warm_splits": args.warm_splits,
                              "noise_sigma": sigma, "noise_ceiling": ceiling,
                              "noise_ceiling_tol": ceiling_tol, "noise_ceiling_group_noise": ceiling_own,
                              "group_noise": [{"model": m.name, "cluster": c.name, "nodes": len(c.nodes),
                                               "gbps": c.nodes[0].bandwidth_gbps, "compute": c.compute,
                                               "noise": float(own[g]) if known[g] else None}
                                              for m, c, _ in groups
                                              for g in [data.keys.index((m.fingerprint, c.fingerprint))]],
                              "table": [{k: v for k, v in r.items() if k != "group_pairwise"} for r in table],
                              "search_by_group": worst, "targets": verdicts})
        print(f"written to {args.out}")
    print(f"total {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
