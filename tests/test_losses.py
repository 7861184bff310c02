"""The loss the runtime calls (``ModelDef.loss()``) equals the loss ``keras.Model.fit`` computes from
``compile(loss=...)``: sample weights, several outputs (a list or dict of them) with one loss for
all or one per output; a loss that does not fit the model's outputs is refused with what to fix."""
from __future__ import annotations

import numpy as np
import pytest

from autosync.models.fit_batch import split_batch
from strategy_space.errors import ConfigError

pytestmark = pytest.mark.integration
RNG = np.random.default_rng(0)
X = RNG.random((8, 3)).astype("float32")
Y1, Y2, Y3 = (RNG.random((8, k)).astype("float32") for k in (1, 2, 1))
W = RNG.uniform(0.5, 2.0, 8).astype("float32")


def _outputs():
    import keras

    x = keras.Input((3,))
    h = keras.layers.Dense(4)(x)
    return x, {n: keras.layers.Dense(k, name=n)(h) for n, k in (("o1", 1), ("o2", 2), ("o3", 1))}


def _halved_abs(y_true, y_pred):   # a plain per-example function
    import keras

    return 0.5 * keras.ops.mean(keras.ops.abs(y_true - y_pred), axis=-1)


def _cases():
    import keras

    x, o = _outputs()
    return [
        # two outputs of one shape and one loss: Keras sums the two losses (stacking them into one
        # tensor and averaging would halve the gradients silently)
        (keras.Model(x, [o["o1"], o["o3"]]), "mse", [Y1, Y3], None),
        (keras.Model(x, [o["o1"], o["o2"]]), ["mse", _halved_abs], [Y1, Y2], W),
        (keras.Model(x, {"o1": o["o1"], "o2": o["o2"]}), {"o2": keras.losses.Huber(), "o1": "mse"},
         {"o1": Y1, "o2": Y2}, {"o1": W, "o2": W[::-1].copy()}),
        (keras.Model(x, {"o1": o["o1"], "o2": o["o2"]}), "mse", [Y1, Y2], W),
        (keras.Model(x, o["o1"]), keras.losses.MeanAbsoluteError(), Y1, W),
        (keras.Model(x, o["o1"]), _halved_abs, Y1, None),
        # an output without a loss (missing from the dict, or None) is left out, as compile leaves it
        (keras.Model(x, {"o1": o["o1"], "o2": o["o2"]}), {"o2": "mse"}, {"o1": Y1, "o2": Y2}, W),
        (keras.Model(x, [o["o1"], o["o2"]]), [None, _halved_abs], [Y1, Y2], None),
    ]


def test_the_runtime_loss_is_the_loss_fit_computes():
    from autosync.models.losses import as_keras_loss

    for model, loss, y, w in _cases():
        model.compile(loss=loss, optimizer="sgd")
        pred = model(X)
        want = float(model.compute_loss(x=X, y=y, y_pred=pred, sample_weight=w))
        _, targets = split_batch((X, y, w), "test")
        got = float(as_keras_loss(loss, "loss_fn()")(targets, pred))
        assert got == pytest.approx(want, rel=1e-6), (loss, got, want)


def test_losses_that_do_not_fit_the_outputs_are_refused():
    import keras

    from autosync.models.losses import as_keras_loss

    x, o = _outputs()
    pair = keras.Model(x, [o["o1"], o["o2"]])
    named = keras.Model(x, {"o1": o["o1"], "o2": o["o2"]})
    for model, loss, y, match in [
        (pair, ["mse", "mse", "mse"], [Y1, Y2], r"returned 3 losses for a model with 2 outputs"),
        (named, {"o1": "mse", "o9": "mse"}, {"o1": Y1, "o2": Y2},
         r"losses are keyed \['o9'\], which is not among the model's outputs \['o1', 'o2'\]"),
        (named, {"o1": None, "o2": None}, {"o1": Y1, "o2": Y2}, r"gives none of the model's outputs"),
        (pair, [None, None], [Y1, Y2], r"gives none of the model's outputs"),
        (keras.Model(x, o["o1"]), ["mse", "mse"], Y1, r"returned 2 losses, but the model has one output"),
        (named, "mse", {"o1": Y1, "other": Y2}, r"targets have keys \['o1', 'other'\], but the model's outputs"),
        (pair, "mse", [Y1], r"has 2 outputs; give its targets as a list of 2"),
    ]:
        with pytest.raises(ValueError, match=match):
            as_keras_loss(loss, "loss_fn()")(y, model(X))
    for bad, match in [(["mse", 3], r"loss_fn\(\)\[1\] returned int, not a loss"),
                       (None, r"loss_fn\(\) returned None, not a loss"),
                       ({"o1": "no_such"}, r"loss_fn\(\)\['o1'\] returned 'no_such', which is not a Keras loss name")]:
        with pytest.raises(ConfigError, match=match):
            as_keras_loss(bad, "loss_fn()")


def _own_step_model(method: str):
    import keras

    class OwnLoss(keras.Model):
        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
            return keras.ops.mean(keras.ops.abs(y - y_pred))

    class OwnStep(keras.Model):
        def train_step(self, data):
            return super().train_step(data)

    cls = {"compute_loss": OwnLoss, "train_step": OwnStep}[method]
    x = keras.Input((3,))
    return cls(x, keras.layers.Dense(1)(x))


@pytest.mark.parametrize("method", ["compute_loss", "train_step"])
def test_a_model_that_changes_what_fit_does_is_refused(method):
    """Its own train_step or compute_loss would not run: refused before anything trains, saying
    where the logic can go."""
    import functools

    from autosync.model_def import ModelDef
    from autosync.models import ingest

    md = ModelDef(name="own", model_fn=functools.partial(_own_step_model, method), loss_fn=lambda: "mse",
                  optimizer_fn=lambda: __import__("keras").optimizers.SGD(), batch_size=8,
                  dataset_fn=lambda i, n: [(X, Y1)])
    with pytest.raises(ConfigError, match=rf"ModelDef own: model class Own\w+ overrides {method}; .*Move it into "
                                          rf"loss_fn .*add_loss"):
        ingest.model_spec_from_def(md)
