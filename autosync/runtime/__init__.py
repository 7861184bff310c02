"""The Ray runtime: execute a Strategy with TensorFlow (or emulated) workers, numpy parameter
servers and collectives, and measure it.

Modules, driver side first:

- ``binding``: ClusterSpec -> Ray nodes and the actor options that pin work there.
- ``plan``: Strategy -> ``SyncPlan``, what runs where (plain data).
- ``engine``: the pool of warm worker actors and the session that runs one plan.
- ``runner``: measured trials, ``RayRunner`` (the tuner's ``Runner``).
- ``trainer``: ``Trainer``, real training with a strategy.
- ``reaper``: stops what a ``local`` run started when its driver dies.
- ``worker``: the TensorFlow worker actor; ``emulated``: a worker that waits the profiled compute
  time and emits synthetic gradients instead; ``rows``: which sparse rows a step reads.
- ``sync``: the worker-side synchronization channels (``SyncChannel``: parameter servers,
  all-reduce, in-graph all-reduce), the collective backends and the compressors.
- ``ps_shard``: the parameter-server actor; ``aggregator``: the per-node actor that merges a
  node's pushes and pulls; ``psnet``: the PS data plane (ZeroMQ between workers and PS actors).
- ``optimizers``: Keras update rules in numpy; ``keras_optimizer``: the model's own Keras
  optimizer on numpy shards where those rules do not apply.
- ``initial``: initial values as workers describe them; ``digest``: a digest of a model's
  weights, to check that every worker built the same ones.

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
