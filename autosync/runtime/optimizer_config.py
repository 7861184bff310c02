"""What the workers tell the rest of the runtime about the model's optimizer: its Keras config,
its class, and the user's own classes it needs, carried by value."""
from __future__ import annotations


def keras_optimizer_config(optimizer) -> dict:
    """``optimizer.get_config()`` plus its class: ``SGD`` for Keras' own classes, the qualified
    name for anything else (a subclass may change the update rule, so it must not pass for the
    Keras one; Keras also renames instances ``sgd_1``, so the name cannot be trusted).

    A class of the user's own (the optimizer's, or its learning-rate schedule's) also travels as
    itself under ``USER_CLASSES`` (name -> class): where it was defined in a model script or in the
    ``__main__`` of a training script, no other process can import it by its module's name, and
    Ray pickles such a class by value (``keras_optimizer.optimizer_class``, ``new_optimizer``)."""
    cls = type(optimizer)
    name = cls.__name__ if _keras_own(cls) else f"{cls.__module__}.{cls.__qualname__}"
    config = {**optimizer.get_config(), "class": name}
    schedule = getattr(optimizer, "_learning_rate", None)
    own = {c.__name__: c for c in (cls, type(schedule)) if not _keras_own(c) and c.__module__ != "builtins"}
    if own:
        config[USER_CLASSES] = own
    return config


# the key of ``keras_optimizer_config`` that carries a user's classes by value
USER_CLASSES = "_user_classes"


def _keras_own(cls) -> bool:
    return cls.__module__.startswith("keras.")
