"""The model's own Keras optimizer object applied to variable shards held as numpy arrays: what a
parameter server or the numpy all-reduce channel runs when the numpy rules of ``optimizers`` do
not cover the configuration (another optimizer, a user's subclass, a learning-rate schedule,
clipping).

The optimizer is rebuilt from ``keras_optimizer_config`` (its ``get_config()`` plus its class) with
the class's own ``from_config``, so a ``LearningRateSchedule`` is deserialized with it. Each shard
is a ``keras.Variable``; an update is one ``apply`` of the shards that have a gradient, with the
optimizer's ``iterations`` set to the global step first, so a schedule is evaluated at the global
step whatever the number of chunks or shards applied separately.

What is exact and what is not (``optimizers.check_keras_apply`` refuses the rest before any PS starts):
- ``clipvalue`` and ``weight_decay`` are element-wise: exact on any shard.
- ``clipnorm`` clips each variable by its own norm: exact when the variable is one shard.
- Lamb, Adafactor and Muon read whole variables: exact when the variable is one shard. A user's
  subclass is taken to be element-wise (its ``update_step`` sees a shard as a variable).
- ``global_clipnorm`` needs the norm over every gradient of the step: refused (see
  ``optimizers.check_optimizer_config``).
- Sparse rows arrive summed per worker (``rows.dedup_rows``) and are applied as one
  ``IndexedSlices``: exact for an optimizer linear in the slices until they are densified (SGD,
  Lion); one that transforms each slice first (Adam's square, Adamax's abs, clipping by value or
  by the slices' norm) would see a row's sum instead, so those are refused on sparse shards
  outside the graph (the graph backend all-gathers the slices: exact there).
"""
from __future__ import annotations

import importlib

import numpy as np

from strategy_space.errors import ConfigError

# built-in optimizers whose update reads a sparse gradient only through linear operations before
# it is densified: summed rows give them the same update as the single slices
_LINEAR_IN_SLICES = frozenset({"sgd", "lion"})
# built-in optimizers whose update reads a whole variable (a norm, a row/column factor, a matrix
# iteration): a shard alone gives another update
_WHOLE_VARIABLE = frozenset({"lamb", "adafactor", "muon"})
# wrappers of other optimizers: apply the inner one in optimizer_fn instead
_WRAPPERS = frozenset({"LossScaleOptimizer", "MultiOptimizer", "OptimizerMap"})


def optimizer_class(config: dict):
    """The Keras optimizer class named by ``config['class']`` (a Keras name such as ``RMSprop`` or
    a qualified ``module.Class`` of a subclass).

    Raises:
        ConfigError: the class cannot be imported or is not a Keras optimizer.
    """
    from autosync.tflog import quiet_startup

    quiet_startup()   # a parameter server's process may import TensorFlow here first
    import keras

    name = str(config.get("class", config.get("name", "")))
    if "." not in name:
        cls = getattr(keras.optimizers, name, None)
    else:
        module, _, qual = name.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), qual, None)
        except ImportError as e:
            raise ConfigError(f"optimizer class {name!r} cannot be imported where updates run ({e}); "
                              f"define it in an importable module") from None
    if name in _WRAPPERS:
        raise ConfigError(f"optimizer {name} wraps other optimizers, which the runtime cannot split across "
                          f"shards; return the inner optimizer from optimizer_fn")
    if not (isinstance(cls, type) and issubclass(cls, keras.optimizers.Optimizer)):
        raise ConfigError(f"optimizer {name!r} is not a keras.optimizers.Optimizer class")
    return cls


def reads_whole_variables(config: dict) -> bool:
    """Whether this optimizer's update reads a whole variable (a norm, a factor), so a shard alone
    gets another update."""
    return str(config.get("class", "")).lower() in _WHOLE_VARIABLE


def linear_in_slices(config: dict) -> bool:
    """Whether summed sparse rows give this optimizer the update its single slices would."""
    return str(config.get("class", "")).lower() in _LINEAR_IN_SLICES


