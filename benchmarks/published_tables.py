"""The analytic model against published measurements of clusters we cannot build.

Each YAML under ``benchmarks/published/`` encodes one published comparison of synchronization
strategies on one model and cluster: the source (citation, where, the quoted figures, notes on what
does not map exactly), the ModelSpec, the compute time per step (with how it follows from published
figures), the ClusterSpec, and per strategy a builder (``none``: the compute alone, what a scaling
efficiency compares with) with its options and its published step time relative to a reference
strategy.

Default mode: the analytic model predicts every strategy with its default (physical, unfitted)
constants; per table this prints predicted vs published relative step times, the pairwise order
agreement and each ratio's error (issue 16's targets).

``--leave-one-out`` (issue 27): for each table in turn, the model's parameters are fitted on every
other table's relative step times and the held-out table is scored with them. How strongly the
fit is pulled towards the physical defaults (the ridge) is itself chosen on the other tables: by a
leave-one-out within them, the strength whose held-out tables come out best (``--ridge R`` fixes
it instead). Per table and overall it prints the pairwise order agreement and the median ratio error, beside the untouched
(default-parameter) model's. Pairs whose published figures are closer than ``--min-gap`` (5 %) are
excluded in both modes.

    python benchmarks/published_tables.py [--dir benchmarks/published] [--leave-one-out [--ridge R]] [--json out.json]
"""
from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _published import (MIN_GAP, RIDGES, TableTerms, fit_params_selected, leave_one_out, load_table,  # noqa: E402
                        params_dict,
                        score, summary)
from _testbed import write_json  # noqa: E402
from strategy_space.errors import ConfigError  # noqa: E402
from tuner.features.alpha_beta import AlphaBeta  # noqa: E402

ORDER_TARGET, RATIO_TOLERANCE = 0.9, 0.25                        # issue 16 (default mode)
LOO_ORDER, LOO_TABLE_ORDER, LOO_TABLE_MIN_PAIRS, LOO_MEDIAN = 0.90, 0.75, 3, 0.20   # issue 27


def _print_table(r: dict, citation: str, extra: dict | None = None) -> None:
    print(f"\n{r['table']}\n  {citation.strip()}")
    head = f"  {'strategy':<24} {'predicted s':>11} {'pred rel':>9} {'published rel':>14} {'ratio error':>12}"
    print(head + (f" {'untouched rel':>14}" if extra else ""))
    errors = iter(r["ratio_errors"])
    for k, (name, s, p, q) in enumerate(zip(r["strategies"], r["predicted_s"], r["predicted"], r["published"])):
        err = "reference" if q == 1.0 and p == 1.0 else f"{next(errors):+.1%}"
        line = f"  {name:<24} {s:>11.4f} {p:>9.3f} {q:>14.3f} {err:>12}"
        print(line + (f" {extra['predicted'][k]:>14.3f}" if extra else ""))


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def run_default(tables, terms, min_gap) -> dict:
    results = []
    for table, tt in zip(tables, terms):
        r = score(tt, AlphaBeta(), min_gap)
        r["citation"] = table["source"]["citation"]
        results.append(r)
        _print_table(r, r["citation"])
        within = all(abs(e) <= RATIO_TOLERANCE for e in r["ratio_errors"])
        print(f"  order agreement {r['pairs_agreeing']}/{r['pairs']}; ratios within +-{RATIO_TOLERANCE:.0%}: "
              f"{_verdict(within)}")
    s = summary(results)
    print(f"\nall tables: {s['tables']} tables, {s['pairs']} published pairs (closer than {min_gap:.0%} excluded)")
    print(f"target pairwise order agreement >= {ORDER_TARGET}: {s['order_agreement']:.3f} -> "
          f"{_verdict(s['order_agreement'] >= ORDER_TARGET)}")
    print(f"target ratios within +-{RATIO_TOLERANCE:.0%}: worst {s['worst_abs_ratio_error']:.1%} -> "
          f"{_verdict(s['worst_abs_ratio_error'] <= RATIO_TOLERANCE)}")
    return {"tables": results, "order_agreement": s["order_agreement"],
            "worst_ratio_error": s["worst_abs_ratio_error"], "median_abs_ratio_error": s["median_abs_ratio_error"]}


