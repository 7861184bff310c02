"""Compressors: bytes on the wire, round trips, error feedback, PowerSGD algebra (no Ray)."""
import numpy as np
import pytest

from autosync.runtime.sync.compression import (ErrorFeedback, FP16Compressor, NoneCompressor, PowerSGDState, elementwise,
                                                orthogonalize, wire_values)
from strategy_space.compressor import Compressor, matrix_dims, powersgd_compressible
from strategy_space.errors import ConfigError


def test_fp16_sends_half_the_bytes():
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    wire, ctx = FP16Compressor().compress(x)
    assert wire.dtype == np.float16 and wire.nbytes == x.nbytes // 2
    back = FP16Compressor().decompress(wire, ctx)
    assert back.dtype == np.float32 and np.allclose(back, x, rtol=1e-3, atol=1e-3)
    assert wire_values((1000,), Compressor.parse("fp16")) == (1000, 2)
    assert wire_values((1000,), Compressor.parse("none")) == (1000, 4)


def test_none_is_identity():
    x = np.arange(5, dtype=np.float32)
    wire, ctx = NoneCompressor().compress(x)
    assert wire is x and NoneCompressor().decompress(wire, ctx) is x


@pytest.mark.parametrize("shape, rank", [((64, 32), 2), ((16, 3, 3, 8), 4), ((100, 200), 1)])
def test_powersgd_sends_r_m_plus_n(shape, rank):
    m, n = shape[0], int(np.prod(shape[1:]))
    assert wire_values(shape, Compressor.parse(f"powersgd({rank})")) == (rank * (m + n), 4)
    # and the P, Q matrices really have that many values
    state = PowerSGDState(rank, error_feedback=False)
    g = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    p = state.first_round("k", g)
    p_hat, q = state.second_round("k", p)
    assert p.size + q.size == rank * (m + n)


def test_powersgd_vectors_and_tiny_matrices_uncompressed():
    assert not powersgd_compressible(*matrix_dims((512,)), 4)
    assert not powersgd_compressible(*matrix_dims((4, 4)), 4)
    assert wire_values((512,), Compressor.parse("powersgd_ef(4)")) == (512, 4)


def test_powersgd_exact_for_low_rank_matrix():
    rng = np.random.default_rng(2)
    g = (rng.standard_normal((50, 2)) @ rng.standard_normal((2, 40))).astype(np.float32)
    state = PowerSGDState(2, error_feedback=False)
    p = state.first_round("k", g)
    p_hat, q = state.second_round("k", p)
    approx = state.finish("k", p_hat, q, g.shape)
    assert np.allclose(approx, g, atol=1e-3)


def test_powersgd_error_feedback_keeps_residual_and_warm_starts():
    rng = np.random.default_rng(3)
    g = rng.standard_normal((30, 20)).astype(np.float32)
    state = PowerSGDState(1, error_feedback=True)
    p_hat, q = state.second_round("k", state.first_round("k", g))
    approx = state.finish("k", p_hat, q, g.shape)
    assert np.allclose(state.ef.residual["k"], g - approx, atol=1e-5)
    assert np.array_equal(state.q["k"], q)  # next step starts from this Q
    # nothing is lost: what was sent plus the residual is exactly what was fed in, and the
    # residual stays bounded, so the average sent converges to the gradient
    sent, errors = approx.copy(), []
    for t in range(2, 301):
        p_hat, q = state.second_round("k", state.first_round("k", g))
        sent += state.finish("k", p_hat, q, g.shape)
        assert np.allclose(sent + state.ef.residual["k"], t * g, atol=1e-5 * t * np.abs(g).max())
        errors.append(np.linalg.norm(sent / t - g) / np.linalg.norm(g))
    assert errors[-1] < 0.1 < errors[10]


def test_powersgd_error_feedback_on_a_3d_tensor_over_steps():
    """An attention kernel (d, heads, d_head) is compressed as a (d, heads*d_head) matrix; the
    residual must come back in the tensor's shape (regression: the second step failed to broadcast
    a (128, 128) residual onto a (128, 2, 64) gradient)."""
    g = np.random.default_rng(5).standard_normal((16, 2, 8)).astype(np.float32)
    state = PowerSGDState(2, error_feedback=True)
    sent = np.zeros_like(g)
    for t in range(1, 4):
        p_hat, q = state.second_round("k", state.first_round("k", g))
        out = state.finish("k", p_hat, q, g.shape)
        assert out.shape == g.shape and state.ef.residual["k"].shape == g.shape
        sent += out
        assert np.allclose(sent + state.ef.residual["k"], t * g, atol=1e-4 * t)


def test_orthogonalize_is_deterministic_and_orthonormal():
    p = np.random.default_rng(4).standard_normal((20, 3))
    q1, q2 = orthogonalize(p), orthogonalize(p.copy())
    assert np.array_equal(q1, q2)
    assert np.allclose(q1.T @ q1, np.eye(3), atol=1e-6)


def test_error_feedback_memory():
    ef = ErrorFeedback()
    x = np.ones(3, np.float32)
    assert ef.add("a", x) is x
    ef.keep("a", x, np.zeros(3, np.float32))
    assert np.array_equal(ef.add("a", x), 2 * x)


