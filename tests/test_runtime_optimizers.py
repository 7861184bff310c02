"""The runtime's numpy optimizers apply exactly Keras' update rules, dense and sparse."""
import numpy as np
import pytest

from autosync.runtime.optimizer_config import keras_optimizer_config
from autosync.runtime.optimizers import check_optimizer_config, make_optimizer

SHAPE = (6, 3)


def keras_optimizer(name, **kw):
    import keras

    return {"sgd": keras.optimizers.SGD, "adam": keras.optimizers.Adam, "adamw": keras.optimizers.AdamW,
            "adagrad": keras.optimizers.Adagrad}[name](**kw)


def grads(step, sparse):
    rng = np.random.default_rng(step)
    if sparse:
        idx = np.array([1, 4, 1, 5], dtype=np.int64)  # a repeated row, as lookups produce
        return idx, rng.standard_normal((4, SHAPE[1])).astype(np.float32)
    return rng.standard_normal(SHAPE).astype(np.float32)


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("name,kw", [
    ("sgd", {"learning_rate": 0.1}),
    ("sgd", {"learning_rate": 0.1, "momentum": 0.9, "nesterov": True}),
    ("adam", {"learning_rate": 0.05, "amsgrad": True}),
    ("adamw", {"learning_rate": 0.05, "weight_decay": 0.1}),
    ("adagrad", {"learning_rate": 0.2}),
    ("sgd", {"learning_rate": 0.1, "weight_decay": 0.05}),
])
@pytest.mark.integration
def test_matches_keras(name, kw, sparse):
    import keras
    import tensorflow as tf

    init = np.random.default_rng(9).standard_normal(SHAPE).astype(np.float32)
    var = keras.Variable(init.copy())
    opt = keras_optimizer(name, **kw)
    ours = make_optimizer(keras_optimizer_config(opt))
    params = {"k": init.copy()}
    ours.add_variable("k", init)
    for step in range(4):
        g = grads(step, sparse)
        tf_grad = tf.IndexedSlices(tf.constant(g[1]), tf.constant(g[0]), tf.constant(SHAPE, tf.int64)) if sparse else tf.constant(g)
        opt.apply_gradients([(tf_grad, var)])
        ours.apply(step, params, {"k": g})
    np.testing.assert_allclose(params["k"], var.numpy(), rtol=2e-6, atol=2e-6)
    assert not np.allclose(params["k"], init)


@pytest.mark.parametrize("name,kw", [
    ("sgd", {"learning_rate": 0.1, "momentum": 0.9, "nesterov": True}),
    ("adam", {"learning_rate": 0.05, "amsgrad": True}),
    ("adamw", {"learning_rate": 0.05, "weight_decay": 0.1}),
    ("adagrad", {"learning_rate": 0.2}),
])
@pytest.mark.integration
def test_a_scalar_variable_stays_an_array_and_matches_keras(name, kw):
    """A scalar (a learned temperature) arrives as a 0-d array; every rule keeps it one, and its
    value is served as a read-only 0-d array (numpy's arithmetic on 0-d arrays gives scalars)."""
    import keras

    var = keras.Variable(np.float32(1.5))
    opt = keras_optimizer(name, **kw)
    ours = make_optimizer(keras_optimizer_config(opt))
    params = {"k": np.array(1.5, np.float32)}
    ours.add_variable("k", params["k"])
    for step in range(4):
        g = np.array(0.3 * (step - 1.5), np.float32)
        opt.apply_gradients([(g, var)])
        ours.apply(step, params, {"k": g})
        served = ours.snapshot(params, "k")
        assert isinstance(served, np.ndarray) and served.shape == () and not served.flags.writeable
    np.testing.assert_allclose(params["k"], var.numpy(), rtol=2e-6, atol=2e-6)
    assert float(params["k"]) != 1.5


@pytest.mark.integration
def test_numpy_rules_run_the_common_configs_and_keras_the_rest():
    import keras

    from autosync.runtime.keras_optimizer import KerasOptimizer
    from autosync.runtime.optimizers import numpy_rules, squares_slices

    assert numpy_rules(keras_optimizer_config(keras.optimizers.Adam(0.1)))
    # the global norm's scale is applied before any rule: the numpy rules run it
    clipped = keras_optimizer_config(keras.optimizers.Adagrad(0.1, global_clipnorm=1.0))
    # ... and is handed a dense gradient: no squared slices to send
    assert numpy_rules(clipped) and not squares_slices(clipped)
    assert squares_slices(keras_optimizer_config(keras.optimizers.Adagrad(0.1)))
    for opt in (keras.optimizers.RMSprop(), keras.optimizers.SGD(clipnorm=1.0),
                keras.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5))):
        config = keras_optimizer_config(opt)
        check_optimizer_config(config)
        assert not numpy_rules(config) and isinstance(make_optimizer(config), KerasOptimizer)
