"""The parameter-server shard on its own (no Ray): deduplicated row pushes give the update raw
slices would, row pulls return just those rows, node pushes count by their weight."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from autosync.runtime.optimizers import make_optimizer
from autosync.runtime.ps_shard import ParameterServerShard
from autosync.runtime.slices import dedup_rows, merge_rows

ADAM = {"class": "Adam", "learning_rate": 0.05}
KEY = (0, 0)


def _raw(seed):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 10, 12), rng.standard_normal((12, 3)).astype(np.float32)


def _reference(init, raws, n):
    opt = make_optimizer(ADAM)
    opt.add_variable(KEY, init)
    params = {KEY: init.copy()}
    idx = np.concatenate([r[0] for r in raws])
    vals = np.concatenate([r[1] for r in raws]) / np.float32(n)
    opt.apply(0, params, {KEY: (idx, vals)})
    return params[KEY]


@pytest.mark.parametrize("sync", [True, False])
def test_dedup_pushes_match_raw_slices_and_pull_returns_rows(sync):
    init = np.random.default_rng(0).standard_normal((10, 3)).astype(np.float32)
    n = 2 if sync else 1
    ps = ParameterServerShard("ps@x", {KEY: init}, [KEY], [], ADAM, num_workers=n, sync=sync)
    raws = [_raw(1), _raw(2)][:n]

    async def go():
        for w, (idx, vals) in enumerate(raws):
            await ps.push(w, 0, {KEY: dedup_rows(idx, vals, with_squares=True)})
        return await ps.pull(1, {KEY: np.array([7, 2], dtype=np.int32)})

    version, direct, shared = asyncio.run(go())
    expected = _reference(init, raws, n)
    np.testing.assert_allclose(ps.params[KEY], expected, rtol=1e-5, atol=5e-6)
    assert version == 1 and shared is None
    np.testing.assert_array_equal(direct[KEY], ps.params[KEY][[7, 2]])
    assert not np.allclose(ps.params[KEY], init)


def test_a_node_push_counts_for_its_workers():
    """Three workers: one pushes itself, a node aggregator pushes the other two's sum (weight 2);
    the step is applied once all three are in, as with three separate pushes."""
    init = np.zeros((10, 3), np.float32)
    ps = ParameterServerShard("ps@x", {KEY: init}, [KEY], [KEY], ADAM, num_workers=3, sync=True)
    raws = [_raw(3), _raw(4), _raw(5)]
    parts = [dedup_rows(i, v, True) for i, v in raws]

    async def go():
        await ps.push("node1", 0, {KEY: merge_rows(parts[1:], True)}, 2, ("shared",))
        assert ps.version == 0
        await ps.push(0, 0, {KEY: parts[0]}, 1, ("shared",))
        return ps.version, await ps.stats()

    version, stats = asyncio.run(go())
    assert version == 1 and stats["pushes"] == 2
    np.testing.assert_allclose(ps.params[KEY], _reference(init, raws, 3), rtol=1e-5, atol=5e-6)


DENSE = (1, 0)


@pytest.mark.parametrize("bad, says", [
    ({DENSE: np.ones((1, 3), np.float32)}, r"shape \(1, 3\) .* pushed for \(1, 0\), whose shard is \(4, 3\)"),
    ({DENSE: np.ones((4, 3), np.int64)}, r"dtype int64 .* \(4, 3\) of floats"),
    ({KEY: (np.array([1, 2]), np.ones((2, 4), np.float32))}, r"values float32\[2, 4\] .* whose shard is \(10, 3\)"),
    ({KEY: (np.array([1, 2, 3]), np.ones((2, 3), np.float32))}, r"one per row id"),
    ({KEY: (np.array([[1], [2]]), np.ones((2, 3), np.float32))}, r"rows int64\[2, 1\]"),
    ({KEY: (np.array([4, 10]), np.ones((2, 3), np.float32))}, r"row ids 4\.\.10 .* holds rows 0\.\.9"),
    ({KEY: (np.array([-1]), np.ones((1, 3), np.float32))}, r"row ids -1\.\.-1"),
])
def test_a_push_of_the_wrong_shape_fails_naming_it_and_changes_nothing(bad, says):
    """A pushed gradient that does not fit its shard (another shape, which numpy would broadcast,
    rows the shard does not hold, not floats) fails the step with what is wrong; the shard keeps
    its values, and a pull reports the failure instead of waiting."""
    table = np.random.default_rng(0).standard_normal((10, 3)).astype(np.float32)
    dense = np.ones((4, 3), np.float32)
    ps = ParameterServerShard("ps@x", {KEY: table, DENSE: dense}, [KEY], [], ADAM, num_workers=1, sync=True)

    async def go():
        with pytest.raises(ValueError, match=says):
            await ps.push(0, 0, bad)
        with pytest.raises(RuntimeError, match="update for step 0 from worker 0 failed: ValueError"):
            await ps.pull(1, {KEY: np.array([1], dtype=np.int32)})

    asyncio.run(go())
    np.testing.assert_array_equal(ps.params[KEY], table)
    np.testing.assert_array_equal(ps.params[DENSE], dense)


@pytest.mark.parametrize("slices", [False, True])
def test_a_node_aggregator_keeps_every_slice_for_an_optimizer_that_transforms_each(slices):
    """A node's sparse push: the workers' rows merged (summed where they repeat), or, for an
    optimizer that transforms each slice (``optimizers.sparse_form``), their slices side by side
    as they came (a repeated row stays repeated)."""
    from autosync.runtime.aggregator import NodeAggregator

    sent = []

    class _Actor:
        class push:   # noqa: N801 - an actor method's ``.remote``
            @staticmethod
            async def remote(*args):
                sent.append(args)

    agg = NodeAggregator("n0", 2, [_Actor()], [KEY], squares=False, slices=slices)
    parts = [(np.array([1, 4, 1], np.int32), np.ones((3, 3), np.float32)),
             (np.array([4, 7], np.int32), np.full((2, 3), 2.0, np.float32))]

    async def go():
        await asyncio.gather(agg.push(0, 0, {0: {KEY: parts[0]}}), agg.push(1, 0, {0: {KEY: parts[1]}}))

    asyncio.run(go())
    (node, step, grads, weight, kinds), = sent
    assert (node, step, weight, kinds) == ("n0", 0, 2, ("shared",))
    rows, values = grads[KEY][:2]
    if slices:
        assert rows.tolist() == [1, 4, 1, 4, 7] and values[:, 0].tolist() == [1, 1, 1, 2, 2]
    else:
        assert rows.tolist() == [1, 4, 7] and values[:, 0].tolist() == [2, 3, 2]


@pytest.mark.integration
def test_a_keras_optimizer_compiled_by_xla_on_the_shard_updates_as_traced(monkeypatch):
    """A parameter server running the Keras path (RMSprop under a schedule) past the count at
    which its update is compiled gives the traced update's values, rows pushed deduplicated by
    two workers in counts that vary by step, and pulls read the same rows."""
    import keras

    from autosync.runtime.optimizer_config import keras_optimizer_config

    config = keras_optimizer_config(keras.optimizers.RMSprop(
        keras.optimizers.schedules.CosineDecay(0.05, decay_steps=6), momentum=0.5))
    rng = np.random.default_rng(7)
    init = {KEY: rng.standard_normal((10, 3)).astype(np.float32), DENSE: rng.standard_normal((4, 3)).astype(np.float32)}
    steps = [[(rng.integers(0, 10, n), rng.standard_normal((n, 3)).astype(np.float32)) for _ in range(2)]
             for n in (3, 6, 12, 4, 9)]
    dense = rng.standard_normal((len(steps), 2, 4, 3)).astype(np.float32)

    def train(after):
        monkeypatch.setenv("AUTOSYNC_KERAS_XLA_AFTER", after)
        ps = ParameterServerShard("ps@x", {k: v.copy() for k, v in init.items()}, [KEY], [], config,
                                  num_workers=2, sync=True)

        async def go():
            for t, pushes in enumerate(steps):
                for w, (idx, vals) in enumerate(pushes):
                    await ps.push(w, t, {KEY: dedup_rows(idx, vals, with_squares=False), DENSE: dense[t, w]})
            return await ps.pull(len(steps), {KEY: np.array([7, 2, 9], dtype=np.int32)})

        version, direct, _ = asyncio.run(go())
        assert version == len(steps)
        return ps, direct

    compiled, got = train("1")
    traced, want = train("off")
    assert compiled.optimizer.updates.xla_after == 1 and any(k[2] is True for k in compiled.optimizer.updates.functions)
    assert not any(k[2] is True for k in traced.optimizer.updates.functions)
    for k in (KEY, DENSE):
        np.testing.assert_allclose(compiled.optimizer.value(compiled.params, k),
                                   traced.optimizer.value(traced.params, k), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[KEY], want[KEY], rtol=1e-5, atol=1e-6)
