"""What a parameter-server worker moves per step for a row-pulled sparse variable (no Ray: the
channel talks to a PS shard in this process): each step's row ids cross once, with the pull, in
the narrowest dtype; the push sends values alone, and the PS applies them to the rows pulled."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from autosync.runtime.optimizers import squares_slices
from autosync.runtime.plan import PSActorPlan, ShardRef
from autosync.runtime.ps_shard import ParameterServerShard
from autosync.runtime.rows import index_dtype
from autosync.runtime.slices import dedup_aligned, dedup_aligned_many
from autosync.runtime.sync.ps import PSChannel

ROWS, WIDTH = 1000, 8
TABLE, BIAS = (0, 0), (1, 0)
SHAPES = [(ROWS, WIDTH), (3,)]


class _Local:
    """An actor handle whose ``method.remote(...)`` runs the shard's coroutine at once (one loop)."""

    def __init__(self, shard, loop):
        self._shard, self._loop = shard, loop

    def __getattr__(self, name):
        method = getattr(self._shard, name)
        return SimpleNamespace(remote=lambda *args: self._loop.run_until_complete(method(*args)))


@pytest.fixture
def local_ray(monkeypatch):
    """``ray.get``/``ray.wait`` over the replies _Local returns directly."""
    import ray

    monkeypatch.setattr(ray, "get", lambda refs: refs)
    monkeypatch.setattr(ray, "wait", lambda refs, num_returns=1, timeout=None: (list(refs), []))
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _shard(optimizer: dict, values: dict) -> ParameterServerShard:
    return ParameterServerShard("ps@x", values, [TABLE], [], optimizer, num_workers=1, sync=True)


def _values():
    rng = np.random.default_rng(0)
    return {TABLE: rng.standard_normal((ROWS, WIDTH)).astype(np.float32), BIAS: np.zeros(3, np.float32)}


def _channel(shard, loop, optimizer: dict, by_reference: bool) -> PSChannel:
    refs = (ShardRef(0, 0, 1, 0, ROWS, 0, True, False), ShardRef(1, 0, 1, 0, 3, 0, False, False))
    return PSChannel(0, [(_Local(shard, loop), PSActorPlan("x", refs))], SHAPES, staleness=0,
                     squares=squares_slices(optimizer),
                     rows_by_reference=by_reference)


def _step(seed: int, touched_share: float = 1.0):
    """A batch's lookups (repeats included), the rows it reads, and a gradient on a share of them."""
    rng = np.random.default_rng(seed)
    lookups = rng.integers(0, ROWS, 60)
    read = np.unique(lookups)
    hit = lookups[np.isin(lookups, read[: max(1, int(len(read) * touched_share))])]
    grad = (hit, rng.standard_normal((len(hit), WIDTH)).astype(np.float32))
    return read, [grad, rng.standard_normal(3).astype(np.float32)]


@pytest.mark.parametrize("optimizer", [{"class": "SGD", "learning_rate": 0.1},
                                       {"class": "Adam", "learning_rate": 0.05},
                                       {"class": "Adagrad", "learning_rate": 0.2}])
@pytest.mark.integration
def test_pushes_by_reference_update_as_explicit_rows_and_send_each_row_id_once(local_ray, optimizer):
    values = _values()
    by_ref, explicit = _shard(optimizer, values), _shard(optimizer, values)
    channel, plain = _channel(by_ref, local_ray, optimizer, True), _channel(explicit, local_ray, optimizer, False)
    width = WIDTH * 4
    for step, share in enumerate((1.0, 0.5, 1.0)):  # step 1: half the rows pulled get no gradient
        read, grads = _step(step, share)
        sent = channel.bytes_sent
        for ch in (channel, plain):
            pulled = ch.pull(step, rows={0: read})
            np.testing.assert_array_equal(pulled[TABLE][0], read)
            ch.push(step, grads)
        # the step's row ids once (2 bytes each: 1000 rows), the gradient's values on those
        # rows, the dense bias; the sum of squared slices of repeated rows for Adam and Adagrad
        repeats = int(np.sum(np.unique(grads[0][0], return_counts=True)[1] > 1))
        squares = repeats * (width + 2) if optimizer["class"] != "SGD" else 0
        assert channel.bytes_sent - sent == len(read) * (width + 2) + 12 + squares
        np.testing.assert_array_equal(by_ref.params[TABLE], explicit.params[TABLE])
        np.testing.assert_array_equal(by_ref.params[BIAS], explicit.params[BIAS])
    assert index_dtype(ROWS) == np.uint16
    assert channel.bytes_received == plain.bytes_received
    assert by_ref._asked == {} and channel._asked == {}  # nothing kept once its push is in


