"""The Python API: ``autosync.tune``, and the runtime's runner and trainer built from names.

    import autosync
    result = autosync.tune("zoo:ncf", cluster="local", trials=16)
    result.save("best.yaml")
    with autosync.make_trainer("zoo:ncf", "best.yaml", "local") as trainer:
        trainer.fit(steps=100)

``worker_pool`` keeps one set of workers for both: the trainer reloads the tuner's instead of starting its own.

The runtime (``RayRunner``, ``Trainer``) takes resolved objects (a ModelDef, a ClusterSpec, a
Strategy); this layer resolves names and files (``autosync.sources``) before handing them down.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import os
import re
import time
from pathlib import Path
from typing import Callable

from autosync.exception_text import first_reason
from autosync.runtime.binding import check_cluster_start
from autosync.search_limits import profiled_with_pins, search_limits, target_optimizer
from autosync.tflog import driver_startup
from autosync.time_limit import allowing
from autosync.tune_result import TuneResult
from strategy_space import ConfigError, ModelSpec, validate
from tuner.search.constraints import Constraints, as_constraints
from tuner.records.goodput import DEFAULT_MIN_EFFICIENCY, DEFAULT_PROBE_STEPS, DEFAULT_QUALITY, QUALITIES, Prober
from tuner.records.outcome import TuneOutcome
from tuner.records.store import TrialStore, check_store_file, open_existing_store
from tuner.records.trial import Runner, Trial
from tuner.records.warmstart import load_warm_start
from tuner.search.baseline_tuner import BaselineTuner
from tuner.search.model_based import ModelBasedTuner, SearchSettings
from tuner.search.tuning import Budget, previous_run, tune_loop


# bounded staleness offered under goodput (besides 0; asynchronous PS too) where probes run on the target
STALENESS_OFFERED = (0, 2)


def default_store_path() -> Path:
    """Where trials accumulate between runs (they warm-start later tunings): the user's cache."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "autosync" / "trials.db"


