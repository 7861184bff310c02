"""The values a step's pulls returned, joined into one value per model variable.

A channel's pull answers ``{(variable, shard): value}``, where a value is a shard's whole array or,
for a table pulled by rows, ``(row ids, rows)``. A variable's value is whole only once every shard
of it has arrived; rows of a table join with whole shards held elsewhere (e.g. all-reduced), which
become rows too.
"""
from __future__ import annotations

import numpy as np

from strategy_space import shard_bounds


def join_pulled(parts: dict, layout: list, first_dims: list) -> dict:
    """``{variable index: array or (row ids, rows)}`` for each variable all of whose shards are in
    ``parts``; ``layout[v]`` is ``(shards, axis)`` and ``first_dims[v]`` the variable's row count."""
    pulled = {}
    for v, (shards, axis) in enumerate(layout):
        got = [parts.get((v, i)) for i in range(shards)]
        if any(p is None for p in got):
            continue
        if shards == 1 and isinstance(got[0], tuple):
            pulled[v] = got[0]   # (row ids, values) as received: the assign joins tables of one row shape
        elif any(isinstance(p, tuple) for p in got):
            bounds = shard_bounds(first_dims[v], shards)
            got = [p if isinstance(p, tuple) else (np.arange(a, b), p) for p, (a, b) in zip(got, bounds)]
            pulled[v] = (np.concatenate([p[0] for p in got]), np.concatenate([p[1] for p in got]))
        elif shards == 1:
            pulled[v] = got[0]  # zero-copy view of the received buffer
        else:
            pulled[v] = np.concatenate(got, axis=axis)
    return pulled
