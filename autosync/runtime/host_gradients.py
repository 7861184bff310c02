"""A worker's gradients in host memory, as it hands them to its synchronizers: a dense one as a
numpy array, a sparse one (``IndexedSlices``) as ``(indices, values)``, None for a variable the
loss does not reach; and the arithmetic of accumulating them (Keras' gradient accumulation, a
worker that draws the batches of several data parts: ``data_parts``)."""
from __future__ import annotations

import numpy as np


def add(a, b):
    """Two gradients of one variable added up: dense arrays summed, sparse slices concatenated."""
    if a is None or b is None:
        return b if a is None else a
    if isinstance(a, tuple):
        return np.concatenate([a[0], b[0]]), np.concatenate([a[1], b[1]])
    return a + b


def divide(g, n: float):
    """``g`` divided by ``n`` (a sparse gradient's values), in its own dtype."""
    if g is None:
        return None
    if isinstance(g, tuple):
        return g[0], g[1] / g[1].dtype.type(n)
    return g / g.dtype.type(n)


def to_numpy(grad):
    """A gradient as numpy: ndarray, ``(indices, values)`` for IndexedSlices, or None."""
    if grad is None:
        return None
    if hasattr(grad, "indices") and hasattr(grad, "values"):
        return grad.indices.numpy(), grad.values.numpy()
    return np.asarray(grad.numpy())   # (a scalar variable's gradient: a 0-d array, not a numpy scalar)
