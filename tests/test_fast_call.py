"""A worker's per-step TensorFlow calls past tf.function's dispatch (``runtime.fast_call``): the
same results as the tf.function, its own path only for the arguments it was traced for."""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.integration


def _function():
    import tensorflow as tf

    scale = tf.Variable(2.0)

    @tf.function
    def f(x, ys):
        return x["a"] * scale + tf.reduce_sum(ys[0]), [tf.shape(y)[0] for y in ys]

    return f


def test_flat_calls_give_the_tf_functions_results_on_the_fast_path():
    from autosync.runtime.fast_call import FlatFunction

    f = _function()
    x = {"a": np.arange(4, dtype=np.float32)}
    ys = [np.ones((3, 2), np.float32), np.zeros(5, np.int64)]
    flat = FlatFunction(f, (x, ys))
    assert flat.fast   # the TensorFlow this project pins has the flat entry point
    want, got = f(x, ys), flat(x, ys)
    np.testing.assert_array_equal(got[0].numpy(), want[0].numpy())
    assert [int(n) for n in got[1]] == [3, 5] and flat.fallbacks == 0
    # new values of the same shapes: the traced graph reads them (and the captured variable)
    np.testing.assert_array_equal(flat({"a": np.ones(4, np.float32)}, ys)[0].numpy(), np.full(4, 2.0 + 6.0))
    assert flat.fallbacks == 0


def test_fast_calls_take_tensors_and_strided_arrays_as_the_tf_function_does():
    """Arguments are made tensors by the eager tensor's own constructor: a tensor passes as it
    is, a strided view and a read-only array are read right."""
    import tensorflow as tf

    from autosync.runtime.fast_call import FlatFunction

    f = _function()
    flat = FlatFunction(f, ({"a": np.arange(4, dtype=np.float32)}, [np.ones((3, 2), np.float32),
                                                                     np.zeros(5, np.int64)]))
    strided = np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2]
    frozen = np.arange(5, dtype=np.int64)
    frozen.flags.writeable = False
    for x in ({"a": tf.constant([1.0, 2.0, 3.0, 4.0])}, {"a": np.arange(8, dtype=np.float32)[::2]}):
        args = (x, [strided, frozen])
        got, want = flat(*args), f(*args)
        np.testing.assert_array_equal(got[0].numpy(), want[0].numpy())
        assert [int(n) for n in got[1]] == [3, 5]
    assert flat.fallbacks == 0


@pytest.mark.parametrize("args", [
    ({"a": np.arange(5, dtype=np.float32)}, [np.ones((3, 2), np.float32), np.zeros(5, np.int64)]),   # shape
    ({"a": np.arange(4, dtype=np.float32)}, [np.ones((3, 2), np.float32), np.zeros(5, np.int32)]),   # dtype
    ({"a": np.arange(4, dtype=np.float32)}, [np.ones((3, 2), np.float32)]),                          # structure
], ids=["shape", "dtype", "structure"])
def test_other_arguments_go_through_the_tf_function(args):
    from autosync.runtime.fast_call import FlatFunction

    f = _function()
    flat = FlatFunction(f, ({"a": np.arange(4, dtype=np.float32)}, [np.ones((3, 2), np.float32),
                                                                     np.zeros(5, np.int64)]))
    want = f(*args)
    got = flat(*args)
    np.testing.assert_array_equal(got[0].numpy(), want[0].numpy())
    assert flat.fallbacks == 1


def test_relaxed_dimensions_take_any_length_without_a_fallback():
    import tensorflow as tf

    from autosync.runtime.fast_call import FlatFunction

    table = tf.Variable(np.zeros((6, 2), np.float32))

    @tf.function
    def scatter(rows, values):
        table.scatter_update(tf.IndexedSlices(values, rows))

    flat = FlatFunction(scatter, (np.zeros(0, np.int64), np.zeros((0, 2), np.float32)), relaxed=[(None,), (None, 2)])
    flat(np.array([1, 4]), np.ones((2, 2), np.float32))
    flat(np.array([0, 2, 5]), np.full((3, 2), 3.0, np.float32))
    np.testing.assert_array_equal(table.numpy()[:, 0], [3, 1, 3, 0, 1, 3])
    assert flat.fallbacks == 0
    flat(np.array([3], np.int32), np.ones((1, 2), np.float32))   # other row ids' dtype: the tf.function's
    assert flat.fallbacks == 1 and table.numpy()[3, 0] == 1
    with pytest.raises(ValueError):
        FlatFunction(scatter, (np.zeros(0, np.int64), np.zeros((0, 2), np.float32)), relaxed=[(None,)])


