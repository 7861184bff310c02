"""An AutoSync model script: a small click-through model with a user-id embedding (sparse
gradient) and dense layers, trained on synthetic data.

Use it as ``--model examples/my_model.py:build``, e.g.::

    autosync inspect --model examples/my_model.py:build --profile

AutoSync imports this file, calls ``build()`` and uses the returned ModelDef. Every factory is a
module-level function (or a functools.partial of one) because each Ray worker builds its own
model, optimizer and data shard from them.
"""
import functools

import keras
import numpy as np

from autosync.model_def import ModelDef

USERS = 10_000
EMBEDDING_DIM = 32
FEATURES = 16
BATCH_SIZE = 64


def make_model():
    """Users are embedded (a sparse gradient); numeric features go through a dense layer."""
    user = keras.Input((), dtype="int32", name="user")
    features = keras.Input((FEATURES,), name="features")
    u = keras.layers.Embedding(USERS, EMBEDDING_DIM, name="user_embedding")(user)
    f = keras.layers.Dense(EMBEDDING_DIM, activation="relu", name="feature_dense")(features)
    x = keras.layers.Concatenate(name="concat")([u, f])
    x = keras.layers.Dense(64, activation="relu", name="hidden")(x)
    return keras.Model([user, features], keras.layers.Dense(1, name="logit")(x), name="my_model")


def make_loss():
    return keras.losses.BinaryCrossentropy(from_logits=True)


def make_optimizer(learning_rate=0.01):
    return keras.optimizers.Adam(learning_rate=learning_rate)


def make_dataset(worker_index, num_workers, batches=16):
    """This worker's shard: deterministic, and different for every worker index."""
    rng = np.random.default_rng([42, worker_index, num_workers])
    for _ in range(batches):
        user = rng.integers(0, USERS, size=BATCH_SIZE, dtype=np.int32)
        features = rng.normal(size=(BATCH_SIZE, FEATURES)).astype(np.float32)
        label = (features[:, 0] + 0.1 * rng.normal(size=BATCH_SIZE) > 0).astype(np.float32)
        yield (user, features), label


def build():
    """The function named on the command line: no arguments, returns a ModelDef."""
    return ModelDef(
        name="my_model",
        model_fn=make_model,
        loss_fn=make_loss,
        optimizer_fn=functools.partial(make_optimizer, learning_rate=0.01),
        dataset_fn=make_dataset,
        batch_size=BATCH_SIZE,
    )
