"""The Compressor contract, one suite for every compressor of the registry
(``strategy_space.compressor.COMPRESSOR_KINDS``; PowerSGD at rank 2), run through the runtime's
all-reduce channel over an in-process collective of two ranks (``tests.fake_collective``: no Ray).

Every compressor hands back, on every rank, the same reduced gradient in the gradient's shape and
dtype; ``none`` is exact; a lossy one is exact on what it can represent (values fp16 holds, a
mean gradient of rank <= PowerSGD's rank) and close otherwise; it puts on the wire no more bytes
than ``wire_values`` declares (what the features and the simulator price); it keeps state only
when it says so (error feedback, PowerSGD's warm start), in objects of its own trial, and error
feedback keeps the accumulated error from growing with the steps.
"""
from __future__ import annotations

import numpy as np
import pytest

from autosync.runtime.sync import backends
from autosync.runtime.sync.allreduce import AllReduceChannel, ARGroup, ARMember
from autosync.runtime.sync.compression import ELEMENTWISE, elementwise, wire_values
from strategy_space.compressor import COMPRESSOR_KINDS, Compressor
from tests.fake_collective import ThreadBackend, run_ranks

WORLD = 2
RANK = 2
# a matrix PowerSGD compresses, a vector it sends raw, a 3-D tensor it views as a 5 x 12 matrix
SHAPES = [(16, 12), (7,), (5, 3, 4)]
SGD1 = {"name": "SGD", "learning_rate": 1.0, "momentum": 0.0, "nesterov": False}
CODECS = [Compressor.of(kind, RANK) for kind in COMPRESSOR_KINDS]


@pytest.fixture(params=CODECS, ids=str)
def codec(request):
    return request.param


@pytest.fixture(autouse=True)
def thread_backend(monkeypatch):
    monkeypatch.setitem(backends.BACKENDS, "thread", ThreadBackend)


def test_every_registered_compressor_has_a_runtime_implementation():
    assert {c.name for c in CODECS} == set(COMPRESSOR_KINDS)
    assert set(ELEMENTWISE) <= {c.kind for c in CODECS}, "an element-wise compressor is missing from the registry"
    for c in CODECS:
        if c.kind != "powersgd":    # PowerSGD is a protocol of two all-reduces, not an element-wise pair
            assert elementwise(c).name == c.kind


def _stateful(codec: Compressor) -> bool:
    return codec.error_feedback or codec.kind == "powersgd"


def reduce_steps(codec: Compressor, grads, world: int = WORLD) -> list[list[list[np.ndarray]]]:
    """``grads[step][rank]`` (one array per SHAPES) through one all-reduce channel per rank, all in
    one fusion group with ``codec``; returns ``[rank][step]`` the decoded mean gradients (SGD at
    learning rate 1 from zero: each step's update is minus what the channel reduced) and each
    rank's bytes per step in ``reduce_steps.sent``."""
    members = tuple(ARMember((v, 0), 0, s[0], 0, 1, False, codec, "thread") for v, s in enumerate(SHAPES))
    group = ThreadBackend.prepare(world, "contract")
    sent = [[] for _ in range(world)]

    def rank(r):
        values = {(v, 0): np.zeros(s, np.float32) for v, s in enumerate(SHAPES)}
        ch = AllReduceChannel(r, world, [ARGroup(0, members)], {"thread": group}, values, SGD1, seed=5)
        out = []
        for step, per_rank in enumerate(grads):
            before = {k: v.copy() for k, v in ch.pull(step).items()}
            bytes_before = ch.bytes_sent
            ch.push(step, per_rank[r])
            after = ch.pull(step + 1)
            out.append([before[(v, 0)] - after[(v, 0)] for v in range(len(SHAPES))])
            sent[r].append(ch.bytes_sent - bytes_before)
        return out

    out = run_ranks(world, rank)
    reduce_steps.sent = sent
    return out


def _grads(rng, steps: int, low_rank: bool = False, same: bool = False):
    """Gradients in quarters within [-4, 4] (fp16 holds them and their halves exactly); with
    ``low_rank`` every rank's matrices have rank 1 along shared directions (their mean has rank <= 2)."""
    def one(r):
        out = []
        for s in SHAPES:
            if low_rank and len(s) > 1:
                m, n = s[0], int(np.prod(s[1:]))
                u, w = rng.integers(-4, 5, (m, 1)) / 4, rng.integers(-4, 5, (1, n)) / 4
                out.append((u @ w).astype(np.float32).reshape(s))
            else:
                out.append((rng.integers(-16, 17, s) / 4).astype(np.float32))
        return out

    first = [one(r) for r in range(WORLD)]
    return [first if same else [one(r) for r in range(WORLD)] for _ in range(steps)]