def test_a_workers_steps_take_the_fast_path():
    """A real worker (zoo dlrm, row pulls of ids sliced from an input) trains through its flat
    calls: no step falls back; its row ids, read from the batch in numpy, are the traced
    function's."""
    from autosync.models.zoo import get_model_def
    from autosync.runtime.worker import TrainingWorker

    worker = TrainingWorker.__new__(TrainingWorker)
    worker.load(get_model_def("dlrm"), 0, 1, send_initial=False)
    before = [v.numpy().copy() for v in worker.variables]
    worker.reset(0, 1, [], [(1, 0)] * len(worker.variables))
    for _ in range(3):
        batches, rows = worker._draw()
        worker._gradients_of(batches)
        traced = worker.row_reads.ids.traced(batches[0][0])   # the rows as the tf.function finds them
        assert rows.keys() == traced.keys() and rows
        for v, ids in rows.items():
            np.testing.assert_array_equal(ids, np.unique(traced[v].numpy()))
    worker._assign([v + 1 for v in before])
    np.testing.assert_array_equal(worker.variables[0].numpy(), before[0] + 1)
    worker._assign_rows([before[i] for i in range(len(before)) if i not in worker.row_reads.outputs],
                        [np.array([0, 2]) for _ in sorted(worker.row_reads.outputs)],
                        [before[v][[0, 2]] for v in sorted(worker.row_reads.outputs)])
    np.testing.assert_array_equal(worker.variables[0].numpy()[[0, 2]], before[0][[0, 2]])
    assert (worker._gradients.fallbacks, worker._assign.fallbacks, worker._assign_rows.fallbacks) == (0, 0, 0)


