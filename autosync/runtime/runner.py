"""RayRunner: run strategies on a Ray cluster and measure them (the tuner's ``Runner``).

Per strategy: validate, plan, parameter servers and workers reset (fresh weights, optimizer state
and data; the processes are the pool's, kept warm across clean trials), ``warmup`` steps, then
``steps`` timed steps and, with a precision target, more in growing batches until the 95 % interval
of the median step time is within the target or a cap is reached
(``tuner.records.precision.MeasurePolicy``), all under ``trial_timeout_s``. A strategy that is
invalid, raises or runs out of time becomes a failed/timeout Trial; its actors are killed and
replaced, and the next strategy runs normally. A strategy whose bytes alone, at the cluster's stated
bandwidth, need longer than the limit for its warm-up and first timed steps is not started: it is
a timeout Trial that says so (``tuner.cost_models.analytic.beyond_trial_limit``).
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Sequence

import numpy as np

from autosync.exception_text import python_branch, token_mismatch
from autosync.model_def import ModelDef
from autosync.runtime.data_check import check_losses
from autosync.runtime.emulated import COMPUTE_MODES, EmulatedModelDef, emulated_model_def
from autosync.runtime.engine import Session, TrialFailed, TrialTimeout, WorkerPool, wait_all
from autosync.runtime.plan import SyncPlan, model_spec_from_vars
from strategy_space import ClusterSpec, ModelSpec, Strategy, validate
from strategy_space.builders import resolve_strategy
from strategy_space.errors import ConfigError, short_repr
from tuner.cost_models.analytic import beyond_trial_limit
from tuner.records.precision import MeasurePolicy
from tuner.records.trial import Runner, Trial, lost_nodes_note


def summarize_steps(results: list[dict], warmup: int, untimed_tail: int = 0) -> dict:
    """Step times and per-step breakdown from the workers' ``run`` results.

    A step's time is the longest any worker took from the start of that step to the start of
    its next (the last step run ends after the final synchronizing pull). Breakdown and call
    counts are means over the timed steps and workers. The first ``warmup`` and the last
    ``untimed_tail`` steps run are not timed: a measurement leaves out the last one, whose final
    pull waits for that step's pushes and then pulls every variable once more (a PS step's
    last step took twice the others), which a step of a longer run never does.
    """
    starts = np.array([r["start"] for r in results])            # workers x (steps + 1)
    stop = starts.shape[1] - 1 - untimed_tail
    durations = np.diff(starts, axis=1)[:, warmup:stop]
    timed = slice(warmup, stop)
    compute = np.mean([r["compute"][timed] for r in results])
    sync = np.mean([r["sync"][timed] for r in results])
    calls = np.array([r["calls"][timed] for r in results], dtype=float)
    moved = {k: float(np.mean([r[k][timed] for r in results])) for k in ("bytes_sent", "bytes_received")
             if all(k in r for r in results)}
    return {
        "bytes_per_step_per_worker": moved,
        "step_times": durations.max(axis=0).tolist(),
        "breakdown": {"compute": float(compute), "sync": float(sync)},
        "calls_per_step_per_worker": float(calls.mean()),
        "loss": np.mean([r["loss"] for r in results], axis=0).tolist(),
        "first_step_start": float(starts[:, 0].max()),
    }


def combine_summaries(parts: list[dict]) -> dict:
    """One summary of consecutive ``run`` batches: step times and losses joined, the rest averaged by steps."""
    if len(parts) == 1:
        return parts[0]
    n = [len(p["step_times"]) for p in parts]

    def mean(values: list) -> float:
        return float(sum(k * v for k, v in zip(n, values)) / sum(n))

    return {
        "step_times": [x for p in parts for x in p["step_times"]],
        "breakdown": {k: mean([p["breakdown"][k] for p in parts]) for k in parts[0]["breakdown"]},
        "calls_per_step_per_worker": mean([p["calls_per_step_per_worker"] for p in parts]),
        "bytes_per_step_per_worker": {k: mean([p["bytes_per_step_per_worker"][k] for p in parts])
                                      for k in parts[0]["bytes_per_step_per_worker"]},
        "loss": [x for p in parts for x in p["loss"]],
        "first_step_start": parts[0]["first_step_start"],
    }


class RayRunner(Runner):
    """Runs strategies of one model on one cluster with the Ray runtime.

    The runner takes resolved objects; ``autosync.make_runner`` builds one from names and files
    (``zoo:ncf``, ``local``, YAML paths).

    Args:
        model_def: a ModelDef (real compute); with emulated compute a ModelSpec or an
            EmulatedModelDef.
        cluster: a ClusterSpec.
        warmup: untimed steps per trial (includes tracing and first transfers).
        steps: timed steps per trial (the first batch when a precision target is set).
        precision: run more steps until the 95 % interval of the median step time is within
            this fraction of it (0.03: +-3 %); None: exactly ``steps`` timed steps.
        max_steps, max_measure_s: caps on the timed steps and their seconds (precision mode).
        compute: ``real`` (TensorFlow workers) or ``emulated`` (``autosync.runtime.emulated``:
            workers wait the profiled compute time and send synthetic gradients). Emulated trials are recorded
            against the cluster with ``compute: emulated``, so they never pool with real ones.
        step_time_s: emulated compute per step (default: the spec's ``profile.step_time_s``,
            measured for a trainable model); times the cluster's ``compute_dilation``.
        optimizer: emulated compute's optimizer (``emulated.OPTIMIZERS``; default ``sgd``).
        trial_timeout_s: limit for one trial, start-up included.
        pool: warm workers to use (shared, e.g. between runners of several models); by default
            the runner starts its own and kills them on ``close``.
        model_spec: the ModelSpec trials are recorded against (e.g. one with a measured profile);
            it must describe the variables the workers build (checked on first use).
        timeline: record every worker's and PS actor's timeline while each trial is measured
            (``autosync.runtime.timeline``): the last trial's is ``last_timeline``, actor label
            -> its events (None: none recorded).

    Raises:
        TypeError: a model or cluster that is not one of the objects above (a name or a path).
        ConfigError: bad settings, or the cluster does not fit the Ray cluster.
    """

    def __init__(self, model_def, cluster: ClusterSpec, *, warmup: int = 2, steps: int = 10,
                 trial_timeout_s: float = 300.0, pool: WorkerPool | None = None, model_spec=None,
                 precision: float | None = None, max_steps: int = 200, max_measure_s: float = 60.0,
                 compute: str = "real", step_time_s: float | None = None, optimizer: str = "sgd",
                 timeline: bool = False):
        if not (isinstance(steps, int) and steps >= 1 and isinstance(warmup, int) and warmup >= 0):
            raise ConfigError(f"steps must be an integer >= 1 and warmup >= 0, got steps={steps!r}, warmup={warmup!r}")
        if not trial_timeout_s > 0:
            raise ConfigError(f"trial_timeout_s must be > 0, got {trial_timeout_s!r}")
        self.cluster = require_resolved(cluster, (ClusterSpec,), "the cluster")
        self.compute = compute
        if compute == "emulated":
            self.model_def, self.cluster, model_spec = emulated_setup(model_def, self.cluster, model_spec,
                                                                      step_time_s, optimizer)
        else:
            check_real_compute(compute, self.cluster, step_time_s)
            self.model_def = require_resolved(model_def, (ModelDef,), "the model")
            if model_spec is not None:
                require_resolved(model_spec, (ModelSpec,), "model_spec")
        self.warmup, self.steps, self.trial_timeout_s = warmup, steps, float(trial_timeout_s)
        try:
            self.policy = MeasurePolicy(precision=precision, min_steps=steps, max_steps=max(max_steps, steps),
                                        max_seconds=max_measure_s)
        except ValueError as e:
            raise ConfigError(f"measurement settings: {e}") from None
        self._own_pool = pool is None
        self.pool = WorkerPool.shared_or_new(self.cluster, pool)
        self.binding = self.pool.binding
        self._model = None
        self._given_spec = model_spec
        self._ps_nodes: tuple[str, ...] | None = None   # where the first strategy run puts PS (``model``)
        self.timeline, self.last_timeline = bool(timeline), None

    @property
    def given_spec(self):
        """The ModelSpec given (or, emulated, made) for recording trials; None: the workers' (``model``)."""
        return self._given_spec

    @property
    def model(self):
        """The ModelSpec as the workers built it (starts the workers on first use).

        Raises:
            ConfigError: the workers could not build the model (what failed where): no strategy
                can run, so a command says so (``tune``, ``baselines``) instead of a traceback.
        """
        try:
            return self._loaded()
        except (TrialFailed, TrialTimeout) as e:
            raise load_failure(self.model_def, self.cluster, e) from None

    @property
    def loaded(self) -> bool:
        """Whether the workers have built the model (after a trial: False when its load failed)."""
        return self._model is not None

    def _loaded(self):
        """``model``, raising what the load raised (a trial reports a timeout as one)."""
        if self._model is None:
            # a tuning run's baselines put parameter servers on every node; one strategy, on its own
            nodes = self._ps_nodes if self._ps_nodes is not None else [n.name for n in self.cluster.nodes]
            self.pool.ps.expect(self.model_def, nodes)
            self.pool.ensure(self.model_def, self.cluster.devices, time.monotonic() + self.trial_timeout_s)
            desc, given = self.pool.description, self._given_spec
            built = model_spec_from_vars(self.model_def.name, desc["variables"], self.model_def.batch_size,
                                         desc["optimizer"], slots=given is None)   # slots: what memory counts
            if given is not None:
                facts = lambda m: [(v.name, v.shape, v.dtype, v.sparse) for v in m.variables]  # noqa: E731
                if facts(given) != facts(built) or given.batch_size != built.batch_size:
                    raise ConfigError(f"the model spec given for {self.model_def.name} does not match the variables "
                                      f"the workers built (names, shapes, dtypes, sparsity or batch size differ); "
                                      f"build the spec from the same ModelDef")
                if given.global_clipnorm != built.global_clipnorm:
                    does = ("clips by the global norm" if desc["optimizer"].get("global_clipnorm") is not None else
                            "scales the loss dynamically" if built.global_clipnorm else "does not clip by the global norm")
                    raise ConfigError(f"the model spec given for {self.model_def.name} says global_clipnorm "
                                      f"{str(given.global_clipnorm).lower()} but the workers' optimizer {does} (held "
                                      f"steps: {str(built.global_clipnorm).lower()}); build the spec from the same ModelDef")
            self._model = given or built
        return self._model

    def optimizer_config(self) -> dict:
        """The model's optimizer as the workers built it (``keras_optimizer_config``; starts the
        workers on first use).

        Raises:
            ConfigError: see ``model``.
        """
        self.model
        return dict(self.pool.description["optimizer"])

    def run(self, strategies: Sequence[Strategy], origins: Sequence[str] | None = None) -> list[Trial]:
        """Measure each of ``strategies``: Strategy objects, strategy YAML paths or builders' names
        (``"ps"``, ...: what that builder makes for this model and cluster), or one of them alone.

        Raises:
            ConfigError: a name that is neither a file nor a builder, or a file that is not a
                strategy (before anything runs).
        """
        if isinstance(strategies, (str, bytes, os.PathLike, Strategy)):
            strategies = [strategies]
        strategies = [resolve_strategy(s, lambda: self.model, self.cluster) for s in strategies]
        if origins is not None and len(origins) != len(strategies):
            raise ValueError(f"origins has {len(origins)} entries for {len(strategies)} strategies")
        return [self.run_one(s, origins[i] if origins else s.origin) for i, s in enumerate(strategies)]

    def run_one(self, strategy: Strategy, origin: str = "") -> Trial:
        """Run one strategy; never raises for a strategy that fails (see the module doc)."""
        started = time.time()
        t0 = time.monotonic()
        deadline = t0 + self.trial_timeout_s
        meta: dict = {"warmup": self.warmup, "steps": self.steps, "compute": self.compute}
        if self.compute == "emulated":
            meta["emulated_step_time_s"] = self.model_def.step_time_s
        common = dict(strategy=strategy, origin=origin or strategy.origin, started_at=started,
                      cluster_fingerprint=self.cluster.fingerprint)
        session = None
        try:
            if self._model is None:
                self._ps_nodes = strategy.ps_nodes()
            model = self._given_spec or self._loaded()   # one that cannot fit (memory) fails before any worker loads
            common["model_fingerprint"] = model.fingerprint
            validate(strategy, model, self.cluster)
            self._loaded()
            if lost := self.binding.lost_for(strategy):   # its actors could never be placed: fail now
                return self._failed(common, "failed", f"not run: {lost_nodes_note(*lost)}", meta)
            doomed = beyond_trial_limit(model, self.cluster, strategy, steps=self.warmup + self.steps,
                                        limit_s=self.trial_timeout_s)
            if doomed:
                return self._failed(common, "timeout", doomed, meta)
            desc = self.pool.description or {}
            plan = SyncPlan.build(strategy, model, self.cluster, desc.get("optimizer"), desc.get("variables"),
                                  graph=self.compute != "emulated")
            before = set(self.pool.actors)
            self.pool.ensure(self.model_def, plan.replicas, deadline)
            if set(plan.replicas) - before:
                meta["worker_spawn_s"] = self.pool.spawn_s
            session = Session(self.pool, plan)
            placement = session.start(deadline)
            meta["placement"] = placement
            self.last_timeline = None
            if self.timeline:
                session_timeline(session, True, deadline)
            summary = self._measure(session, deadline)
            check_losses(model.name, summary["loss"], strategy, (self.pool.description or {}).get("optimizer"))
            if self.timeline:
                self.last_timeline = session_timeline(session, False, deadline)
            meta["ps_stats"] = session.ps_stats(deadline)
            session.close(clean=True)   # its PS actors serve the next trial
        except ConfigError as e:
            if session is not None:
                session.close()
            return self._failed(common, "failed", str(e), {**meta, "refused": True})   # it would fail again
        except TrialTimeout as e:
            session_abort(session, self.pool)
            return self._failed(common, "timeout", f"exceeded the trial limit of {self.trial_timeout_s:g} s: {e}", meta)
        except TrialFailed as e:
            session_abort(session, self.pool)
            return self._failed(common, "failed", str(e), meta)
        except Exception as e:  # noqa: BLE001 - a runner never raises for one bad strategy
            session_abort(session, self.pool)
            return self._failed(common, "failed", f"{type(e).__name__}: {e}", meta)
        meta["steps"] = len(summary["step_times"])
        meta["measure"] = self.policy.describe(summary["step_times"])
        meta.update({
            "startup_s": summary["first_step_start"] - started,
            "ray_calls_per_step_per_worker": summary["calls_per_step_per_worker"],
            "bytes_per_step_per_worker": summary["bytes_per_step_per_worker"],
            # sparse variables pulled whole each step: their lookups are not known before the step
            "full_pull": dict(self.pool.description.get("full_pull", {})),
            "ps_actors": len(plan.ps_actors),
            "workers": plan.num_workers,
            "loss": summary["loss"],
        })
        return Trial(status="ok", step_times=tuple(summary["step_times"]), breakdown=summary["breakdown"],
                     batch_size=self.model_def.batch_size * plan.num_workers, finished_at=time.time(),
                     meta=meta, **common)

    def _measure(self, session: Session, deadline: float) -> dict:
        """Warm-up and the first batch, then further batches while the policy asks for more and
        the trial's deadline leaves room for them (estimated from the steps so far). Each batch
        runs one step more than it times: its last step ends with the synchronizing pull, which
        no step of a longer run has (``summarize_steps``)."""
        parts = [summarize_steps(session.run(self.warmup + self.steps + 1, deadline), self.warmup, 1)]
        for _ in range(64):  # bounded: every batch adds >= 1 step and max_steps caps them
            times = [x for p in parts for x in p["step_times"]]
            more = self.policy.next_batch(times, float(np.sum(times)))
            per_step = float(np.mean(times))
            if per_step > 0:  # leave a fifth of the time left for the untimed step, the final pull and slack
                more = min(more, int(0.8 * (deadline - time.monotonic()) / per_step) - 1)
            if more <= 0:
                break
            parts.append(summarize_steps(session.run(more + 1, deadline), 0, 1))
        return combine_summaries(parts)

    def _failed(self, common: dict, status: str, reason: str, meta: dict) -> Trial:
        common.setdefault("model_fingerprint", self._model.fingerprint if self._model else "")
        return Trial(status=status, error=reason, finished_at=time.time(), meta=meta, **common)

    def lost_nodes(self) -> list[str]:
        """The cluster's nodes that left the Ray cluster since the runner bound it."""
        return self.binding.lost_nodes()

    def close(self) -> None:
        """Kill the workers and stop the embedded Ray if this runner started them (a shared pool
        is left to its owner)."""
        if self._own_pool:
            self.pool.kill_all()
            self.binding.close()


