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

from autosync.models.ingest import SAMPLE_WEIGHT, TARGETS
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
    """``loss`` as a ``keras.losses.Loss`` whose call returns the batch mean.

    Raises:
        ConfigError: ``loss`` is neither a ``Loss``, a Keras loss name nor a callable; ``where``
            names what produced it.
    """
    if isinstance(loss, keras.losses.Loss):
        return SampleWeighted(loss)
    if isinstance(loss, str):
        try:
            loss = keras.losses.get(loss)
        except ValueError:
            raise ConfigError(f"{where} returned {loss!r}, which is not a Keras loss name; return a "
                              f"keras.losses.Loss, a function (y_true, y_pred) or a name such as 'mse'") from None
        if isinstance(loss, keras.losses.Loss):
            return SampleWeighted(loss)
    if not callable(loss):
        raise ConfigError(f"{where} returned {type(loss).__name__}, not a loss; return a keras.losses.Loss, "
                          f"a function (y_true, y_pred) or a Keras loss name such as 'mse'")
    return SampleWeighted(FunctionLoss(loss))


class SampleWeighted(keras.losses.Loss):
    """``loss`` called with the batch's sample weights where its targets carry them
    (``ingest.split_batch``), as ``keras.Model.fit`` calls its compiled loss: per-example values
    times their weights, summed and divided by the number of values (Keras' default reduction)."""

    def __init__(self, loss: keras.losses.Loss):
        super().__init__(name=loss.name, reduction=loss.reduction)
        self.loss = loss

    def __call__(self, y_true, y_pred, sample_weight=None):
        if isinstance(y_true, dict) and SAMPLE_WEIGHT in y_true:
            y_true, sample_weight = y_true[TARGETS], y_true[SAMPLE_WEIGHT]
        return self.loss(y_true, y_pred, sample_weight=sample_weight)
