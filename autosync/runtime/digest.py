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


def zeros_digest(variables: list) -> str:
    """A digest of all-zero arrays of these sizes, ``variables``: ``(shape, dtype)`` pairs, read
    from the sizes alone (emulated workers compare it among themselves): hashing the zero bytes
    of a full-size embedding spec would take a worker minutes (hours for a table of terabytes)
    before its first step."""
    h = hashlib.sha1(b"zeros")
    for shape, dtype in variables:
        h.update(f"{tuple(int(d) for d in shape)}:{np.dtype(dtype).str};".encode())
    return h.hexdigest()
