"""The random state of a model's layers, one stream per worker.

Keras' random layers (Dropout, GaussianNoise, SpatialDropout, random augmentation, a user's layer
that holds a ``keras.random.SeedGenerator``) draw from a seed generator whose state is a variable
of the model (``model.variables``, not ``model.weights``): a seed word and a counter that every
draw advances. Every worker builds the model from the ModelDef's seed, so every worker's generators
start from the same state: without more, worker k's example i would get the same dropout mask as
worker 0's example i in every step, noise that is correlated across the replicas, where one process
on the global batch draws every example's mask independently.

``worker_state`` gives each worker a stream of its own: worker 0 keeps the state the seed gave
(one worker trains as one process with that seed does), worker k > 0 gets another seed word,
derived from the first and k, so runs stay reproducible. A worker sets these at the start of
every trial (``TrainingWorker.reset``), so a trial does not depend on what the warm worker ran
before, and a checkpoint keeps each worker's current states (a restored run draws what the
uninterrupted one would have).
"""
from __future__ import annotations

import hashlib

import numpy as np

STATE_NAME = "seed_generator_state"   # the name Keras gives a SeedGenerator's state variable


def seed_states(model) -> list:
    """The state variables of the seed generators ``model`` tracks, in ``model.variables`` order
    (none for a model without random layers)."""
    weights = {id(w) for w in model.weights}
    return [v for v in model.variables
            if id(v) not in weights and getattr(v, "name", "") == STATE_NAME and tuple(v.shape) == (2,)]


def initial_states(model) -> list:
    """``(variable, its value now)`` of each of ``model``'s generators (``seed_states``): taken
    right after the build, the state the seed gave."""
    return [(v, np.array(v.numpy())) for v in seed_states(model)]


def worker_state(initial: np.ndarray, worker_index: int) -> np.ndarray:
    """Worker ``worker_index``'s start state for a generator that the seed started at ``initial``
    (``[seed, counter]``): ``initial`` itself for worker 0, another seed word for the others."""
    out = np.array(initial, copy=True)
    if worker_index:
        digest = hashlib.blake2b(f"{int(out[0])}/{int(worker_index)}".encode(), digest_size=8).digest()
        out[0] = int.from_bytes(digest, "little") % (2 ** 31 - 1) + 1   # fits every dtype Keras uses
    return out


def assign(variables: list, values: list) -> None:
    for variable, value in zip(variables, values):
        variable.assign(np.asarray(value, dtype=np.dtype(variable.dtype)))
