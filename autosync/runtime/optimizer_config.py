"""What the workers tell the rest of the runtime about the model's optimizer: its Keras config,
its class, and the user's own classes it needs, carried by value."""
from __future__ import annotations

from autosync.runtime.loss_scale import LOSS_SCALE, unwrapped
from strategy_space.errors import ConfigError


def keras_optimizer_config(optimizer, variables=None) -> dict:
    """``optimizer.get_config()`` plus its class: ``SGD`` for Keras' own classes, the qualified
    name for anything else (a subclass may change the update rule, so it must not pass for the
    Keras one; Keras also renames instances ``sgd_1``, so the name cannot be trusted).

    A class of the user's own (the optimizer's, or its learning-rate schedule's) also travels as
    itself under ``USER_CLASSES`` (name -> class): where it was defined in a model script or in the
    ``__main__`` of a training script, no other process can import it by its module's name, and
    Ray pickles such a class by value (``keras_optimizer.optimizer_class``, ``new_optimizer``).

    With the model's trainable ``variables`` (a worker's), a weight-decaying optimizer's exclusions
    (``optimizer.exclude_from_weight_decay(var_names=["bias"])``, which its config does not carry)
    travel as the indices of the variables Keras' own rule leaves undecayed, under ``NO_DECAY``:
    every synchronizer decays the rest only, whatever its shards are called. Their constraints
    (``kernel_constraint=NonNeg()``, ...), which Keras' optimizer applies to a variable after each
    of its updates, travel as ``{variable name: constraint class}`` under ``CONSTRAINED``: only an
    update in the training graph applies them (``keras_optimizer.check_constraints``).

    A ``LossScaleOptimizer`` is described by its inner optimizer, with the dynamic loss scaling's
    settings under ``LOSS_SCALE`` (``loss_scale``)."""
    optimizer, scaling = unwrapped(optimizer)   # a LossScaleOptimizer: its inner one, and the scaling
    cls = type(optimizer)
    name = cls.__name__ if _keras_own(cls) else f"{cls.__module__}.{cls.__qualname__}"
    config = {**optimizer.get_config(), "class": name}
    if scaling is not None:
        config[LOSS_SCALE] = scaling
    schedule = getattr(optimizer, "_learning_rate", None)
    own = {c.__name__: c for c in (cls, *_classes_within(schedule)) if _users(c)}
    if own:
        config[USER_CLASSES] = own
    decays = getattr(optimizer, "_use_weight_decay", None)   # Keras' own rule, exclusions included
    if variables is not None and config.get("weight_decay") and callable(decays):
        kept = [i for i, v in enumerate(variables) if not decays(v)]
        if kept:
            config[NO_DECAY] = kept
    constrained = {v.path: type(v.constraint).__name__ for v in variables or ()
                   if getattr(v, "constraint", None) is not None}
    if constrained:
        config[CONSTRAINED] = constrained
    return config


# the key of ``keras_optimizer_config`` that carries a user's classes by value
USER_CLASSES = "_user_classes"
# and the one with the indices of the variables weight decay leaves alone
NO_DECAY = "no_weight_decay"
# and the variables with a constraint Keras applies after each update (name -> its class)
CONSTRAINED = "constrained_variables"


def _keras_own(cls) -> bool:
    return cls.__module__.startswith("keras.")


def _users(cls) -> bool:
    return not _keras_own(cls) and cls.__module__ != "builtins"


def _classes_within(value, depth: int = 4, seen=None) -> list:
    """The classes of ``value`` and of the objects it holds with a ``get_config`` (a schedule
    that wraps another: a warm-up around a decay), ``depth`` attributes deep: a user's class
    nested in a user's schedule is deserialized by that schedule's own ``from_config`` where
    updates run, which finds it only among the classes carried."""
    seen = set() if seen is None else seen
    if value is None or id(value) in seen or depth < 0:
        return []
    seen.add(id(value))
    if isinstance(value, dict):
        held = value.values()
    elif isinstance(value, (list, tuple)):
        held = value
    elif hasattr(value, "get_config"):
        held = vars(value).values() if hasattr(value, "__dict__") else ()
    else:
        return []
    found = [type(value)] if hasattr(value, "get_config") else []
    for item in held:
        found += _classes_within(item, depth - 1, seen)
    return found


def check_learning_rate(optimizer) -> None:
    """Refuse a learning rate given as a plain callable (``learning_rate=lambda: rate``), which
    Keras calls at every update: updates run in parameter servers and other workers, where it
    would read their own copy of whatever it reads, never what this process changes while
    training. A ``LearningRateSchedule`` is a function of the step, the same everywhere."""
    import keras

    optimizer, _ = unwrapped(optimizer)
    rate = getattr(optimizer, "_learning_rate", None)
    if callable(rate) and not isinstance(rate, keras.optimizers.schedules.LearningRateSchedule):
        name = getattr(rate, "__name__", type(rate).__name__)
        raise ConfigError(f"optimizer option learning_rate={name} is a callable, which Keras calls at every update; "
                          f"AutoSync applies updates in parameter servers and other workers, where it would read "
                          f"their own copy of what it reads, never what your process changes while training; give "
                          f"a float or a keras.optimizers.schedules.LearningRateSchedule (a function of the step, "
                          f"the same in every process)")


def full_size_slots(optimizer) -> int:
    """Arrays of a variable's full size ``optimizer`` keeps for each variable it updates (Adam 2, with
    amsgrad 3; SGD with momentum 1; Adagrad, RMSprop, Lion 1; Keras' EMA and gradient accumulation
    one more each): counted on a copy of it built for a 3 x 5 stand-in variable, so a subclass counts
    as it builds (``ModelSpec.optimizer_slots``). 0 where no copy can be built from its config, and at
    most ``MAX_SLOTS``: a memory floor never counts what it cannot see, nor refuses a model for it."""
    import keras
    import numpy as np

    from strategy_space.model_spec import MAX_SLOTS

    optimizer, _ = unwrapped(optimizer)
    try:
        copy = type(optimizer).from_config(optimizer.get_config())
        copy.build([keras.Variable(np.zeros((3, 5), "float32"), name="stand_in")])
        return min(sum(tuple(v.shape) == (3, 5) for v in copy.variables), MAX_SLOTS)
    except Exception:  # noqa: BLE001 - the user's class: a count it cannot make is 0, not a failure
        return 0
