"""A model's loss as the runtime calls it: one ``keras.losses.Loss`` whatever form the user gave.

``keras.Model.compile`` takes a ``Loss``, a name or a plain function and wraps the last so that
its per-example values are averaged over the batch; the runtime's workers call the loss directly,
so they need the same wrapping (a plain function returning per-example values would otherwise
be differentiated as their sum).
"""
from __future__ import annotations

import re
from typing import Any

import keras

from autosync.models.fit_batch import SAMPLE_WEIGHT, TARGETS
from strategy_space.errors import ConfigError


class FunctionLoss(keras.losses.Loss):
    """A plain loss function ``(y_true, y_pred)``, reduced by ``keras.losses.Loss``: the mean over
    every element of what it returns (a scalar is left as it is)."""

    def __init__(self, fn):
        # the name opens a TensorFlow name scope: only the characters a root scope may hold
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", getattr(fn, "__name__", "")).lstrip("_.-")
        super().__init__(name=name or "loss")
        self.fn = fn

    def call(self, y_true, y_pred):
        return self.fn(y_true, y_pred)


def as_keras_loss(loss: Any, where: str) -> keras.losses.Loss:
    """``loss`` as the ``keras.losses.Loss`` the runtime calls, reduced as ``keras.Model.compile``
    reduces it (``ModelLoss``): a ``Loss``, a Keras loss name or a function ``(y_true, y_pred)``,
    or a list or dict of them, one per model output, as ``compile(loss=...)`` takes them.

    Raises:
        ConfigError: ``loss`` (or one of its parts) is neither a ``Loss``, a Keras loss name nor a
            callable; ``where`` names what produced it.
    """
    if isinstance(loss, dict) and loss:
        return ModelLoss({k: _one(v, f"{where}[{k!r}]") for k, v in loss.items()})
    if isinstance(loss, (list, tuple)) and loss:
        return ModelLoss([_one(v, f"{where}[{i}]") for i, v in enumerate(loss)])
    if loss is None:
        raise ConfigError(f"{where} returned None, not a loss; return a keras.losses.Loss, a function "
                          f"(y_true, y_pred), a Keras loss name such as 'mse', or a list or dict of them")
    return ModelLoss(_one(loss, where))


def _one(loss: Any, where: str) -> keras.losses.Loss | None:
    if loss is None:   # one output of several without a loss, as compile takes it: not trained through
        return None
    if isinstance(loss, keras.losses.Loss):
        return loss
    if isinstance(loss, str):
        try:
            loss = keras.losses.get(loss)
        except ValueError:
            raise ConfigError(f"{where} returned {loss!r}, which is not a Keras loss name; return a "
                              f"keras.losses.Loss, a function (y_true, y_pred) or a name such as 'mse'") from None
        if isinstance(loss, keras.losses.Loss):
            return loss
    if not callable(loss):
        raise ConfigError(f"{where} returned {type(loss).__name__}, not a loss; return a keras.losses.Loss, "
                          f"a function (y_true, y_pred), a Keras loss name such as 'mse', or a list or dict "
                          f"of them (one per model output)")
    return FunctionLoss(loss)


class ModelLoss(keras.losses.Loss):
    """The model's loss as ``keras.Model.fit`` computes it from ``compile(loss=...)``:

    - the batch's sample weights taken from its targets where they ride (``fit_batch.split_batch``):
      per-example values times their weights, summed and divided by their number;
    - a model with several outputs (a list or dict of them): one loss per output, by position
      or by output name (one loss given: the same for every output), their values summed; the
      targets have the outputs' structure; sample weights, one array for all outputs or one per
      output. An output whose loss is None, or missing from a dict, adds nothing (its head gets
      no gradient and is not trained), as ``compile`` leaves it.
    """

    def __init__(self, losses):
        one = isinstance(losses, keras.losses.Loss)
        super().__init__(name=losses.name if one else "model_loss")
        self.losses = losses

    def __call__(self, y_true, y_pred, sample_weight=None):
        if isinstance(y_true, dict) and SAMPLE_WEIGHT in y_true:
            y_true, sample_weight = y_true[TARGETS], y_true[SAMPLE_WEIGHT]
        if not isinstance(y_pred, (list, tuple, dict)):
            if not isinstance(self.losses, keras.losses.Loss):
                raise ValueError(f"loss_fn returned {len(self.losses)} losses, but the model has one output; "
                                 f"return one loss")
            return self.losses(y_true, y_pred, sample_weight=sample_weight)
        names = list(y_pred) if isinstance(y_pred, dict) else list(range(len(y_pred)))
        unknown = sorted(set(self.losses) - set(names), key=str) if isinstance(self.losses, dict) else []
        if unknown:
            raise ValueError(f"loss_fn's losses are keyed {unknown}, which {'is' if len(unknown) == 1 else 'are'} "
                             f"not among the model's outputs {names}; key the losses by the model's output names")
        losses = [self._loss_of(name, position, len(names)) for position, name in enumerate(names)]
        if all(loss is None for loss in losses):
            raise ValueError(f"loss_fn gives none of the model's outputs {names} a loss; give at least one")
        total = 0.0
        for position, (name, loss) in enumerate(zip(names, losses)):
            if loss is None:   # an output without a loss is not trained through, as compile leaves it
                continue
            total = total + loss(_part(y_true, name, position, names, "targets"), y_pred[name],
                                 sample_weight=_part(sample_weight, name, position, names, "sample weights",
                                                     whole=True))
        return total

    def _loss_of(self, name, position: int, count: int) -> keras.losses.Loss:
        losses = self.losses
        if isinstance(losses, keras.losses.Loss):
            return losses
        if isinstance(losses, dict):
            return losses.get(name)
        if len(losses) != count:
            raise ValueError(f"loss_fn returned {len(losses)} losses for a model with {count} outputs; return one "
                             f"per output")
        return losses[position]


def _part(value, name, position: int, names: list, what: str, whole: bool = False):
    """Output ``name``'s part of the targets (or sample weights) of a multi-output model."""
    if value is None or (whole and not isinstance(value, (list, tuple, dict))):
        return value
    if isinstance(value, dict):
        if name in value:
            return value[name]
        raise ValueError(f"the {what} have keys {sorted(value)}, but the model's outputs are {names}")
    if isinstance(value, (list, tuple)) and len(value) == len(names):
        return value[position]
    raise ValueError(f"the model has {len(names)} outputs; give its {what} as a list of {len(names)} or a dict "
                     f"keyed by output name")
