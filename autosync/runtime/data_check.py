"""What the runtime warns of the user's data and training: workers that draw the same data, and a
loss that diverges on an exact strategy.

Workers that draw the same data: a ``dataset_fn`` that ignores the worker's index.

Data parallelism trains on one shard per worker; a ``dataset_fn(i, n)`` that never uses ``i`` (a
``tf.data`` pipeline read in order without ``shard``, a file list every worker reads alike) gives
every worker the same batches, so N workers train as one does, at N times the cost: a mistake
``tf.distribute`` hides by sharding datasets itself, and Horovod and Ray Train leave to the user.
Each worker reports a digest of its first batch (``TrainingWorker.load``); when two or more agree,
``SameDataWarning`` names them. It stays a warning: step times, what ``tune`` measures, do not depend
on the data, and a test may want the same batches everywhere.

A loss that is not finite (nan, inf) in a trial of a lossless, synchronous strategy, which trains
as one process would: the model diverges with its optimizer and data, whatever the strategy, and
``DivergedWarning`` says so. Its step times still hold; the strategy recommended would not train
the model. (A lossy strategy's divergence is its own: the goodput probe gives it efficiency 0. Under
dynamic loss scaling a step whose loss is not finite is skipped, as Keras skips it: only a trial
whose last loss is not finite is said to diverge.)
"""
from __future__ import annotations

import math
import warnings


class TrainingWarning(UserWarning):
    """What the runtime warns of the user's model, data or training (said when a command ends)."""


class DivergedWarning(TrainingWarning):
    """A trial of a lossless, synchronous strategy saw a loss that is not finite."""


class SameDataWarning(TrainingWarning):
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


def check_losses(model_name: str, losses: list, strategy, optimizer: dict | None = None) -> None:
    """Warn (``DivergedWarning``) when a trial of ``strategy``, lossless, saw a loss that is not finite.
    Under dynamic loss scaling (the ``optimizer`` config's ``loss_scale``) such a step was skipped,
    as Keras skips it: only a trial whose last loss is not finite did not recover."""
    from autosync.runtime.loss_scale import LOSS_SCALE
    from tuner.records.goodput import is_lossless

    bad = next((x for x in losses if not math.isfinite(x)), None)
    if bad is not None and (optimizer or {}).get(LOSS_SCALE) is not None and math.isfinite(losses[-1]):
        return
    if bad is not None and is_lossless(strategy):
        warnings.warn(DivergedWarning(
            f"model {model_name}: its loss became {bad} in a trial of a lossless, synchronous strategy, which "
            f"trains as one process on the global batch would: the model diverges with its optimizer and data, "
            f"whatever the strategy; step times are measured all the same, but none of them trains it: lower the "
            f"learning rate, clip the gradients (e.g. global_clipnorm) or look for nan or inf in the data"),
            stacklevel=2)
