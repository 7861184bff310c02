"""``autosync simulate``: predicted step time of a strategy, or the accuracy table of a store.

    autosync simulate --model M --cluster C --strategy FILE|BUILDER [--json] [--store STORE]
    autosync simulate --eval STORE

Without ``--store`` the prediction is the analytic (alpha-beta) model; with a store holding at
least 10 ok trials it is the learned simulator trained on them.
"""
from __future__ import annotations

import json

from strategy_space.errors import ConfigError


def register(sub) -> None:
    p = sub.add_parser("simulate", help="predict a strategy's step time, or evaluate the predictors on a store",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="zoo:NAME, script.py:fn or a model-spec YAML")
    p.add_argument("--cluster", help="local, testbed or a cluster-spec YAML")
    p.add_argument("--strategy", metavar="FILE|BUILDER",
                   help="strategy YAML file, or a builder's name (ps, all_reduce, ...: the strategy `autosync build` "
                        "makes for this model and cluster)")
    p.add_argument("--store", help="trial store to train the learned simulator on")
    p.add_argument("--eval", metavar="STORE", help="print the evaluation table of the predictors on STORE")
    p.add_argument("--json", action="store_true", help="print JSON (step_time_s in seconds)")
    p.set_defaults(func=run)


def _open_store(path: str):
    from tuner.records.store import open_existing_store

    return open_existing_store(path)


def _evaluate(args) -> int:
    from tuner.records.dataset import build_trial_set, store_groups
    from tuner.cost_models.evaluation import evaluate, format_table

    with _open_store(args.eval) as store:
        groups = store_groups(store)
    try:
        data = build_trial_set(groups)
    except ValueError as e:
        raise ConfigError(f"{args.eval}: {e}; the store needs ok trials with their model and cluster specs") from None
    protocols = ("within", "lomo") if len(set(data.model_names)) > 1 else ("within",)
    rows = evaluate(data, protocols=protocols)
    print(json.dumps(rows, indent=2) if args.json else format_table(rows))
    return 0


def run(args) -> int:
    if args.eval:
        return _evaluate(args)
    missing = [f"--{n}" for n in ("model", "cluster", "strategy") if not getattr(args, n)]
    if missing:
        raise ConfigError(f"simulate needs {', '.join(missing)} (or --eval STORE)")
    from autosync.planning import compute_source
    from autosync.sources import load_cluster, load_model_spec, load_strategy_for
    from strategy_space import validate
    from strategy_space.builders import strategy_or_builder
    from strategy_space.space import StrategySpace
    from tuner.cost_models.analytic import AnalyticCostModel
    from tuner.features.tables import FeatureTables
    from tuner.features.batch import COL, featurize

    # the cluster and a strategy file (or a builder's name) are checked before the model is built
    cluster, strategy = load_cluster(args.cluster), strategy_or_builder(args.strategy)
    model = load_model_spec(args.model)
    strategy = validate(load_strategy_for(strategy, model, cluster), model, cluster)
    X = featurize(FeatureTables.from_specs(model, cluster), StrategySpace(model, cluster).encode([strategy]))
    predictor, step = "analytic", float(AnalyticCostModel().predict(X)[0])
    if args.store:
        from tuner.records.dataset import build_trial_set, store_groups
        from tuner.cost_models.simulator import LearnedSimulator

        with _open_store(args.store) as store:
            groups = store_groups(store)
        if groups:
            data = build_trial_set(groups)
            sim = LearnedSimulator().fit(data.X, data.y)
            step = float(sim.predict(X)[0])
            predictor = "learned" if sim.regressor_ is not None else "analytic (fitted)"
    keys = ("compute_s", "comm_s", "wire_s", "nic_in_s", "nic_out_s", "intra_s", "ar_ring_s", "exposed_frac",
            "ps_share", "ps_messages", "ar_collectives", "ps_push_max_node_bytes", "ar_wire_bytes", "cpu_s",
            "cpu_bytes_max", "ps_calls_max", "ar_curve_s", "ring_steps", "nccl_ring_steps", "ring_steps_objectstore",
            "ps_latency_rounds")
    breakdown = {k: float(X[0, COL[k]]) for k in keys}
    result = {"model": model.name, "cluster": cluster.name, "predictor": predictor, "step_time_s": step,
              "samples_per_s": model.batch_size * cluster.num_workers / step if step > 0 else None,
              "breakdown": breakdown, "compute_source": compute_source(model, cluster),
              "assumed": cluster.assumptions()}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{model.name} on {cluster.name}: predicted step time {step * 1e3:.2f} ms ({predictor})")
        for k, v in breakdown.items():
            print(f"  {k:<24} {v:.6g}")
        print(f"compute: {result['compute_source']}")
        for a in result["assumed"]:
            print(f"assumed: {a}")
    return 0