def check_real_compute(compute: str, cluster, step_time_s) -> None:
    """Refuse settings that only make sense with emulated compute.

    Raises:
        ConfigError: unknown mode, or an emulated-only setting with real compute.
    """
    if compute not in COMPUTE_MODES:
        raise ConfigError(f"compute must be one of {', '.join(COMPUTE_MODES)}, got {compute!r}")
    problems = []
    if cluster.compute == "emulated":
        problems.append(f"cluster {cluster.name} records compute: emulated; run it with --compute emulated "
                        f"(API: compute='emulated')")
    if cluster.compute_dilation != 1:
        problems.append(f"cluster {cluster.name} has compute_dilation {cluster.compute_dilation:g}, which only "
                        f"emulated compute can follow (real TensorFlow compute cannot be slowed down); run with "
                        f"--compute emulated, or bring the testbed up without --dilation")
    if step_time_s is not None:
        problems.append("--step-time sets the compute time of emulated compute; add --compute emulated")
    if problems:
        raise ConfigError(problems)


def load_failure(model_def, cluster: ClusterSpec, error: Exception) -> ConfigError:
    """What a command or a Trainer says when the workers cannot build the model (its code raises there, or the
    load outlasts the time limit): the model's fault or the cluster's (a token it refuses: ``token_mismatch``)."""
    fix = (token_mismatch(str(error)) or python_branch(str(error))
           or "; check that the model trains on this cluster (autosync run)")
    return ConfigError(f"the workers could not load model {model_def.name} on cluster {cluster.name}: {error}{fix}")