def test_elementwise_compressor_of_a_setting():
    assert isinstance(elementwise(Compressor.parse("fp16_ef")), FP16Compressor)
    assert isinstance(elementwise(Compressor.parse("none")), NoneCompressor)
    with pytest.raises(ValueError, match="not element-wise"):
        elementwise(Compressor.parse("powersgd(3)"))
    with pytest.raises(ConfigError, match="needs a rank"):
        Compressor.parse("powersgd")


def test_sparse_members_of_a_group_cost_one_collective_in_all():
    """However many sparse variables share a group, a step all-gathers them with one call (a
    call per variable would be one round trip per variable per step), row ids in the narrowest
    dtype that numbers the members' rows, a worker's repeated rows summed (SGD updates alike)."""
    from autosync.runtime.slices import sparse_frame
    from autosync.runtime.sync.allreduce import AllReduceChannel, ARGroup, ARMember

    shapes = [(10, 3), (7, 2), (5,)]
    members = tuple(ARMember((v, 0), 0, s[0], 0, 1, True, Compressor(), "objectstore") for v, s in enumerate(shapes))
    rng = np.random.default_rng(0)
    grads = [(np.array([1, 3, 1]), rng.standard_normal((3, 3)).astype(np.float32)),
             (np.array([6]), rng.standard_normal((1, 2)).astype(np.float32)),
             (np.array([0, 4]), rng.standard_normal(2).astype(np.float32))]

    class Recorder:
        """A two-worker backend: the peer sends the same rows, doubled."""
        calls, sent = 0, None

        def allgather(self, arr, tag):
            Recorder.calls += 1
            Recorder.sent = arr
            return [arr, sparse_frame([(i, 2 * v) for i, v in grads], members)[0]]

    values = {(v, 0): np.zeros(s, np.float32) for v, s in enumerate(shapes)}
    ch = AllReduceChannel(0, 2, [ARGroup(0, members)], {"objectstore": None}, values,
                          {"name": "SGD", "learning_rate": 1.0, "class": "SGD"})
    ch._backends["objectstore"] = Recorder()
    ch.push(0, grads)
    assert Recorder.calls == 1 and ch.calls == 1
    # 3 counts (4 bytes each), 5 ids of one byte (row 1 summed; padded to 8), 6 + 2 + 2 float32 values
    assert Recorder.sent.nbytes == 12 + 8 + 4 * 10
    for v, (idx, vals) in enumerate(grads):
        want = np.zeros(shapes[v], np.float32)
        np.add.at(want, idx, -(vals + 2 * vals) / 2)  # SGD lr 1 on the mean of both workers
        np.testing.assert_allclose(ch.pull(1)[(v, 0)], want, rtol=1e-5, atol=1e-6)


def test_a_sparse_frame_reads_back_every_members_rows_and_values():
    """Members of several row shapes and precisions, one with no rows this step, ids past 255
    (two-byte ids): each worker's frame gives back its rows and values exactly (narrower values
    widened to the group's widest dtype on the wire)."""
    from autosync.runtime.slices import read_sparse_frame, sparse_frame
    from autosync.runtime.sync.allreduce import ARMember

    shapes = [(300, 2, 3), (40, 4), (9,)]
    members = [ARMember((v, 0), 0, s[0], 0, 1, True, Compressor(), "gloo") for v, s in enumerate(shapes)]
    rng = np.random.default_rng(1)
    parts = [(np.array([299, 0, 17, 299]), rng.standard_normal((4, 2, 3)).astype(np.float32)),
             (np.zeros(0, np.int64), np.zeros((0, 4), np.float16)),
             (np.array([8, 2]), rng.standard_normal(2).astype(np.float16))]
    frame, layout = sparse_frame(parts, members)
    assert frame.dtype == np.int32 and layout[0] == np.uint16 and layout[1] == np.float32
    back = read_sparse_frame(frame.copy(), layout)
    for (idx, vals), (got_idx, got_vals) in zip(parts, back):
        np.testing.assert_array_equal(got_idx, idx)
        assert got_vals.shape == vals.shape
        np.testing.assert_array_equal(got_vals.astype(vals.dtype), vals)


def test_a_sparse_frame_carries_the_summed_squares_of_repeated_rows():
    """A part summed by ``dedup_rows`` with squares: read back, each row's square is the sum of
    its slices' squares where it repeated, its value's square where it did not."""
    from autosync.runtime.slices import dedup_rows, read_sparse_frame, sparse_frame
    from autosync.runtime.sync.allreduce import ARMember

    members = [ARMember((v, 0), 0, 50, 0, 1, True, Compressor(), "gloo") for v in range(2)]
    rng = np.random.default_rng(2)
    raw = [(np.array([4, 9, 4, 4, 30]), rng.standard_normal((5, 2)).astype(np.float32)),
           (np.array([3, 8]), rng.standard_normal(2).astype(np.float32))]
    parts = [dedup_rows(i, v, True) for i, v in raw]
    assert len(parts[0]) == 4 and len(parts[1]) == 2   # rows repeat in the first only
    frame, layout = sparse_frame(parts, members, squares=True)
    for (idx, vals), (ids, sums, squares) in zip(raw, read_sparse_frame(frame, layout)):
        for row, s, sq in zip(ids.tolist(), sums, squares):
            np.testing.assert_allclose(s, vals[idx == row].sum(axis=0), rtol=1e-6)
            np.testing.assert_allclose(sq, np.square(vals[idx == row]).sum(axis=0), rtol=1e-6)
