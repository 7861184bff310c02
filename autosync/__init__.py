"""AutoSync: find how to synchronize each variable's gradients, then train that way on Ray.

The heavy parts (TensorFlow, Ray) are imported lazily, when first used.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it (imported on first access)
_LAZY = {
    "ModelDef": "autosync.model_def",
    "Trainer": "autosync.runtime.trainer",
    "tune": "autosync.api",
    "make_runner": "autosync.api",
    "make_trainer": "autosync.api",
    "worker_pool": "autosync.api",
    "TuneResult": "autosync.tune_result",
    "plan": "autosync.planning",
    "Plan": "autosync.planning",
    "load_cluster": "autosync.sources",
    "load_model_def": "autosync.sources",
    "load_model_spec": "autosync.sources",
    # what the API raises: bad input (a message that says what to fix), and a run that failed or
    # ran past its limit (a worker's or parameter server's error, a dead actor)
    "ConfigError": "strategy_space.errors",
    "TrialFailed": "autosync.runtime.waiting",
    "TrialTimeout": "autosync.runtime.waiting",
    # what it warns of: every worker drew the same data; the loss diverged on an exact strategy
    "SameDataWarning": "autosync.runtime.data_check",
    "DivergedWarning": "autosync.runtime.data_check",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'autosync' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
