"""A dense model whose gradient (~8.4 MB per step) is big enough for the network to dominate a
step on the emulated testbed, with synthetic data.

Ray workers unpickle these factories; drivers register this module to be pickled by value
(``ray.cloudpickle.register_pickle_by_value``) because the tests folder is not importable there.
"""
from __future__ import annotations

import functools

import numpy as np

from autosync.model_def import ModelDef

INPUTS, HIDDEN, OUTPUTS = 512, 2048, 512


def build_model():
    import keras

    x = keras.Input((INPUTS,), name="x")
    h = keras.layers.Dense(HIDDEN, activation="relu", name="wide")(x)
    out = keras.layers.Dense(OUTPUTS, name="out")(h)
    return keras.Model(x, out)


def mse():
    import keras

    return keras.losses.MeanSquaredError()


def sgd(learning_rate: float = 0.01):
    import keras

    return keras.optimizers.SGD(learning_rate=learning_rate)


def make_batches(worker: int, num_workers: int, batch: int = 32, count: int = 4):
    """``count`` fixed random batches for this worker (a finite set the runtime cycles)."""
    rng = np.random.RandomState(500 + 31 * worker + num_workers)
    return [(rng.standard_normal((batch, INPUTS)).astype("float32"),
             rng.standard_normal((batch, OUTPUTS)).astype("float32")) for _ in range(count)]


def parameter_bytes() -> int:
    """Bytes of all trainable variables (float32), i.e. of one full gradient."""
    return 4 * (INPUTS * HIDDEN + HIDDEN + HIDDEN * OUTPUTS + OUTPUTS)


def model_def(batch: int = 32) -> ModelDef:
    return ModelDef(name="dense8mb", model_fn=build_model, loss_fn=mse, optimizer_fn=sgd,
                    dataset_fn=functools.partial(make_batches, batch=batch), batch_size=batch, seed=11)
