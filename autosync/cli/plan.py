"""``autosync plan``: the strategies predicted best for a model on a cluster, nothing run.

    autosync plan --model M --cluster C [--top K] [--out FILE] [--store STORE] [--warm-start W]
                  [--constraints FILE] [--json]
"""
from __future__ import annotations

import argparse

from autosync.sources import MODEL_FORMS


def register(sub) -> None:
    p = sub.add_parser(
        "plan", help="predict the best strategies for a model on a cluster (a spec: nothing is run)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Predict, without running anything, which strategies are fastest for a model on a cluster "
                    "described by its spec (plan before renting it): every baseline builder's strategy and the best "
                    "of a search, scored by the cost model tune starts from, beside the analytic model and the "
                    f"physical lower bound. MODEL is {MODEL_FORMS}; give a model spec with a profile measured on the "
                    f"cluster's accelerator (e.g. configs/models/nvidia-h200/) for its compute.")
    p.add_argument("--model", required=True, metavar="MODEL", help="the model source")
    p.add_argument("--cluster", required=True, metavar="C", help="a cluster-spec YAML (or local, testbed)")
    p.add_argument("--top", type=int, default=5, help="searched strategies to list besides the baselines (default 5)")
    p.add_argument("--out", metavar="FILE", help="write the best predicted strategy as YAML (autosync run --strategy)")
    p.add_argument("--store", metavar="STORE", help="a trial store whose measured trials the predictor also learns from")
    p.add_argument("--warm-start", default="builtin", metavar="W",
                   help="trials the predictor learns from: builtin (default), none, or a store path")
    p.add_argument("--constraints", metavar="FILE", help="YAML of pinned decisions every searched strategy keeps")
    p.add_argument("--json", action="store_true", help="print JSON (seconds) instead of the table")
    p.set_defaults(func=run)


def run(args) -> int:
    from autosync.cli.paths import check_output_file
    from autosync.planning import format_plan, plan, plan_json

    if args.out:
        check_output_file(args.out, "--out")
    result = plan(args.model, args.cluster, top=args.top, store=args.store, warm_start=args.warm_start,
                  constraints=args.constraints)
    print(plan_json(result) if args.json else format_plan(result))
    if args.out:
        result.save(args.out)
        if not args.json:
            print(f"best predicted strategy written to {args.out}")
    return 0
