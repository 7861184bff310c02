"""Dynamic loss scaling on every synchronizer: what Keras' ``LossScaleOptimizer`` does, and what
``compile`` gives a ``mixed_float16`` model.

Keras multiplies the loss by a scale before the backward pass (so float16 gradients do not underflow),
divides the gradients by it, and applies the inner optimizer only when every gradient is finite;
otherwise the step is skipped (no update, the inner optimizer's ``iterations`` stays) and the scale
halves. After ``dynamic_growth_steps`` applied steps in a row the scale doubles. Under a distribution
strategy the check reads the all-reduced gradients, so every replica decides alike.

Here a worker computes the gradients of ``loss * scale / workers`` and divides them by that (a power
of two: exact) before any synchronizer sees them (``scaled_gradients``); the step is then held, as under ``global_clipnorm``
(``sync.base``'s held steps): every channel hands over the gradients without updating and gives its
part of the squared norm of the global-batch gradient. That sum, in float64 (a float32 squared cannot
overflow it), is finite exactly when every reduced gradient is: Keras' check, on the same reduced
values. Every worker sums the same parts, so every worker's ``LossScale`` takes the same steps, and
a skipped step is released with no scale (``SKIP``): no synchronizer updates. A parameter server or
a numpy all-reduce is told the optimizer's count of applied updates (``iteration``), which a schedule
and Adam's bias correction read, as Keras' inner optimizer counts them.

A fixed scale (an optimizer's own ``loss_scale_factor``, which Keras' trainer multiplies the loss by
and ``apply`` divides the gradients by, before clipping) takes the same way through the worker's
step, scale over workers included, and nothing else: no step is held, checked or skipped, and
whatever applies updates is built without it: the gradients it gets are unscaled already.
"""
from __future__ import annotations

import numpy as np

# the optimizer config's key (``optimizer_config.keras_optimizer_config``) with the settings
LOSS_SCALE = "loss_scale"
SKIP = None   # the scale ``release`` gets for a skipped step


def holds_steps(optimizer: dict | None) -> bool:
    """Whether an optimizer config's steps are held until every synchronizer's part is in
    (``ModelSpec.global_clipnorm``): it clips by the global norm, or scales the loss dynamically."""
    return bool(optimizer) and (optimizer.get("global_clipnorm") is not None or optimizer.get(LOSS_SCALE) is not None)


def wrapped_for_policy(optimizer, model):
    """``optimizer`` as Keras' ``compile`` trains ``model`` with it: wrapped in a
    ``LossScaleOptimizer`` (Keras' defaults) when the model's dtype policy is ``mixed_float16`` and
    it is not one already; otherwise (``model`` None too) as it is."""
    policy = getattr(getattr(model, "dtype_policy", None), "name", None)
    if policy != "mixed_float16":
        return optimizer
    import keras

    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) or not isinstance(optimizer,
                                                                                     keras.optimizers.Optimizer):
        return optimizer   # (not an optimizer: its check says so)
    return keras.optimizers.LossScaleOptimizer(optimizer)


def unwrapped(optimizer):
    """``(the optimizer whose rule the synchronizers apply, its loss-scaling settings or None)``:
    a ``LossScaleOptimizer``'s inner optimizer with ``{"initial_scale", "dynamic_growth_steps"}``."""
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is None or type(optimizer).__name__ != "LossScaleOptimizer":
        return optimizer, None
    return inner, {"initial_scale": float(optimizer.initial_scale),
                   "dynamic_growth_steps": int(optimizer.dynamic_growth_steps)}


class LossScale:
    """One worker's copy of the dynamic loss scale (module doc): the same on every worker.

    Attributes:
        scale: what the loss is multiplied by (float32, a power of two for Keras' default start).
        counter: applied steps since the scale last changed.
        skipped: steps skipped so far (a step's optimizer ``iteration`` is its number less these).
    """

    def __init__(self, initial_scale: float, dynamic_growth_steps: int):
        if not (np.isfinite(initial_scale) and initial_scale > 0) or int(dynamic_growth_steps) < 1:
            raise ValueError(f"a loss scale needs initial_scale > 0 and dynamic_growth_steps >= 1, got "
                             f"{initial_scale!r} and {dynamic_growth_steps!r}")
        self.scale = np.float32(initial_scale)
        self.growth = int(dynamic_growth_steps)
        self.counter = 0
        self.skipped = 0

    @classmethod
    def of(cls, config: dict) -> "LossScale | None":
        """The loss scale an optimizer config asks for (``LOSS_SCALE``), or None."""
        settings = config.get(LOSS_SCALE)
        return None if settings is None else cls(settings["initial_scale"], settings["dynamic_growth_steps"])

    def iteration(self, step: int) -> int:
        """The optimizer's count of applied updates before ``step`` (Keras' ``iterations``)."""
        return step - self.skipped

    def after(self, finite: bool) -> None:
        """Move on past a step whose reduced gradients were all finite (applied) or not (skipped),
        as Keras' ``LossScaleOptimizer`` does."""
        if not finite:
            self.scale, self.counter = np.float32(self.scale * np.float32(0.5)), 0
            self.skipped += 1
        elif self.counter == self.growth - 1:
            self.scale, self.counter = np.float32(self.scale * np.float32(2.0)), 0
        else:
            self.counter += 1

    def state(self) -> list:
        """``[scale, counter, skipped]`` (what a checkpoint keeps)."""
        return [float(self.scale), self.counter, self.skipped]

    def load(self, state) -> None:
        """Continue from ``state``'s values."""
        scale, counter, skipped = state
        self.scale, self.counter, self.skipped = np.float32(scale), int(counter), int(skipped)


def scaled_gradients(tape, loss, variables, factor):
    """Inside a traced step: the gradients of ``loss`` (this worker's batch mean) with respect to
    ``variables``, taken of ``loss`` times ``factor`` (a float32 ``tf.Variable``: the loss scale over
    the number of workers, ``per_worker``; None: of ``loss`` itself) and divided by it again (an
    ``IndexedSlices``'s values), as Keras' ``LossScaleOptimizer`` unscales them."""
    import tensorflow as tf

    if factor is None:
        return tape.gradient(loss, variables)
    with tape:   # recorded by the same tape (entered again)
        scaled = loss * tf.cast(factor, loss.dtype)
    grads = tape.gradient(scaled, variables)

    def unscale(g):
        if g is None:
            return None
        if isinstance(g, tf.IndexedSlices):
            return tf.IndexedSlices(g.values / tf.cast(factor, g.values.dtype), g.indices, g.dense_shape)
        return g / tf.cast(factor, g.dtype)

    return [unscale(g) for g in grads]


def per_worker(scale, workers: int) -> np.float32:
    """What a worker multiplies its batch's mean loss by: the scale over the number of workers, as a
    distribution strategy divides each replica's loss by the global batch, so the float16 values of
    its backward pass are those of one process on the global batch: a gradient overflows, and the
    scale moves, as there, whatever the number of workers (exact for a power of two)."""
    return np.float32(scale) / np.float32(workers)
