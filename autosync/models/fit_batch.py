"""What a batch is and what training minimizes on it, as ``keras.Model.fit`` has them.

A ``dataset_fn`` yields ``(inputs, targets)`` or ``(inputs, targets, sample_weight)``
(``split_batch``); the runtime carries every batch as a pair, the weights riding in the targets.
``batch_loss`` is the loss a step differentiates: the model's loss plus the losses it adds itself.
No TensorFlow at import: the runtime's modules import this at their top.
"""
from __future__ import annotations

from typing import Any

from autosync.models.keras_settings import check_precision
from strategy_space.errors import ConfigError

# A batch's sample weights ride inside its targets, ``{TARGETS: targets, SAMPLE_WEIGHT: weights}``:
# every path of the runtime that carries (inputs, targets) carries them too, and the loss
# ``ModelDef.loss()`` returns hands them to the user's loss as ``keras.Model.fit`` does.
TARGETS, SAMPLE_WEIGHT = "autosync/targets", "autosync/sample_weight"


def split_batch(batch: Any, where: str) -> tuple[Any, Any]:
    """(inputs, targets) of one batch from ``dataset_fn``: an (inputs, targets) pair, or an
    (inputs, targets, sample_weight) triple as ``keras.Model.fit`` takes it (the weights packed
    into the targets, see ``SAMPLE_WEIGHT``; None: unweighted).

    Raises:
        ConfigError: the batch is neither.
    """
    if isinstance(batch, (tuple, list)) and len(batch) == 3:
        x, y, weights = batch
        return (x, y) if weights is None else (x, {TARGETS: y, SAMPLE_WEIGHT: weights})
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise ConfigError(f"{where}: dataset_fn must yield (inputs, targets) pairs or (inputs, targets, "
                          f"sample_weight) triples, got {type(batch).__name__}"
                          + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else ""))
    return batch[0], batch[1]


def batch_loss(model, loss, inputs, targets):
    """What ``keras.Model.fit`` minimizes on a batch (``Model.compute_loss``): ``loss`` of the
    model's outputs in training mode plus every loss the model adds itself (weight and activity
    regularizers, ``add_loss``), each summed. Averaged over the workers, a weight regularizer's
    gradient counts once, as under a ``tf.distribute`` strategy, where Keras scales it by the
    number of replicas."""
    import keras

    value = loss(targets, model(inputs, training=True))
    for extra in model.losses:
        value = value + keras.ops.sum(keras.ops.cast(extra, value.dtype))
    return value


def check_model(model, where: str) -> None:
    """Refuse a model whose class changes what ``fit`` does with a batch (``train_step`` or
    ``compute_loss`` of its own): the runtime differentiates ``batch_loss``, so such a model would
    train differently here than under ``fit``, silently.

    Raises:
        ConfigError: which method, and where its logic can go instead.
    """
    import keras

    own = [m for m in ("train_step", "compute_loss") if getattr(type(model), m, None) is not getattr(keras.Model, m)]
    if own:
        raise ConfigError(f"{where}: model class {type(model).__name__} overrides {' and '.join(own)}; AutoSync "
                          f"computes each worker's gradient of loss_fn on the model's outputs plus the losses the "
                          f"model adds (regularizers, add_loss) itself, so that logic would not run. Move it into "
                          f"loss_fn (a loss per output is allowed), the model's call() with self.add_loss(...), or "
                          f"the optimizer")
    check_precision(model, where)
