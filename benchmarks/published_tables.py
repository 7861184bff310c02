"""The analytic model against published measurements of clusters we cannot build.

Each YAML under ``benchmarks/published/`` encodes one published comparison of synchronization
strategies on one model and cluster: the source (paper, table or figure, the quoted figures), the
ModelSpec, the compute time per step (with how it follows from published constants), the
ClusterSpec, and per strategy a builder (``none``: the compute alone, what a scaling efficiency
compares with) and its published step time relative to a reference
strategy. The analytic model predicts every strategy with its default (physical, unfitted)
constants; per table this prints predicted vs published relative step times, the pairwise order
agreement and each ratio's error. The tables are the test, never training data.

Targets (issue 16): pairwise order agreement >= 0.9 over all tables; every predicted ratio within
+-25 % of the published one.

    python benchmarks/published_tables.py [--dir benchmarks/published] [--json out.json]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time
from dataclasses import replace

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from strategy_space import ClusterSpec, ComputeProfile, ConfigError, load_model_spec  # noqa: E402
from strategy_space.builders import get_builder  # noqa: E402
from strategy_space.space import StrategySpace  # noqa: E402
from strategy_space.yaml_io import parse_text, read_text  # noqa: E402
from tuner.cost_model import AnalyticCostModel  # noqa: E402

ORDER_TARGET, RATIO_TOLERANCE = 0.9, 0.25
TABLE_KEYS = {"source", "model", "batch_size", "compute", "cluster", "reference", "strategies"}


def load_table(path: str) -> dict:
    """A published table: its specs built and its strategies built by their builders.

    Raises:
        ConfigError: a missing or unknown key, a reference that is not a strategy, a bad spec.
    """
    data = parse_text(read_text(path), path) or {}
    keys = set(data)
    if keys != TABLE_KEYS:
        raise ConfigError(f"{path}: keys must be {sorted(TABLE_KEYS)}; missing {sorted(TABLE_KEYS - keys)}, "
                          f"unknown {sorted(keys - TABLE_KEYS)}")
    model = load_model_spec(os.path.join(os.path.dirname(path), data["model"]))
    model = replace(model, batch_size=int(data["batch_size"]),
                    profile=ComputeProfile(float(data["compute"]["step_time_s"]), device="published constants"))
    cluster = ClusterSpec.from_dict(data["cluster"])
    rows = data["strategies"]
    names = [r["name"] for r in rows]
    if data["reference"] not in names:
        raise ConfigError(f"{path}: reference {data['reference']!r} is not one of the strategies {names}")
    # builder "none": the same compute without any communication (what scaling efficiency compares with)
    strategies = [None if r["builder"] == "none" else get_builder(r["builder"], **(r.get("options") or {})).build(
        model, cluster) for r in rows]
    return {"path": os.path.relpath(path, REPO), "source": data["source"], "model": model, "cluster": cluster,
            "reference": data["reference"], "names": names, "strategies": strategies,
            "published": np.array([float(r["published"]) for r in rows])}


def score(table: dict) -> dict:
    """Predicted vs published step times relative to the reference, order agreement, ratio errors."""
    model, cluster = table["model"], table["cluster"]
    synced = [s for s in table["strategies"] if s is not None]
    predicted_s = np.full(len(table["strategies"]), model.profile.step_time_s)
    if synced:
        enc = StrategySpace(model, cluster).encode(synced)
        at = [i for i, s in enumerate(table["strategies"]) if s is not None]
        predicted_s[at] = AnalyticCostModel().predict_strategies(model, cluster, enc)
    ref = table["names"].index(table["reference"])
    predicted = predicted_s / predicted_s[ref]
    published = table["published"] / table["published"][ref]
    agree = total = 0
    n = len(published)
    for i in range(n):
        for j in range(i + 1, n):
            if published[i] == published[j]:
                continue   # a published tie orders nothing
            total += 1
            agree += (predicted[i] - predicted[j]) * (published[i] - published[j]) > 0
    others = [i for i in range(n) if i != ref]
    errors = predicted[others] / published[others] - 1.0
    return {"table": table["path"], "citation": table["source"]["citation"], "strategies": table["names"],
            "predicted_s": predicted_s.tolist(), "predicted": predicted.tolist(), "published": published.tolist(),
            "pairs": total, "pairs_agreeing": int(agree), "ratio_errors": errors.tolist()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=os.path.join(REPO, "benchmarks", "published"))
    ap.add_argument("--json", help="write the results here (with the commit and start time of the run)")
    args = ap.parse_args(argv)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    paths = sorted(glob.glob(os.path.join(args.dir, "*.yaml")))
    if not paths:
        print(f"no published tables under {args.dir}", file=sys.stderr)
        return 2
    results = []
    for path in paths:
        r = score(load_table(path))
        results.append(r)
        print(f"\n{r['table']}\n  {r['citation'].strip()}")
        print(f"  {'strategy':<18} {'predicted s':>11} {'pred rel':>9} {'published rel':>14} {'ratio error':>12}")
        errors = iter(r["ratio_errors"])
        for name, s, p, q in zip(r["strategies"], r["predicted_s"], r["predicted"], r["published"]):
            err = "reference" if q == 1.0 and p == 1.0 else f"{next(errors):+.1%}"
            print(f"  {name:<18} {s:>11.4f} {p:>9.3f} {q:>14.3f} {err:>12}")
        within = all(abs(e) <= RATIO_TOLERANCE for e in r["ratio_errors"])
        print(f"  order agreement {r['pairs_agreeing']}/{r['pairs']}; ratios within +-{RATIO_TOLERANCE:.0%}: "
              f"{'met' if within else 'MISSED'}")
    pairs = sum(r["pairs"] for r in results)
    agree = sum(r["pairs_agreeing"] for r in results)
    errors = np.concatenate([r["ratio_errors"] for r in results])
    overall = agree / pairs if pairs else float("nan")
    print(f"\nall tables: {len(results)} tables, {pairs} published pairs")
    print(f"target pairwise order agreement >= {ORDER_TARGET}: {overall:.3f} -> "
          f"{'met' if overall >= ORDER_TARGET else 'MISSED'}")
    print(f"target ratios within +-{RATIO_TOLERANCE:.0%}: worst {np.abs(errors).max():.1%} -> "
          f"{'met' if np.abs(errors).max() <= RATIO_TOLERANCE else 'MISSED'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"commit": commit, "started": started, "tables": results,
                       "order_agreement": overall, "worst_ratio_error": float(np.abs(errors).max())}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
