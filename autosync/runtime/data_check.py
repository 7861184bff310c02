"""Workers that draw the same data: a ``dataset_fn`` that ignores the worker's index.

Data parallelism trains on one shard per worker; a ``dataset_fn(i, n)`` that never uses ``i`` (a
``tf.data`` pipeline read in order without ``shard``, a file list every worker reads alike) gives
every worker the same batches, so N workers train as one does, at N times the cost: a mistake
``tf.distribute`` hides by sharding datasets itself, and Horovod and Ray Train leave to the user.
Each worker reports a digest of its first batch (``TrainingWorker.load``); when all of them agree,
``SameDataWarning`` says so. It stays a warning: step times, what ``tune`` measures, do not depend
on the data, and a test may want the same batches everywhere.
"""
from __future__ import annotations

import warnings


class SameDataWarning(UserWarning):
    """Every worker drew the same first batch from ``dataset_fn``."""


def check_shards(model_name: str, slots: list, digests: list) -> None:
    """Warn (``SameDataWarning``) when two or more workers all drew the same first batch."""
    if len(slots) < 2 or None in digests or len(set(digests)) != 1:
        return
    warnings.warn(SameDataWarning(
        f"model {model_name}: workers {', '.join(slots)} all drew the same first batch from dataset_fn, so they "
        f"train on copies of one shard, as one worker would; give each its own: dataset_fn(i, n) gets the "
        f"worker's index i (tf.data: ds.shard(n, i); or sample with a generator seeded by i)"), stacklevel=2)
