"""``global_clipnorm`` on a parameter-server actor without Ray (``ps_clip``'s held steps): the
actor's part of the norm is its averaged dense gradients plus the workers' sparse parts, nothing
is updated before the scale comes, the first scale of a step counts; and ``clip_scale`` is Keras'
``clip_by_global_norm`` factor."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from autosync.runtime.ps_shard import ParameterServerShard
from autosync.runtime.slices import dedup_rows
from autosync.runtime.sync.base import clip_scale

A, B, E = (0, 0), (1, 0), (2, 0)  # two dense keys, one sparse
LR, CLIP = 0.1, 0.5


def _values():
    rng = np.random.default_rng(0)
    return {A: rng.standard_normal((4, 3)).astype(np.float32), B: rng.standard_normal(5).astype(np.float32),
            E: rng.standard_normal((10, 2)).astype(np.float32)}


def _raw(worker):
    """A worker's gradients as computed: the sparse one with repeated rows."""
    rng = np.random.default_rng(10 + worker)
    return {A: rng.standard_normal((4, 3)).astype(np.float32), B: rng.standard_normal(5).astype(np.float32),
            E: (np.array([1, 3, 1, 7]), rng.standard_normal((4, 2)).astype(np.float32))}


def test_clip_scale_is_keras_clip_by_global_norm_factor():
    assert clip_scale(25.0, 1.0) == pytest.approx(0.2)
    assert clip_scale(0.25, 1.0) == 1.0
    assert np.isnan(clip_scale(np.inf, 1.0)) and np.isnan(clip_scale(np.nan, 1.0))
    assert clip_scale(25.0, 1.0).dtype == np.float32


@pytest.mark.integration   # the Keras optimizer (global_clipnorm is not one of the numpy rules)
@pytest.mark.parametrize("chunks", [None, [[A], [B], [E]]], ids=["whole", "chunked"])
def test_a_held_step_waits_for_every_norm_and_applies_on_the_first_scale(chunks):
    ps = ParameterServerShard("ps@x", _values(), [E], [], {"class": "SGD", "learning_rate": LR, "global_clipnorm": CLIP},
                              num_workers=2, sync=True, chunks=chunks)
    raw = [_raw(0), _raw(1)]
    locals_ = [float(np.sum(np.square(g[E][1], dtype=np.float64))) for g in raw]
    mean = {k: (raw[0][k] + raw[1][k]) / 2 for k in (A, B)}
    expected_sq = sum(float(np.sum(np.square(mean[k], dtype=np.float64))) for k in (A, B)) + sum(locals_) / 4

    async def go():
        for w in range(2):
            g = {A: raw[w][A], B: raw[w][B], E: dedup_rows(*raw[w][E], False)}
            if chunks is None:
                await ps.push(w, 0, g)
            else:
                for c, keys in enumerate(chunks):
                    await ps.push(w, 0, {k: g[k] for k in keys}, chunk=c)
        first = asyncio.ensure_future(ps.clip_norm(0, 0, locals_[0]))
        await asyncio.sleep(0.01)
        assert not first.done()   # waits for worker 1's sparse part
        second = await asyncio.wait_for(ps.clip_norm(1, 0, locals_[1]), 5)
        assert await asyncio.wait_for(first, 5) == second
        with pytest.raises(RuntimeError, match="asked the norm of step 0 twice"):
            await ps.clip_norm(1, 0, 0.0)
        pull = asyncio.ensure_future(ps.pull(1))
        await asyncio.sleep(0.01)
        assert not pull.done() and ps.version == 0   # nothing applied before the scale
        scale = clip_scale(second, CLIP)
        await ps.clip_scale(0, scale)
        await ps.clip_scale(0, np.float32(1.0))   # another worker's: ignored
        version, values, _ = await asyncio.wait_for(pull, 5)
        return second, scale, version, values

    sq, scale, version, values = asyncio.run(go())
    assert sq == pytest.approx(expected_sq, rel=1e-6) and scale < 1 and version == 1
    initial = _values()
    for k in (A, B):
        np.testing.assert_allclose(values[k], initial[k] - LR * scale * mean[k], rtol=1e-5, atol=1e-6)
    want = initial[E].copy()
    for w in range(2):
        np.add.at(want, raw[w][E][0], -LR * scale * raw[w][E][1] / 2)
    np.testing.assert_allclose(values[E], want, rtol=1e-5, atol=1e-6)


@pytest.mark.integration   # the Keras optimizer
def test_the_workers_sparse_parts_are_summed_in_worker_order():
    """Three workers' parts whose float sum depends on the order they are added in (``ordered_sum``):
    whatever order the workers ask in, the norm is the sum in worker order."""
    parts = [1e-16, 1e-16, 1.0]
    assert (parts[0] + parts[1]) + parts[2] != (parts[2] + parts[0]) + parts[1]   # the test can fail

    def norm(order):
        ps = ParameterServerShard("ps@x", _values(), [E], [], {"class": "SGD", "learning_rate": LR,
                                                               "global_clipnorm": CLIP}, num_workers=3, sync=True)

        async def go():
            for w in range(3):
                await ps.push(w, 0, {A: np.zeros((4, 3), np.float32), B: np.zeros(5, np.float32),
                                     E: dedup_rows(*_raw(w)[E], False)})
            asks = [asyncio.ensure_future(ps.clip_norm(w, 0, parts[w])) for w in order]
            return await asyncio.wait_for(asyncio.gather(*asks), 5)

        return asyncio.run(go())

    for order in ([0, 1, 2], [2, 0, 1], [1, 2, 0]):
        assert norm(order) == [((parts[0] + parts[1]) + parts[2]) / 9] * 3
