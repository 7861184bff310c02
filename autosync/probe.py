"""Statistical-efficiency probes: train a lossy strategy and its lossless twin from the same
initial weights on the same data, and estimate how many lossless steps one of its steps is worth
(``tuner.records.goodput``).

A probe trains with the runtime's ``Trainer``, so it runs the user's own model, loss, optimizer
and data on real workers. The twin of every lossy strategy trains as one process on the global
batch (the runtime holds every lossless strategy to that), so one twin curve per (model, workers,
steps, seed) serves every candidate: it is stored once and reused, and in a tuning run it is
trained with the fastest lossless strategy measured (on a slow network the candidate's own twin,
uncompressed, can be several times slower). Probes are stored in the trial
store under ``tuner.records.goodput.probe_cache_key`` — per model, how it trains (its layers, initial
weights, loss, optimizer and data: ``autosync.models.training_key``) and lossy parts; for staleness
and asynchrony, whose effect depends on timing, per cluster too — and a probe found there is not run
again.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import time

from strategy_space import ClusterSpec, ModelSpec, Strategy
from strategy_space.errors import ConfigError, short_repr
from tuner.records.goodput import (DEFAULT_PROBE_STEPS, EXACT, Efficiency, LossyParts, Prober, ProbeResult, estimate_efficiency,
                           lossless_twin, lossy_parts, probe_cache_key, probe_model_key)

# the lossy-parts key under which a twin curve is stored (a lossless "candidate")
_TWIN = LossyParts()


def seeded(model_def, seed: int | None):
    """``model_def`` with initial weights from ``seed`` and, where its data generator takes a
    ``seed`` keyword (the zoo's do), its data too; unchanged for None."""
    if seed is None or seed == model_def.seed and not _takes_seed(model_def.dataset_fn):
        return model_def
    data = model_def.dataset_fn
    if _takes_seed(data):
        data = functools.partial(data.func, *data.args, **{**data.keywords, "seed": int(seed)})
    return dataclasses.replace(model_def, seed=int(seed), dataset_fn=data)


def _takes_seed(fn) -> bool:
    if not isinstance(fn, functools.partial):
        return False
    try:
        return "seed" in inspect.signature(fn.func).parameters
    except (TypeError, ValueError):
        return False


def train_losses(model_def, strategy: Strategy, cluster: ClusterSpec, steps: int, *, pool=None,
                 timeout_s: float = 600.0) -> tuple[list[float], float]:
    """Per-step losses of ``steps`` steps of ``strategy`` from the model's initial weights, and
    the seconds the steps took (start-up excluded)."""
    from autosync.runtime.trainer import Trainer

    with Trainer(model_def, strategy, cluster, pool=pool, timeout_s=timeout_s) as trainer:
        t0 = time.perf_counter()
        history = trainer.fit(steps, steps_per_call=min(50, max(1, steps)))
        return list(history.loss), time.perf_counter() - t0


class TrainingProber(Prober):
    """Probes by training on a cluster, cached in a trial store.

    Args:
        model_def: the trainable model (a ModelDef).
        model_spec: its ModelSpec (names the model in the cache, ``probe_model_key``).
        cluster: where the probes train (real compute).
        steps: steps each of the candidate and the twin trains.
        seed: seed of initial weights and data (None: the model's own).
        store: a TrialStore to read and write probes (None: no cache beyond this object).
        pool: warm workers to train on (a ``RayRunner``'s), else each probe starts its own.
        note: what the probes rest on, said in the outputs.
        on_result: called with each ProbeResult measured here (not those found in the cache).
        on_target: the probes train on the workers whose step times are measured (real compute),
            so staleness and asynchrony, whose effect depends on timing, can be probed.
    """

    def __init__(self, model_def, model_spec, cluster: ClusterSpec, *, steps: int = DEFAULT_PROBE_STEPS,
                 seed: int | None = None, store=None, pool=None, note: str = "", timeout_s: float = 600.0,
                 on_result=None, on_target: bool = False):
        if not (isinstance(steps, int) and steps >= 10):
            raise ConfigError(f"probe steps must be an integer >= 10 (the loss is smoothed over a tenth of them), "
                              f"got {steps!r}")
        self.model_def = seeded(model_def, seed)
        self.seed = self.model_def.seed
        self.model_key = probe_model_key(model_spec)
        self.cluster = cluster
        self.steps = steps
        self.store, self.pool, self.note, self.timeout_s = store, pool, note, timeout_s
        self.on_result = on_result
        self.on_target = on_target
        self.workers = len(cluster.devices)
        self._memo: dict[str, ProbeResult] = {}
        self._lossless: Strategy | None = None
        self._training: str | None = None

    @property
    def training(self) -> str:
        """The digest of how the model trains (``training_digest``), computed on first use."""
        if self._training is None:
            from autosync.models.training_key import training_digest

            self._training = training_digest(self.model_def, self.workers)
        return self._training

    @property
    def training_known(self) -> str | None:
        return self._training

    def _key(self, parts: LossyParts) -> str:
        return probe_cache_key(self.model_key, parts, self.workers, self.steps, self.seed, self.cluster.fingerprint,
                               self.training)

    def _cached(self, key: str) -> ProbeResult | None:
        if key in self._memo:
            return self._memo[key]
        found = self.store.probe(key) if self.store is not None else None
        if found is not None:
            self._memo[key] = found
        return found

    def _keep(self, key: str, result: ProbeResult) -> None:
        self._memo[key] = result
        if self.store is not None:
            self.store.add_probe(key, result)

    def _train(self, strategy: Strategy) -> tuple[list[float], float]:
        return train_losses(self.model_def, strategy, self.cluster, self.steps, pool=self.pool, timeout_s=self.timeout_s)

    def use_lossless(self, strategy: Strategy) -> None:
        if lossy_parts(strategy).lossless and strategy.replicas == ():
            self._lossless = strategy

    def twin(self, strategy: Strategy) -> ProbeResult:
        """The lossless curve, trained the first time with the fastest lossless strategy the run
        measured (``use_lossless``) or else ``strategy``'s lossless twin: every lossless
        strategy trains as one process, so the curve is the same."""
        key = self._key(_TWIN)
        found = self._cached(key)
        if found is not None:
            return found
        started = time.time()
        losses, wall = self._train(self._lossless or lossless_twin(strategy))
        result = ProbeResult(self.model_def.name, self.model_key, _TWIN.key, "lossless", self.workers, self.cluster.name,
                             self.steps, self.seed, EXACT, tuple(losses), tuple(losses), wall, wall, started,
                             {"training": self.training})
        self._keep(key, result)
        return result

    def probe(self, strategy: Strategy) -> ProbeResult:
        """The ProbeResult of ``strategy`` (from the cache when its lossy parts were probed)."""
        parts = lossy_parts(strategy)
        if parts.lossless:
            return dataclasses.replace(self.twin(strategy), efficiency=EXACT)
        key = self._key(parts)
        found = self._cached(key)
        if found is not None:
            return dataclasses.replace(found, efficiency=dataclasses.replace(found.efficiency, source="cache"))
        twin = self.twin(strategy)
        started = time.time()
        losses, wall = self._train(strategy)
        e = dataclasses.replace(estimate_efficiency(losses, twin.twin_loss), note=self.note)
        result = ProbeResult(self.model_def.name, self.model_key, parts.key, parts.describe(), self.workers,
                             self.cluster.name, self.steps, self.seed, e, tuple(losses), twin.twin_loss, wall,
                             twin.twin_wall_s, started, {"training": self.training})
        self._keep(key, result)
        if self.on_result:
            self.on_result(result)
        return result

    def efficiency(self, strategy: Strategy) -> Efficiency:
        """E of ``strategy``: 1 without training when it is lossless, else its probe's."""
        if lossy_parts(strategy).lossless:
            return EXACT
        return self.probe(strategy).efficiency


def check_stand_in(tuned, stand_in, source: str) -> None:
    """Raise ConfigError unless ModelSpec ``stand_in`` has every variable name of ``tuned``."""
    missing = sorted(set(tuned.names) - set(stand_in.names))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ConfigError(f"--probe-model {source}: the stand-in model {stand_in.name} has no variable named "
                          f"{shown} of model {tuned.name}; a stand-in must have the tuned model's variables "
                          f"(by name; their shapes may differ), e.g. the same architecture at another size")


def move_lossy_parts(strategy: Strategy, model: ModelSpec, cluster: ClusterSpec) -> Strategy:
    """``model`` all-reduced exactly, except the variables of the same names as ``strategy``'s lossy
    parts: a compressor on any shard compresses the whole variable, a stale or asynchronous PS
    shard makes the variable such a PS on the cluster's first node (``StandInProber``'s
    translation, also ``benchmarks/accelerator_efficiency.py --whole-variables``).

    Raises:
        ConfigError: the moved strategy does not validate on ``model`` and ``cluster``.
    """
    from strategy_space import AllReduce, PS, VarConfig, validate
    from strategy_space.builders import get_builder

    base = {c.name: c for c in get_builder("all_reduce").build(model, cluster).variables}
    parts, node = lossy_parts(strategy), cluster.nodes[0].name
    lossy: dict[str, object] = {}
    for name, _, codec in parts.compressed:
        lossy.setdefault(name, AllReduce(compressor=codec, group=base[name].synchronizers[0].group))
    for name, _, staleness in parts.stale:
        lossy.setdefault(name, PS(node, staleness=staleness))
    for name, _ in parts.asynchronous:
        lossy.setdefault(name, PS(node, sync=False))
    configs = tuple(VarConfig(name, (lossy[name],)) if name in lossy else config for name, config in base.items())
    moved = Strategy(configs, origin=f"{strategy.origin or 'candidate'} on {model.name}")
    validate(moved, model, cluster)
    return moved


class StandInProber(Prober):
    """Efficiencies of one model's strategies probed on another, trainable model: a stand-in.

    A model-spec YAML (a full-size model planned for a GPU cluster, say) has no code to train, so
    what its lossy parts cost in convergence cannot be measured on it; a trainable model with the
    same variables (the same architecture at another size, e.g. ``zoo:lm1b`` for ``lm1b-full``)
    can stand in. Each candidate's lossy parts move onto the stand-in's variable of the same name
    (a compressor on any shard compresses the whole variable; a stale or asynchronous PS shard
    makes the variable's PS so); every other variable is all-reduced without loss, which trains as
    one process. The stand-in's efficiency is an estimate for the tuned model's, said so in the
    outputs: compression error depends on a matrix's shape and spectrum, so a smaller model can
    be hurt more or less than the full one.

    Args:
        inner: a TrainingProber of the stand-in (its cache keys name the stand-in).
        tuned: the ModelSpec being tuned.
        stand_in: the stand-in's ModelSpec.
        source: how the user named the stand-in (said in the note).

    Raises:
        ConfigError: the stand-in lacks some of the tuned model's variables.
    """

    def __init__(self, inner: TrainingProber, tuned, stand_in, source: str):
        check_stand_in(tuned, stand_in, source)
        self.inner, self.tuned, self.stand_in, self.source = inner, tuned, stand_in, source
        self.note = (f"efficiencies probed on the stand-in model {source} ({stand_in.name}, real compute on "
                     f"{inner.workers} workers; lossy parts moved onto its variables of the same names): an "
                     f"estimate for {tuned.name}, whose own convergence was not measured")
        inner.note = self.note

    @property
    def training_known(self) -> str | None:
        return self.inner.training_known

    def translate(self, strategy: Strategy) -> Strategy:
        """The stand-in's strategy carrying ``strategy``'s lossy parts (see the class)."""
        return move_lossy_parts(strategy, self.stand_in, self.inner.cluster)

    def efficiency(self, strategy: Strategy) -> Efficiency:
        if lossy_parts(strategy).lossless:
            return EXACT
        e = self.inner.efficiency(self.translate(strategy))
        return dataclasses.replace(e, note=self.note) if e.probed else e


def resolve_stand_in(model, probe_model, compute: str, quality: str, prober, runner, before_read=None):
    """(source, ModelDef, ModelSpec) of ``autosync.tune``'s ``probe_model``, checked before any
    worker starts (its other arguments as ``tune`` got them); None without one. ``before_read`` is
    called once the arguments passed, before the stand-in is read (``tune``'s Ray check).

    Raises:
        ConfigError: a stand-in this run cannot use, or one without the tuned model's variables.
    """
    if probe_model is None:
        return None
    from autosync.model_def import ModelDef
    from autosync.sources import is_trainable_source, load_model_def, load_model_spec

    source = probe_model.name if isinstance(probe_model, ModelDef) else probe_model
    if runner is not None:
        compute = getattr(runner, "compute", None)
    if compute != "emulated":
        raise ConfigError(f"--probe-model {source}: a stand-in is for emulated compute; with real compute the "
                          f"tuned model itself is probed on its workers (drop --probe-model, or use --compute emulated)")
    if quality != "goodput" or prober is not None or (runner is not None and not hasattr(runner, "pool")):
        raise ConfigError(f"--probe-model {source}: a stand-in probes lossy parts under --quality goodput on the Ray "
                          f"runtime's workers; this run has quality {quality}"
                          + (" and its own prober or runner" if prober is not None or runner is not None else ""))
    if not (isinstance(probe_model, ModelDef) or (isinstance(probe_model, str) and is_trainable_source(probe_model))):
        raise ConfigError(f"--probe-model {short_repr(source)}: a stand-in must be a trainable model (zoo:NAME or "
                          f"script.py:function), since its efficiencies are measured by training it")
    if before_read is not None:
        before_read()
    model_def = load_model_def(probe_model)
    stand_in_spec = load_model_spec(model_def)
    check_stand_in(model if isinstance(model, ModelSpec) else load_model_spec(model), stand_in_spec, source)
    return source, model_def, stand_in_spec


def prepare_probe(model, strategy, cluster="local", *, steps: int = DEFAULT_PROBE_STEPS):
    """Resolve and check what ``autosync probe`` is given, before anything trains or is written:
    returns (ModelDef, ModelSpec, Strategy, ClusterSpec).

    Raises:
        ConfigError: bad model, strategy, cluster or steps, or a strategy that does not fit them.
    """
    from autosync.sources import load_cluster, load_model_def, load_model_spec, load_strategy_for
    from strategy_space import validate
    from strategy_space.builders import BUILDERS

    if not (isinstance(steps, int) and steps >= 10):
        raise ConfigError(f"--steps must be an integer >= 10 (the loss is smoothed over a tenth of them), got {steps!r}")
    # a file is read (a bad one refused) before the model is built; a builder's name builds for the model
    named = isinstance(strategy, str) and strategy in BUILDERS and not os.path.exists(os.path.expanduser(strategy))
    if not named:
        strategy = load_strategy_for(strategy, None, None)
    model_def, cluster_spec = load_model_def(model), load_cluster(cluster)
    spec = load_model_spec(model_def)
    if named:
        strategy = load_strategy_for(strategy, spec, cluster_spec)
    validate(strategy, spec, cluster_spec)
    return model_def, spec, strategy, cluster_spec


def probe_strategy(model_def, spec, strategy: Strategy, cluster: ClusterSpec, *, steps: int = DEFAULT_PROBE_STEPS,
                   seed: int | None = None, store=None, timeout_s: float = 600.0) -> tuple[ProbeResult | None, Efficiency]:
    """Probe one strategy (``autosync probe``; arguments as ``prepare_probe`` returns them).

    Returns:
        (the probe, its efficiency); (None, E = 1 not probed) for a lossless strategy, which
        trains as one process.
    """
    if lossy_parts(strategy).lossless:
        return None, EXACT
    prober = TrainingProber(model_def, spec, cluster, steps=steps, seed=seed, store=store, timeout_s=timeout_s)
    result = prober.probe(strategy)
    return result, result.efficiency


def default_prober(model, runner, spec: ModelSpec, store, steps: int, seed: int | None,
                   stand_in=None) -> tuple[Prober | None, str]:
    """The prober of a tuning run under ``goodput`` and what it rests on: the model trained on the
    runner's own workers (with emulated compute, the trainable model, or the ``stand_in``
    that ``autosync.probe.resolve_stand_in`` returned, with real compute on the same cluster); (None, why) when there
    is nothing to train (a runner that is not the Ray runtime's, or a model-spec YAML)."""
    from autosync.model_def import ModelDef
    from autosync.sources import is_trainable_source, load_model_def

    if runner is None or not hasattr(runner, "pool"):
        return None, ("lossy parts were not proposed: the given runner has no trainable model to probe their "
                      "statistical efficiency with")
    if stand_in is not None:
        source, model_def, stand_in_spec = stand_in
        inner = TrainingProber(model_def, stand_in_spec, runner.cluster, steps=steps, seed=seed, store=store,
                               pool=runner.pool)
        prober = StandInProber(inner, spec, stand_in_spec, source)
        return prober, prober.note
    if runner.compute == "real":
        return TrainingProber(runner.model_def, spec, runner.cluster, steps=steps, seed=seed, store=store,
                              pool=runner.pool, on_target=True), ""
    if isinstance(model, ModelDef) or (isinstance(model, str) and is_trainable_source(model)):
        note = (f"efficiencies probed with real compute of the trainable model on the same {len(runner.cluster.devices)} "
                f"workers (step times are emulated; staleness, whose effect depends on timing, is not proposed)")
        return TrainingProber(load_model_def(model), spec, runner.cluster, steps=steps, seed=seed, store=store,
                              pool=runner.pool, note=note), note
    return None, ("lossy parts were not proposed: a model-spec YAML has no code to train, so their statistical "
                  "efficiency cannot be probed; give a trainable model (zoo:NAME or script.py:function) to have them, "
                  "or a trainable stand-in with the same variables (--probe-model)")
