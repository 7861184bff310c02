"""Predicting the rows a step reads, and what a worker sends for a sparse gradient."""
from __future__ import annotations

import re

import numpy as np
import pytest

from autosync.runtime.rows import payload_bytes
from autosync.runtime.slices import dedup_rows
from tests import runtime_models as rm


def test_dedup_sums_repeated_rows_and_keeps_their_squares():
    idx = np.array([5, 1, 5, 3, 5], dtype=np.int64)
    vals = np.arange(10, dtype=np.float32).reshape(5, 2)
    rows, sums, pos, squares = dedup_rows(idx, vals, with_squares=True)
    assert rows.tolist() == [1, 3, 5] and rows.dtype == np.int32
    np.testing.assert_array_equal(sums, [[2, 3], [6, 7], [0 + 4 + 8, 1 + 5 + 9]])
    assert pos.tolist() == [2]  # only row 5 repeats
    np.testing.assert_array_equal(squares, [[0 + 16 + 64, 1 + 25 + 81]])
    assert len(dedup_rows(idx, vals, with_squares=False)) == 2
    rows, sums = dedup_rows(np.array([4, 2]), vals[:2], with_squares=True)  # nothing repeats
    assert rows.tolist() == [2, 4] and sums.tolist() == [[2, 3], [0, 1]]
    assert payload_bytes({"a": (rows, sums), "b": [np.zeros(3, np.float64)]}) == 8 + 16 + 24


@pytest.mark.integration
def test_rows_of_embeddings_fed_by_inputs_and_tied_table_is_not_row_sparse():
    import keras
    import tensorflow as tf

    from autosync.runtime.rows import find_row_reads

    keras.utils.set_random_seed(0)
    model = rm.build_multi_embedding_model()
    x, y = rm.multi_batches(0, 1)[0]
    with tf.GradientTape() as tape:
        loss = rm.mse()(y, model(x))
    grads = tape.gradient(loss, model.trainable_variables)
    sparse = [isinstance(g, tf.IndexedSlices) for g in grads]
    reads = find_row_reads(model, model.trainable_variables, sparse)
    assert sparse[:3] == [True, True, False] and reads.full_pull == {}
    rows = reads.rows(x)
    assert sorted(rows) == [0, 1]
    assert rows[0].tolist() == np.unique(np.concatenate([x[0].ravel(), x[1].ravel()])).tolist()
    assert rows[1].tolist() == np.unique(x[2]).tolist()
    for v in (0, 1):  # exactly the rows the gradient touches
        assert rows[v].tolist() == np.unique(grads[v].indices.numpy()).tolist()


@pytest.mark.integration
def test_a_gather_in_a_custom_layer_is_pulled_whole_and_says_why():
    import keras
    import tensorflow as tf

    from autosync.runtime.rows import find_row_reads

    class Lookup(keras.layers.Layer):
        def build(self, shape):
            self.table = self.add_weight(shape=(20, 3), name="table")

        def call(self, ids):
            return tf.gather(self.table, ids)

    ids = keras.Input((2,), dtype="int32")
    model = keras.Model(ids, keras.layers.Flatten()(Lookup(name="lookup")(ids)))
    reads = find_row_reads(model, model.trainable_variables, [True])
    assert reads.outputs == {} and reads.rows(np.zeros((1, 2), "int32")) == {}
    assert "lookup/table" in reads.full_pull
    assert "not read by a keras.layers.Embedding or a layer declaring row_reads" in reads.full_pull["lookup/table"]


def test_merge_rows_sums_senders_and_keeps_every_squared_slice():
    from autosync.runtime.slices import merge_rows

    rng = np.random.default_rng(3)
    idx = [np.array([0, 4, 4, 7]), np.array([4, 9, 9])]
    vals = [rng.standard_normal((4, 2)).astype(np.float32), rng.standard_normal((3, 2)).astype(np.float32)]
    rows, sums, pos, squares = merge_rows([dedup_rows(i, v, True) for i, v in zip(idx, vals)], True)
    all_idx, all_vals = np.concatenate(idx), np.concatenate(vals)
    assert rows.tolist() == [0, 4, 7, 9]
    for k, r in enumerate(rows):
        np.testing.assert_allclose(sums[k], all_vals[all_idx == r].sum(0), rtol=1e-6)
    assert rows[pos].tolist() == [4, 9]  # the rows with more than one slice in all
    for k, r in zip(pos, rows[pos]):
        np.testing.assert_allclose(squares[list(pos).index(k)], np.square(all_vals[all_idx == r]).sum(0), rtol=1e-6)
    assert len(merge_rows([dedup_rows(i, v, False) for i, v in zip(idx, vals)], False)) == 2


