"""The Ray runtime: execute a Strategy with TensorFlow workers and numpy parameter servers.

Modules: ``binding`` (ClusterSpec -> Ray nodes), ``plan`` (Strategy -> what runs where),
``worker`` (TF worker actor), ``ps_shard`` (PS actor), ``psnet`` (the PS data plane: ZeroMQ
between workers and PS actors), ``optimizers`` (Keras update rules in numpy), ``sync`` (worker-side
synchronization channels and collective backends), ``engine`` (pool and session on the driver),
``runner`` (measured trials, ``RayRunner``), ``trainer`` (``Trainer`` for real training).
Nothing heavy is imported until used.
"""
from __future__ import annotations

import importlib

_LAZY = {"RayRunner": "autosync.runtime.runner", "Trainer": "autosync.runtime.trainer"}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'autosync.runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
