"""Gradient compressors for all-reduce.

Two shapes of compression exist:

* element-wise compressors are stateless pairs, ``compress(x) -> (wire, ctx)`` and
  ``decompress(wire, ctx) -> x``, applied to a fused buffer before and after one all-reduce
  (``none``, ``fp16``). ``fp16`` really sends 2 bytes per value.
* PowerSGD is a protocol: per matrix M (m x n), ``P = M Q`` is all-reduced, orthogonalized, then
  ``Q = M^T P`` is all-reduced and ``M ~ P Q^T``: r(m + n) values instead of m n. Q is warm-started
  from the previous step. Tensors of rank > 2 are viewed as (shape[0], prod(rest)); vectors and
  tiny matrices (where r(m+n) >= m n) are sent uncompressed (the rule is
  ``strategy_space.compressor.powersgd_compressible``, shared with the features and the simulator).

``ErrorFeedback`` adds the residual of the previous step's compression before compressing and keeps
the new residual (Karimireddy et al., 2019); ``fp16_ef`` and ``powersgd_ef`` use it.

All state (residuals, warm-start Qs) lives in objects created per trial and per worker, so two
trials never share it.
"""
from __future__ import annotations

import abc
import zlib
from typing import Any

import numpy as np

from autosync.runtime.reshard import key_text
from strategy_space.errors import ConfigError
from strategy_space.compressor import Compressor, matrix_dims, powersgd_wire_values


class ElementwiseCompressor(abc.ABC):
    """A stateless element-wise compressor (the operation; the setting is a
    ``strategy_space.compressor.Compressor``)."""

    name: str = ""

    @abc.abstractmethod
    def compress(self, x: np.ndarray) -> tuple[np.ndarray, Any]:
        """Return the array to send and a context for ``decompress``."""

    @abc.abstractmethod
    def decompress(self, wire: np.ndarray, ctx: Any) -> np.ndarray:
        """Invert ``compress`` (up to the precision it drops)."""

    def wire_bytes(self, num_values: int, itemsize: int = 4) -> int:
        """Bytes one tensor of ``num_values`` values occupies on the wire."""
        return num_values * itemsize


class NoneCompressor(ElementwiseCompressor):
    name = "none"

    def compress(self, x):
        return x, None

    def decompress(self, wire, ctx):
        return wire


class FP16Compressor(ElementwiseCompressor):
    """Half precision on the wire. Values are scaled by the caller (divided by the number of
    workers before the sum) so the fp16 sum does not overflow where the mean would not."""

    name = "fp16"

    def compress(self, x):
        return x.astype(np.float16), x.dtype

    def decompress(self, wire, ctx):
        return wire.astype(ctx)

    def wire_bytes(self, num_values, itemsize=4):
        return num_values * 2


ELEMENTWISE: dict[str, type[ElementwiseCompressor]] = {"none": NoneCompressor, "fp16": FP16Compressor}


class ErrorFeedback:
    """Residual memory for a lossy compressor, per tensor key."""

    def __init__(self):
        self.residual: dict[Any, np.ndarray] = {}

    def add(self, key, x: np.ndarray) -> np.ndarray:
        r = self.residual.get(key)
        return x if r is None else x + r

    def keep(self, key, corrected: np.ndarray, transmitted: np.ndarray) -> None:
        self.residual[key] = corrected - transmitted


def as_matrix(x: np.ndarray) -> np.ndarray:
    """View a tensor as the matrix PowerSGD compresses: (shape[0], rest)."""
    return x.reshape(x.shape[0], -1)


def orthogonalize(p: np.ndarray, eps: float = 1e-8) -> np.ndarray:
    """Orthonormal columns spanning ``p`` (reduced QR; a zero column stays zero)."""
    q, r = np.linalg.qr(p)
    # QR's sign is arbitrary; fix it so every worker (same input) gets the same basis
    signs = np.sign(np.diag(r))
    signs[signs == 0] = 1.0
    q = q * signs
    q[:, np.abs(np.diag(r)) < eps] = 0.0
    return q