def run_dir(store_path: str | os.PathLike, model_name: str, cluster_name: str, run_id: str) -> Path:
    """Where a tuning run's outputs go unless told otherwise (``autosync tune``, ``report``): beside its trial
    store, ``runs/MODEL-CLUSTER-RUNID/`` (by default under the user's cache, never a source checkout)."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{model_name}-{cluster_name}-{run_id}").strip("._") or run_id
    return Path(os.path.abspath(store_path)).parent / "runs" / name[:120]


def make_runner(model, cluster="local", *, compute: str = "real", profile: bool = False,
                step_time_s: float | None = None, optimizer: str = "sgd", model_spec: ModelSpec | None = None,
                **settings):
    """A ``RayRunner`` for a model and a cluster given by name, file or object.

    Args:
        model: a ModelDef, ``zoo:NAME`` or ``script.py:function``; with emulated compute also a
            model-spec YAML, a ModelSpec or an EmulatedModelDef.
        cluster: ``local``, ``testbed``, a cluster YAML path or a ClusterSpec.
        compute, step_time_s, optimizer: as for ``tune``.
        profile: real compute: trials recorded against the model's profiled ModelSpec (as ``tune``); else the workers'.
        model_spec: the ModelSpec trials are recorded against (``profile`` is then not read).
        settings: the other ``RayRunner`` keywords (``warmup``, ``steps``, ``precision``,
            ``max_steps``, ``max_measure_s``, ``trial_timeout_s``, ``pool``).

    Raises:
        ConfigError: bad model, cluster or settings, or an optimizer the runtime cannot apply; before Ray starts.
    """
    from autosync.runtime.emulated import check_emulated_settings
    from autosync.runtime.optimizers import check_model_optimizer
    from autosync.runtime.runner import RayRunner, check_real_compute
    from autosync.runtime.gpu_profile import profiled_spec
    from autosync.sources import is_trainable, load_cluster, load_emulated_model, load_model_def

    driver_startup()
    cluster_spec = check_cluster_start(load_cluster(cluster))   # a Ray that cannot be reached: said before the read
    # the cluster as the runner marks it (emulated compute never pools with real)
    _check_pool(settings.get("pool"), dataclasses.replace(cluster_spec, compute=compute) if compute == "emulated"
                else cluster_spec)
    if compute == "emulated":
        check_emulated_settings(step_time_s, optimizer)   # said before a model is read
    with allowing(settings.get("trial_timeout_s")):   # a model whose trials may take that long may load as long
        if compute == "emulated":
            if model_spec is None:   # a trainable model profiled once, its optimizer's pins taken along
                model = (profiled_with_pins(load_model_def(model), len(cluster_spec.devices))
                         if step_time_s is None and is_trainable(model) else load_emulated_model(model, step_time_s))
        else:
            check_real_compute(compute, cluster_spec, step_time_s)
            model = load_model_def(model)
            # fail now, not after every trial failed: what the runtime's optimizers cannot apply
            check_model_optimizer(model)
            if profile and model_spec is None:   # measured where the workers compute, on a GPU cluster
                model_spec = profiled_spec(model, cluster_spec)
    return RayRunner(model, cluster_spec, compute=compute, step_time_s=step_time_s, optimizer=optimizer,
                     model_spec=model_spec, **settings)


def make_trainer(model, strategy, cluster="local", **settings):
    """A ``Trainer`` for a model, a strategy and a cluster given by name, file or object.

    Args:
        model: a ModelDef, ``zoo:NAME`` or ``script.py:function``.
        strategy: a Strategy, a strategy YAML path, or a builder's name (``"ps"``: the baseline
            that builder makes for this model and cluster).
        cluster: ``local``, ``testbed``, a cluster YAML path or a ClusterSpec.
        settings: the other ``Trainer`` keywords (``timeout_s``, ``pool``, ``restore``: a checkpoint directory, see
            ``Trainer.save``; ``keep_global_batch``: on fewer workers, each also draws the lost ones' batches).

    Raises:
        ConfigError: bad model, strategy or cluster (see ``Trainer`` for the rest); TypeError: an unknown keyword.
    """
    from autosync.runtime.trainer import Trainer
    from autosync.sources import load_cluster, load_model_def, load_strategy_for
    from strategy_space.builders import strategy_or_builder

    driver_startup()
    inspect.signature(Trainer).bind(None, None, None, **settings)   # TypeError: a keyword Trainer has not
    strategy = strategy_or_builder(strategy)   # these said before the model loads (seconds of TensorFlow)
    cluster_spec = check_cluster_start(load_cluster(cluster))   # a Ray that cannot be reached: said before the read
    _check_pool(settings.get("pool"), cluster_spec)
    with allowing(settings.get("timeout_s")):
        model_def = load_model_def(model)
    return Trainer(model_def, load_strategy_for(strategy, model_def, cluster_spec), cluster_spec, **settings)


@contextlib.contextmanager
def worker_pool(cluster="local"):
    """Warm workers for ``tune``, ``make_runner`` and ``make_trainer`` to share (``pool=``) in one script,
    so that training after tuning reloads the tuner's workers instead of starting new ones (each start
    imports TensorFlow: seconds per worker); on exit the workers and parameter servers are killed, and
    the embedded Ray is stopped if this started it. Real compute only (emulated workers never pool).

        with autosync.worker_pool("local") as pool:
            result = autosync.tune("zoo:ncf", "local", pool=pool)
            with autosync.make_trainer("zoo:ncf", result.best_strategy, "local", pool=pool) as trainer:
                trainer.fit(steps=100)

    Args:
        cluster: ``local``, ``testbed``, a cluster YAML path or a ClusterSpec; the runners and trainers
            given the pool must name the same cluster.

    Raises:
        ConfigError: bad cluster, or one that does not fit the Ray cluster; before any worker starts.
    """
    from autosync.runtime.engine import WorkerPool
    from autosync.sources import load_cluster

    driver_startup()
    pool = WorkerPool.shared_or_new(check_cluster_start(load_cluster(cluster)))
    try:
        yield pool
    finally:
        pool.close()


def _check_pool(pool, cluster_spec) -> None:
    """Refuse a ``worker_pool`` that is closed or bound to another cluster before the model is read
    (seconds of TensorFlow), as the runner or trainer would after it.

    Raises:
        ConfigError: the pool cannot serve ``cluster_spec``.
    """
    if pool is not None:
        from autosync.runtime.engine import WorkerPool

        if not isinstance(pool, WorkerPool):
            raise ConfigError(f"pool must be the pool autosync.worker_pool gives (with autosync.worker_pool(cluster) "
                              f"as pool: ...), got {type(pool).__name__} {pool!r:.80}")
        WorkerPool.shared_or_new(cluster_spec, pool)


def _seconds(value) -> bool:
    """Whether ``value`` is a finite number of seconds > 0."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf


