"""Keras optimizer update rules re-implemented in numpy, for parameter-server shards and the
all-reduced variables' local updates.

Parameter-server actors are fresh processes every trial; importing TensorFlow there would cost
seconds per trial (see ``benchmarks/runtime_overhead.py``), so they apply updates with these
numpy versions of the Keras 3 formulas instead. The arithmetic follows Keras step by step in the
variable's dtype (float32 scalars, same operation order), so results match a single-process Keras
optimizer to float rounding.

Sparse gradients arrive as ``(indices, values)`` with possibly repeated indices (one slice per
embedding lookup, exactly what ``tf.IndexedSlices`` holds), or as ``(indices, values, squares)``
where the sender already summed repeated slices and ``squares`` holds each row's sum of squared
slices. Keras treats them as follows, and so do we: repeated indices add up; for Adam,
``square(gradient)`` squares each slice *before* they are added up (Keras squares the
``IndexedSlices`` values), so ``v`` sees the sum of squared slices.
"""
from __future__ import annotations

import abc

import numpy as np

from strategy_space.errors import short_repr
from strategy_space.errors import ConfigError

# config keys that change the update rule; any non-default value is rejected, not ignored
_UNSUPPORTED = {
    "clipnorm": None, "global_clipnorm": None, "clipvalue": None,
    "use_ema": False, "loss_scale_factor": None, "gradient_accumulation_steps": None,
}
# handled by every optimizer here (weight decay by the base class) or not part of the update rule
_IGNORED = {"name", "class", "learning_rate", "weight_decay", "ema_momentum", "ema_overwrite_frequency"}


