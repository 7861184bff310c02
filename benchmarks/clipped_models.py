"""Zoo models with their own optimizer clipping by the global norm (``global_clipnorm``), for
profiling what holding a PS step until the norm is known costs (``ps_step_profile.py``)::

    python benchmarks/ps_step_profile.py --models ncf benchmarks/clipped_models.py:ncf --builders ps

Each function returns the zoo model's ModelDef with the same optimizer and ``global_clipnorm``
added (``CLIPNORM``, large enough not to change ncf's first steps much; what is measured is the
step's time, not its training).
"""
from __future__ import annotations

import dataclasses
import functools

CLIPNORM = 1.0


def clipped_optimizer(optimizer_fn, clipnorm: float):
    """The optimizer ``optimizer_fn`` builds, with ``global_clipnorm`` set."""
    optimizer = optimizer_fn()
    return type(optimizer).from_config({**optimizer.get_config(), "global_clipnorm": clipnorm})


def _clipped(name: str):
    from autosync.models.zoo import get_model_def

    model_def = get_model_def(name)
    return dataclasses.replace(model_def, name=f"{model_def.name}-clipped",
                               optimizer_fn=functools.partial(clipped_optimizer, model_def.optimizer_fn, CLIPNORM))


def ncf():
    return _clipped("ncf")


def dlrm():
    return _clipped("dlrm")
