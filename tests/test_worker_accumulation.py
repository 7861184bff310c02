"""A worker's step under ``gradient_accumulation_steps`` without TensorFlow: it draws n batches,
pulls the union of the rows they read, and hands over the mean of their gradients in Keras' order
(summed, then divided; a sparse gradient's slices concatenated). The integration tests check the
training against one process (``test_runtime_user_optimizer``)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from autosync.runtime.worker import TrainingWorker


class _Tensor:
    """What TensorFlow hands back: an object with ``numpy()``."""

    def __init__(self, array):
        self.array = array

    def numpy(self):
        return self.array


def _worker(accumulate: int, xs: list):
    w = TrainingWorker.__new__(TrainingWorker)   # no TensorFlow: only what a step's drawing reads
    w.accumulate, w.drawn = accumulate, 0
    w._data, w._parts = (0, 1), ((0,), 1)   # one worker, its own data part
    w.batches = iter([(x, None) for x in xs])
    w.row_reads = SimpleNamespace(rows=lambda x: {0: np.unique(x)})
    w.variables = [SimpleNamespace(path="table", shape=(10, 2))]   # the table the ids read

    def compute(x, y):   # batch k's gradients: its rows with values k + 1, a dense k + 1, none
        k = next(i for i, other in enumerate(xs) if other is x)
        slices = SimpleNamespace(indices=_Tensor(x), values=_Tensor(np.full((len(x), 2), k + 1, np.float32)))
        return np.float32(k), [slices, _Tensor(np.full(3, k + 1, np.float32)), None]

    w._compute = compute
    return w


def test_a_step_of_n_batches_reads_their_rows_and_hands_over_their_mean():
    xs = [np.array([1, 4]), np.array([4, 7]), np.array([2])]
    w = _worker(3, xs)
    batches, rows = w._draw()
    assert w.drawn == 3 and [b[0] for b in batches] == xs
    np.testing.assert_array_equal(rows[0], [1, 2, 4, 7])
    loss, (sparse, dense, none) = w._gradients_of(batches)
    assert loss == 1.0 and none is None
    np.testing.assert_array_equal(sparse[0], [1, 4, 4, 7, 2])
    np.testing.assert_allclose(sparse[1][:, 0], np.array([1, 1, 2, 2, 3]) / 3, rtol=1e-6)
    np.testing.assert_allclose(dense, np.full(3, 2.0), rtol=1e-6)   # (1 + 2 + 3) / 3


def test_one_batch_per_step_is_handed_over_as_computed():
    xs = [np.array([5, 3, 5])]
    w = _worker(1, xs)
    batches, rows = w._draw()
    np.testing.assert_array_equal(rows[0], [3, 5])
    _, (sparse, dense, _) = w._gradients_of(batches)
    np.testing.assert_array_equal(sparse[0], [5, 3, 5])
    np.testing.assert_array_equal(dense, np.ones(3, np.float32))


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_worker_holding_two_of_three_parts_on_two_workers_hands_over_its_share_of_their_sum(accumulate):
    """Parts 0 and 2 of 3 on worker 0 of 2 (``data_parts``): the synchronizers' mean over the two
    workers must come out as the mean over the three parts, so the worker hands over the sum of its
    parts' gradients (each part's the mean of its ``accumulate`` batches) times 2/3."""
    xs = [np.array([k]) for k in range(2 * accumulate)]
    w = _worker(accumulate, xs)
    w._data, w._parts = (0, 2), ((0, 2), 3)
    batches, _ = w._draw()
    assert len(batches) == 2 * accumulate and w.drawn == 2 * accumulate
    loss, (sparse, dense, _) = w._gradients_of(batches)
    assert loss == pytest.approx(np.mean(np.arange(2 * accumulate)) * 4 / 3)   # batch k's loss is k
    parts = np.arange(1, 2 * accumulate + 1, dtype=np.float32).reshape(2, accumulate).mean(axis=1)
    np.testing.assert_allclose(dense, np.full(3, parts.sum() * 2 / 3), rtol=1e-6)
    np.testing.assert_allclose(sparse[1][:, 0], np.arange(1, 2 * accumulate + 1) / (1.5 * accumulate), rtol=1e-6)