def test_dedup_aligned_lays_summed_values_on_the_rows_pulled():
    asked = np.array([2, 5, 9, 11], np.uint16)
    idx, vals = np.array([9, 2, 9]), np.arange(6, dtype=np.float32).reshape(3, 2)
    none, laid, at, sq = dedup_aligned(asked, idx, vals, True)
    assert none is None and at.tolist() == [2] and at.dtype == np.uint16
    np.testing.assert_array_equal(laid, [[2, 3], [0, 0], [0 + 4, 1 + 5], [0, 0]])
    np.testing.assert_array_equal(sq, [[0 + 16, 1 + 25]])
    assert len(dedup_aligned(asked, idx, vals, False)) == 2
    none, laid = dedup_aligned(asked, np.array([11, 2]), vals[:2], True)  # nothing repeats: no squares
    np.testing.assert_array_equal(laid, [[2, 3], [0, 0], [0, 0], [0, 1]])
    with pytest.raises(ValueError, match=r"rows \[3\] that were not pulled"):
        dedup_aligned(asked, np.array([3, 9]), vals[:2], False)
    with pytest.raises(ValueError, match=r"rows \[12\] that were not pulled"):   # past the last row pulled
        dedup_aligned(asked, np.array([12]), vals[:1], False)


@pytest.mark.parametrize("seed", range(4))
def test_dedup_aligned_is_summing_in_order_onto_the_pulled_rows_bit_for_bit(seed):
    """Against the plain rule: every pulled row starts at zero and adds its slices in their order
    (``np.add.at``), squares likewise, for the rows that repeat."""
    rng = np.random.default_rng(seed)
    asked = np.unique(rng.integers(0, 5000, 300)).astype(np.uint16)
    idx = rng.choice(asked, size=int(rng.integers(1, 600))).astype(np.int64)
    vals = rng.standard_normal((len(idx), 8)).astype(np.float32)
    _assert_plain_sums(dedup_aligned(asked, idx, vals, True), asked, idx, vals, True)


def _assert_plain_sums(got, asked, idx, vals, squares: bool):
    """``got`` is what the plain rule gives: every pulled row from zero plus its slices in order
    (``np.add.at``), and for the rows that repeat (with ``squares``) their squares likewise."""
    place = np.searchsorted(asked, idx)
    want = np.zeros((len(asked),) + vals.shape[1:], vals.dtype)
    np.add.at(want, place, vals)
    square_sums = np.zeros_like(want)
    np.add.at(square_sums, place, np.square(vals))
    repeated = np.flatnonzero(np.bincount(place, minlength=len(asked)) > 1)
    assert got[0] is None and got[1].dtype == want.dtype and got[1].tobytes() == want.tobytes()
    if squares and len(repeated):
        assert got[2].dtype == asked.dtype and got[2].tolist() == repeated.tolist()
        assert got[3].tobytes() == square_sums[repeated].tobytes()
    else:
        assert len(got) == 2


