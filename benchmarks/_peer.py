"""The peer a Ray user would pick instead of AutoSync: Ray Train's ``TensorflowTrainer`` running
``MultiWorkerMirroredStrategy`` (collective all-reduce of every gradient), measured on the same
model, per-worker batch and nodes.

Keras 3.15 + TF 2.21 break MultiWorkerMirroredStrategy with more than one worker in two places
(``_maybe_symbolic_build`` reduces a tuple of PerReplica values; ``reduce_per_replica`` reduces
scalar metrics along axis 0). ``patch_keras_for_mwms`` works around both; it is applied inside the
benchmark's training function only, never by AutoSync itself.
"""
from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time


def patch_keras_for_mwms() -> None:
    """Work around the two Keras 3 bugs above (idempotent)."""
    import tensorflow as tf
    from keras.src import tree
    from keras.src.backend.tensorflow import trainer as kt

    if getattr(kt.TensorFlowTrainer, "_autosync_mwms_patch", False):
        return
    original_build = kt.TensorFlowTrainer._maybe_symbolic_build

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        if self._distribute_strategy is None or iterator is None:
            return original_build(self, iterator=iterator, data_batch=data_batch)
        # the batch is only needed for its shapes: take the first local replica's part
        for _, _, it in iterator:
            batch = next(it)
            break
        strategy = self.distribute_strategy
        local = tf.nest.map_structure(
            lambda v: strategy.experimental_local_results(v)[0] if isinstance(v, tf.distribute.DistributedValues) else v,
            batch)
        with strategy.scope():
            self._symbolic_build(data_batch=local)

    def reduce_per_replica(values, strategy, reduction):
        if kt._collective_all_reduce_multi_worker(strategy) and reduction in ("auto", "mean"):
            def mean(v):
                local = strategy.experimental_local_results(v)[0] if kt._is_per_replica_instance(v) else v
                return strategy.reduce("MEAN", v, axis=0 if (local.shape.rank or 0) > 0 else None)
            return tree.map_structure(mean, values)
        return original_reduce(values, strategy, reduction)

    original_reduce = kt.reduce_per_replica
    kt.TensorFlowTrainer._maybe_symbolic_build = _maybe_symbolic_build
    kt.reduce_per_replica = reduce_per_replica
    kt.TensorFlowTrainer._autosync_mwms_patch = True


