"""Trainer: real training of a model with a strategy on a Ray cluster.

    trainer = Trainer(model_def, strategy, cluster_spec)   # or autosync.make_trainer("zoo:ncf", "best.yaml", "local")
    history = trainer.fit(steps=100)
    weights = trainer.get_weights()
    trainer.close()

Consecutive ``fit`` calls continue training (weights, optimizer state and data position are kept). Workers
run ``steps_per_call`` steps per driver round trip; callbacks see each step's logs after its round trip returns.

Checkpoints (``autosync.runtime.checkpoint`` on disk, ``session_state`` in the actors):

    trainer.save("ckpt")                                   # between fit calls
    Trainer(model_def, strategy, cluster, restore="ckpt")  # continues from its step, under any strategy
    trainer.fit(steps=1000, checkpoint_every=100, checkpoint_dir="ckpt", max_failures=3)
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import time

import numpy as np

from autosync.model_def import ModelDef
from autosync.runtime.checkpoint import CheckpointInfo, CheckpointStore, Manifest
from autosync.runtime import data_parts, reshard, session_state, timeline as record
from autosync.runtime.engine import Session, TrialFailed, WorkerPool, wait_all
from autosync.runtime.fit_history import History, step_callbacks
from autosync.runtime.optimizers import check_model_optimizer
from autosync.runtime.plan import SyncPlan, model_spec_from_vars
from autosync.runtime.recovery import Recovery
from autosync.runtime.runner import load_failure, require_resolved, session_timeline, summarize_steps
from strategy_space import ClusterSpec, Strategy, validate
from strategy_space.errors import ConfigError


@contextlib.contextmanager
def _fails(session: Session):
    """Mark ``session`` failed if the block raises: a session that failed part-way (start, save,
    restore, weights) has its PS actors killed on close, never given back to the pool."""
    try:
        yield
    except BaseException:
        session.failed = True
        raise

def check_fit(steps, steps_per_call, checkpoint_every, checkpoint_dir, max_failures, elastic) -> None:
    """``Trainer.fit``'s arguments checked. Raises ConfigError, saying which and why."""
    if not (isinstance(steps, int) and not isinstance(steps, bool) and steps >= 0):
        raise ConfigError(f"steps must be an integer >= 0, got {steps!r}")
    if not (isinstance(steps_per_call, int) and steps_per_call >= 1):
        raise ConfigError(f"steps_per_call must be an integer >= 1, got {steps_per_call!r}")
    every = checkpoint_every
    if every is not None and not (isinstance(every, int) and not isinstance(every, bool) and every >= 1):
        raise ConfigError(f"checkpoint_every must be an integer >= 1 (steps) or None, got {checkpoint_every!r}")
    if not (isinstance(max_failures, int) and not isinstance(max_failures, bool) and max_failures >= 0):
        raise ConfigError(f"max_failures must be an integer >= 0, got {max_failures!r}")
    if not isinstance(elastic, bool):
        raise ConfigError(f"elastic must be True or False, got {elastic!r}")
    if elastic and not max_failures:
        raise ConfigError("elastic needs max_failures >= 1 (a node's loss is one of the failures it recovers from)")
    if checkpoint_dir is None and (checkpoint_every is not None or max_failures):
        raise ConfigError(f"{'checkpoint_every' if checkpoint_every is not None else 'max_failures'} needs "
                          f"checkpoint_dir: the directory checkpoints are written to "
                          f"{'and restarts continue from' if max_failures else ''}".rstrip())