@pytest.mark.parametrize("name", ["ncf", "dlrm"])
def test_row_ids_read_from_inputs_are_the_traced_functions(name):
    """Where every embedding is fed by a model input (ncf) or a basic slice of one (dlrm: one
    column per table), its rows are read from the batch in numpy, as the traced function gives
    them; a batch given as a dict goes to the traced function."""
    import tensorflow as tf

    from autosync.models.zoo import get_model_def
    from autosync.runtime.rows import find_row_reads

    model_def = get_model_def(name)
    model = model_def.model_fn()
    x, y = next(model_def.batches(0, 1))
    with tf.GradientTape() as tape:
        loss = model_def.loss()(y, model(x, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    reads = find_row_reads(model, model.trainable_variables, [isinstance(g, tf.IndexedSlices) for g in grads])
    assert hasattr(reads.ids, "traced")
    traced = reads.ids.traced
    for _ in range(3):
        x, _ = next(model_def.batches(0, 1))
        got, want = reads.ids(x), traced(x)
        assert got.keys() == want.keys() and len(got) >= 2
        for v in got:
            np.testing.assert_array_equal(np.asarray(got[v]), want[v].numpy())
            assert np.asarray(got[v]).dtype == np.int64
        named = reads.ids({t.name: a for t, a in zip(model.inputs, x)})   # a dict: the traced function
        assert all(np.array_equal(named[v].numpy(), want[v].numpy()) for v in want)


def test_without_the_eager_tensor_constructor_arguments_are_converted_as_tensorflow_converts_them(monkeypatch):
    """A TensorFlow whose ``EagerTensor`` is not where ``_tensor_maker`` looks: each argument goes
    through ``tf.convert_to_tensor`` (tensors as they are), and a flat call gives the same results."""
    import tensorflow as tf
    from tensorflow.python.framework import ops

    from autosync.runtime import fast_call

    monkeypatch.delattr(ops, "EagerTensor")
    maker = fast_call._tensor_maker([tf.float32, tf.int64])
    monkeypatch.undo()
    strided = np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2]
    given = tf.constant([7, 8], tf.int64)
    got = maker([strided, given])
    assert got[1] is given and got[0].dtype == tf.float32
    np.testing.assert_array_equal(got[0].numpy(), strided)

    f = _function()
    x, ys = {"a": np.arange(4, dtype=np.float32)}, [np.ones((3, 2), np.float32), np.zeros(5, np.int64)]
    flat = fast_call.FlatFunction(f, (x, ys))
    monkeypatch.delattr(ops, "EagerTensor")
    flat._tensors = fast_call._tensor_maker(flat._dtypes)
    monkeypatch.undo()
    for args in ((x, ys), ({"a": np.arange(8, dtype=np.float32)[::2]}, [strided, ys[1]])):
        got, want = flat(*args), f(*args)
        np.testing.assert_array_equal(got[0].numpy(), want[0].numpy())
        assert [int(n) for n in got[1]] == [int(n) for n in want[1]]
    assert flat.fallbacks == 0


def _grads_function():
    import tensorflow as tf

    table = tf.Variable(np.arange(12, dtype=np.float32).reshape(6, 2))
    dense = tf.Variable(np.ones((2, 1), np.float32))
    unused = tf.Variable(1.0)

    @tf.function
    def grads(ids, x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.matmul(tf.gather(table, ids) * x, dense))
        return loss, tape.gradient(loss, [dense, table, unused])

    return grads


def test_outputs_are_packed_below_tensorflows_own_packing_with_the_same_values():
    """A gradient step's outputs (a loss, a dense gradient, IndexedSlices, None) come back from
    the graph's flat outputs in their structure and values, call after call."""
    import tensorflow as tf

    from autosync.runtime.fast_call import FlatFunction

    grads = _grads_function()
    example = (np.array([0, 3, 3], np.int64), np.ones((3, 2), np.float32))
    flat = FlatFunction(grads, example)
    assert flat.lowest
    for ids in ([0, 3, 3], [5, 1, 2]):
        args = (np.array(ids, np.int64), np.full((3, 2), 0.5, np.float32))
        (loss, got), (want_loss, want) = flat(*args), grads(*args)
        assert isinstance(got, list) and got[2] is None and isinstance(got[1], tf.IndexedSlices)
        assert float(loss) == float(want_loss)
        np.testing.assert_array_equal(got[0].numpy(), want[0].numpy())
        np.testing.assert_array_equal(got[1].indices.numpy(), ids)
        np.testing.assert_array_equal(got[1].values.numpy(), want[1].values.numpy())
        np.testing.assert_array_equal(got[1].dense_shape.numpy(), [6, 2])
    assert flat.fallbacks == 0


def test_under_a_recording_tape_calls_take_tensorflows_path_and_differentiate():
    """The lowest path does not record on a tape: where one may record, the call goes through
    TensorFlow's entry point, so a gradient through it is still there."""
    import tensorflow as tf

    from autosync.runtime.fast_call import FlatFunction

    @tf.function
    def square(x):
        return [x * x]

    flat = FlatFunction(square, (np.ones(3, np.float32),))
    assert flat.lowest
    x = tf.constant([1.0, 2.0, 3.0])
    with tf.GradientTape() as tape:
        tape.watch(x)
        (y,) = flat(x)
    np.testing.assert_array_equal(tape.gradient(y, x).numpy(), [2.0, 4.0, 6.0])
    np.testing.assert_array_equal(flat(np.array([2.0, 2.0, 2.0], np.float32))[0].numpy(), [4.0, 4.0, 4.0])


def test_outputs_it_does_not_pack_keep_tensorflows_packing():
    """A dict of outputs is not rebuilt below TensorFlow's packing: the call gives it as the
    tf.function does."""
    import tensorflow as tf

    from autosync.runtime.fast_call import FlatFunction

    @tf.function
    def named(x):
        return {"double": 2 * x, "half": x / 2}

    flat = FlatFunction(named, (np.ones(2, np.float32),))
    assert flat.fast and not flat.lowest
    got = flat(np.array([2.0, 4.0], np.float32))
    assert sorted(got) == ["double", "half"]
    np.testing.assert_array_equal(got["half"].numpy(), [1.0, 2.0])


def test_joined_assign_sets_every_variable_small_ones_through_one_array_each_dtype():
    """Five small float32 variables travel as one array (a scalar among them); two float64 ones, too few
    to join, and a large one go alone; every variable gets exactly its value, on the fast path."""
    import keras

    from autosync.runtime import fast_call

    shapes = [((3, 4), "float32"), ((4,), "float32"), ((), "float32"), ((2, 2, 2), "float32"), ((5,), "float32"),
              ((3,), "float64"), ((2, 3), "float64"), ((fast_call.JOIN_VALUES + 1,), "float32")]
    variables = [keras.Variable(np.zeros(s, d)) for s, d in shapes]
    rng = np.random.default_rng(0)
    initial = [np.zeros(s, d) for s, d in shapes]
    joined = fast_call.JoinedAssign(variables, initial)
    assert joined.groups == [[0, 1, 2, 3, 4]] and joined.alone == [5, 6, 7]
    for _ in range(2):
        values = [rng.normal(size=s).astype(d) for s, d in shapes]
        values[3] = values[3].transpose(2, 0, 1)   # a strided value
        joined(values)
        for var, value in zip(variables, values):
            np.testing.assert_array_equal(np.asarray(var.numpy()), value)
            assert np.asarray(var.numpy()).dtype == value.dtype
    assert joined.fallbacks == 0