@pytest.mark.parametrize("seed", range(4))
def test_dedup_aligned_many_gives_each_table_the_plain_sums_of_its_own(seed):
    """Tables of two widths and two dtypes, some with repeated rows, one with none, one empty, one
    alone in its width, laid end to end: each result is the plain rule's for that table alone."""
    rng = np.random.default_rng(seed)
    items = []
    for t, (width, dtype, draws) in enumerate([(8, np.float32, 40), (8, np.float32, 0), (8, np.float32, 300),
                                               (4, np.float32, 50), (8, np.float64, 30), (8, np.float32, 10)]):
        asked = np.unique(rng.integers(0, 3000, 120)).astype(np.uint16 if t % 2 else np.uint32)
        idx = rng.choice(asked, size=draws).astype(np.int64)
        if t == 5:
            idx = np.unique(idx)   # no row repeats
        items.append((asked, idx, rng.standard_normal((len(idx), width)).astype(dtype)))
    for squares in (True, False):
        for item, got in zip(items, dedup_aligned_many(items, squares)):
            _assert_plain_sums(got, *item, squares)
    bad = items[:3] + [(items[3][0], np.array([int(items[3][0].max()) + 1]), items[3][2][:1])]
    with pytest.raises(ValueError, match="that were not pulled"):
        dedup_aligned_many(bad, False)
    assert dedup_aligned_many([], True) == []


def test_index_dtype_is_the_narrowest_that_numbers_the_rows():
    assert [index_dtype(n) for n in (2, 256, 257, 65536, 65537, 2**32, 2**32 + 1)] == [
        np.uint8, np.uint8, np.uint16, np.uint16, np.uint32, np.uint32, np.int64]


@pytest.mark.integration
def test_a_push_without_rows_needs_the_pull_of_its_step(local_ray):
    shard = _shard({"class": "SGD", "learning_rate": 0.1}, _values())
    with pytest.raises(RuntimeError, match="pulled no rows of it for that step"):
        local_ray.run_until_complete(shard.push(0, 0, {TABLE: (None, np.zeros((2, WIDTH), np.float32))}))


@pytest.mark.integration
def test_an_optimizer_that_transforms_each_slice_gets_every_slice_as_keras_does(local_ray):
    """RMSprop squares each slice before repeated rows add up (``optimizers.sparse_form``): the
    channel pushes every slice with its row id (no summing, no rows by reference) and the shard
    updates as Keras updates the variable with the ``IndexedSlices`` itself."""
    import keras
    import tensorflow as tf

    from autosync.runtime.optimizers import sparse_form

    optimizer = {"class": "RMSprop", "learning_rate": 0.05, "rho": 0.8}
    assert sparse_form(optimizer) == "slices"
    values = _values()
    shard = _shard(optimizer, values)
    refs = (ShardRef(0, 0, 1, 0, ROWS, 0, True, False), ShardRef(1, 0, 1, 0, 3, 0, False, False))
    channel = PSChannel(0, [(_Local(shard, local_ray), PSActorPlan("x", refs))], SHAPES, staleness=0,
                        squares=squares_slices(optimizer), rows_by_reference=False, keep_slices=True)
    ref, table = keras.optimizers.RMSprop(0.05, rho=0.8), keras.Variable(values[TABLE].copy())
    bias = keras.Variable(values[BIAS].copy())
    for step in range(3):
        rng = np.random.default_rng(step)
        lookups = rng.integers(0, 50, 60)   # rows repeat: summing them would change the update
        read = np.unique(lookups)
        grads = [(lookups, rng.standard_normal((60, WIDTH)).astype(np.float32)), rng.standard_normal(3).astype(np.float32)]
        channel.pull(step, rows={0: read})
        sent = channel.bytes_sent
        channel.push(step, grads)
        assert channel.bytes_sent - sent == len(grads[0][0]) * (WIDTH * 4 + 2) + 12   # every slice, 2-byte ids
        ref.apply([tf.IndexedSlices(grads[0][1], grads[0][0], (ROWS, WIDTH)), tf.constant(grads[1])], [table, bias])
    pulled = channel.pull(3, fresh=True, rows={0: np.arange(ROWS)})
    np.testing.assert_allclose(pulled[TABLE][1], table.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(pulled[BIAS], bias.numpy(), rtol=1e-5, atol=1e-6)
    assert not np.allclose(pulled[TABLE][1], values[TABLE])
