"""Workers that draw the same data: a ``dataset_fn`` that ignores the worker's index.

Data parallelism trains on one shard per worker; a ``dataset_fn(i, n)`` that never uses ``i`` (a
``tf.data`` pipeline read in order without ``shard``, a file list every worker reads alike) gives
every worker the same batches, so N workers train as one does, at N times the cost: a mistake
``tf.distribute`` hides by sharding datasets itself, and Horovod and Ray Train leave to the user.
Each worker reports a digest of its first batch (``TrainingWorker.load``); when two or more agree,
``SameDataWarning`` names them. It stays a warning: step times, what ``tune`` measures, do not depend
on the data, and a test may want the same batches everywhere.
"""
from __future__ import annotations

import warnings


class SameDataWarning(UserWarning):
    """Two or more workers drew the same first batch from ``dataset_fn``."""


def check_shards(model_name: str, slots: list, digests: list) -> None:
    """Warn (``SameDataWarning``) when two or more workers drew the same first batch: each group
    of them is named."""
    groups: dict = {}
    for slot, digest in zip(slots, digests):
        if digest is not None:
            groups.setdefault(digest, []).append(slot)
    alike = [g for g in groups.values() if len(g) > 1]
    if not alike:
        return
    which = "; ".join(", ".join(g) for g in alike)
    scope = "all " if len(alike) == 1 and len(alike[0]) == len(slots) else ""
    warnings.warn(SameDataWarning(
        f"model {model_name}: workers {which} {scope}drew the same first batch from dataset_fn, so they train on "
        f"copies of one shard, as one worker would; give each its own: dataset_fn(i, n) gets the worker's index "
        f"i (tf.data: ds.shard(n, i); or sample with a generator seeded by i)"), stacklevel=2)