class KerasOptimizer:
    """The interface of ``optimizers.NumpyOptimizer`` over a real Keras optimizer.

    Every update replaces ``params[key]`` with a new array, so a value handed out by ``snapshot``
    is never changed under its reader.
    """

    squares_slices = False  # Keras squares what it is given; the summed squares are of no use

    def __init__(self, config: dict):
        cls = optimizer_class(config)
        self.optimizer = cls.from_config({k: v for k, v in config.items() if k != "class"})
        self.variables: dict = {}
        self._order: list = []
        self._functions: dict = {}
        self.copies = 0

    def add_variable(self, key, value: np.ndarray) -> None:
        self._order.append(key)

    def adopt(self, params: dict, key) -> None:
        """Nothing to do: updates always write new arrays."""

    def snapshot(self, params: dict, key) -> np.ndarray:
        return params[key]

    def _compiled(self, keys: tuple):
        """One traced update per set of keys (a chunk): eager Keras pays Python per operation."""
        import tensorflow as tf

        fn = self._functions.get(keys)
        if fn is None:
            variables = [self.variables[k] for k in keys]
            fn = self._functions[keys] = tf.function(lambda grads: self.optimizer.apply(grads, variables),
                                                     reduce_retracing=True)
        return fn

    def _build(self, params: dict) -> None:
        import keras

        for key in self._order:
            self.variables[key] = keras.Variable(np.array(params[key]), name="shard")
        self.optimizer.build([self.variables[k] for k in self._order])
        # state of the optimizer as a whole, beyond ``iterations`` (Nadam's ``u_product``): an
        # update of several chunks at one step must start each from the step's state. Slots of
        # the shards are named after them (``shard_...``), so they are told apart by name.
        self._global = [v for v in self.optimizer.variables
                        if v is not self.optimizer.iterations and not v.name.startswith("shard")]
        self._step_state = (None, [])

    def state(self) -> dict:
        """The optimizer's variables (iterations, slots, ...) as ``"keras/<i>" -> array``, in the
        optimizer's order; empty before its first update built them."""
        if not self.variables:
            return {}
        return {f"keras/{i}": np.array(v.numpy()) for i, v in enumerate(self.optimizer.variables)}

    def load_state(self, params: dict, arrays: dict) -> list[str]:
        """Set the variables to ``params`` and the optimizer's state to ``state()``'s arrays (none:
        the checkpoint was taken before the first update). Returns the problems (nothing set)."""
        from autosync.runtime.optimizer_state import state_problems

        if not self.variables:
            self._build(params)
        else:
            for key in self._order:
                self.variables[key].assign(params[key])
        if not arrays:
            return []
        want = {f"keras/{i}": tuple(v.shape) for i, v in enumerate(self.optimizer.variables)}
        problems = state_problems(want, arrays)
        if problems:
            return problems
        for i, v in enumerate(self.optimizer.variables):
            v.assign(arrays[f"keras/{i}"])
        self._step_state = (None, [])
        return []

    def apply(self, iteration: int, params: dict, grads: dict) -> None:
        """One step of the Keras optimizer on the shards in ``grads`` (see ``NumpyOptimizer.apply``)."""
        import tensorflow as tf

        if not self.variables:
            self._build(params)
        keys = [k for k in self._order if k in grads]
        tensors = []
        for key in keys:
            g = grads[key]
            var = self.variables[key]
            if isinstance(g, tuple):
                tensors.append(tf.IndexedSlices(tf.convert_to_tensor(g[1], var.dtype),
                                                tf.convert_to_tensor(np.asarray(g[0], np.int64)),
                                                tf.constant(var.shape, tf.int64)))
            else:
                tensors.append(tf.convert_to_tensor(g, var.dtype))
        self.optimizer.iterations.assign(iteration)
        if self._step_state[0] == iteration:   # another chunk of the same step
            for v, value in zip(self._global, self._step_state[1]):
                v.assign(value)
        else:
            self._step_state = (iteration, [v.numpy() for v in self._global])
        self._compiled(tuple(keys))(tensors)
        for key in keys:
            params[key] = self.variables[key].numpy()
