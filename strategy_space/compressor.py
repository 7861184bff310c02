"""Gradient compressors as values, and PowerSGD's rule of what it compresses.

A strategy names a compressor by its spec (``none``, ``fp16``, ``fp16_ef``, ``powersgd(4)``,
``powersgd_ef(4)``); ``Compressor.parse`` turns the spec into a frozen value once (cached), and
everything after that — the encoding, the features, the network simulation, the runtime — reads
its fields instead of the text. ``str(value)`` gives the spec back.

PowerSGD at rank ``r`` views a tensor as the matrix ``(shape[0], rest)`` and sends ``r(m + n)``
values for its ``m x n`` instead of ``m n``; a tensor where that saves nothing (vectors, thin or
tiny matrices) is sent raw. ``powersgd_compressible`` and ``powersgd_wire_values`` are that rule,
element-wise over numpy arrays as well as on plain numbers, so the vectorised features, the
simulator and the runtime apply the same one.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import numpy as np

from .errors import ConfigError, short_repr

COMPRESSOR_KINDS = ("none", "fp16", "fp16_ef", "powersgd", "powersgd_ef")
_RANKED = ("powersgd", "powersgd_ef")
_SPEC_RE = re.compile(r"^(none|fp16|fp16_ef|powersgd|powersgd_ef)(?:\((\d+)\))?$")
# PowerSGD's rank: real uses are 1 to 32 (a rank near a matrix's smaller side sends more than the
# raw gradient); the cap keeps generated or mistyped ranks from allocating rank-wide factors
MAX_RANK = 1024
_ALLOWED = f"none, fp16, fp16_ef, powersgd(RANK), powersgd_ef(RANK) with RANK from 1 to {MAX_RANK}"


@dataclass(frozen=True)
class Compressor:
    """One compressor setting.

    Attributes:
        kind: ``none``, ``fp16`` or ``powersgd``.
        rank: PowerSGD's approximation rank (0 for the others).
        error_feedback: keep the compression residual and add it back the next step.
    """

    kind: str = "none"
    rank: int = 0
    error_feedback: bool = False

    def __post_init__(self):
        if self.kind not in ("none", "fp16", "powersgd"):
            raise ConfigError(f"compressor kind {short_repr(self.kind)} is not one of none, fp16, powersgd")
        if (self.kind == "powersgd") != (isinstance(self.rank, int) and 1 <= self.rank <= MAX_RANK):
            raise ConfigError(f"compressor {self.kind} takes {'a rank >= 1' if self.kind == 'powersgd' else 'no rank'}, "
                              f"got rank {short_repr(self.rank)}")
        if self.kind == "none" and self.error_feedback:
            raise ConfigError("compressor none has no error feedback (nothing is lost to feed back)")

    @property
    def name(self) -> str:
        """The spec without the rank, one of ``COMPRESSOR_KINDS`` (``fp16_ef``, ``powersgd``...)."""
        return self.kind + "_ef" if self.error_feedback else self.kind

    def __str__(self) -> str:
        return f"{self.name}({self.rank})" if self.kind == "powersgd" else self.name

    @classmethod
    def parse(cls, text) -> "Compressor":
        """The value of a spec such as ``powersgd_ef(4)`` (parsed once per distinct spec).

        Raises:
            ConfigError: for an unknown name, a missing or zero rank, or a rank on an unranked one.
        """
        if not isinstance(text, str):
            raise ConfigError(f"compressor {short_repr(text)} is not one of {_ALLOWED}")
        return _parse(text)

    @classmethod
    def of(cls, name: str, rank: int = 0) -> "Compressor":
        """The value for one of ``COMPRESSOR_KINDS`` and a rank (ignored unless PowerSGD)."""
        ef = name.endswith("_ef")
        kind = name[:-3] if ef else name
        return cls(kind, rank if kind == "powersgd" else 0, ef)


@functools.lru_cache(maxsize=1024)
def _parse(text: str) -> Compressor:
    m = _SPEC_RE.match(text)
    if not m:
        raise ConfigError(f"compressor {short_repr(text)} is not one of {_ALLOWED}")
    name, rank = m.group(1), m.group(2)
    if name in _RANKED:
        if rank is None or len(rank) > 6 or not 1 <= int(rank) <= MAX_RANK:
            raise ConfigError(f"compressor {short_repr(text)} needs a rank from 1 to {MAX_RANK}, e.g. {name}(4)")
        return Compressor.of(name, int(rank))
    if rank is not None:
        raise ConfigError(f"compressor {name} takes no rank, got {short_repr(text)}; allowed: {_ALLOWED}")
    return Compressor.of(name)


def matrix_dims(shape) -> tuple[int, int]:
    """The matrix PowerSGD sees in a tensor of ``shape``: ``(shape[0], rest)``; a vector is one
    column and a scalar one value, which no rank compresses."""
    shape = tuple(int(d) for d in shape)
    if not shape:
        return 1, 1
    return shape[0], int(np.prod(shape[1:], dtype=np.int64))


def shard_matrix_dims(slices, slice_values, dim0, first_axis):
    """``matrix_dims`` of a shard given by numbers instead of a shape, element-wise: the shard holds
    ``slices`` slices of ``slice_values`` values each along its partition axis; ``dim0`` is the
    variable's first dimension, ``first_axis`` whether the partition axis is that one."""
    m = np.where(first_axis, slices, dim0)
    n = np.where(first_axis, slice_values, slices * slice_values / dim0)
    return m, n


def powersgd_compressible(m, n, rank):
    """Whether PowerSGD at ``rank`` sends less for an ``m x n`` matrix than the matrix itself
    (``r(m + n) < m n``, which implies ``min(m, n) > r``). Element-wise."""
    return rank * (m + n) < m * n


def powersgd_wire_values(m, n, rank):
    """Values PowerSGD at ``rank`` sends for an ``m x n`` matrix in one step: ``r(m + n)`` where
    that is less than ``m n``, else the matrix raw. Element-wise."""
    low, full = rank * (m + n), m * n
    return np.where(low < full, low, full)
