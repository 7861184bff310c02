"""Dynamic loss scaling without TensorFlow: the worker's ``LossScale`` moves as Keras'
``LossScaleOptimizer`` (the integration test compares it with Keras' own), ``hand_over`` holds every
step and skips one whose norm is not finite on every channel with the optimizer's count, and a
parameter server (numpy rules, no Ray) skips it in every chunk and counts its updates."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from autosync.runtime.loss_scale import LOSS_SCALE, SKIP, LossScale
from autosync.runtime.ps_shard import ParameterServerShard
from autosync.runtime.sync.base import hand_over


def test_the_scale_halves_on_a_skip_and_doubles_after_the_growth_steps():
    ls = LossScale(1024.0, 2)
    seen = []
    for finite in (True, True, False, True, False, True, True, True):
        ls.after(finite)
        seen.append((float(ls.scale), ls.counter, ls.skipped))
    assert seen == [(1024, 1, 0), (2048, 0, 0), (1024, 0, 1), (1024, 1, 1), (512, 0, 2), (512, 1, 2), (1024, 0, 2),
                    (1024, 1, 2)]
    assert ls.iteration(8) == 6 and ls.scale.dtype == np.float32
    again = LossScale(1.0, 5)
    again.load(ls.state())
    assert again.state() == ls.state() == [1024.0, 1, 2]
    assert LossScale.of({}) is None and LossScale.of({LOSS_SCALE: {"initial_scale": 8.0,
                                                                  "dynamic_growth_steps": 3}}).state() == [8.0, 0, 0]


@pytest.mark.parametrize("scale,growth", [(0.0, 10), (np.inf, 10), (-2.0, 10), (8.0, 0)])
def test_a_scale_or_growth_keras_would_not_take_is_refused(scale, growth):
    with pytest.raises(ValueError, match="initial_scale > 0 and dynamic_growth_steps >= 1"):
        LossScale(scale, growth)


class _Channel:
    """A channel that records what ``hand_over`` does with it; ``sq`` is its part of the norm."""

    def __init__(self, sq):
        self.sq, self.calls = sq, []

    def push(self, step, grads):
        self.calls.append(("push", step))

    def push_held(self, step, grads):
        self.calls.append(("held", step))
        return self.sq

    def held_sq(self, held):
        return held

    def release(self, step, scale, iteration=None):
        self.calls.append(("release", step, None if scale is SKIP else float(scale), iteration))


def test_hand_over_skips_a_step_whose_norm_is_not_finite_on_every_channel():
    ls = LossScale(16.0, 100)
    channels = [_Channel(1.0), _Channel(4.0)]
    hand_over(channels, 0, [], None, ls)
    channels[1].sq = np.inf   # one channel's gradient overflowed: the whole step is skipped
    hand_over(channels, 1, [], None, ls)
    channels[1].sq = np.nan
    hand_over(channels, 2, [], 1.0, ls)   # and under global_clipnorm too
    channels[1].sq = 4.0
    hand_over(channels, 3, [], 1.0, ls)   # clipped: the norm is sqrt(5)
    for ch in channels:
        assert ch.calls[1::2] == [("release", 0, 1.0, 0), ("release", 1, None, 1), ("release", 2, None, 1),
                                  ("release", 3, pytest.approx(1 / np.sqrt(5.0)), 1)]
        assert ch.calls[0::2] == [("held", s) for s in range(4)]   # held, never pushed
    assert ls.state() == [4.0, 1, 2]
    plain = _Channel(1.0)
    hand_over([plain], 0, [], None, None)
    assert plain.calls == [("push", 0)]


def test_a_parameter_server_skips_a_step_in_every_chunk_and_counts_updates_only():
    """Adam on a PS, two chunks: step 1 released as skipped changes nothing; step 2 is then update
    1 (Adam's bias correction), equal to a PS that never saw step 1."""
    values = {(0, 0): np.ones((3, 2), np.float32), (1, 0): np.ones(4, np.float32)}
    config = {"class": "Adam", "learning_rate": 0.1, LOSS_SCALE: {"initial_scale": 8.0, "dynamic_growth_steps": 5}}

    def grads(step):
        rng = np.random.default_rng(step)
        return {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in values.items()}

    async def run(ps, data, skip):
        """Step ``n`` pushes the gradients ``grads(data[n])``; the steps in ``skip`` are skipped."""
        for step, seed in enumerate(data):
            for c, key in enumerate(sorted(values)):
                await ps.push(0, step, {key: grads(seed)[key]}, chunk=c)
            await ps.clip_norm(0, step, 0.0)
            await ps.clip_scale(step, SKIP if step in skip else 1.0, step - len([s for s in skip if s < step]))
        return await ps.values()

    def shard():
        return ParameterServerShard("ps@x", {k: v.copy() for k, v in values.items()}, [], [], config, num_workers=1,
                                    sync=True, chunks=[[k] for k in sorted(values)])

    skipped = shard()
    after_skip = asyncio.run(run(skipped, [0, 1, 2], skip={1}))
    # as if step 1 had never run: its gradients are Adam's update 1 (bias correction), not 2
    never = asyncio.run(run(shard(), [0, 2], skip=set()))
    assert all(np.array_equal(after_skip[k], never[k]) for k in values)
    assert skipped.version == 3 and skipped._skipped == 1


def _powersgd_step(state, grad):
    """One worker's PowerSGD step on one matrix alone (the means are its own values)."""
    p = state.first_round("w", grad)
    p_hat, q = state.second_round("w", p)
    return state.finish("w", p_hat, q, grad.shape)


def test_the_compressors_memory_is_put_back_as_it_was_before_a_skipped_step():
    from autosync.runtime.sync.compression import ErrorFeedback, PowerSGDState, restore_state, saved_state

    fp16, psgd, late = "fp16_ef", "powersgd_ef", "other"
    ef = {fp16: ErrorFeedback()}
    ef[fp16].keep("a", np.ones(3, np.float32), np.zeros(3, np.float32))
    state = PowerSGDState(1, True, seed=0)
    _powersgd_step(state, np.arange(12, dtype=np.float32).reshape(4, 3))
    powersgd = {psgd: state}
    q, residual = state.q["w"].copy(), state.ef.residual["w"].copy()
    saved = saved_state(ef, powersgd)
    # a step whose gradient was not finite: every residual and Q becomes nan, another compressor starts
    ef[fp16].keep("a", np.full(3, np.nan, np.float32), np.zeros(3, np.float32))
    ef[late] = ErrorFeedback()
    _powersgd_step(state, np.full((4, 3), np.inf, np.float32))
    assert np.isnan(state.q["w"]).all()
    restore_state(ef, powersgd, saved)
    assert list(ef) == [fp16] and np.array_equal(ef[fp16].residual["a"], np.ones(3))
    assert np.array_equal(state.q["w"], q) and np.array_equal(state.ef.residual["w"], residual)


def test_an_update_ahead_begun_for_a_skipped_step_leaves_the_table_as_if_it_never_ran():
    """Adam on a parameter server updates a large embedding's untouched rows ahead, as a step's first
    push arrives (``update_ahead``); a step then skipped must leave the table and its slots as they
    were, and the next step is the optimizer's update 1, as on a server that never saw it."""
    table = (0, 0)
    rows = 300   # 300 x 1000 float32: above update_ahead's 1 MiB floor
    values = {table: np.random.default_rng(0).standard_normal((rows, 1000)).astype(np.float32)}
    config = {"class": "Adam", "learning_rate": 0.1, LOSS_SCALE: {"initial_scale": 8.0, "dynamic_growth_steps": 5}}

    def grad(seed, worker):
        rng = np.random.default_rng([seed, worker])
        return (np.sort(rng.choice(rows, 5, replace=False)), rng.standard_normal((5, 1000)).astype(np.float32))

    async def run(ps, data, skip):
        for step, seed in enumerate(data):
            for w in range(2):
                await ps.push(w, step, {table: grad(seed, w)})
            asks = [ps.clip_norm(w, step, 0.0) for w in range(2)]
            await asyncio.gather(*asks)
            await ps.clip_scale(step, SKIP if step in skip else 1.0, step - len([s for s in skip if s < step]))
        return (await ps.values())[table]

    def shard():
        return ParameterServerShard("ps@x", {table: values[table].copy()}, [table], [], config, num_workers=2,
                                    sync=True)

    skipped = shard()
    after_skip = asyncio.run(run(skipped, [0, 1, 2], skip={1}))
    never = asyncio.run(run(shard(), [0, 2], skip=set()))
    assert skipped.optimizer.ahead >= 1   # updates ahead were used, not only begun
    assert np.array_equal(after_skip, never)
