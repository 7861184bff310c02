"""Planning for a cluster before renting it (``autosync plan``, ``autosync.plan``): the strategies
the cost model predicts best for a model on a cluster described by its spec, with nothing run.

The predictor is the one ``tune`` starts from (``tuner.cost_models.predictor.Predictor``): fitted on
the warm-start dataset and the trial store, it scores every baseline builder's strategy and a
whole-space annealing search (lossless strategies only: a lossy part's cost to convergence is
measured by probes, which need the model to train). Every figure is a prediction: beside the
times quoted, the untouched analytic model's and the physical lower bound (the larger of compute
and the busiest NIC's time for the bytes a strategy moves) bound what to expect; how well such
predictions held on models and clusters never fitted on is in ``benchmarks/plan_vs_measured.py``
and ``benchmarks/published_tables.py --leave-one-out``. Compute per step comes from the model
spec's profile (measure it on the target's accelerator: ``autosync inspect --profile`` there, or a
spec of ``configs/models/nvidia-*``), else it is estimated from the parameters.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
from dataclasses import dataclass, field

import numpy as np

from strategy_space import Strategy
from strategy_space.errors import ConfigError
from strategy_space.memory import memory_floor, memory_problems

# the repository's configs (model specs measured on GPUs among them); absent from a wheel install
CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


@dataclass
class PlannedStrategy:
    """One strategy with its predictions.

    Attributes:
        origin: the builder (``ps``, ``all_reduce``, ...) or ``search``.
        strategy: the strategy.
        predicted_s: the step time the plan quotes (``Plan.predictor`` says whose).
        analytic_s: the analytic (alpha-beta) model's, untouched by any fit.
        lower_bound_s: the larger of compute and the busiest NIC's time (``step_lower_bound``).
        busiest_nic_s: the least time the busiest NIC needs for the bytes of one step.
        aliases: other builders that build the same strategy.
        memory_bytes: the largest host-memory floor of a node (``strategy_space.memory``), what the
            fullest node must hold at least.
    """

    origin: str
    strategy: Strategy
    predicted_s: float
    analytic_s: float
    lower_bound_s: float
    busiest_nic_s: float
    aliases: list[str] = field(default_factory=list)
    memory_bytes: int = 0

    def to_dict(self) -> dict:
        return {"origin": self.origin, "aliases": self.aliases, "predicted_s": self.predicted_s,
                "analytic_s": self.analytic_s, "lower_bound_s": self.lower_bound_s,
                "busiest_nic_s": self.busiest_nic_s, "memory_bytes": self.memory_bytes}


@dataclass
class Plan:
    """What ``plan`` predicts: ``ranked`` is every strategy scored, by the step time quoted, best
    first, baselines and searched ones alike.

    Attributes:
        predictor: whose step times ``ranked`` quotes and why (``learned``: the predictor fitted on
            ``trained_on`` trials of ``groups`` (model, cluster) groups, ``target_trials`` of them this
            model on this cluster; ``analytic ...``: the untouched analytic model, see ``_transfer_scorer``).
        compute_s, compute_source: the compute per step the predictions assume, and where it comes from.
        assumed: what else the predictions take on trust about the cluster, each with how to say
            it instead (``ClusterSpec.intra_node_assumption``).
        search_note: what the model's optimizer keeps out of the plan, and why (``autosync.search_limits``).
        unfit: the baselines left out as they cannot fit a node's memory (``strategy_space.memory``),
            each as (builder, the problems); the search proposes none such.
    """

    model: str
    cluster: str
    ranked: list[PlannedStrategy]
    predictor: str
    trained_on: int
    groups: int
    target_trials: int
    compute_s: float
    compute_source: str
    assumed: list[str] = field(default_factory=list)
    search_note: str = ""
    unfit: list[tuple[str, list[str]]] = field(default_factory=list)

    @property
    def best(self) -> PlannedStrategy:
        return self.ranked[0]

    @property
    def best_baseline(self) -> PlannedStrategy | None:
        """The baseline predicted fastest (None where no baseline fits the cluster's memory)."""
        return min((p for p in self.ranked if p.origin != "search"), key=lambda p: p.predicted_s, default=None)

    def to_dict(self) -> dict:
        best, base = self.best, self.best_baseline
        return {"model": self.model, "cluster": self.cluster, "predictor": self.predictor,
                "trained_on_trials": self.trained_on, "groups": self.groups, "target_trials": self.target_trials,
                "compute_s": self.compute_s, "compute_source": self.compute_source, "assumed": self.assumed,
                "search_note": self.search_note,
                "best": best.to_dict(), "best_baseline": base.to_dict() if base else None,
                "predicted_speedup_over_best_baseline": base.predicted_s / best.predicted_s if base else None,
                "ranked": [p.to_dict() for p in self.ranked],
                "unfit": [{"origin": name, "problems": problems} for name, problems in self.unfit]}

    def save(self, path: str) -> None:
        """Write the recommended strategy as a strategy YAML (``autosync run --strategy``)."""
        from strategy_space import save

        save(self.best.strategy, path)


def plan(model, cluster, *, top: int = 5, store=None, warm_start="builtin", constraints=None,
         seed: int = 0, scorer: str = "auto") -> Plan:
    """Predict the best strategies for ``model`` on ``cluster`` without running anything (module doc).

    Args:
        model: a model source (``zoo:NAME``, ``script.py:fn``, a model-spec YAML) or a ModelSpec.
        cluster: a cluster name or spec YAML (``local``, ``testbed``, a file) or a ClusterSpec.
        top: searched strategies to return besides the baselines.
        store: a trial store whose measured trials the predictor also learns from.
        warm_start: ``builtin``, ``none``, a path, or groups already loaded (see ``tune``).
        constraints: pinned decisions (a path, the YAML's content as a dict, or ``Constraints``) every
            searched strategy keeps.
        scorer: whose step times to quote: ``auto`` (``_transfer_scorer``), ``learned`` or ``analytic``.

    Raises:
        ConfigError: bad input, said before any work.
    """
    from autosync.search_limits import built_model_optimizer, search_limits
    from autosync.sources import is_trainable, load_cluster, load_model_def, load_model_spec
    from tuner.search.baseline_tuner import BaselineTuner
    from tuner.cost_models.analytic import AnalyticCostModel, lower_bound_of_row
    from tuner.features.tables import estimate_compute_s
    from tuner.records.history import History
    from tuner.records.warmstart import load_warm_start
    from tuner.search.constraints import as_constraints
    from tuner.search.model_based import ModelBasedTuner, SearchSettings

    if scorer not in ("auto", "learned", "analytic"):
        raise ConfigError(f"scorer must be auto, learned or analytic, got {scorer!r}")
    if not isinstance(top, int) or isinstance(top, bool) or not 1 <= top <= 100:
        raise ConfigError(f"top must be an integer from 1 to 100 (searched strategies to list), got {top!r}")
    cluster_spec = cluster if hasattr(cluster, "nodes") else load_cluster(cluster)
    constraints = as_constraints(constraints)
    optimizer: dict = {}   # a trainable model's optimizer: what the runtime refuses under it is not planned
    if is_trainable(model):
        spec, optimizer = built_model_optimizer(load_model_def(model))
    else:
        spec = model if hasattr(model, "variables") else load_model_spec(model)
    limits = search_limits(optimizer, constraints, {v.name for v in spec.variables if v.sparse})
    constraints = limits.constraints
    if constraints is not None and constraints.cluster_problems(cluster_spec):
        raise ConfigError(constraints.cluster_problems(cluster_spec))
    if constraints is not None and constraints.lossy_pins():
        raise ConfigError(f"the constraints pin lossy parts ({'; '.join(constraints.lossy_pins())}) but a plan "
                          f"proposes lossless strategies only (a lossy part's cost to convergence is measured by "
                          f"training: autosync tune); drop those pins to plan")
    groups = list(warm_start) if isinstance(warm_start, (list, tuple)) else load_warm_start(warm_start)
    tuner = ModelBasedTuner(spec, cluster_spec, constraints=constraints, warm_start=groups, lossless=True,
                            settings=SearchSettings(batch=top, seed=seed))
    if store is not None:
        from tuner.records.dataset import store_groups
        from tuner.records.store import open_existing_store

        with open_existing_store(str(store)) as opened:
            tuner.load_groups(store_groups(opened))
    searched = tuner.next_batch(top, History(spec, cluster_spec))   # refits the predictor on everything
    predictor = tuner.predictor
    if scorer == "auto":
        scorer = _transfer_scorer(tuner.training.trial_set(), spec, predictor)
    elif scorer == "learned" and predictor.source_ != "simulator":
        scorer = "analytic (nothing learned)"
    if scorer.startswith("analytic") and tuner.training.trial_set() is not None:
        # the times quoted are the analytic model's: its own search proposes too (the learned
        # predictor's picks are what it would have measured, not what the analytic model ranks best)
        own = ModelBasedTuner(spec, cluster_spec, constraints=constraints, lossless=True,
                              settings=SearchSettings(batch=top, seed=seed))
        searched += own.next_batch(top, History(spec, cluster_spec))
    # every builder's strategy once, projected onto the pins (``NAME+pins`` where they change it),
    # the optimizer's included: a plan recommends only what the runtime runs
    candidates: list[tuple[str, Strategy, list]] = [
        (b.origin, b.strategy, list(b.aliases))
        for b in BaselineTuner(spec, cluster_spec, constraints=constraints, lossless=True).proposals()]
    unfit = [(name, memory_problems(strategy, spec, cluster_spec)) for name, strategy, _ in candidates]
    unfit = [(name, problems) for name, problems in unfit if problems]
    left_out = {name for name, _ in unfit}
    candidates = [c for c in candidates if c[0] not in left_out]
    seen = {s.canonical().fingerprint for _, s, _ in candidates}
    for p in searched:
        key = p.strategy.canonical().fingerprint
        if key not in seen:
            seen.add(key)
            candidates.append(("search", p.strategy, []))
    if not candidates:
        name, problems = min(unfit, key=lambda u: len(u[1]))
        raise ConfigError([f"no strategy of model {spec.name} fits the memory of cluster {cluster_spec.name}: no "
                           f"baseline does and the search found none; what {name} needs:"] + problems)
    encoded = tuner.space.encode([s for _, s, _ in candidates])
    X = predictor.features(encoded)
    analytic = AnalyticCostModel().predict(X)
    # by predicted step time: a plan quotes times (the search's ranker only picks what to measure)
    seconds = analytic if scorer.startswith("analytic") else predictor.predict(encoded, X)
    order = np.argsort(seconds, kind="stable")
    ranked, searched_outlines = [], {}
    for i in order:
        name, strategy, aliases = candidates[i]
        if name == "search":   # searched strategies alike in outline and time within 1 %: the first stands for all
            alike = searched_outlines.setdefault(outline(strategy), [])
            if any(abs(seconds[i] / s - 1) < 0.01 for s in alike):
                continue
            alike.append(float(seconds[i]))
        bound = lower_bound_of_row(X[i])
        ranked.append(PlannedStrategy(name, dataclasses.replace(strategy, origin=name), float(seconds[i]),
                                      float(analytic[i]), bound["overlapped_s"], bound["busiest_nic_s"], aliases,
                                      max(f.host_bytes for f in memory_floor(strategy, spec, cluster_spec))))
    learned = getattr(predictor, "n_trials_", 0)
    return Plan(model=spec.name, cluster=cluster_spec.name, ranked=ranked, predictor=scorer,
                trained_on=int(learned), groups=int(getattr(predictor, "n_groups_", 0)),
                target_trials=int(getattr(predictor, "n_target_", 0)),
                compute_s=float(estimate_compute_s(spec) * cluster_spec.compute_dilation),
                compute_source=compute_source(spec, cluster_spec),
                assumed=cluster_spec.assumptions(), search_note=limits.search_note, unfit=unfit)


def compute_source(spec, cluster) -> str:
    """Where the compute per step a prediction assumes comes from (``plan``, ``simulate``): the
    spec's profile, or an estimate from the parameters, said with what to give instead; on a
    cluster with GPUs, the specs AutoSync ships measured on GPUs of this model, if any."""
    from tuner.features.tables import ESTIMATE_FLOPS

    if spec.profile is not None and spec.profile.step_time_s > 0:
        device = spec.profile.device
        if device.startswith("cpu") and any(n.gpus for n in cluster.nodes):
            return (f"the model spec's profile, measured on {device} though this cluster has GPUs: measure it on "
                    f"the cluster's accelerator, `autosync inspect --profile --out` there")
        return "the model spec's profile" + (f" ({device})" if device and device != "unknown" else "")
    return _estimated(spec, cluster, ESTIMATE_FLOPS)


def _estimated(spec, cluster, flops: float) -> str:
    said = (f"estimated from the parameters at {flops / 1e9:g} GFLOP/s: the model spec has no profile; "
            f"measure one on the cluster's accelerator, `autosync inspect --profile --out`")
    if not any(n.gpus for n in cluster.nodes):
        return said
    shipped = sorted(glob.glob(os.path.join(CONFIGS, "models", "*", f"{glob.escape(spec.name)}.yaml")))
    measured = [p for p in shipped if _same_variables(p, spec)]
    also = (f", or give the spec of this model measured on a GPU: {', '.join(_shown(p) for p in measured)}"
            if measured else "")
    return said.replace("GFLOP/s:", "GFLOP/s, a CPU's rate though this cluster has GPUs:", 1) + also


def _shown(path: str) -> str:
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def _same_variables(path: str, spec) -> bool:
    from strategy_space.yaml_io import load

    try:
        shipped = load(path, "model")
    except ConfigError:
        return False
    return [(v.name, v.shape) for v in shipped.variables] == [(v.name, v.shape) for v in spec.variables]


_JUDGED: dict = {}   # (training data, protocol, seed) -> pairwise accuracy of each scorer


def _transfer_scorer(data, spec, predictor) -> str:
    """Whose step times a plan quotes: with trials of this model on this cluster, the scorer the
    predictor chose on them (``Predictor.fit``); without, the analytic model or the learned
    simulator, whichever ordered held-out groups better in the training data, held out as this
    target stands: leave one model out for a model no group holds, else leave one cluster out (the
    same protocols as ``benchmarks/simulator_accuracy.py``). Returns the scorer with why, the
    accuracies it was judged by included."""
    from tuner.cost_models.evaluation import evaluate, predictors

    if data is None or not len(data):
        return "analytic (nothing measured to learn from)"
    if predictor.n_target_:
        return "learned" if predictor.source_ == "simulator" else "analytic (fitted on this model and cluster)"
    protocol = "lomo" if spec.name not in set(data.model_names) else "logo"
    if len(set(data.model_names if protocol == "lomo" else [k[1] for k in data.keys])) < 2:
        return "learned"
    key = (tuple(data.keys), len(data), float(np.sum(data.y)), protocol, predictor.seed)
    acc = _JUDGED.get(key)
    if acc is None:   # a few seconds (a simulator fit per held-out model or cluster): once per process
        methods = predictors(seed=predictor.seed)
        rows = evaluate(data, {k: methods[k] for k in ("analytic (default)", "simulator (ratio)")},
                        protocols=(protocol,))
        acc = _JUDGED[key] = {r["method"]: r["pairwise_acc"] for r in rows}
    held = "leave one model out" if protocol == "lomo" else "leave one cluster out"
    # each figure named: the sentence's subject is the winner, and a bare "A against B" read backwards
    why = (f"pairwise order {acc['simulator (ratio)']:.3f} learned, {acc['analytic (default)']:.3f} analytic, "
           f"{held} on the trials learned from")
    if acc["analytic (default)"] > acc["simulator (ratio)"]:
        return f"analytic (it ranked held-out groups better than the learned simulator: {why})"
    return f"learned (it ranked held-out groups at least as well as the analytic model: {why})"


def outline(strategy: Strategy) -> str:
    """A strategy in a few words: what goes to parameter servers and what is all-reduced."""
    from strategy_space import PS

    ps_vars = ar_vars = shards = 0
    hosts, groups, extras = set(), set(), set()
    for vc in strategy.variables:
        kinds = {isinstance(s, PS) for s in vc.synchronizers}
        ps_vars += True in kinds
        ar_vars += False in kinds
        for s in vc.synchronizers:
            if isinstance(s, PS):
                shards += 1
                hosts.add(s.destination)
                if s.local_replication:
                    extras.add("local replication")
            else:
                groups.add(s.group)
                if s.hierarchical:
                    extras.add("hierarchical")
    parts = []
    if ps_vars:
        parts.append(f"PS: {ps_vars} var{'s' * (ps_vars > 1)}, {shards} shard{'s' * (shards > 1)} on {len(hosts)} "
                     f"node{'s' * (len(hosts) > 1)}")
    if ar_vars:
        parts.append(f"AR: {ar_vars} var{'s' * (ar_vars > 1)} in {len(groups)} group{'s' * (len(groups) > 1)}")
    return "; ".join(parts + sorted(extras))


def format_plan(p: Plan) -> str:
    """The plan as the command prints it."""
    from autosync.formatting import human_bytes, table

    def ms(s: float) -> str:
        return f"{s * 1e3:.1f} ms" if s < 10 else f"{s:.2f} s"

    best = p.best_baseline.predicted_s if p.best_baseline else None
    rows = [(("best: " if i == 0 else "") + r.origin + (f" (= {', '.join(r.aliases)})" if r.aliases else ""),
             outline(r.strategy), ms(r.predicted_s), ms(r.analytic_s), ms(r.lower_bound_s),
             f"{best / r.predicted_s:.2f}x" if best else "-", human_bytes(r.memory_bytes))
            for i, r in enumerate(p.ranked)]
    learned = (f"{p.predictor}; learned from {p.trained_on} measured trials of {p.groups} (model, cluster) groups, "
               f"{p.target_trials} of them this model on this cluster" if p.trained_on else p.predictor)
    return "\n".join([
        f"{p.model} on {p.cluster}: predicted, nothing run (compute {ms(p.compute_s)} a step, {p.compute_source})",
        table(("strategy", "outline", "predicted step", "analytic", "lower bound", "vs best baseline",
               "fullest node"), rows, right=(2, 3, 4, 5, 6)),
        f"predictor: {learned}; lossless strategies only (a lossy part's cost to convergence needs the model "
        f"to train: `autosync tune`); measure before trusting a gain (`autosync run`)",
    ] + [f"assumed: {a}" for a in p.assumed] + ([p.search_note] if p.search_note else [])
      + [f"does not fit, left out: {name}: {'; '.join(problems)}" for name, problems in p.unfit])


def plan_json(p: Plan) -> str:
    return json.dumps(p.to_dict(), indent=2)
