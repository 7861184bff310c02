"""A digest of a model's weights: how the driver checks that every worker built the same initial
weights without receiving every worker's copy (for a 540M-parameter model each copy is 2 GB)."""
from __future__ import annotations

import hashlib

import numpy as np


def weights_digest(arrays: list) -> str:
    """SHA-1 over the arrays' bytes, in order."""
    h = hashlib.sha1()
    for a in arrays:
        h.update(np.ascontiguousarray(a))  # the array's own buffer (a contiguous one is not copied)
    return h.hexdigest()


def zeros_digest(variables: list, chunk_bytes: int = 1 << 16) -> str:
    """``weights_digest`` of all-zero arrays of these sizes, ``variables``: ``(shape, dtype)``
    pairs, hashed from one reused block of zero bytes (the arrays are never allocated)."""
    h = hashlib.sha1()
    zeros = memoryview(bytes(chunk_bytes))
    for shape, dtype in variables:
        left = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        while left > 0:
            n = min(left, chunk_bytes)
            h.update(zeros[:n])
            left -= n
    return h.hexdigest()
