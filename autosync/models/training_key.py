"""What a model's training curve depends on beyond its variables' names and shapes, as a digest.

A statistical-efficiency probe (``autosync.probe``) trains a lossy strategy beside its lossless
twin and is stored for reuse. Whether a compressor or staleness costs convergence depends on how
the model trains: its optimizer (class, learning rate or schedule, momentum, clipping, decay), its
loss, its layers (an activation changed keeps every variable's shape), its initial weights and its
data. Keyed on the variables alone, a probe of a learning rate that diverged would be reused after
the user lowered it. ``training_digest`` covers them, computed in the driver the way a worker builds
the model (``autosync.runtime.worker``): under the ModelDef's seed, worker 0 of ``workers``; and the
code of the ModelDef's four factories (the file each is defined in: a model script, the zoo; a
function typed in a notebook, its compiled code), since a custom layer's ``call``, a loss function
or a learning-rate function edited under the same name leaves every config as it was.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import json
import marshal
import re
import warnings
from pathlib import Path

from strategy_space.strict import fingerprint

from .apart import Taken

# object addresses in the text of a value that has no config of its own (``<function f at 0x7f...>``)
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_FACTORIES = ("model_fn", "loss_fn", "optimizer_fn", "dataset_fn")
# digests taken where a large model was read in a process of its own for something else
# (``read_with_digest``), per ModelDef object and number of workers
_TAKEN = Taken()


def _plain(value) -> str:
    """A JSON-able stand-in for a value ``json`` cannot write: its text without addresses."""
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    return _ADDRESS.sub("", repr(value))


def _config(obj) -> dict:
    """A Keras object's (a model, a loss) ``get_config()`` with its class, or its class alone where
    it has none (a subclassed model)."""
    name = _plain(type(obj))
    try:
        return {"class": name, "config": obj.get_config()}
    except Exception:  # noqa: BLE001 - NotImplementedError (subclassed models), or a user's own error
        return {"class": name}


def _code(fn) -> str:
    """A digest of a factory's code: the file it is defined in, else its compiled code (with the
    arguments a ``functools.partial`` binds)."""
    bound = []
    while isinstance(fn, functools.partial):
        bound.append(_ADDRESS.sub("", repr((fn.args, sorted(fn.keywords.items())))))
        fn = fn.func
    try:
        text = Path(inspect.getsourcefile(fn) or "").read_bytes()
    except (TypeError, OSError):   # a builtin, or code with no file (a notebook's, exec'd text)
        code = getattr(fn, "__code__", None)
        text = marshal.dumps(code) if code is not None else _plain(fn).encode()
    return hashlib.sha1(text + repr(bound).encode()).hexdigest()


def training_digest(model_def, workers: int) -> str:
    """A 16-hex-digit digest of the model's layers, initial weights, loss, optimizer and worker 0's
    first batch (of ``workers``), as every worker builds and draws them, and of its factories' code.

    A large model is built in a process of its own (``apart``); the code is read here (a function
    pickled by value has no file in the child).

    Raises:
        ConfigError: the user's factories fail (``ingest.user_code``).
    """
    from . import apart

    taken = _TAKEN.get(model_def, workers)
    if taken is not None:
        return taken
    return apart.read(built_digest, model_def, workers, [_code(getattr(model_def, f)) for f in _FACTORIES])


def read_with_digest(fn, model_def, args: tuple, workers: int):
    """``apart.read(fn, model_def, *args)``; where the model is read in a process of its own, its
    ``training_digest`` for ``workers`` is taken there too and kept, so that a later
    ``training_digest`` of this ModelDef (the same object) starts no process of its own."""
    from . import apart

    code = [_code(getattr(model_def, f)) for f in _FACTORIES]
    result, digest = apart.read_and(fn, model_def, args, (built_digest, (workers, code)))
    if digest is not None:
        _TAKEN.put(model_def, digest, workers)
    return result


def built_digest(model_def, workers: int, code: list) -> str:
    """``training_digest`` of ``code`` (its factories' digests) and of the model built in this
    process."""
    import keras
    import numpy as np
    import tensorflow as tf

    from autosync.models.ingest import user_code
    from autosync.runtime import random_seeds
    from autosync.runtime.digest import weights_digest
    from autosync.runtime.optimizer_config import USER_CLASSES, keras_optimizer_config

    with user_code(model_def, "building the model, its loss, optimizer and first batch for the probe cache"), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")   # e.g. Keras on a lambda in a config: the workers say it where it matters
        keras.utils.set_random_seed(model_def.seed)
        model = model_def.build_model()
        x, _ = next(model_def.batches(0, workers))
        model(x, training=False)   # weights built lazily come out as the worker's do
        weights = weights_digest([np.asarray(w.numpy()) for w in model.weights])
        seed = random_seeds.worker_seed(model_def.seed, 0)
        first = next(random_seeds.seeded(seed, model_def.batches(0, workers)))
        batch = weights_digest([np.asarray(a) for a in tf.nest.flatten(first)])
        # not its name: Keras names a process's second Adam ``adam_1``
        optimizer = {k: v for k, v in keras_optimizer_config(model_def.optimizer_fn()).items()
                     if k not in (USER_CLASSES, "name")}
        parts = {"model": _config(model), "weights": weights, "batch": batch, "loss": _config(model_def.loss()),
                 "optimizer": optimizer, "batch_size": model_def.batch_size,
                 "code": code}
    return fingerprint(json.loads(json.dumps(parts, default=_plain)))
