"""The training worker actor: one per replica; builds the Keras model and computes gradients.

A worker process imports TensorFlow once (seconds), so the runtime keeps workers warm across
trials; ``load`` builds a model, ``reset`` starts a trial from the initial weights and a fresh data
iterator, and ``run`` executes steps against the trial's synchronization channels.
"""
from __future__ import annotations

import os
import time

import numpy as np

from autosync.runtime.optimizers import keras_optimizer_config


def _to_numpy(grad):
    """A gradient as numpy: ndarray, ``(indices, values)`` for IndexedSlices, or None."""
    if grad is None:
        return None
    if hasattr(grad, "indices") and hasattr(grad, "values"):
        return grad.indices.numpy(), grad.values.numpy()
    return grad.numpy()


class TrainingWorker:
    """State of one training replica (wrapped with ``ray.remote`` by the runtime).

    Args:
        num_cpus: CPUs this actor was given; TensorFlow's thread pools are sized to it before
            TensorFlow runs anything in this process.
    """

    def __init__(self, num_cpus: float):
        threads = max(1, int(num_cpus))
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(threads)
        # two at least: an in-graph collective is launched by an inter-op thread, and with one
        # it waits for whatever long gradient op runs (no overlap with the backward pass)
        tf.config.threading.set_inter_op_parallelism_threads(max(2, threads))
        self.threads = threads
        self.model_def = None
        self.model = None
        self.channels: list = []
        self.step = 0

    def info(self) -> dict:
        """Where this worker runs."""
        import ray
        import tensorflow as tf

        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                "intra_op_threads": tf.config.threading.get_intra_op_parallelism_threads(),
                "inter_op_threads": tf.config.threading.get_inter_op_parallelism_threads()}

    def collective_address(self) -> str:
        """Where this worker's TensorFlow server will listen (``host:port``)."""
        from autosync.comm.tf_collective import free_address

        return free_address()

    def join_collective(self, rank: int, addresses: list) -> str:
        """Join the workers' TensorFlow cluster (before ``load``); see ``tf_collective.join``."""
        from autosync.comm.tf_collective import join

        return join(rank, addresses)

    def load(self, model_def, worker_index: int, num_workers: int) -> dict:
        """Build the model from its seed and probe one gradient.

        Returns:
            ``{"variables": [{name, shape, dtype, sparse}], "optimizer": config, "initial": [arrays]}``
            (trainable variables in model order).
        """
        import keras
        import tensorflow as tf

        self.model_def = model_def
        keras.utils.set_random_seed(model_def.seed)
        self.model = model_def.model_fn()
        self.loss = model_def.loss_fn()
        optimizer = model_def.optimizer_fn()
        model, loss_fn = self.model, self.loss

        @tf.function
        def gradients(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            return loss, tape.gradient(loss, model.trainable_variables)

        @tf.function
        def assign(values):
            # one graph call for all pulled values instead of one eager op per variable
            for var, value in zip(model.trainable_variables, values):
                var.assign(value)

        self._gradients = gradients
        self._assign = assign
        x, y = next(model_def.batches(worker_index, num_workers))
        _, grads = gradients(x, y)  # builds a model created without shapes, traces once
        self.variables = list(model.trainable_variables)
        self.initial_weights = [w.copy() for w in model.get_weights()]
        return {
            "variables": [{"name": v.path, "shape": list(v.shape), "dtype": str(v.dtype),
                           "sparse": isinstance(g, tf.IndexedSlices)}
                          for v, g in zip(self.variables, grads)],
            "optimizer": keras_optimizer_config(optimizer),
            "initial": [v.numpy() for v in self.variables],
        }

    def reset(self, worker_index: int, num_workers: int, channels: list, layout: list) -> None:
        """Start from the initial weights with a fresh data iterator and the given channels;
        ``layout[v]`` is variable v's (number of shards, partition axis)."""
        self.model.set_weights(self.initial_weights)
        self.batches = self.model_def.batches(worker_index, num_workers)
        self.channels = channels
        # a channel that synchronizes inside the graph supplies the step (its gradients come back None)
        self._compute = next((c.bind(self.model, self.loss, self.model_def.optimizer_fn())
                              for c in channels if hasattr(c, "bind")), self._gradients)
        self.layout = [tuple(x) for x in layout]
        self.step = 0

    def run(self, steps: int) -> dict:
        """Run ``steps`` training steps, then pull the final values.

        Returns:
            per-step lists ``start`` (UNIX time at each step start, plus one after the final
            pull), ``compute``, ``sync`` (seconds), ``loss`` and ``calls`` (Ray calls made).
        """
        out = {"start": [], "compute": [], "sync": [], "loss": [], "calls": []}
        for _ in range(steps):
            calls0 = sum(c.calls for c in self.channels)
            t0 = time.time()
            out["start"].append(t0)
            self._assign_pulled(self.step)
            x, y = next(self.batches)
            t1 = time.perf_counter()
            loss, grads = self._compute(x, y)
            grads = [_to_numpy(g) for g in grads]
            compute = time.perf_counter() - t1
            for channel in self.channels:
                channel.push(self.step, grads)
            out["compute"].append(compute)
            out["sync"].append(time.time() - t0 - compute)
            out["loss"].append(float(loss))
            out["calls"].append(sum(c.calls for c in self.channels) - calls0)
            self.step += 1
        # the final pull waits for every worker's last update: the model ends fully synchronized
        self._assign_pulled(self.step, fresh=True)
        for channel in self.channels:
            channel.finish()
        out["start"].append(time.time())
        return out

    def get_weights(self) -> list:
        """All model weights (``model.get_weights()`` order)."""
        return self.model.get_weights()

    def _assign_pulled(self, step: int, fresh: bool = False) -> None:
        parts: dict = {}
        for channel in self.channels:
            parts.update(channel.pull(step, fresh=fresh))
        pulled = {}
        for v, (shards, axis) in enumerate(self.layout):
            if shards == 1:
                if (v, 0) in parts:
                    pulled[v] = parts[(v, 0)]  # zero-copy view of the received buffer
            elif all((v, i) in parts for i in range(shards)):
                pulled[v] = np.concatenate([parts[(v, i)] for i in range(shards)], axis=axis)
        if len(pulled) == len(self.variables):
            self._assign([pulled[i] for i in range(len(self.variables))])
        else:
            for i, value in pulled.items():
                self.variables[i].assign(value)