def require_resolved(value, types: tuple, what: str):
    """``value`` when it is one of ``types``; the runtime takes resolved objects only.

    Raises:
        TypeError: anything else (typically a name or a path, which the API resolves).
    """
    if not isinstance(value, types):
        kinds = " or ".join(t.__name__ for t in types)
        raise TypeError(f"{what} must be a {kinds}, got {short_repr(value)}; the runtime takes resolved objects: "
                        f"resolve names and files (zoo:NAME, script.py:function, local, YAML paths) with "
                        f"autosync.make_runner(model, cluster, ...), autosync.make_trainer(model, strategy, cluster, ...) or "
                        f"autosync.load_model_def / load_model_spec / load_cluster")
    return value


def emulated_setup(model, cluster: ClusterSpec, model_spec, step_time_s, optimizer):
    """(EmulatedModelDef, the cluster marked ``compute: emulated``, the ModelSpec trials are
    recorded against) for a ModelSpec or an EmulatedModelDef (``model_spec``, when given, is the
    spec and ``model`` is not read).

    The recorded spec carries the undilated step time as its profile (the cluster carries the
    dilation), so the simulator sees what the workers do.

    Raises:
        TypeError: neither a ModelSpec nor an EmulatedModelDef (a trainable model's spec, with
            its measured compute time, comes from ``autosync.load_model_spec(model, profile=True)``).
    """
    from strategy_space import ComputeProfile

    cluster = dataclasses.replace(require_resolved(cluster, (ClusterSpec,), "the cluster"), compute="emulated")
    if isinstance(model, EmulatedModelDef):
        return model, cluster, model.spec
    if model_spec is None:
        model_spec = require_resolved(model, (ModelSpec, EmulatedModelDef), "an emulated-compute model")
    require_resolved(model_spec, (ModelSpec,), "model_spec")
    md = emulated_model_def(model_spec, cluster, step_time_s, optimizer)
    base = model_spec.profile
    # the record names what the emulated time is: the spec's measured device's, or --step-time's
    device = f"emulated {base.device}" if step_time_s is None and base is not None and base.device else "emulated"
    profile = ComputeProfile(step_time_s=md.step_time_s / cluster.compute_dilation, device=device,
                             ready_order=base.ready_order if base else ())
    spec = dataclasses.replace(model_spec, profile=profile)
    return dataclasses.replace(md, spec=spec), cluster, spec


def session_timeline(session: Session, record: bool, deadline: float) -> dict:
    """Turn the timeline of every worker and PS actor of ``session`` on, or off: then actor label
    (``worker I (NODE)``, ``ps@NODE``) -> its events (``timeline.toggle``)."""
    plan = session.plan
    labels = [f"worker {i} ({plan.replica_node(slot)})" for i, slot in enumerate(plan.replicas)]
    labels += [p.name for p in plan.ps_actors]
    actors = list(session.workers) + list(session.ps_actors)
    got = wait_all([a.timeline.remote(record) for a in actors], deadline, "worker or parameter server", labels)
    return dict(zip(labels, got))


def session_abort(session: Session | None, pool: WorkerPool) -> None:
    """Kill everything a failed or hung trial may have left running."""
    if session is not None:
        session.abort()
    else:
        pool.kill_all()