def _train_loop(config: dict) -> None:
    """Runs in every Ray Train worker: MWMS training with per-batch timing."""
    import keras
    import numpy as np
    import ray.train
    import tensorflow as tf

    from autosync.sources import load_model_def

    patch_keras_for_mwms()
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    model_def = load_model_def(config["model"])
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        keras.utils.set_random_seed(model_def.seed)
        model = model_def.model_fn()
        # the user's loss as a Ray Train user hands it to compile (Keras wraps and scales it)
        model.compile(optimizer=model_def.optimizer_fn(), loss=model_def.loss_fn())

    batches = model_def.batches(rank, world)
    if config.get("target") is not None:
        # training to a loss: this worker's whole stream of batches, as AutoSync's workers read it
        first = next(batches)
        spec = tf.nest.map_structure(lambda a: tf.TensorSpec(np.shape(a), tf.as_dtype(np.asarray(a).dtype)), first)
        # a fresh stream from its start each time the dataset is iterated: Keras iterates it once
        # to build the model and once to train, and a shared iterator would lose the batches the
        # first pass (and its prefetch) took
        ds = tf.data.Dataset.from_generator(lambda: model_def.batches(rank, world), output_signature=spec)
    else:
        # a few real batches of this worker's shard, held in memory and repeated: no Python
        # generator in the measured loop
        held = [next(batches) for _ in range(min(8, config["warmup"] + config["steps"]))]
        stacked = tf.nest.map_structure(lambda *xs: np.stack(xs), *held)
        ds = tf.data.Dataset.from_tensor_slices(stacked).repeat()
    options = tf.data.Options()
    # every worker already reads its own shard of the data (as AutoSync's workers do)
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    ds = ds.with_options(options)
    # a per-worker dataset as it is: handed a plain dataset, Keras distributes it with
    # experimental_distribute_dataset, which takes each batch for the global one and splits it over
    # all replicas, so each worker would train on half its batch (and the peer on half the global
    # batch: a different loss from the first step, more steps to a target)
    ds = strategy.distribute_datasets_from_function(lambda _context: ds)

    ends: list[float] = []
    losses: list[float] = []
    target, window = config.get("target"), config.get("window", 20)

    class Timer(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            ends.append(time.perf_counter())
            # Keras logs the epoch's running mean (constant batches): this batch's own loss from it
            mean = float((logs or {}).get("loss", float("nan")))
            losses.append(mean * len(ends) - sum(losses))
            if target is not None and len(losses) >= window and sum(losses[-window:]) / window <= target:
                self.model.stop_training = True

    steps = config["warmup"] + config["steps"] if target is None else config["cap"]
    start = time.perf_counter()
    model.fit(ds, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=[Timer()])
    times = [b - a for a, b in zip([start] + ends[:-1], ends)][config["warmup"]:]
    ray.get(ray.get_actor(config["collector"]).put.remote(rank, {
        "step_times": times, "batches_seen": len(ends), "fit_s": time.perf_counter() - start,
        "losses": losses, "ends": [e - start for e in ends]}))


class _Collector:
    """Named actor the training workers hand their timings to (Ray Train V2 keeps no metrics of
    reports without a checkpoint)."""

    def __init__(self):
        self.results: dict = {}

    def put(self, rank: int, result: dict) -> None:
        self.results[rank] = result

    def get(self) -> dict:
        return self.results


def measure_peer(model: str, cluster, warmup: int = 3, steps: int = 10, timeout_s: float = 600, *,
                 target: float | None = None, window: int = 20, cap: int = 0) -> dict:
    """Median step time of TensorflowTrainer (MWMS) for ``model`` (a trainable source string) with
    one worker per replica slot of ``cluster``, spread over its nodes as AutoSync spreads them.

    With ``target``: train on the workers' whole data streams until the mean loss of the last
    ``window`` steps is at most ``target`` (at most ``cap`` steps); the result also has
    ``losses`` and ``ends`` (seconds from the start of ``fit`` to the end of each step, rank 0).

    Returns:
        ``{"status": "ok", "step_times": [...], "median": s, ...}`` or ``{"status": "failed", "error": ...}``.
    """
    from ray.train import RunConfig, ScalingConfig
    from ray.train.tensorflow import TensorflowTrainer

    import ray

    world = cluster.num_workers
    collector_name = f"autosync-peer-collector-{time.time_ns()}"
    collector = ray.remote(num_cpus=0)(_Collector).options(name=collector_name).remote()
    storage = tempfile.mkdtemp(prefix="autosync-peer-")   # Ray Train's run records: not kept
    one_per_node = all((n.workers or 0) <= 1 for n in cluster.nodes) and len(cluster.nodes) > 1
    try:
        trainer = TensorflowTrainer(
            _train_loop,
            train_loop_config={"model": model, "warmup": warmup, "steps": steps, "collector": collector_name,
                               "target": target, "window": window, "cap": cap},
            scaling_config=ScalingConfig(num_workers=world, use_gpu=False, resources_per_worker={"CPU": 1},
                                         placement_strategy="STRICT_SPREAD" if one_per_node else "PACK"),
            run_config=RunConfig(name=f"peer-{int(time.time())}", storage_path=storage),
        )
        trainer.fit()
        results = ray.get(collector.get.remote())
    except Exception as e:  # the peer failing is a result to report, not a crash of the benchmark
        return {"status": "failed", "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    finally:
        ray.kill(collector)
        shutil.rmtree(storage, ignore_errors=True)
    chief = results.get(0, {})
    times = chief.get("step_times") or []
    if not times:
        return {"status": "failed", "error": f"no step times from rank 0: {chief or results}"}
    return {"status": "ok", "step_times": times, "median": statistics.median(times),
            "losses": chief.get("losses", []), "ends": chief.get("ends", [])}


if __name__ == "__main__":  # quick manual check: python benchmarks/_peer.py zoo:ncf
    import sys

    import ray

    from autosync.sources import load_cluster

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR")
    print(measure_peer(sys.argv[1] if len(sys.argv) > 1 else "zoo:ncf", load_cluster("local"), warmup=2, steps=5))
