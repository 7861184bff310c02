"""The benchmarks' peer (Ray Train's TensorflowTrainer, ``benchmarks/_peer.py``) trains what
AutoSync trains: each of 2 workers on its own batch of the same stream, the same update as one
process on the global batch. Two faults made it train another model before: Keras split each
worker's batch over all replicas (half the global batch a step), and a data stream shared between
Keras' build pass and its training pass lost batches."""
from __future__ import annotations

import glob
import importlib
import os
import sys
import tempfile

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.integration

BENCH = os.path.join(REPO, "benchmarks")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)


def _one_process_losses(model_def, steps: int) -> list[float]:
    import keras
    import numpy as np
    import tensorflow as tf

    keras.utils.set_random_seed(model_def.seed)
    model, optimizer, loss = model_def.model_fn(), model_def.optimizer_fn(), model_def.loss()
    streams = [model_def.batches(0, 2), model_def.batches(1, 2)]
    losses = []
    for _ in range(steps):
        (x0, y0), (x1, y1) = (next(s) for s in streams)
        x = tf.nest.map_structure(lambda a, b: np.concatenate([a, b]), x0, x1)
        with tf.GradientTape() as tape:
            value = loss(np.concatenate([y0, y1]), model(x, training=True))
        optimizer.apply_gradients(zip(tape.gradient(value, model.trainable_variables), model.trainable_variables))
        losses.append(float(value))
    return losses


def test_ray_train_peer_makes_the_one_process_update_on_the_global_batch(ray_session):
    from ray import cloudpickle

    from autosync.sources import load_cluster, load_model_def

    peer = importlib.import_module("_peer")
    cloudpickle.register_pickle_by_value(peer)
    cluster = load_cluster("local")
    assert cluster.num_workers == 2
    runs = lambda: set(glob.glob(os.path.join(tempfile.gettempdir(), "autosync-peer-*")))  # noqa: E731
    before = runs()
    got = peer.measure_peer("zoo:ncf", cluster, warmup=0, steps=0, target=float("-inf"), window=20, cap=4,
                            timeout_s=300)
    assert got["status"] == "ok", got.get("error")
    assert runs() <= before, "Ray Train's run records were left in the temporary directory"
    want = _one_process_losses(load_model_def("zoo:ncf"), 4)
    # the first loss checks the batch each worker trains on, the later ones the updates and the stream
    assert got["losses"] == pytest.approx(want, rel=1e-4, abs=1e-5)
