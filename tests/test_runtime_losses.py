"""The loss ``keras.Model.fit`` minimizes, on every synchronizer (real Ray + TF): datasets that
yield ``(inputs, targets, sample_weight)``, models with several outputs and a loss per output,
and the losses a model adds itself (regularizers) train to the weights of one process on the
global batch, weighed and summed as Keras does."""
from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

from tests import runtime_models as rm
from tests.test_runtime_ps import _model_spec, _train
from tests.test_runtime_user_optimizer import _strategy

pytestmark = pytest.mark.integration
STEPS = 3


def _weighted_reference(md, num_workers: int, steps: int) -> list:
    """One process on the global batch: Keras' MeanSquaredError called with the weights, as
    ``fit`` calls it (independent of how the runtime carries them)."""
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(md.seed)
    model, opt, loss = md.model_fn(), md.optimizer_fn(), keras.losses.MeanSquaredError()
    data = [list(md.dataset_fn(i, num_workers)) for i in range(num_workers)]
    for step in range(steps):
        x, y, w = (np.concatenate(part) for part in zip(*[d[step % len(d)] for d in data]))
        with tf.GradientTape() as tape:
            value = loss(y, model(x, training=True), sample_weight=w)
        opt.apply_gradients(zip(tape.gradient(value, model.trainable_variables), model.trainable_variables))
    return model.get_weights()


@pytest.mark.parametrize("optimizer,strategy", [
    ("adam", "ps"), ("adam", "partitioned_ps"), ("sgd", "parallax"), ("adam", "gloo"), ("sgd", "graph")])
def test_sample_weights_train_as_keras_weighs_them(pool, optimizer, strategy):
    md = dataclasses.replace(rm.model_def(optimizer, learning_rate=0.05), dataset_fn=rm.weighted_batches)
    spec = _model_spec(pool, md)
    _, _, weights = _train(pool, md, _strategy(strategy, spec), steps=STEPS)
    expected = _weighted_reference(md, num_workers=2, steps=STEPS)
    for got, want, var in zip(weights, expected, spec.variables):
        assert np.allclose(got, want, rtol=1e-5, atol=1e-6), (var.name, np.abs(got - want).max())
    # the weights changed the result: the same data unweighted ends elsewhere
    unweighted = rm.reference_weights(rm.model_def(optimizer, learning_rate=0.05), num_workers=2, steps=STEPS)
    assert any(not np.allclose(a, b, rtol=1e-3, atol=1e-4) for a, b in zip(weights, unweighted))


@pytest.mark.parametrize("model,strategy", [("two_heads", "ps"), ("two_heads", "gloo"), ("two_heads", "graph"),
                                            ("regularized", "partitioned_ps"), ("regularized", "graph"),
                                            ("one_head", "ps"), ("one_head", "partitioned_ps"), ("one_head", "gloo"),
                                            ("one_head", "graph")])
def test_what_keras_fit_minimizes_is_what_trains(pool, model, strategy):
    """A dict of outputs, a dict of losses (one per output) and sample weights; a weight and an
    activity regularizer: the reference is Keras' own ``compile`` + ``train_on_batch`` on the
    global batch."""
    import keras

    if model in ("two_heads", "one_head"):   # one_head: a loss for one output only, the other head untrained
        md = rm.ModelDef(name=model, model_fn=rm.build_two_output_model,
                         loss_fn=rm.two_output_losses if model == "two_heads" else rm.one_head_loss,
                         optimizer_fn=functools.partial(rm.make_optimizer, "sgd", learning_rate=0.1),
                         dataset_fn=rm.two_output_batches, batch_size=8, seed=7)
    else:
        md = dataclasses.replace(rm.model_def("sgd", learning_rate=0.1), name="regularized",
                                 model_fn=rm.build_regularized_model, dataset_fn=rm.weighted_batches)
    spec = _model_spec(pool, md)
    _, history, weights = _train(pool, md, _strategy(strategy, spec), steps=STEPS)
    keras.utils.set_random_seed(md.seed)
    fitted = md.model_fn()
    fitted.compile(loss=md.loss_fn(), optimizer=md.optimizer_fn())
    data = [md.dataset_fn(i, 2) for i in range(2)]
    losses = []
    for step in range(STEPS):
        (x0, y0, w0), (x1, y1, w1) = (d[step] for d in data)
        y = {k: np.concatenate([y0[k], y1[k]]) for k in y0} if isinstance(y0, dict) else np.concatenate([y0, y1])
        total = fitted.train_on_batch(np.concatenate([x0, x1]), y, sample_weight=np.concatenate([w0, w1]))
        losses.append(total[0] if isinstance(total, list) else total)   # two heads: the sum of their losses
    for got, want in zip(weights, fitted.get_weights()):
        assert np.allclose(got, want, rtol=1e-5, atol=1e-6), np.abs(got - want).max()
    if model == "one_head":   # the head without a loss kept its initial weights, the rest moved
        keras.utils.set_random_seed(md.seed)
        initial = dict(zip(names := [v.name for v in spec.variables], [v.numpy() for v in md.model_fn().trainable_variables]))
        final = dict(zip(names, weights))
        assert all(np.array_equal(final[n], initial[n]) for n in ("pair/kernel", "pair/bias"))
        assert not np.allclose(final["score/kernel"], initial["score/kernel"])
    # the workers' mean loss is fit's (each worker's loss of its half of the global batch, averaged)
    assert np.allclose(history.loss, losses, rtol=1e-4), (history.loss, losses)
    if model == "regularized":   # the regularizers changed the result: they were not left out
        plain = dataclasses.replace(md, model_fn=rm.build_model)
        unregularized = _weighted_reference(plain, num_workers=2, steps=STEPS)
        assert any(not np.allclose(a, b, rtol=1e-3, atol=1e-4) for a, b in zip(weights, unregularized))
