"""PowerSGD inside the ``graph`` backend's training step (``sync.graph``): its two rounds of
TensorFlow collectives for one fusion group's members, and the state they keep across steps."""
from __future__ import annotations

import zlib

import numpy as np

from autosync.runtime.sync.allreduce import ARMember
from autosync.runtime.sync.compression import orthogonalize
from autosync.runtime.sync.tf_collective import all_reduce
from strategy_space.compressor import Compressor, matrix_dims, powersgd_compressible


class PowerSGDGraphState:
    """PowerSGD's two rounds for one (group, compressor) inside the graph, with its state (warm
    Q per matrix, error-feedback residual) in variables: the same protocol as
    ``autosync.runtime.sync.compression.PowerSGDState`` (same Q draw, same sign-fixed orthogonalization).
    Round 1 all-reduces the P matrices and the uncompressible members in one buffer, round 2 the
    Q matrices."""

    def __init__(self, members: list[tuple[ARMember, tuple[int, ...]]], comp: Compressor, seed: int):
        import tensorflow as tf

        self.rank, self.ef = comp.rank, comp.error_feedback
        self.shapes = {m.key: shape for m, shape in members}
        self.low = {m.key for m, shape in members if powersgd_compressible(*matrix_dims(shape), self.rank)}
        self.q, self.err = {}, {}
        for m, shape in members:
            if m.key not in self.low:
                continue
            n = int(np.prod(shape[1:]))
            rng = np.random.default_rng([seed, zlib.crc32(repr(m.key).encode())])
            self.q[m.key] = tf.Variable(orthogonalize(rng.standard_normal((n, self.rank)).astype(np.float32)),
                                        trainable=False)
            if self.ef:
                self.err[m.key] = tf.Variable(tf.zeros([shape[0], n]), trainable=False)

    def variables(self) -> list:
        """What it keeps across steps: the warm Qs, then the residuals."""
        return [*self.q.values(), *self.err.values()]

    def reduce(self, ms: list[ARMember], parts: list, world: int, keys, hint: str) -> dict:
        import tensorflow as tf

        low = [(m, p) for m, p in zip(ms, parts) if m.key in self.low]
        raw = [(m, p) for m, p in zip(ms, parts) if m.key not in self.low]
        mats = {}
        for m, p in low:
            shape = self.shapes[m.key]
            mat = tf.reshape(tf.cast(p, tf.float32), [shape[0], -1])
            mats[m.key] = mat + self.err[m.key] if self.ef else mat
        ps = [tf.matmul(mats[m.key], self.q[m.key]) for m, _ in low]
        flat = [tf.reshape(x, [-1]) for x in ps] + [tf.reshape(tf.cast(p, tf.float32), [-1]) for _, p in raw]
        out1 = all_reduce(tf.concat(flat, 0) / world, world, next(keys), hint)
        out, offset, p_hats = {}, 0, []
        for m, _ in low:
            size = self.shapes[m.key][0] * self.rank
            p_hats.append(orthogonalize_in_graph(tf.reshape(out1[offset:offset + size], [-1, self.rank])))
            offset += size
        for m, p in raw:
            size = int(np.prod(self.shapes[m.key]))
            out[m.key] = tf.cast(tf.reshape(out1[offset:offset + size], tf.shape(p)), p.dtype)
            offset += size
        if not low:
            return out
        qs = [tf.matmul(mats[m.key], p_hat, transpose_a=True) for (m, _), p_hat in zip(low, p_hats)]
        out2 = all_reduce(tf.concat([tf.reshape(q, [-1]) for q in qs], 0) / world, world, next(keys), hint)
        offset = 0
        for (m, p), p_hat, q in zip(low, p_hats, qs):
            q_mean = tf.reshape(out2[offset:offset + int(np.prod(q.shape))], q.shape)
            offset += int(np.prod(q.shape))
            approx = tf.matmul(p_hat, q_mean, transpose_b=True)
            self.q[m.key].assign(q_mean)
            if self.ef:
                self.err[m.key].assign(mats[m.key] - approx)
            out[m.key] = tf.cast(tf.reshape(approx, tf.shape(p)), p.dtype)
        return out


def orthogonalize_in_graph(p, eps: float = 1e-8):
    """``autosync.runtime.sync.compression.orthogonalize`` in the graph: reduced QR, signs fixed by R's
    diagonal, columns of a rank-deficient P zeroed."""
    import tensorflow as tf

    q, r = tf.linalg.qr(p)
    diag = tf.linalg.diag_part(r)
    signs = tf.where(diag < 0, -tf.ones_like(diag), tf.ones_like(diag))
    keep = tf.cast(tf.abs(diag) >= eps, q.dtype)
    return q * signs * keep
