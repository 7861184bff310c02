"""A script's Keras settings (its dtype policy set at the top level) hold on every process that
builds its model: Ray's workers unpickle the factories without running the script, so they built a
float32 model where the script's own process builds a mixed-precision one. A mixed_float16 model
trains with Keras' dynamic loss scaling (``test_runtime_loss_scale``): its steps are held."""
from __future__ import annotations

import dataclasses
import functools
import pickle

import numpy as np
import pytest

from autosync.models import keras_settings
from strategy_space.errors import ConfigError
from tests import runtime_models as rm
from tests.test_runtime_ps import _model_spec, _train
from tests.test_runtime_user_optimizer import _strategy

STEPS = 3
SCRIPT = '''
import functools

import keras

from autosync.model_def import ModelDef
from tests import runtime_models as rm

keras.mixed_precision.set_global_policy("POLICY")


def make_model():
    # what a script that relies on its own top level sees; a float32 model would hide a wrong build
    if keras.config.dtype_policy().name != "POLICY":
        raise ValueError(f"model built under the {keras.config.dtype_policy().name} policy")
    return rm.build_model(rm.VOCAB)


def build():
    return ModelDef(name="policy_POLICY", model_fn=make_model, loss_fn=rm.mse,
                    optimizer_fn=functools.partial(rm.make_optimizer, "adam", learning_rate=0.05),
                    dataset_fn=functools.partial(rm.make_batches, batch=8), batch_size=8, seed=7)
'''


@pytest.fixture
def restore_keras_settings():
    """The script sets this process's policy: give the other tests of this process theirs back."""
    import keras

    saved = keras_settings.current()
    yield
    keras_settings.apply(saved)
    assert keras.config.dtype_policy().name == saved["dtype_policy"]


def _script(tmp_path, policy):
    from autosync.models.script import load_model_def

    path = tmp_path / f"policy_{policy}.py"
    path.write_text(SCRIPT.replace("POLICY", policy))
    return load_model_def(str(path), "build")


def test_settings_that_are_not_keras_settings_say_which():
    with pytest.raises(ConfigError, match=r"unknown Keras settings \['dtype'\]; the settings carried are"):
        keras_settings.apply({"dtype": "float16"}, "ModelDef m")
    with pytest.raises(ConfigError, match="keras_settings must be a dict"):
        dataclasses.replace(rm.model_def("sgd", learning_rate=0.1), keras_settings="mixed_bfloat16")


@pytest.mark.integration
def test_a_policy_the_script_sets_holds_on_the_workers_and_trains_as_one_process(pool, tmp_path,
                                                                                   restore_keras_settings):
    import keras

    md = _script(tmp_path, "mixed_bfloat16")
    assert md.keras_settings is None   # taken when sent, from the process that sends it
    sent = pickle.loads(pickle.dumps(md))
    assert sent.keras_settings["dtype_policy"] == "mixed_bfloat16" and sent.name == md.name
    spec = _model_spec(pool, md)
    # the variables stay float32 under a mixed policy (their bytes do not change)
    assert {v.dtype for v in spec.variables} == {"float32"}
    _, _, weights = _train(pool, md, _strategy("ps", spec), steps=STEPS)
    expected = rm.reference_weights(md, num_workers=2, steps=STEPS)   # bfloat16 compute here too
    for got, want, var in zip(weights, expected, spec.variables):
        # bfloat16 sums of two half batches round differently from one sum of the global batch
        assert np.allclose(got, want, rtol=2e-2, atol=2e-3), (var.name, np.abs(got - want).max())
    initial = rm.reference_weights(md, num_workers=2, steps=0)
    assert all(not np.allclose(a, b) for a, b in zip(weights, initial))
    # the worker process, reused for the next model, takes that model's settings (float32 here)
    keras.mixed_precision.set_global_policy("float32")
    plain = rm.model_def("sgd", learning_rate=0.1)
    _, _, weights = _train(pool, plain, _strategy("ps", spec), steps=STEPS)
    for got, want in zip(weights, rm.reference_weights(plain, num_workers=2, steps=STEPS)):
        assert np.allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.integration
def test_a_mixed_float16_script_holds_its_steps_and_a_setting_keras_refuses_is_named(tmp_path,
                                                                                   restore_keras_settings):
    from autosync.models.ingest import model_spec_from_def

    # compile would wrap its optimizer in a LossScaleOptimizer: the spec counts held steps
    assert model_spec_from_def(_script(tmp_path, "mixed_float16")).global_clipnorm
    assert not model_spec_from_def(_script(tmp_path, "mixed_bfloat16")).global_clipnorm
    with pytest.raises(ConfigError, match="ModelDef m: Keras refuses image_data_format='channels_middle'"):
        keras_settings.apply({"image_data_format": "channels_middle"}, "ModelDef m")


def _float8_model():
    import keras

    x = keras.Input((4,), name="x")
    model = keras.Model(x, keras.layers.Dense(2, name="d")(keras.layers.Dense(3, name="h")(x)))
    model.layers[1].quantize("float8")   # the Dense layers alone: an InputLayer has nothing to quantize
    model.layers[2].quantize("float8")
    return model


def _batches(worker_index, num_workers):
    yield np.ones((2, 4), np.float32), np.ones((2, 2), np.float32)


@pytest.mark.integration
def test_a_float8_model_is_refused_before_any_gradient_is_taken():
    """Keras overwrites a float8 layer's scales and amax histories with their "gradient"; averaged
    and applied as weights they would train to nonsense (and its gradient failed in the model's
    ingestion with "too many values to unpack")."""
    from autosync.model_def import ModelDef
    from autosync.models.ingest import model_spec_from_def

    md = ModelDef(name="f8", model_fn=_float8_model, loss_fn=rm.mse,
                  optimizer_fn=functools.partial(rm.make_optimizer, "sgd"), dataset_fn=_batches, batch_size=2)
    with pytest.raises(ConfigError, match=r"ModelDef f8: variables h/inputs_scale, h/inputs_amax_history, "
                                          r"h/kernel_scale, h/kernel_amax_history \(and 8 more\) are overwritten "
                                          r"with their gradient .*float8.*mixed_bfloat16"):
        model_spec_from_def(md)
    keras_settings.check_precision(rm.build_model(rm.VOCAB), "ModelDef plain")   # the same layers unquantized pass