def _check_resumable(store_path: Path) -> None:
    """Raise ConfigError unless the trial store at ``store_path`` holds a tuning run (of any model
    and cluster: which one is known only once the model is loaded)."""
    why = ("does not exist" if not store_path.exists() else "is empty" if store_path.stat().st_size == 0 else None)
    if why is None:
        with open_existing_store(store_path) as existing:
            if not any(t.run_id for t in existing.trials()):
                why = "holds no tuning run"
    if why is not None:
        raise ConfigError(f"--resume: there is no earlier run to continue: the trial store {store_path} {why}; give "
                          f"the --store of the run to continue, or leave out --resume to start a new run")


def tune(model, cluster="local", *, trials: int = 24, time_budget_s: float | None = None,
         store: str | os.PathLike | None = None, constraints: Constraints | str | None = None,
         resume: bool = False, steps: int = 10, warmup: int = 3, trial_timeout_s: float = 300.0,
         patience: int = 4, confirm: int = 2, settings: SearchSettings | None = None, warm_start="builtin",
         precision: float | None = 0.03, max_steps: int = 200, compute: str = "real",
         step_time_s: float | None = None, optimizer: str = "sgd", runner: Runner | None = None,
         on_trial: Callable[[Trial, TuneOutcome], None] | None = None,
         quality: str = DEFAULT_QUALITY, probe_steps: int = DEFAULT_PROBE_STEPS, probe_seed: int | None = None,
         prober: Prober | None = None, on_probe: Callable | None = None,
         min_efficiency: float = DEFAULT_MIN_EFFICIENCY, probe_model=None, pool=None) -> TuneResult:
    """Find the fastest synchronization strategy for ``model`` on ``cluster`` by measurement.

    Args:
        model: a ModelDef, ``zoo:NAME`` or ``script.py:function``.
        cluster: ``local``, ``testbed``, a cluster YAML path or a ClusterSpec.
        trials: search trials (each builder's baseline is measured too, first).
        time_budget_s: stop proposing after this many seconds from the call, the workers' start
            and the model's profile included (baselines always run).
        store: TrialStore path (default: the user's cache); trials of earlier runs, of any model
            and cluster, warm-start the predictor.
        constraints: pinned decisions (a Constraints, a YAML path or the YAML's content as a dict).
        resume: continue the latest run of this model and cluster in the store.
        steps, warmup, trial_timeout_s: per-trial measurement settings.
        precision, max_steps: after ``steps``, measure until the 95 % interval of the median step
            time is within ``precision`` of it (None: exactly ``steps``), at most ``max_steps``.
        patience: stop after this many rounds without a better measured strategy.
        confirm: re-measure the best strategy and the best baseline until each has 1 + confirm
            measurements (the recommendation and the speed-up rest on those; 0: off).
        warm_start: trials the predictor learns from besides the store: ``builtin`` (the dataset
            AutoSync measured on its testbed), ``none``, another trial store file (read only), or
            groups already loaded with ``tuner.records.warmstart.load_warm_start``.
        compute, step_time_s, optimizer: ``real`` (TensorFlow workers) or ``emulated`` (workers
            wait ``step_time_s``, default the profiled compute time, and send synthetic gradients;
            ``model`` may then be a model-spec YAML; ``optimizer`` names its optimizer); see
            ``autosync.runtime.emulated``.
        runner: measure with this Runner instead of the Ray runtime (tests, simulation).
        on_trial: progress callback.
        quality: ``goodput`` (default): rank by step time / statistical efficiency, proposing
            lossy parts (compressors) and keeping a lossy strategy only with a measured
            efficiency; ``exact``: never propose a lossy part; ``step``: rank by step time alone
            (lossy parts unmeasured). See ``tuner.records.goodput``.
        probe_steps, probe_seed: steps and seed of each efficiency probe (``autosync.probe``).
        prober: measures efficiencies (default: trains the model on the runner's workers; with
            ``runner`` given and no prober, lossy parts are not proposed under ``goodput``).
        on_probe: called with (trial, Efficiency) after each probe.
        min_efficiency: under ``goodput``, the least measured efficiency a lossy strategy needs to
            be recommended (default 0.95: a probe sees only the first steps of training).
        probe_model: with emulated compute, a trainable model (``zoo:NAME``, ``script.py:function``
            or a ModelDef) with ``model``'s variable names whose efficiencies stand in for
            ``model``'s (``autosync.probe.StandInProber``): how a model-spec YAML gets lossy parts
            proposed, or a full-size model gets them probed at a size that trains quickly.
        pool: the ``worker_pool`` to measure on (real compute; left running for a ``make_trainer`` after
            this); by default the workers are started here and killed on return.

    Raises:
        ConfigError: bad model, cluster, constraints or settings.
    """
    from autosync.probe import default_prober, resolve_stand_in
    from autosync.runtime.emulated import check_emulated_settings
    from autosync.sources import is_trainable, load_cluster, load_model_def

    called = time.monotonic()   # the time budget counts from here: start-up is part of the wait
    driver_startup()
    for name, value, least in (("trials", trials, 0), ("confirm", confirm, 0), ("patience", patience, 1),
                               ("steps", steps, 1), ("warmup", warmup, 0), ("max_steps", max_steps, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ConfigError(f"{name} must be an integer >= {least}, got {value!r}")
    if time_budget_s is not None and not _seconds(time_budget_s):
        raise ConfigError(f"time_budget_s must be a number of seconds > 0 or None (no limit), got {time_budget_s!r}")
    if not _seconds(trial_timeout_s):
        raise ConfigError(f"trial_timeout_s must be a number of seconds > 0, got {trial_timeout_s!r}")
    if compute == "emulated":   # said before the model is read below
        check_emulated_settings(step_time_s, optimizer)
    if pool is not None and (runner is not None or compute != "real"):
        raise ConfigError("pool is for the workers tune starts with real compute; leave it out with "
                          + ("runner (the runner has its own)" if runner is not None else f"compute {compute!r}"))
    if quality not in QUALITIES:
        raise ConfigError(f"quality must be one of {', '.join(QUALITIES)}, got {quality!r}")
    if not (isinstance(min_efficiency, (int, float)) and 0 <= min_efficiency <= 1):
        raise ConfigError(f"min_efficiency must be a number from 0 to 1, got {min_efficiency!r}")
    if store is not None and not isinstance(store, (str, os.PathLike)):
        raise ConfigError(f"store must be a trial store path (a str or a path) or None (the user's cache), got "
                          f"{type(store).__name__} {store!r:.80}")
    if not isinstance(probe_steps, int) or probe_steps < 10:
        raise ConfigError(f"probe steps must be an integer >= 10 (the loss is smoothed over a tenth of them), "
                          f"got {probe_steps!r}")
    if settings is not None and not isinstance(settings, SearchSettings):
        raise ConfigError(f"settings must be a SearchSettings (from tuner.search.settings), got {type(settings).__name__}")
    cluster_spec = load_cluster(cluster)
    _check_pool(pool, cluster_spec)
    # a Ray that cannot be reached: said after the stand-in's arguments, before it is read
    stand_in = resolve_stand_in(model, probe_model, compute, quality, prober, runner,
                                before_read=None if runner is not None else lambda: check_cluster_start(cluster_spec))
    # a bad path fails before any worker starts
    warm_groups = list(warm_start) if isinstance(warm_start, (list, tuple)) else load_warm_start(warm_start)
    constraints = as_constraints(constraints)
    if constraints is not None:   # what the cluster cannot run (nccl without GPUs) fails before any worker starts
        problems = constraints.cluster_problems(cluster_spec)
        if problems:
            raise ConfigError(problems)
        if quality == "exact" and constraints.lossy_pins():
            raise ConfigError(f"the constraints pin lossy parts ({'; '.join(constraints.lossy_pins())}) but quality "
                              f"exact never proposes one; use --quality goodput (measures what they cost in "
                              f"convergence) or drop those pins")
    store_path = Path(store).expanduser() if store is not None else default_store_path()
    check_store_file(store_path)   # a damaged store fails now, untouched, before any worker starts
    if resume:   # a resume with nothing to resume fails before any worker starts
        _check_resumable(store_path)
    own_runner = runner is None
    if runner is None:
        # trials are recorded against the profiled spec (real compute) or the emulated one, on
        # the cluster as the runner runs it (emulated compute marks it)
        if compute == "emulated" and is_trainable(model):   # read here (one object), once Ray is known to answer
            check_cluster_start(cluster_spec)
            model = load_model_def(model)
        runner = make_runner(model, cluster_spec, compute=compute, profile=True, step_time_s=step_time_s,
                             optimizer=optimizer, warmup=warmup, steps=steps, trial_timeout_s=trial_timeout_s,
                             precision=precision, max_steps=max(max_steps, steps), pool=pool)
        cluster_spec, spec = runner.cluster, runner.given_spec
    else:
        spec = runner.model
    if resume:
        with open_existing_store(store_path) as existing:
            found, _ = previous_run(existing, spec, cluster_spec)
        if found is None:
            if own_runner:
                runner.close()
            raise ConfigError(f"--resume: the trial store {store_path} holds no earlier run of model {spec.name} on "
                              f"cluster {cluster_spec.name} (with these settings) to continue; leave out --resume to "
                              f"start a new run")
    store_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        # what the model's optimizer makes the runtime refuse is never proposed (a clashing pin fails here)
        limits = search_limits(target_optimizer(model, compute, runner), constraints,
                               {v.name for v in spec.variables if v.sparse})
        with TrialStore(store_path) as trial_store:
            lossy_note = ""
            if quality == "goodput" and prober is None:
                prober, lossy_note = default_prober(model, runner, spec, trial_store, probe_steps, probe_seed,
                                                     stand_in)
            lossless = quality == "exact" or (quality == "goodput" and prober is None)
            if quality == "exact":
                lossy_note = "quality exact: no lossy part was proposed"
            elif prober is not None and not lossy_note:
                lossy_note = prober.note
            # staleness and asynchrony depend on timing: offered only where probes train on the
            # target itself (real compute on the measured workers)
            timed = quality == "goodput" and prober is not None and getattr(prober, "on_target", False)
            if timed and not limits.staleness_ok:
                timed = False
                lossy_note = "; ".join(filter(None, [lossy_note, limits.staleness_note]))
            tuner = ModelBasedTuner(spec, cluster_spec, constraints=limits.constraints,
                                    settings=settings or SearchSettings(), warm_start=warm_groups, lossless=lossless,
                                    staleness=STALENESS_OFFERED if timed else (0,), allow_async=timed)
            # the baselines as their builders make them, on the user's pins alone (module search_limits)
            budget = Budget(trials=trials, time_s=time_budget_s, patience=patience, confirm=confirm, started=called)
            outcome = tune_loop(runner, trial_store, tuner, budget,
                                baselines=BaselineTuner(spec, cluster_spec, constraints=constraints),
                                resume=resume, on_trial=on_trial, quality=quality,
                                prober=prober if quality == "goodput" else None, on_probe=on_probe,
                                min_efficiency=min_efficiency)
    finally:
        if own_runner:
            runner.close()
    best = outcome.best
    if best is None:
        reasons = sorted({first_reason(t.error) for t in outcome.trials if not t.ok})
        what = ("every baseline failed (PS and all-reduce alike), so no search was run"
                if outcome.stop_reason == "baselines_failed" else "every trial failed" + (
                    f" and the run stopped: {outcome.stop_note}" if outcome.stop_note else ""))
        timed_out = all(t.status == "timeout" for t in outcome.trials if not t.ok)
        refused = all(t.meta.get("refused") for t in outcome.trials if not t.ok)   # before they ran: said why
        raise ConfigError(f"{what}, so there is no strategy to recommend ("
                          + ("each was refused before it ran: fix what it says" if refused else
                             "check that the model trains on this cluster: autosync run --strategy ...")
                          + (f"; every trial ran past its limit of {trial_timeout_s:g} s: a model that is slow to "
                             f"start or to step needs a longer one (--timeout, trial_timeout_s), a hung one a fix"
                             if timed_out else "") + f"); reasons: {'; '.join(reasons)}.")
    validate(best.strategy, spec, cluster_spec)
    return TuneResult(best_strategy=best.strategy, best_trial=best, baselines=outcome.baselines, model=spec,
                      cluster=cluster_spec, outcome=outcome, store_path=str(store_path),
                      warm_start_trials=sum(len(trials) for _, _, trials in warm_groups), quality=quality,
                      lossy_note=lossy_note, search_note=limits.search_note)
