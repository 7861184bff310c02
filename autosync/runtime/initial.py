"""Initial values as a worker's description carries them to the parameter servers and the
all-reduce channels: arrays, or ``ZeroInitial`` for a variable that starts at zero.

An emulated worker's variables all start at zero (``autosync.runtime.emulated``); describing
them instead of allocating them keeps full-size zero tables out of the worker, the object store
and the pickled description (a full-size dlrm's tables are 2 GB). Whoever needs the values makes
only its own part (``initial_slice``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ZeroInitial:
    """A variable whose initial value is all zeros: its shape and dtype, no values."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


def initial_slice(value, start: int, stop: int, axis: int) -> tuple[np.ndarray, bool]:
    """``value[start:stop]`` along ``axis``, contiguous, and whether it was allocated here (False:
    a view of ``value``, e.g. of Ray's object store, which its reader must not write into).

    ``value`` is an array or a ``ZeroInitial`` (zeros of the slice's shape are allocated; the
    pages of a large one stay unbacked until written)."""
    if isinstance(value, ZeroInitial):
        shape = list(value.shape)
        if shape:
            shape[axis] = stop - start
        return np.zeros(shape, value.dtype), True
    if value.ndim == 0 or (start == 0 and stop == value.shape[axis]):
        return value, False
    part = value[(slice(None),) * axis + (slice(start, stop),)]
    if part.flags.c_contiguous:
        return part, False  # a slice along axis 0
    return np.ascontiguousarray(part), True
