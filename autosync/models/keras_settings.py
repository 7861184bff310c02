"""The Keras settings a model is built under, carried to every process that builds it.

Keras keeps a few process-wide settings that change what ``model_fn()`` builds: the dtype policy
(``keras.mixed_precision.set_global_policy("mixed_bfloat16")``: layers compute in bfloat16 and keep
float32 variables), ``floatx``, ``epsilon`` and the image data format. A training script sets them
at its top level or in ``__main__``, which runs in the driver only: Ray workers and parameter
servers unpickle the ModelDef's factories without running the script again, so they built a
float32 model where the user's own process builds a mixed-precision one. A ``ModelDef`` therefore
carries the settings of the process that sends it (``ModelDef.__getstate__``), and every process
sets them before it builds the model (``ModelDef.build_model``), as if the script had run there.
"""
from __future__ import annotations

import sys

from strategy_space.errors import ConfigError

KEYS = ("floatx", "epsilon", "image_data_format", "dtype_policy")


def current() -> dict | None:
    """This process's Keras settings, or None where Keras was never imported (nothing was set:
    the receiving process keeps its own defaults)."""
    keras = sys.modules.get("keras")
    config = getattr(keras, "config", None)
    if config is None:
        return None
    return {"floatx": config.floatx(), "epsilon": float(config.epsilon()),
            "image_data_format": config.image_data_format(), "dtype_policy": config.dtype_policy().name}


def apply(settings: dict | None, where: str = "ModelDef") -> None:
    """Set each Keras setting ``settings`` gives (``current()`` gives all of them, so a process
    that built another model under other settings keeps none of those). None leaves the process
    as it is.

    Raises:
        ConfigError: a key or value Keras does not take, with which one.
    """
    if not settings:
        return
    unknown = sorted(set(settings) - set(KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown Keras settings {unknown}; the settings carried are {list(KEYS)}")
    import keras

    setters = {"floatx": keras.config.set_floatx, "epsilon": keras.config.set_epsilon,
               "image_data_format": keras.config.set_image_data_format,
               "dtype_policy": keras.config.set_dtype_policy}
    for key in KEYS:   # floatx before the policy: a policy left unset follows floatx
        if key in settings:
            try:
                setters[key](settings[key])
            except (ValueError, TypeError) as e:
                raise ConfigError(f"{where}: Keras refuses {key}={settings[key]!r}: {e}") from None


def check_precision(model, where: str) -> None:
    """Refuse a model with float8 layers, whose scale and history variables Keras overwrites with
    their "gradient" (``overwrite_with_gradient``) instead of applying the optimizer. (A
    ``mixed_float16`` model trains with dynamic loss scaling, as Keras' ``compile`` gives it:
    ``autosync.runtime.loss_scale``.)

    Raises:
        ConfigError: the variables, and the policies that train here.
    """
    overwritten = [v.path for v in model.trainable_variables if getattr(v, "overwrite_with_gradient", False)]
    if overwritten:
        raise ConfigError(f"{where}: variables {', '.join(overwritten[:4])}"
                          f"{f' (and {len(overwritten) - 4} more)' if len(overwritten) > 4 else ''} are overwritten "
                          f"with their gradient (overwrite_with_gradient: Keras float8 training, "
                          f"model.quantize('float8')); AutoSync's synchronizers average gradients and apply the "
                          f"optimizer's rule to every variable, so these scales and histories would be trained as "
                          f"weights. Train without float8 quantization (quantize for inference after training), or "
                          f"with keras.mixed_precision.set_global_policy('mixed_bfloat16')")