class Trainer(Recovery):
    """Train with a synchronization strategy.

    The trainer takes resolved objects; ``autosync.make_trainer`` builds one from names and files
    (``zoo:ncf``, a strategy YAML, ``local``).

    Args:
        model: a ModelDef.
        strategy: a Strategy.
        cluster: a ClusterSpec.
        timeout_s: limit for each round trip to the workers (start-up included in the first).
        pool: warm workers to use (see ``RayRunner``); by default the trainer starts its own.
        restore: a checkpoint directory (``save``, ``fit(checkpoint_dir=...)``) to continue from:
            weights, optimizer state, global step and data positions. It must have been written
            with the same model and optimizer class; under another strategy the optimizer state is
            re-cut for this one (``reshard``), onto another number of workers each goes on in its
            own part of the data past the batches the saved workers drew together
            (``session_state.resized_position``; a synchronous strategy's checkpoint).
        keep_global_batch: where this trainer goes on with fewer workers than its checkpoint's (a
            ``restore`` onto fewer, an ``elastic`` fit without a lost node), each worker draws the
            batches of the workers it stands for as well (``data_parts``), so that a step applies
            the gradient of the same global batch, drawn as the uninterrupted run would have (a
            synchronous strategy then trains to its weights), each step computing the most batches
            a worker holds; else the global batch shrinks with the workers. Not with all-reduce
            groups reduced inside the training step (backend ``graph``, or ``auto`` on GPUs).

    Raises:
        TypeError: a model, strategy or cluster that is not one of the objects above.
        ConfigError: a strategy that does not fit the model, an optimizer the runtime does not
            implement (checked before Ray starts), a model the workers cannot load (its factories
            raise there: the worker's error is in the message), or a ``restore`` checkpoint that does not
            exist, is damaged or was written for another model or optimizer (the
            message says what differs; a missing or damaged one is found before Ray starts).
    """

    def __init__(self, model: ModelDef, strategy: Strategy, cluster: ClusterSpec, *, timeout_s: float = 600.0,
                 pool: WorkerPool | None = None, restore: str | os.PathLike | None = None,
                 keep_global_batch: bool = False):
        self.model_def = require_resolved(model, (ModelDef,), "the model")
        self.strategy = require_resolved(strategy, (Strategy,), "the strategy")
        self.cluster = require_resolved(cluster, (ClusterSpec,), "the cluster")
        if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s < float("inf")):
            raise ConfigError(f"timeout_s must be a number of seconds > 0, got {timeout_s!r}")
        if not isinstance(keep_global_batch, bool):
            raise ConfigError(f"keep_global_batch must be True or False, got {keep_global_batch!r}")
        check_model_optimizer(self.model_def)   # before Ray starts, as the commands do
        self.timeout_s = float(timeout_s)
        self._keras_model = None
        self.keep_global_batch, self._parts = keep_global_batch, None   # per worker, its data parts (or None)
        restoring = None
        if restore is not None:   # a missing, damaged or foreign checkpoint fails before Ray starts
            restoring = CheckpointStore(restore)
            manifest, _ = restoring.read()
            self._parts = data_parts.restored(len(manifest.data_positions),
                                              len(self.strategy.resolved_replicas(self.cluster)), keep_global_batch)
            problems = manifest.mismatches(self._manifest(variables=manifest.variables))
            if problems:
                raise ConfigError(problems, source=f"restore {restore}")
        self._own_pool = pool is None
        self._new_pool = False   # an elastic fit made its own pool (``Recovery._go_on_without``)
        # what an elastic fit goes back to when its nodes are back
        self._given = (self.strategy, self.cluster, self._parts)
        self.pool = WorkerPool.shared_or_new(self.cluster, pool)
        self.binding = self.pool.binding
        self.session: Session | None = None
        self.stop_training = False
        try:
            self._start()
            if keep_global_batch:   # (an elastic fit would find out only when a node is lost)
                self.session.check_parts()
            if restoring is not None:
                self._restore(restoring, time.monotonic() + self.timeout_s)
        except Exception:
            self.close()
            raise

    def _start(self) -> None:
        from autosync.runtime.optimizers import numpy_rules

        deadline = time.monotonic() + self.timeout_s
        if getattr(self, "plan", None) is not None and self.pool.description is not None:
            # a restart: the PS actors import Keras (if the optimizer needs it) while the workers start
            self.pool.ps.prepare([p.node for p in self.plan.ps_actors],
                                 not numpy_rules(self.pool.description["optimizer"]))
        elif self.pool.description is None or self.pool.model_def is not self.model_def:
            # the first start: likewise, beside the workers' first load of the model
            self.pool.ps.expect(self.model_def, self.strategy.ps_nodes())
        try:
            self.pool.ensure(self.model_def, self.strategy.resolved_replicas(self.cluster), deadline)
        except TrialFailed as e:   # at the first start: the model's fault (a restart's failures are counted)
            if getattr(self, "plan", None) is None:
                raise load_failure(self.model_def, self.cluster, e) from None
            raise
        desc = self.pool.description
        self.model_spec = model_spec_from_vars(self.model_def.name, desc["variables"], self.model_def.batch_size,
                                               desc["optimizer"], slots=True)   # what the memory check counts
        validate(self.strategy, self.model_spec, self.cluster)
        self.plan = SyncPlan.build(self.strategy, self.model_spec, self.cluster, desc["optimizer"], desc["variables"])
        self.session = Session(self.pool, self.plan, self._parts)
        with _fails(self.session):
            self.session.start(deadline)
        self.step = 0

    def fit(self, steps: int, callbacks=(), steps_per_call: int = 10, *, checkpoint_every: int | None = None,
            checkpoint_dir: str | os.PathLike | None = None, max_failures: int = 0, elastic: bool = False,
            timeline: str | os.PathLike | None = None) -> History:
        """Train ``steps`` steps.

        Args:
            steps: how many steps (each: every worker one batch, then synchronization).
            callbacks: callables ``fn(step, logs)`` or objects with ``on_step_end(step, logs)``;
                ``logs`` has ``loss``, ``step_time_s`` and ``wall_time_s``. Setting ``trainer.stop_training = True``
                stops after the current round trip. After a restart, the steps redone are seen
                again. A callback that raises ends ``fit`` with its exception once the round
                trip's steps are counted (``step``; a next ``fit`` goes on from there).
            steps_per_call: steps per round trip to the workers (shortened so that round trips
                end on every checkpoint step).
            checkpoint_every: write a checkpoint (``save``) to ``checkpoint_dir`` each time the
                global step reaches a multiple of this.
            checkpoint_dir: where checkpoints go (one directory; each write replaces the last).
            max_failures: how many times a worker or parameter-server failure (a dead actor, an
                error, a round trip past ``timeout_s``) is recovered from: everything left is killed,
                the actors are started again from the last checkpoint in ``checkpoint_dir`` (one is
                written when ``fit`` starts) and training goes on, as Ray Train's
                ``FailureConfig(max_failures)``. Needs ``checkpoint_dir``.
            elastic: when a node the strategy uses has left the Ray cluster (a failure, counted
                in ``max_failures``), go on without it: the strategy keeps its choices, the lost
                node's workers are dropped and its parameter-server shards move to the nodes left
                (``strategy_space.shrink.without_nodes``), and training goes on from the last
                checkpoint on fewer workers, past the batches drawn before, the global batch smaller
                (the learning rate is not rescaled), as Horovod's elastic mode, or kept
                (``keep_global_batch``: the workers left draw the lost ones' batches too). ``trainer.strategy``
                and ``trainer.cluster`` are then the re-placed ones. A Ray node with the lost node's
                label (or address) that has joined by then is taken instead, the strategy as it was;
                and at each ``checkpoint_every`` checkpoint after, once every node of the cluster it
                was given is in the Ray cluster again, training goes on on all of them under the
                strategy it was given, from that checkpoint.
                Without ``elastic`` such a failure ends ``fit``.
            timeline: write what every worker and parameter server did in these steps to this file
                as a Chrome trace (``autosync.runtime.timeline``; actors started again after a
                failure are not recorded).

        Returns:
            the History of these steps (``restarts`` lists the recoveries).

        Raises:
            ConfigError: bad arguments.
            RuntimeError: a worker or parameter server failed, more than ``max_failures`` times
                (every actor is then killed); the message lists each failure.
        """
        check_fit(steps, steps_per_call, checkpoint_every, checkpoint_dir, max_failures, elastic)
        callbacks = step_callbacks(callbacks)
        if self.session is None:
            raise RuntimeError("this Trainer is closed (or failed); create a new one")
        if timeline is not None:
            record.check_path(timeline, "timeline")
            session_timeline(self.session, True, time.monotonic() + self.timeout_s)
        store = CheckpointStore(checkpoint_dir) if checkpoint_dir is not None else None
        if store is not None:
            store.check_writable()
        history = History()
        self.stop_training = False
        first, target = self.step, self.step + steps
        failures: list[str] = []
        began = time.time()   # UNIX time, as the workers' step stamps
        if max_failures:   # the point a failure before the first periodic checkpoint restarts from
            self._save_or_end(store.path)

        def guarded(work):
            self._guarded(work, store, failures, max_failures, history, first, elastic)
        while self.step < target and not self.stop_training:
            n = min(steps_per_call, target - self.step)
            if checkpoint_every is not None:
                n = min(n, checkpoint_every - self.step % checkpoint_every)
            guarded(lambda: self._round_trip(n, callbacks, history, began, checkpoint_every, store))
            if elastic and checkpoint_every is not None and self.step % checkpoint_every == 0:
                guarded(lambda: self._take_back(store, history))   # nodes it went on without are back
        if self.step > first and self.session.pool.description["optimizer"].get("use_ema"):
            self._take_averages()   # as Keras' fit ends: the model takes its moving averages
        if timeline is not None and self.session is not None:
            record.save(timeline, session_timeline(self.session, False, time.monotonic() + self.timeout_s),
                        {"model": self.model_spec.name, "steps": [first, self.step]})
        return history

    def _save_or_end(self, path) -> None:
        """``save``; a failure ends the session (``fit``'s first checkpoint: nothing to restart from)."""
        try:
            self.save(path)
        except TrialFailed:
            self.session.abort()
            self.session = None
            raise

    def _take_averages(self) -> None:
        """Every parameter server's shards, then every worker's channels and model, take the
        optimizer's moving averages (``use_ema``)."""
        deadline = time.monotonic() + self.timeout_s
        with _fails(self.session):
            wait_all([a.finalize.remote() for a in self.session.ps_actors], deadline, "parameter server")
            wait_all([w.finalize.remote() for w in self.session.workers], deadline, "worker")

    def _round_trip(self, n: int, callbacks, history: History, began: float, checkpoint_every, store) -> None:
        try:
            results = self.session.run(n, time.monotonic() + self.timeout_s)
        except TrialFailed:
            raise   # ``_guarded`` kills what is left
        except Exception:
            self.session.abort()
            self.session = None
            raise
        summary = summarize_steps(results, 0)
        # a step ends when its last worker starts the next one (or finishes the final pull)
        ends = np.max([r["start"][1:] for r in results], axis=0) - began
        done = []   # every step the workers ran is counted before a callback can raise
        for loss, seconds, wall in zip(summary["loss"], summary["step_times"], ends):
            history.loss.append(loss)
            history.step_times.append(seconds)
            history.wall_times.append(float(wall))
            done.append((self.step, {"loss": loss, "step_time_s": seconds, "wall_time_s": float(wall)}))
            self.step += 1
        if checkpoint_every is not None and self.step % checkpoint_every == 0:
            self.save(store.path)
        for step, logs in done:
            for call in callbacks:
                call(step, logs)

    def save(self, path: str | os.PathLike) -> CheckpointInfo:
        """Write a checkpoint of the training state to the directory ``path``, atomically.

        It holds the model's weights (worker 0's, as ``get_weights``) in ``model.weights.h5``,
        the file the model's own ``save_weights`` writes (``keras.Model.load_weights`` reads it;
        written as the weights stream in, without a model in the driver: ``weights_file``),
        every parameter server's optimizer slots and update counters and the all-reduced
        variables' optimizer state and each worker's random-layer generators (``random_seeds``)
        and compressor memory (error feedback, PowerSGD's Qs) in ``state.npz``, and the global
        step and each worker's data position in ``manifest.json`` (see
        ``autosync.runtime.checkpoint`` for the layout). A crash while writing leaves the previous
        checkpoint in ``path`` whole. Not kept: the other workers' own non-trainable state
        (BatchNormalization statistics: worker 0's are restored on every worker).

        Returns:
            where it went, its size and how long the write took.

        Raises:
            ConfigError: ``path`` is a file or a non-empty directory that holds no checkpoint.
            TrialFailed: a worker or parameter server failed while its state was read.
        """
        if self.session is None:
            raise RuntimeError("this Trainer is closed (or failed); create a new one")
        t0 = time.perf_counter()
        store = CheckpointStore(path)
        store.check_writable()
        with _fails(self.session):
            snap = session_state.snapshot(self.session, time.monotonic() + self.timeout_s)
        manifest = dataclasses.replace(self._manifest(step=self.step, positions=snap.positions,
                                                      ps_versions=snap.ps_versions), state_index=snap.state_index())

        with _fails(self.session):
            info = store.write(manifest, lambda file: session_state.write_weights(snap, file, self._model),
                               snap.arrays())
        return dataclasses.replace(info, seconds=time.perf_counter() - t0, read_seconds=snap.read_s)

    def _manifest(self, step: int = 0, positions: tuple | None = None, ps_versions: dict | None = None,
                  variables: tuple | None = None) -> Manifest:
        """A manifest describing this trainer's state (``variables`` given: before the workers
        described the model)."""
        from autosync.runtime.optimizer_config import keras_optimizer_config

        if variables is None:
            variables = tuple((v["name"], tuple(v["shape"]), v["dtype"]) for v in self.pool.description["variables"])
            optimizer = self.pool.description["optimizer"]["class"]
        else:
            optimizer = keras_optimizer_config(self.model_def.optimizer_fn())["class"]
        n = sum(map(len, self._parts)) if self._parts else len(self.strategy.resolved_replicas(self.cluster))
        return Manifest(step=step, data_positions=tuple(positions) if positions is not None else (0,) * n,
                        model=self.model_def.name, variables=variables, optimizer=optimizer,
                        strategy=self.strategy.to_dict(), strategy_fingerprint=self.strategy.fingerprint,
                        ps_versions=ps_versions or {})

    def _model(self):
        """A Keras model of this ModelDef in the driver, to write and read the weights file with
        the model's own ``save_weights``/``load_weights`` where its layout is unknown
        (``weights_file``)."""
        if self._keras_model is None:
            self._keras_model = self._built_model()
        return self._keras_model

    def _built_model(self):
        model = self.model_def.build_model()
        if not model.built:   # a subclassed model: build it on one batch
            x, _ = next(self.model_def.batches(0, 1))
            model(x, training=False)
        return model

    def keras_model(self, metrics=None):
        """A new Keras model of this ModelDef in this process, holding the trained weights
        (``get_weights``) and compiled with the ModelDef's ``loss_fn()`` and ``metrics`` (as
        ``keras.Model.compile`` takes them): ``evaluate`` it on held-out data, ``predict`` or save it
        as any Keras model. It is the caller's: what is done to it leaves the Trainer as it was."""
        weights = self.get_weights()
        model = self._built_model()
        model.set_weights(weights)
        model.compile(loss=self.model_def.loss_fn(), metrics=metrics)
        return model

    def _restore(self, store: CheckpointStore, deadline: float) -> Manifest:
        """Load the checkpoint in ``store`` into the running session (fresh actors).

        Raises ConfigError: the checkpoint does not fit this trainer, or is damaged."""
        manifest, info = store.read()
        problems = manifest.mismatches(self._manifest())
        if problems:
            raise ConfigError(problems, source=f"restore {store.path}")
        with contextlib.ExitStack() as opened, _fails(self.session):
            # each weight is read when it is sent (a model's weights are not copied whole)
            weights, values = opened.enter_context(session_state.saved_weights(
                self.session, info.weights_path, deadline, self._model, f"restore {store.path}"))
            arrays, versions = opened.enter_context(contextlib.closing(store.arrays(manifest))), manifest.ps_versions
            if recut := manifest.strategy_fingerprint != self.strategy.fingerprint:   # re-cut for this strategy
                arrays, versions = reshard.recut(manifest, arrays, self.session.plan, f"restore {store.path}")
            state = session_state.SessionState(weights, manifest.data_positions, arrays, versions)
            problems = session_state.load(self.session, state, values, manifest.step, deadline, recut)
        if problems:
            self.session.failed = True   # refused part-way: likewise
            raise ConfigError(sorted(set(problems)), source=f"restore {store.path}")
        self.step = manifest.step
        return manifest

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
        with _fails(self.session):
            return self.session.weights(time.monotonic() + self.timeout_s)

    def close(self) -> None:
        """End the session (its PS actors go back to the pool, or are killed if it failed), and kill
        the workers and PS actors and stop the embedded Ray if this Trainer started them."""
        if self.session is not None:
            self.session.close(clean=True)   # PS actors of a failed session are killed (``Session.failed``)
            self.session = None
        if self._own_pool or self._new_pool:
            self.pool.kill_all()
        if self._own_pool:
            self.binding.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
