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

``seeded``: each worker's data is drawn under a seed of its own as well (``worker_seed``).
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


def _derived(word: int, worker_index: int, kind: str = "") -> int:
    """Worker ``worker_index``'s word for ``word``: ``word`` for worker 0, else one in [1, 2**31)."""
    if not worker_index:
        return int(word)
    digest = hashlib.blake2b(f"{kind}{int(word)}/{int(worker_index)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2 ** 31 - 1) + 1   # fits every dtype Keras uses


def worker_state(initial: np.ndarray, worker_index: int) -> np.ndarray:
    """Worker ``worker_index``'s start state for a generator that the seed started at ``initial``
    (``[seed, counter]``): ``initial`` itself for worker 0, another seed word for the others."""
    out = np.array(initial, copy=True)
    out[0] = _derived(out[0], worker_index)
    return out


def worker_seed(seed: int, worker_index: int) -> int:
    """The seed of the process-wide generators (Python's ``random``, numpy's, TensorFlow's and
    Keras' global ones) while worker ``worker_index`` draws its data: the ModelDef's ``seed`` for
    worker 0, one derived from it and the index for the others."""
    return _derived(seed, worker_index, "data/")


def seeded(seed: int, batches):
    """``batches`` (an iterator not started yet, such as ``ModelDef.batches``) drawn under
    ``keras.utils.set_random_seed(seed)``, set where its first item is drawn (the prefetch
    thread). Every worker built the model under one seed, which also left the process-wide
    generators in one state: a ``dataset_fn`` that samples or shuffles with them (``np.random``,
    ``random``, ``tf.data``'s ``shuffle`` without a seed) gave every worker the same batches, N
    copies of one worker's data; and a restored run drew other batches than the uninterrupted one."""
    import keras

    keras.utils.set_random_seed(seed)
    yield from batches


def assign(variables: list, values: list) -> None:
    for variable, value in zip(variables, values):
        variable.assign(np.asarray(value, dtype=np.dtype(variable.dtype)))