def _mean(per_rank):
    return [sum(g[v] for g in per_rank) / WORLD for v in range(len(SHAPES))]


def test_every_rank_gets_the_same_gradient_in_its_shape_and_dtype(codec):
    grads = _grads(np.random.default_rng(0), steps=2)
    out = reduce_steps(codec, grads)
    for step in range(2):
        for v, s in enumerate(SHAPES):
            got = out[0][step][v]
            assert got.shape == s and got.dtype == np.float32
            for r in range(1, WORLD):
                np.testing.assert_array_equal(out[r][step][v], got)


def test_exact_on_what_it_represents(codec):
    # fp16 holds every value here; each rank's matrices are rank 1, so their mean has rank <= 2 = RANK
    grads = _grads(np.random.default_rng(1), steps=1, low_rank=codec.kind == "powersgd")
    got, want = reduce_steps(codec, grads)[0][0], _mean(grads[0])
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_lossless_exact_lossy_close_on_any_gradient(codec):
    rng = np.random.default_rng(2)
    grads = [[[rng.standard_normal(s).astype(np.float32) for s in SHAPES] for _ in range(WORLD)]]
    got, want = reduce_steps(codec, grads)[0][0], _mean(grads[0])
    for g, w, s in zip(got, want, SHAPES):
        err = np.linalg.norm(g - w) / np.linalg.norm(w)
        if codec.kind == "none":
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)
        elif codec.kind == "fp16":
            assert err < 2e-3
        elif len(s) == 1:    # a vector PowerSGD sends raw
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)
        else:                # a projection of the mean onto RANK directions: never larger than it
            assert err < 1.0 and np.linalg.norm(g) <= np.linalg.norm(w) * (1 + 1e-5)


def test_bytes_on_the_wire_within_what_is_declared(codec):
    declared = sum(n * per for n, per in (wire_values(s, codec) for s in SHAPES))
    reduce_steps(codec, _grads(np.random.default_rng(3), steps=2))
    assert all(0 < b <= declared for per_rank in reduce_steps.sent for b in per_rank), (reduce_steps.sent, declared)
    if codec.kind != "none":    # a compressor that saves nothing is not one
        assert declared < sum(int(np.prod(s)) * 4 for s in SHAPES)


def test_state_only_where_declared_and_only_within_a_trial(codec):
    grads = _grads(np.random.default_rng(4), steps=3, same=True)   # the same gradient every step
    first, again = reduce_steps(codec, grads)[0], reduce_steps(codec, grads)[0]
    for a, b in zip(first, again):     # a fresh trial starts from nothing a previous one left
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
    if not _stateful(codec):           # stateless: the same input gives the same output every step
        for step in first[1:]:
            for x, y in zip(step, first[0]):
                np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("name", [k for k in COMPRESSOR_KINDS if k.endswith("_ef")])
def test_error_feedback_keeps_the_accumulated_error_from_growing(name):
    """The same gradient every step: without feedback each step loses the same part and the sum
    drifts linearly; with it, the sum of what was sent stays within a bounded distance of the true
    sum. One rank, so that only the compressor loses: on several ranks an fp16 all-reduce also
    rounds its fp16 sum, a loss error feedback does not see (it halves the drift there, no more)."""
    rng = np.random.default_rng(6)
    grads = [[[rng.standard_normal(s).astype(np.float32) for s in SHAPES]]] * 32

    def accumulated_error(codec, steps):
        out = reduce_steps(codec, grads[:steps], world=1)[0]
        return sum(np.linalg.norm(sum(o[v] for o in out) - steps * grads[0][0][v]) for v in range(len(SHAPES)))

    ef, plain = Compressor.of(name, RANK), Compressor.of(name[:-3], RANK)
    assert accumulated_error(plain, 32) > 16 * accumulated_error(plain, 1) > 0
    assert accumulated_error(ef, 32) < 1.25 * accumulated_error(ef, 8)
    assert accumulated_error(ef, 32) < accumulated_error(plain, 32) / 4


@pytest.mark.parametrize("kind", sorted(ELEMENTWISE))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_elementwise_pairs_invert_statelessly(kind, dtype):
    c = ELEMENTWISE[kind]()
    x = (np.arange(-12, 12, dtype=dtype) / 8).reshape(4, 6)
    wire, ctx = c.compress(x)
    assert wire.nbytes == c.wire_bytes(x.size, x.dtype.itemsize)
    back = c.decompress(wire, ctx)
    assert back.shape == x.shape and back.dtype == x.dtype
    np.testing.assert_array_equal(back, x)       # eighths in [-1.5, 1.5]: exact in fp16 too
    again, _ = c.compress(x)
    np.testing.assert_array_equal(again, wire)
    assert vars(c) == {}                         # the operation holds nothing between calls