@pytest.mark.integration
def test_lm1b_sampled_softmax_declares_its_rows():
    """The zoo's LM1B draws its sampled classes from the labels, so its softmax rows are known
    before the step: every sparse variable is predicted, exactly as its gradient touches."""
    import tensorflow as tf

    from autosync.models import ingest, zoo
    from autosync.runtime.rows import row_reads_of

    md = zoo.get_model_def("lm1b")
    reads = row_reads_of(md)
    assert reads.full_pull == {} and len(reads.outputs) == 3
    model = md.model_fn()
    for x, y in [ingest.first_batch(md, 0, 2), ingest.first_batch(md, 1, 2)]:
        variables, grads = ingest.compute_gradients(model, md.loss(), x, y)
        predicted = find_reads_on(model, variables, grads).rows(x)
        for v, g in enumerate(grads):
            if isinstance(g, tf.IndexedSlices):
                assert predicted[v].tolist() == np.unique(g.indices.numpy()).tolist(), variables[v].path


def find_reads_on(model, variables, grads):
    import tensorflow as tf

    from autosync.runtime.rows import find_row_reads

    return find_row_reads(model, variables, [isinstance(g, tf.IndexedSlices) for g in grads])


@pytest.mark.parametrize("slices,rows,width,dtype", [
    (512, 300, 8, np.float32),     # each row a few times: rounds
    (300, 5, 3, np.float32),       # rows repeated far beyond ROUNDS_MAX: the padded tail
    (64, 64 * 50, 4, np.float64),  # mostly once
    (40, 7, 1, np.int64),
    (0, 3, 2, np.float32),
    (900, 400, 4, np.float32),     # a few hot rows beside many rare ones: each the way it needs
    (700, 200, None, np.float32),  # values of one element per row (a 1-D variable)
])
def test_scatter_plan_sum_is_np_add_at_bit_for_bit(slices, rows, width, dtype):
    from autosync.runtime.slices import ScatterPlan

    def scatter_sum(inverse, values, n, dtype=None):
        return ScatterPlan(inverse, n).sum(values, dtype)

    rng = np.random.default_rng(slices + rows)
    inverse = rng.integers(0, rows, slices)
    if slices >= 700:   # the first rows take a third of the slices: tens each
        inverse[: slices // 3] = rng.integers(0, 5, slices // 3)
        rng.shuffle(inverse)
    if width is None:
        values = (rng.standard_normal(slices) * rng.choice([1e-4, 1.0, 1e4], slices) * 100).astype(dtype)
        want = np.zeros(rows, dtype)
        np.add.at(want, inverse, values)
        assert scatter_sum(inverse, values, rows).tobytes() == want.tobytes()
        return
    values = (rng.standard_normal((slices, width)) * rng.choice([1e-4, 1.0, 1e4], (slices, 1)) * 100).astype(dtype)
    want = np.zeros((rows, width), dtype)
    np.add.at(want, inverse, values)
    got = scatter_sum(inverse, values, rows)
    assert got.dtype == want.dtype and got.tobytes() == want.tobytes()
    # summed in another dtype, as np.add.at into an array of it does
    if dtype == np.float64:
        want32 = np.zeros((rows, width), np.float32)
        np.add.at(want32, inverse, values.astype(np.float32))
        assert scatter_sum(inverse, values.astype(np.float32), rows, np.float32).tobytes() == want32.tobytes()


def _add_at(inverse, values, rows, dtype=None):
    want = np.zeros((rows,) + values.shape[1:], dtype or values.dtype)
    np.add.at(want, inverse, values)
    return want


@pytest.mark.parametrize("layout", ["hot", "one_hot_scalar", "all_rows", "permutation", "wide_tail", "many_rows"])
def test_scatter_plan_is_np_add_at_bit_for_bit_on_every_path(layout):
    """Each way a plan adds slices: rounds over every row at once, a padded tail of rows repeated
    past ROUNDS_MAX (one hot row of scalars: the pairwise-summed column), np.add.at where that
    tail would be large, the sort for more rows than 16 bits hold; signed zeros included, values
    of many magnitudes (an order change shows in the last bits); one plan for several arrays."""
    from autosync.runtime.slices import ROUNDS_MAX, ScatterPlan

    rng = np.random.default_rng(7)
    rows, width = 50, (3,)
    if layout == "hot":
        inverse = np.minimum(rng.geometric(0.08, 600) - 1, rows - 1)
    elif layout == "one_hot_scalar":
        rows, width = 4, ()
        inverse = np.r_[np.zeros(200, np.int64), 1, 2, 2, 3]
    elif layout == "all_rows":
        inverse = np.r_[np.arange(rows), rng.integers(0, rows, 60)]
    elif layout == "permutation":
        inverse = rng.permutation(rows)
    elif layout == "wide_tail":   # one row very hot beside many just past the rounds: np.add.at for the tail
        inverse = np.r_[np.zeros(3000, np.int64), np.repeat(np.arange(1, rows), ROUNDS_MAX + 1)]
    else:
        rows = 70_000
        inverse = rng.integers(0, 300, 2000) * 233
    rng.shuffle(inverse)
    plan = ScatterPlan(inverse, rows)
    if layout == "hot":
        assert plan.tail is not None and plan.tail[2] is not None
    if layout == "wide_tail":
        assert plan.tail is not None and plan.tail[2] is None
    if layout == "one_hot_scalar":
        assert list(plan.tail[1]) == [0]
    for dtype in (np.float32, np.float64):
        values = (rng.standard_normal((len(inverse),) + width)
                  * 10.0 ** rng.integers(-6, 6, (len(inverse),) + width)).astype(dtype)
        values[rng.random(values.shape) < 0.2] = -0.0
        for v in (values, np.square(values)):
            assert plan.sum(v).tobytes() == _add_at(inverse, v, rows).tobytes()
    # summed in another dtype than the values': np.add.at into an array of it
    values = rng.standard_normal((len(inverse),) + width)
    assert plan.sum(values, np.float32).tobytes() == _add_at(inverse, values, rows, np.float32).tobytes()


def test_a_step_that_touches_rows_it_did_not_pull_fails_naming_them():
    from types import SimpleNamespace

    from autosync.runtime.rows import check_pulled_rows

    paths = [SimpleNamespace(path="dense/kernel"), SimpleNamespace(path="user_embedding/embeddings")]
    pulled = {1: np.array([2, 5, 9], np.int64)}
    dense = np.zeros((2, 2), np.float32)
    check_pulled_rows(paths, pulled, [dense, (np.array([9, 2, 2, 5]), np.ones((4, 3)))])   # all pulled: fine
    for touched, missed in (([9, 3, 11, 3], [3, 11]), ([1], [1]), ([10], [10])):
        with pytest.raises(RuntimeError, match=re.escape(f"user_embedding/embeddings: the step read rows {missed} ")):
            check_pulled_rows(paths, pulled, [dense, (np.array(touched), np.ones((len(touched), 3)))])
    with pytest.raises(RuntimeError, match=r"read rows \[0\]"):
        check_pulled_rows(paths, {1: np.zeros(0, np.int64)}, [dense, (np.array([0]), np.ones((1, 3)))])


@pytest.mark.integration
def test_ids_sliced_from_inputs_are_read_in_numpy_and_computed_ones_are_traced():
    """Embeddings fed by basic slices of model inputs (a negative column, a column range, an
    Ellipsis with a step) have their ids read from the batch in numpy, the traced function's ids
    exactly; an id computed from an input (a modulo) keeps the traced function."""
    import keras

    from autosync.runtime.rows import find_row_reads

    def model_of(feeds):
        a = keras.Input((4,), dtype="int32", name="a")
        b = keras.Input((3,), dtype="int32", name="b")
        tables = [keras.layers.Embedding(20, 2, name=f"t{i}") for i in range(len(feeds(a, b)))]
        pooled = [keras.ops.sum(t(f), axis=1) if len(f.shape) > 1 else t(f) for t, f in zip(tables, feeds(a, b))]
        return keras.Model([a, b], keras.layers.Dense(1)(keras.layers.Concatenate()(pooled)))

    rng = np.random.default_rng(0)
    batch = [rng.integers(0, 20, (8, 4)).astype(np.int32), rng.integers(0, 20, (8, 3)).astype(np.int32)]
    sliced = model_of(lambda a, b: [a[:, -1], a[:, 1:3], b[..., ::2], a])
    reads = find_row_reads(sliced, sliced.trainable_variables, [v.path.endswith("embeddings")
                                                                for v in sliced.trainable_variables])
    assert hasattr(reads.ids, "traced") and len(reads.outputs) == 4
    got, want = reads.ids(batch), reads.ids.traced(batch)
    for v in want:
        np.testing.assert_array_equal(got[v], want[v].numpy())
    by_table = {reads.outputs[v][0]: got[v] for v in got}
    assert np.array_equal(by_table["t0"], batch[0][:, -1]) and np.array_equal(by_table["t2"], batch[1][:, ::2].ravel())
    computed = model_of(lambda a, b: [keras.ops.mod(a[:, 0], 7), b])
    reads = find_row_reads(computed, computed.trainable_variables, [v.path.endswith("embeddings")
                                                                    for v in computed.trainable_variables])
    assert not hasattr(reads.ids, "traced") and len(reads.outputs) == 2   # the tf.function itself
    modulo = next(v for v in reads.outputs if reads.outputs[v] == ["t0"])
    np.testing.assert_array_equal(reads.ids(batch)[modulo].numpy(), batch[0][:, 0] % 7)


def test_ids_outside_a_table_are_refused_naming_the_table_and_the_batch():
    from types import SimpleNamespace

    from autosync.runtime.rows import check_row_ids

    tables = [SimpleNamespace(path="dense/kernel", shape=(3, 2)), SimpleNamespace(path="user/embeddings", shape=(10, 4))]
    check_row_ids(tables, {1: np.array([0, 4, 9])}, batch=1)             # every id in the table
    check_row_ids(tables, {1: np.zeros(0, np.int64)}, batch=1)            # a batch that reads none
    for ids, bad in (([3, 10], [10]), ([-2, -1, 5], [-2, -1]), ([-1, 0, 10, 12], [-1, 10, 12])):
        with pytest.raises(ValueError, match=re.escape(f"batch 7 looks up rows {bad} of user/embeddings, a table "
                                                       f"of 10 rows (ids must be in [0, 10)")):
            check_row_ids(tables, {1: np.array(ids, np.int64)}, batch=7)
