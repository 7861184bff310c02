"""Trainer: real training of a model with a strategy on a Ray cluster.

    trainer = Trainer(model_def, strategy, cluster_spec)   # or autosync.make_trainer("zoo:ncf", "best.yaml", "local")
    history = trainer.fit(steps=100)
    weights = trainer.get_weights()
    trainer.close()

Consecutive ``fit`` calls continue training (weights, optimizer state and data position are
kept). Workers run ``steps_per_call`` steps per driver round trip; callbacks see each step's
logs after its round trip returns.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from autosync.model_def import ModelDef
from autosync.runtime.engine import Session, WorkerPool
from autosync.runtime.optimizers import check_model_optimizer
from autosync.runtime.plan import SyncPlan, model_spec_from_vars
from autosync.runtime.runner import require_resolved, summarize_steps
from strategy_space import ClusterSpec, Strategy, validate
from strategy_space.errors import ConfigError


@dataclass
class History:
    """What ``fit`` did.

    Attributes:
        loss: per step, the mean over workers of each worker's batch loss.
        step_times: per step, seconds (the slowest worker).
        wall_times: per step, wall-clock seconds from the start of the ``fit`` call to the end of
            the step (the last worker's), driver round trips included: what loss against time
            is plotted over.
    """

    loss: list = field(default_factory=list)
    step_times: list = field(default_factory=list)
    wall_times: list = field(default_factory=list)

    @property
    def history(self) -> dict:
        """Keras-style ``{"loss": [...], "step_time_s": [...], "wall_time_s": [...]}``."""
        return {"loss": list(self.loss), "step_time_s": list(self.step_times), "wall_time_s": list(self.wall_times)}


class Trainer:
    """Train with a synchronization strategy.

    The trainer takes resolved objects; ``autosync.make_trainer`` builds one from names and files
    (``zoo:ncf``, a strategy YAML, ``local``).

    Args:
        model: a ModelDef.
        strategy: a Strategy.
        cluster: a ClusterSpec.
        timeout_s: limit for each round trip to the workers (start-up included in the first).
        pool: warm workers to use (see ``RayRunner``); by default the trainer starts its own.

    Raises:
        TypeError: a model, strategy or cluster that is not one of the objects above.
        ConfigError: a strategy that does not fit the model, or an optimizer the runtime does not
            implement (checked before Ray starts).
    """

    def __init__(self, model: ModelDef, strategy: Strategy, cluster: ClusterSpec, *, timeout_s: float = 600.0,
                 pool: WorkerPool | None = None):
        self.model_def = require_resolved(model, (ModelDef,), "the model")
        self.strategy = require_resolved(strategy, (Strategy,), "the strategy")
        self.cluster = require_resolved(cluster, (ClusterSpec,), "the cluster")
        check_model_optimizer(self.model_def)   # before Ray starts, as the commands do
        self.timeout_s = float(timeout_s)
        self._own_pool = pool is None
        self.pool = WorkerPool.shared_or_new(self.cluster, pool)
        self.binding = self.pool.binding
        self.session: Session | None = None
        self.stop_training = False
        try:
            self._start()
        except Exception:
            self.close()
            raise

    def _start(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        self.pool.ensure(self.model_def, self.strategy.resolved_replicas(self.cluster), deadline)
        desc = self.pool.description
        self.model_spec = model_spec_from_vars(self.model_def.name, desc["variables"], self.model_def.batch_size)
        validate(self.strategy, self.model_spec, self.cluster)
        self.plan = SyncPlan.build(self.strategy, self.model_spec, self.cluster)
        self.session = Session(self.pool, self.plan)
        self.session.start(deadline)
        self.step = 0

    def fit(self, steps: int, callbacks=(), steps_per_call: int = 10) -> History:
        """Train ``steps`` steps.

        Args:
            steps: how many steps (each: every worker one batch, then synchronization).
            callbacks: callables ``fn(step, logs)`` or objects with ``on_step_end(step, logs)``;
                ``logs`` has ``loss``, ``step_time_s`` and ``wall_time_s``. Setting ``trainer.stop_training = True``
                stops after the current round trip.
            steps_per_call: steps per round trip to the workers.

        Returns:
            the History of these steps.

        Raises:
            ConfigError: bad arguments.
            RuntimeError: a worker or parameter server failed (every actor is then killed).
        """
        if not (isinstance(steps, int) and steps >= 0):
            raise ConfigError(f"steps must be an integer >= 0, got {steps!r}")
        if not (isinstance(steps_per_call, int) and steps_per_call >= 1):
            raise ConfigError(f"steps_per_call must be an integer >= 1, got {steps_per_call!r}")
        if self.session is None:
            raise RuntimeError("this Trainer is closed (or failed); create a new one")
        history = History()
        self.stop_training = False
        done = 0
        began = time.time()   # UNIX time, as the workers' step stamps
        while done < steps and not self.stop_training:
            n = min(steps_per_call, steps - done)
            try:
                results = self.session.run(n, time.monotonic() + self.timeout_s)
            except Exception:
                self.session.abort()
                self.session = None
                raise
            summary = summarize_steps(results, 0)
            # a step ends when its last worker starts the next one (or finishes the final pull)
            ends = np.max([r["start"][1:] for r in results], axis=0) - began
            for loss, seconds, wall in zip(summary["loss"], summary["step_times"], ends):
                history.loss.append(loss)
                history.step_times.append(seconds)
                history.wall_times.append(float(wall))
                logs = {"loss": loss, "step_time_s": seconds, "wall_time_s": float(wall)}
                for cb in callbacks:
                    (cb.on_step_end if hasattr(cb, "on_step_end") else cb)(self.step, logs)
                self.step += 1
            done += n
        return history

    def get_weights(self) -> list:
        """All model weights as numpy arrays, in ``model.get_weights()`` order, as worker 0 holds
        them.

        Trainable weights are synchronized, so every worker holds the same values. Non-trainable
        state is not: BatchNormalization's moving mean and variance are worker 0's own, updated
        from its data shard only; they are not averaged over the workers as
        ``tf.distribute.MultiWorkerMirroredStrategy`` with ``SyncBatchNormalization`` would.
        """
        if self.session is None:
            raise RuntimeError("this Trainer is closed (or failed); create a new one")
        return self.session.weights(time.monotonic() + self.timeout_s)

    def close(self) -> None:
        """Kill the PS actors, and the workers and embedded Ray if this Trainer started them."""
        if self.session is not None:
            self.session.close()
            self.session = None
        if self._own_pool:
            self.pool.kill_all()
            self.binding.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