def _scatter_sum(shape, dtype, indices: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Dense array of ``shape`` holding the sum of ``values`` rows at ``indices``."""
    out = np.zeros(shape, dtype=dtype)
    np.add.at(out, indices, values)
    return out


def _grad_and_square(var: np.ndarray, grad):
    """The dense gradient and the gradient squared as Keras squares it: for a sparse gradient
    each slice is squared before repeated rows are added up. A sparse gradient may carry those
    squares already, ``(indices, values, squares)``, when its slices were summed before sending
    (``squares`` None: each slice is its own square's source)."""
    if isinstance(grad, tuple):
        indices, values = grad[0], grad[1]
        squares = grad[2] if len(grad) > 2 and grad[2] is not None else np.square(values)
        return (_scatter_sum(var.shape, var.dtype, indices, values),
                _scatter_sum(var.shape, var.dtype, indices, squares))
    return grad, np.square(grad)


class NumpyOptimizer(abc.ABC):
    """Base class: holds hyper-parameters and per-variable slots; ``apply`` updates one step.

    Variables are never changed in place: each update stores a new array, so a snapshot handed
    out earlier (a pull being serialized) is never modified under the reader.
    """

    slot_names: tuple[str, ...] = ()
    keras_name = ""
    squares_slices = False  # the update reads the square of each sparse slice (Adam, Adagrad)
    _options: dict = {}

    def __init__(self, config: dict):
        self.learning_rate = float(config["learning_rate"])
        wd = config.get("weight_decay")
        self.weight_decay = float(wd) if wd else None
        self.options = {k: config.get(k, v) for k, v in self._options.items()}
        self.slots: dict = {}

    def add_variable(self, key, value: np.ndarray) -> None:
        """Create zero slots (momentum, velocity, ...) for the variable stored under ``key``."""
        self.slots[key] = {name: np.zeros_like(value) for name in self.slot_names}

    def apply(self, iteration: int, params: dict, grads: dict) -> None:
        """Apply one optimizer step to every variable in ``grads``.

        Args:
            iteration: the optimizer's step counter before this update (Keras ``iterations``).
            params: key -> current value; replaced by the new value.
            grads: key -> dense ndarray or ``(indices, values)``; keys absent are not updated
                (Keras skips variables whose gradient is None).
        """
        wd = self.weight_decay
        for key, grad in grads.items():
            var = params[key]
            if wd is not None:
                # Keras decays every variable that has a gradient, before the update step
                var = var - var * var.dtype.type(wd) * var.dtype.type(self.learning_rate)
            params[key] = self._update(iteration, key, var, grad)

    @abc.abstractmethod
    def _update(self, iteration, key, var, grad):
        """The new value of one variable after one step (never modifies ``var`` in place)."""


class SGD(NumpyOptimizer):
    """``keras.optimizers.SGD`` (plain, momentum, nesterov)."""

    keras_name = "sgd"
    _options = {"momentum": 0.0, "nesterov": False}

    def __init__(self, config):
        super().__init__(config)
        self.slot_names = ("momentum",) if self.options["momentum"] != 0 else ()

    def _update(self, iteration, key, var, grad):
        lr = var.dtype.type(self.learning_rate)
        if not self.slot_names:
            if isinstance(grad, tuple):
                new = var.copy()
                np.subtract.at(new, grad[0], grad[1] * lr)
                return new
            return var - grad * lr
        g = _scatter_sum(var.shape, var.dtype, grad[0], grad[1]) if isinstance(grad, tuple) else grad
        mom = var.dtype.type(self.options["momentum"])
        slots = self.slots[key]
        m = slots["momentum"] * mom - g * lr
        slots["momentum"] = m
        if self.options["nesterov"]:
            return var + (m * mom - g * lr)
        return var + m


class Adam(NumpyOptimizer):
    """``keras.optimizers.Adam`` with bias correction and optional AMSGrad."""

    keras_name = "adam"
    squares_slices = True
    _options = {"beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7, "amsgrad": False}

    def __init__(self, config):
        super().__init__(config)
        self.slot_names = ("m", "v", "v_hat") if self.options["amsgrad"] else ("m", "v")

    def _update(self, iteration, key, var, grad):
        f = var.dtype.type
        o = self.options
        lr = f(self.learning_rate)
        step = f(iteration + 1)
        beta_1_power = np.power(f(o["beta_1"]), step)
        beta_2_power = np.power(f(o["beta_2"]), step)
        alpha = lr * np.sqrt(f(1) - beta_2_power) / (f(1) - beta_1_power)
        g, g2 = _grad_and_square(var, grad)
        s = self.slots[key]
        s["m"] = s["m"] + (g - s["m"]) * f(1 - o["beta_1"])
        s["v"] = s["v"] + (g2 - s["v"]) * f(1 - o["beta_2"])
        v = s["v"]
        if o["amsgrad"]:
            s["v_hat"] = np.maximum(s["v_hat"], v)
            v = s["v_hat"]
        return var - (s["m"] * alpha) / (np.sqrt(v) + f(o["epsilon"]))


class AdamW(Adam):
    """``keras.optimizers.AdamW``: Adam plus decoupled weight decay (applied by the base class)."""

    keras_name = "adamw"


class Adagrad(NumpyOptimizer):
    """``keras.optimizers.Adagrad``. For a sparse gradient Keras squares each slice before the
    slices are added up, so the accumulator gets the sum of squared slices."""

    keras_name = "adagrad"
    squares_slices = True
    slot_names = ("accumulator",)
    _options = {"initial_accumulator_value": 0.1, "epsilon": 1e-7}

    def add_variable(self, key, value: np.ndarray) -> None:
        self.slots[key] = {"accumulator": np.full_like(value, self.options["initial_accumulator_value"])}

    def _update(self, iteration, key, var, grad):
        f = var.dtype.type
        lr = f(self.learning_rate)
        s = self.slots[key]
        if isinstance(grad, tuple) and self.weight_decay is None:
            return self._update_rows(key, var, grad, lr, f(self.options["epsilon"]))
        g, g2 = _grad_and_square(var, grad)
        s["accumulator"] = s["accumulator"] + g2
        return var - (lr * g) / np.sqrt(s["accumulator"] + f(self.options["epsilon"]))

    def _update_rows(self, key, var, grad, lr, eps):
        """The same update on the touched rows only: elsewhere Keras adds 0 to the accumulator and
        subtracts exactly 0 from the variable, so skipping those rows changes no bit (repeated rows
        are added up in the same order as the dense scatter does)."""
        indices, values = grad[0], grad[1]
        squares = grad[2] if len(grad) > 2 and grad[2] is not None else np.square(values)
        rows, inverse = np.unique(indices, return_inverse=True)
        g = _scatter_sum((len(rows),) + var.shape[1:], var.dtype, inverse, values)
        g2 = _scatter_sum((len(rows),) + var.shape[1:], var.dtype, inverse, squares)
        acc = self.slots[key]["accumulator"]  # never handed out: updated in place
        acc_rows = acc[rows] + g2
        acc[rows] = acc_rows
        new = var.copy()  # a pulled snapshot of var must not change under its reader
        new[rows] = var[rows] - (lr * g) / np.sqrt(acc_rows + eps)
        return new


OPTIMIZERS = {cls.keras_name: cls for cls in (SGD, Adam, AdamW, Adagrad)}


def keras_optimizer_config(optimizer) -> dict:
    """``optimizer.get_config()`` plus its class: ``SGD`` for Keras' own classes, the qualified
    name for anything else (a subclass may change the update rule, so it must not pass for the
    Keras one; Keras also renames instances ``sgd_1``, so the name cannot be trusted)."""
    cls = type(optimizer)
    name = cls.__name__ if cls.__module__.startswith("keras.") else f"{cls.__module__}.{cls.__qualname__}"
    return {**optimizer.get_config(), "class": name}


# where the rules above run, for messages: every strategy's updates go through them, the
# parameter servers' and the all-reduced variables' alike (``autosync.runtime.sync.allreduce``)
_WHERE = ("by AutoSync's runtime (it applies every update, parameter server or all-reduce, with its own copy "
          "of the Keras rules)")


def check_optimizer_config(config: dict) -> None:
    """Raise if a Keras optimizer config (``optimizer.get_config()``) cannot be run by the runtime.

    Raises:
        ConfigError: unknown optimizer, a learning-rate schedule, or an option that changes the
            update rule and is not implemented (weight decay, clipping, EMA, ...).
    """
    name = _kind(config)
    problems = []
    if name not in OPTIMIZERS:
        problems.append(f"optimizer {short_repr(config.get('class', config.get('name')))} is not supported {_WHERE}; "
                        f"supported: {', '.join(c.__name__ for c in OPTIMIZERS.values())} "
                        f"(keras.optimizers); change the ModelDef's optimizer_fn")
    lr = config.get("learning_rate")
    if not isinstance(lr, (int, float)):
        problems.append(f"optimizer learning_rate must be a constant number, got {type(lr).__name__} (a schedule?), "
                        f"which is not supported {_WHERE}; use a float learning rate")
    for key, default in _UNSUPPORTED.items():
        if config.get(key, default) != default:
            problems.append(f"optimizer option {key}={short_repr(config[key])} is not supported {_WHERE}; "
                            f"remove it (allowed: {default!r})")
    if name in OPTIMIZERS:
        known = set(OPTIMIZERS[name]._options) | set(_UNSUPPORTED) | _IGNORED
        extra = sorted(set(config) - known)
        if extra:
            problems.append(f"optimizer {name}: options {extra} are not implemented {_WHERE}")
    if problems:
        raise ConfigError(problems)


def check_model_optimizer(model_def) -> None:
    """The one optimizer check every command runs on a trainable model, before Ray starts
    (``tune``, ``run``, ``baselines`` refuse; ``inspect`` warns).

    Raises:
        ConfigError: see ``check_optimizer_config``, attributed to the model.
    """
    try:
        check_optimizer_config(keras_optimizer_config(model_def.optimizer_fn()))
    except ConfigError as e:
        raise e.with_source(f"model {model_def.name}") from None


def squares_slices(config: dict) -> bool:
    """Whether the optimizer of ``config`` needs the sum of squared slices of repeated sparse rows
    (a sender that sums repeated rows must then send those squares as well)."""
    cls = OPTIMIZERS.get(_kind(config))
    return cls is None or cls.squares_slices


def make_optimizer(config: dict) -> NumpyOptimizer:
    """The numpy optimizer for a Keras optimizer config.

    Raises:
        ConfigError: see ``check_optimizer_config``.
    """
    check_optimizer_config(config)
    return OPTIMIZERS[_kind(config)](config)


def _kind(config: dict) -> str:
    """``sgd``/``adam`` from the optimizer's class (Keras renames instances ``sgd_1``, ...)."""
    return str(config.get("class", config.get("name", ""))).lower()