def run_leave_one_out(tables, terms, min_gap, ridge: float | None = None) -> dict:
    """``ridge``: a fixed ridge strength; None (default) chooses it per held-out table by
    leave-one-out within the other tables (``_published.fit_params_selected``)."""
    untouched = [score(tt, AlphaBeta(), min_gap) for tt in terms]
    fit = (lambda train: fit_params_selected(train, min_gap)) if ridge is None else \
        (lambda train: fit_params_selected(train, min_gap, ridges=[ridge]))
    loo = leave_one_out(terms, fit, lambda tt, f: score(tt, f.params, min_gap))
    rows = []
    for table, r, u in zip(tables, loo, untouched):
        selected = r.pop("fitted")
        chosen, fitted = selected.ridge, selected.params
        _print_table(r, table["source"]["citation"], extra=u)
        print(f"  leave-one-out: order {r['pairs_agreeing']}/{r['pairs']}, median |ratio error| "
              f"{r['median_abs_ratio_error']:.1%}   untouched: order {u['pairs_agreeing']}/{u['pairs']}, "
              f"median |ratio error| {u['median_abs_ratio_error']:.1%}")
        print(f"  fitted on the other tables (ridge {chosen:g}): "
              + ", ".join(f"{k}={v:.3g}" for k, v in params_dict(fitted).items()))
        rows.append({"table": r["table"], "citation": table["source"]["citation"], "strategies": r["strategies"],
                     "published": r["published"], "pairs": r["pairs"],
                     "leave_one_out": {k: r[k] for k in ("predicted", "predicted_s", "pairs_agreeing", "ratio_errors",
                                                         "median_abs_ratio_error")} | {"params": params_dict(fitted), "ridge": chosen},
                     "untouched": {k: u[k] for k in ("predicted", "predicted_s", "pairs_agreeing", "ratio_errors",
                                                     "median_abs_ratio_error")}})
    s_loo, s_unt = summary(loo), summary(untouched)
    chosen_all = fit(terms)
    all_fit = params_dict(chosen_all.params) | {"ridge": chosen_all.ridge,
                                                "inner_median_abs_ratio_error": chosen_all.inner_errors}
    print(f"\n{len(tables)} tables, {s_loo['pairs']} published pairs (closer than {min_gap:.0%} excluded)")
    print(f"{'':<34} {'leave-one-out':>14} {'untouched':>10}")
    print(f"{'pairwise order agreement':<34} {s_loo['order_agreement']:>14.3f} {s_unt['order_agreement']:>10.3f}")
    print(f"{'median |ratio error|':<34} {s_loo['median_abs_ratio_error']:>14.3f} "
          f"{s_unt['median_abs_ratio_error']:>10.3f}")
    weak = [r for r in loo if r["pairs"] >= LOO_TABLE_MIN_PAIRS]
    worst = min((r["pairs_agreeing"] / r["pairs"] for r in weak), default=float("nan"))
    print(f"target overall order >= {LOO_ORDER}: {s_loo['order_agreement']:.3f} -> "
          f"{_verdict(s_loo['order_agreement'] >= LOO_ORDER)}")
    print(f"target order >= {LOO_TABLE_ORDER} on every table with >= {LOO_TABLE_MIN_PAIRS} pairs ({len(weak)} tables): "
          f"worst {worst:.3f} -> {_verdict(worst >= LOO_TABLE_ORDER)}")
    print(f"target median |ratio error| <= {LOO_MEDIAN}: {s_loo['median_abs_ratio_error']:.3f} -> "
          f"{_verdict(s_loo['median_abs_ratio_error'] <= LOO_MEDIAN)}")
    print("parameters fitted on all tables (for reference, never used to score): "
          + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in all_fit.items()))
    return {"min_gap": min_gap, "tables": rows, "leave_one_out": s_loo, "untouched": s_unt,
            "worst_table_order_leave_one_out": worst, "params_fitted_on_all_tables": all_fit,
            "defaults": params_dict(AlphaBeta()),
            "targets": {"order_overall": LOO_ORDER, "order_per_table": LOO_TABLE_ORDER,
                        "per_table_min_pairs": LOO_TABLE_MIN_PAIRS, "median_abs_ratio_error": LOO_MEDIAN}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=os.path.join(REPO, "benchmarks", "published"))
    ap.add_argument("--leave-one-out", action="store_true",
                    help="fit the model's parameters on all tables but one, score that one, for each table")
    ap.add_argument("--min-gap", type=float, default=MIN_GAP,
                    help="exclude pairs whose published figures differ by less than this fraction (default 0.05)")
    ap.add_argument("--ridge", type=float, default=None,
                    help="--leave-one-out with this fixed ridge strength (default: chosen for each held-out table "
                         "by leave-one-out within the other tables)")
    ap.add_argument("--json", help="write the results here (with the commit and start time of the run)")
    args = ap.parse_args(argv)
    if args.ridge is not None and not (args.ridge >= 0 and np.isfinite(args.ridge)):
        print(f"--ridge must be a finite number >= 0, got {args.ridge}", file=sys.stderr)
        return 2
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or None
    paths = sorted(glob.glob(os.path.join(args.dir, "*.yaml")))
    if not paths:
        print(f"no published tables under {args.dir}", file=sys.stderr)
        return 2
    tables = []
    for path in paths:
        try:
            tables.append(load_table(path))
        except ConfigError as e:
            print(f"published_tables.py: error: {e}", file=sys.stderr)
            return 2
        except (KeyError, TypeError, ValueError, AttributeError) as e:   # a field of the wrong kind
            print(f"published_tables.py: error: {path}: a field is missing or of the wrong kind ({type(e).__name__}: "
                  f"{e}); the tables under benchmarks/published/ show each field", file=sys.stderr)
            return 2
    terms = [TableTerms.of(t) for t in tables]
    if args.leave_one_out:
        out = {"commit": commit, "run_started": started, "mode": "leave_one_out"} | run_leave_one_out(
            tables, terms, args.min_gap, args.ridge) | {"ridge": args.ridge if args.ridge is not None else
                                                        "chosen by inner leave-one-out from " + str(list(RIDGES))}
    else:
        out = {"commit": commit, "started": started, "min_gap": args.min_gap} | run_default(tables, terms, args.min_gap)
    if args.json:
        write_json(args.json, out, default=lambda x: x.tolist() if isinstance(x, np.ndarray) else float(x))
    return 0


if __name__ == "__main__":
    sys.exit(main())