class PowerSGDState:
    """Per-worker, per-trial state of PowerSGD for a set of tensors.

    Hyper-parameters:
        rank: the approximation rank. Higher is more accurate and sends more
            (r(m+n) values per m x n matrix). 1-4 usually suffice with error feedback.
        error_feedback: keep the compression residual and add it back next step. Without it
            PowerSGD's bias slows convergence noticeably; keep it on unless measuring.
        seed: Q's initial random draw; must be equal on every worker (the same Q everywhere is
            what makes the all-reduced P meaningful).
    """

    def __init__(self, rank: int, error_feedback: bool, seed: int = 0):
        if rank < 1:
            raise ConfigError(f"PowerSGD rank must be >= 1, got {rank}")
        self.rank = rank
        self.ef = ErrorFeedback() if error_feedback else None
        self.seed = seed
        self.q: dict[Any, np.ndarray] = {}
        self._m: dict[Any, np.ndarray] = {}

    def _q(self, key, n: int, dtype) -> np.ndarray:
        q = self.q.get(key)
        if q is None:
            # a process-independent seed per tensor: every worker must draw the same Q
            rng = np.random.default_rng([self.seed, zlib.crc32(repr(key).encode())])
            q = orthogonalize(rng.standard_normal((n, self.rank)).astype(dtype))
            self.q[key] = q
        return q

    def first_round(self, key, grad: np.ndarray) -> np.ndarray:
        """P = M Q for this tensor (M with error feedback added); remembers M."""
        m = as_matrix(grad)
        if self.ef is not None:
            m = as_matrix(self.ef.add(key, grad))
        self._m[key] = m
        return m @ self._q(key, m.shape[1], m.dtype)

    def second_round(self, key, p_mean: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Given the all-reduced mean P: orthogonalize it and return (P_hat, Q = M^T P_hat)."""
        p_hat = orthogonalize(p_mean)
        return p_hat, self._m[key].T @ p_hat

    def finish(self, key, p_hat: np.ndarray, q_mean: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """The decompressed mean gradient P_hat Q^T; keeps Q for the next step's warm start and
        the residual for error feedback."""
        approx = (p_hat @ q_mean.T).reshape(shape)
        self.q[key] = q_mean
        if self.ef is not None:  # the residual in the gradient's own shape: next step adds it to one
            self.ef.keep(key, self._m[key].reshape(shape), approx)
        del self._m[key]
        return approx


def memory_arrays(error_feedback: dict, powersgd: dict) -> dict:
    """What a channel's compressors keep across steps (``saved_state``'s dicts) as named arrays, for
    a checkpoint (each worker's own): ``ef/<compressor>/<var>.<shard>`` residuals, and
    ``powersgd/<compressor>/q/<var>.<shard>`` warm-start Qs and ``.../ef/<var>.<shard>`` residuals."""
    out = {}
    for comp, ef in error_feedback.items():
        out.update((f"ef/{comp}/{key_text(k)}", a) for k, a in ef.residual.items())
    for comp, state in powersgd.items():
        out.update((f"powersgd/{comp}/q/{key_text(k)}", a) for k, a in state.q.items())
        if state.ef is not None:
            out.update((f"powersgd/{comp}/ef/{key_text(k)}", a) for k, a in state.ef.residual.items())
    return out


def load_memory(error_feedback: dict, powersgd: dict, arrays: dict, seed: int) -> None:
    """Set the compressors' memory (``saved_state``'s dicts, emptied first) from ``memory_arrays``'
    arrays; PowerSGD's states are made with ``seed``, as the channel makes them."""
    error_feedback.clear()
    powersgd.clear()
    for name, array in arrays.items():
        kind, comp, rest = name.split("/", 2)
        comp = Compressor.parse(comp)
        if kind == "ef":
            error_feedback.setdefault(comp, ErrorFeedback()).residual[_key(rest)] = np.array(array)
            continue
        state = powersgd.setdefault(comp, PowerSGDState(comp.rank, comp.error_feedback, seed))
        part, key = rest.split("/", 1)
        (state.q if part == "q" else state.ef.residual)[_key(key)] = np.array(array)


def _key(text: str) -> tuple:
    return tuple(int(x) for x in text.split("."))


def elementwise(codec: Compressor) -> ElementwiseCompressor:
    """The element-wise compressor of a ``none`` or ``fp16`` setting (error feedback or not).

    Raises:
        ValueError: for PowerSGD, which is a protocol (``PowerSGDState``), not an element-wise pair.
    """
    if codec.kind not in ELEMENTWISE:
        raise ValueError(f"compressor {codec} is not element-wise; use PowerSGDState for PowerSGD")
    return ELEMENTWISE[codec.kind]()


def wire_values(shape: tuple[int, ...], codec: Compressor) -> tuple[int, int]:
    """(values sent, bytes per value) for one tensor under ``codec`` in one step."""
    n = int(np.prod(shape)) if shape else 1
    if codec.kind == "powersgd":
        return int(powersgd_wire_values(*matrix_dims(shape), codec.rank)), 4
    return n, elementwise(codec).wire_bytes(1)


def saved_state(error_feedback: dict, powersgd: dict) -> tuple:
    """What the compressors of a channel keep across steps (``{Compressor: ErrorFeedback}``,
    ``{Compressor: PowerSGDState}``: residuals, warm-start Qs), saved before a held step so that a
    step skipped under dynamic loss scaling leaves them as they were (``restore_state``): a residual
    of a gradient that was not finite would poison every later step. Dict copies suffice: a step
    replaces their arrays, it never changes one in place."""
    kept = [(ef.residual, dict(ef.residual)) for ef in error_feedback.values()]
    for state in powersgd.values():
        kept.append((state.q, dict(state.q)))
        if state.ef is not None:
            kept.append((state.ef.residual, dict(state.ef.residual)))
    return dict(error_feedback), dict(powersgd), kept


def restore_state(error_feedback: dict, powersgd: dict, saved: tuple) -> None:
    """Put back what ``saved_state`` saved (compressors first made since are dropped)."""
    ef_before, powersgd_before, kept = saved
    error_feedback.clear()
    error_feedback.update(ef_before)
    powersgd.clear()
    powersgd.update(powersgd_before)
    for live, before in kept:
        live.clear()
        live.update(before)
