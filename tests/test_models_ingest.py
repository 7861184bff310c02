"""Ingestion: sparse detection from a real gradient, rows per step, names, ready order, profile."""
from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from autosync.model_def import ModelDef
from autosync.models import fit_batch, ingest, profile
from strategy_space.errors import ConfigError

VOCAB, DIM, BATCH, WIDTH = 50, 4, 8, 3


def TiedLM():
    """An embedding used twice: a lookup (sparse) and the output projection (dense). (Keras and
    TensorFlow are imported by the tests that use them: collecting this file stays fast.)"""
    import keras
    import tensorflow as tf

    class TiedLM(keras.Model):
        def __init__(self):
            super().__init__(name="tied")
            self.embedding = keras.layers.Embedding(VOCAB, DIM, name="embedding")
            self.hidden = keras.layers.Dense(DIM, name="hidden")

        def call(self, ids, training=None):
            h = self.hidden(tf.reduce_mean(self.embedding(ids), axis=1))
            return tf.matmul(h, self.embedding.embeddings, transpose_b=True)

    return TiedLM()


def _sgd():
    import keras

    return keras.optimizers.SGD()


def _lookup_model():
    import keras

    ids = keras.Input((WIDTH,), dtype="int32")
    x = keras.layers.Flatten()(keras.layers.Embedding(VOCAB, DIM, name="lookup")(ids))
    x = keras.layers.Dense(5, name="dense")(x)
    return keras.Model(ids, keras.layers.Dense(1, name="out")(x))


def _mse():
    import keras

    return keras.losses.MeanSquaredError()


def _ids_batches(worker_index, num_workers):
    ids = np.array([[1, 2, 3], [3, 3, 7], [1, 9, 9], [2, 2, 2], [4, 1, 0], [0, 0, 0], [7, 7, 1], [9, 4, 3]],
                   dtype=np.int32)
    yield ids, np.zeros((BATCH, 1), np.float32)


def _tied_batches(worker_index, num_workers):
    ids, _ = next(_ids_batches(worker_index, num_workers))
    yield ids, np.zeros((BATCH, VOCAB), np.float32)


@pytest.mark.integration
def test_embedding_lookup_is_sparse_with_measured_rows_and_dense_layers_are_dense():
    ids, y = next(_ids_batches(0, 1))
    spec = ingest.model_spec_from_model(_lookup_model(), _mse(), ids, y, name="lookup", batch_size=BATCH)
    by_name = {v.name: v for v in spec.variables}
    assert list(by_name) == ["lookup/embeddings", "dense/kernel", "dense/bias", "out/kernel", "out/bias"]
    emb = by_name["lookup/embeddings"]
    assert emb.sparse and emb.shape == (VOCAB, DIM) and emb.dtype == "float32"
    assert emb.rows_per_step == len(np.unique(ids)) == 7  # ids 0, 1, 2, 3, 4, 7, 9
    assert not any(v.sparse for n, v in by_name.items() if n != "lookup/embeddings")
    assert all(v.rows_per_step is None for n, v in by_name.items() if n != "lookup/embeddings")


@pytest.mark.integration
def test_unused_variables_and_synchronized_batch_norm_inside_a_nested_model_are_warned_of():
    """An unused layer never changes; a BatchNormalization with synchronized=True (sharing batch
    statistics across tf.distribute's replicas) normalizes each worker's own batch here: both said."""
    import keras

    inner = keras.Sequential([keras.layers.Dense(4, name="d"), keras.layers.BatchNormalization(synchronized=True,
                                                                                                 name="sync_bn")],
                             name="block")
    x = keras.Input((3,))
    unused = keras.layers.Dense(2, name="unused")
    unused.build((None, 3))
    model = keras.Model(x, keras.layers.Dense(1, name="out")(inner(x)))
    model.unused = unused
    data = np.ones((BATCH, 3), np.float32)
    with pytest.warns(UserWarning) as caught:
        ingest.model_spec_from_model(model, _mse(), data, np.ones((BATCH, 1), np.float32), name="m",
                                     batch_size=BATCH)
    said = [str(w.message) for w in caught]
    assert any("sync_bn normalize(s) with synchronized=True" in m and "each normalize over their own batch" in m
               for m in said), said
    assert any("the loss does not depend on 2 trainable variable(s) (unused/kernel, unused/bias)" in m for m in said), said


@pytest.mark.integration
def test_tied_embedding_used_sparsely_and_densely_is_dense():
    ids, y = next(_tied_batches(0, 1))
    spec = ingest.model_spec_from_model(TiedLM(), _mse(), ids, y, name="tied", batch_size=BATCH)
    emb = spec.var("tied/embedding/embeddings")
    assert not emb.sparse and emb.rows_per_step is None
    assert spec.sparse_share == 0.0


def test_variable_names_disambiguates_repeated_paths():
    class Var:
        def __init__(self, path):
            self.path = path

    assert ingest.variable_names([Var("a/kernel"), Var("a/kernel"), Var("b"), Var("a/kernel")]) == [
        "a/kernel", "a/kernel_1", "b", "a/kernel_2"]


@pytest.mark.integration
def test_model_spec_from_def_rejects_empty_dataset_and_non_pairs():
    base = dict(name="m", model_fn=_lookup_model, loss_fn=_mse, optimizer_fn=_sgd, batch_size=BATCH)
    with pytest.raises(ConfigError, match=r"dataset_fn\(0, 1\) yielded no batches"):
        ingest.model_spec_from_def(ModelDef(dataset_fn=lambda w, n: [], **base))
    with pytest.raises(ConfigError, match=r"must yield \(inputs, targets\) pairs or \(inputs, targets, "
                                          r"sample_weight\) triples, got ndarray"):
        ingest.model_spec_from_def(ModelDef(dataset_fn=lambda w, n: [np.zeros((BATCH, WIDTH), np.int32)], **base))


def test_a_first_batch_of_another_size_than_batch_size_is_refused():
    """batch_size counts the examples a worker draws per step (samples/s, the cost model, the
    global batch): a dataset batched otherwise made every one of those wrong, silently (samples/s
    half the truth for batches of 64 declared as 32). Inputs nested in a dict or list count too;
    a shape it cannot read is left alone."""
    never = lambda *a: None  # noqa: E731 - only the data is read
    ids = np.zeros((2 * BATCH, WIDTH), np.int32)
    y = np.zeros((2 * BATCH, 1), np.float32)
    for inputs in (ids, {"ids": ids}, [ids, ids]):
        md = ModelDef(name="m", model_fn=never, loss_fn=never, optimizer_fn=never, batch_size=BATCH,
                      dataset_fn=lambda w, n, x=inputs: iter([(x, y)]))
        with pytest.raises(ConfigError, match=rf"ModelDef m: the first batch of dataset_fn\(0, 1\) holds {2 * BATCH} "
                                              rf"examples, but batch_size is {BATCH}; .*set batch_size={2 * BATCH}"):
            ingest.first_batch(md)
    for inputs in (ids[:BATCH], {"ids": ids[:BATCH]}, [ids[:BATCH], ids[:BATCH]]):   # the right size
        md = ModelDef(name="m", model_fn=never, loss_fn=never, optimizer_fn=never, batch_size=BATCH,
                      dataset_fn=lambda w, n, x=inputs: iter([(x, y[:BATCH])]))
        assert ingest.first_batch(md)[0] is inputs


def test_python_values_where_arrays_belong_are_refused_naming_where():
    """A list of numbers (or strings, or lists) in a batch is read as that many separate inputs, as
    Keras reads a list: the model then failed with 'expects 2 named input(s) ... received 64 input
    tensors'. Arrays, tensors and numpy scalars pass."""
    never = lambda *a: None  # noqa: E731 - only the data is read
    ids = np.zeros((BATCH, WIDTH), np.int32)
    y = np.zeros((BATCH, 1), np.float32)
    cases = [(([[1, 2, 3]] * BATCH, y), "inputs[0][0]"),
             (({"a": ids, "b": list(range(BATCH))}, y), "inputs['b'][0]"),
             (({"a": ids, "s": ["x"] * BATCH}, y), "inputs['s'][0]"),
             ((ids, y.tolist()), "targets[0][0]")]
    for batch, where in cases:
        md = ModelDef(name="m", model_fn=never, loss_fn=never, optimizer_fn=never, batch_size=BATCH,
                      dataset_fn=lambda w, n, b=batch: iter([b]))
        with pytest.raises(ConfigError, match=rf"ModelDef m: the first batch of dataset_fn\(0, 1\) holds a Python value "
                                              rf"at {re.escape(where)} where an array belongs .*np.asarray"):
            ingest.first_batch(md)
    ok = ({"a": ids, "n": np.full(BATCH, np.float32(2))}, (y, np.float32(1.0)))   # numpy scalars are arrays' values
    md = ModelDef(name="m", model_fn=never, loss_fn=never, optimizer_fn=never, batch_size=BATCH,
                  dataset_fn=lambda w, n: iter([ok]))
    assert ingest.first_batch(md)[0] is ok[0]


@pytest.mark.integration
def test_model_spec_says_whether_the_optimizer_clips_by_the_global_norm():
    """The cost of a held step is the optimizer's to say: ``global_clipnorm`` marks the spec (its
    own fingerprint); ``clipnorm`` (per variable) needs no agreement between shards and does not."""
    import keras

    base = dict(name="lookup", model_fn=_lookup_model, loss_fn=_mse, dataset_fn=_ids_batches, batch_size=BATCH)
    plain, per_var, clipped = (
        ingest.model_spec_from_def(ModelDef(optimizer_fn=lambda c=clip: keras.optimizers.Adam(**c), **base))
        for clip in ({}, {"clipnorm": 1.0}, {"global_clipnorm": 1.0}))
    assert (plain.global_clipnorm, per_var.global_clipnorm, clipped.global_clipnorm) == (False, False, True)
    assert plain.fingerprint == per_var.fingerprint != clipped.fingerprint
    assert clipped.variables == plain.variables


@pytest.mark.integration
def test_profile_measures_step_time_device_and_backward_ready_order():
    model_def = ModelDef(name="lookup", model_fn=_lookup_model, loss_fn=_mse, optimizer_fn=_sgd,
                         dataset_fn=_ids_batches, batch_size=BATCH)
    spec = profile.profiled_model_spec(model_def, warmup_steps=1, timed_steps=3)
    p = spec.profile
    assert 0 < p.step_time_s < 5
    assert p.device.startswith(("cpu:", "gpu:")) and p.device.endswith(tuple(f"x{i}" for i in range(1, 1025)))
    # chain lookup -> dense -> out: the backward pass reaches the output layer first, the lookup last
    order = list(p.ready_order)
    assert sorted(order) == sorted(spec.names)
    assert order.index("out/kernel") < order.index("dense/kernel") < order.index("lookup/embeddings")
    assert order[-1] == "lookup/embeddings"


@pytest.mark.integration
def test_under_gradient_accumulation_a_profiled_step_is_n_batches(monkeypatch):
    import dataclasses

    import keras

    real = profile.profile_model
    monkeypatch.setattr(profile, "profile_model",
                        lambda *a, **k: dataclasses.replace(real(*a, **k), step_time_s=0.01))   # one batch: 10 ms
    base = dict(name="lookup", model_fn=_lookup_model, loss_fn=_mse, dataset_fn=_ids_batches, batch_size=BATCH)
    one = profile.profiled_model_spec(ModelDef(optimizer_fn=_sgd, **base), warmup_steps=1, timed_steps=1)
    three = profile.profiled_model_spec(
        ModelDef(optimizer_fn=lambda: keras.optimizers.SGD(0.1, gradient_accumulation_steps=3), **base),
        warmup_steps=1, timed_steps=1)
    assert one.profile.step_time_s == 0.01 and three.profile.step_time_s == pytest.approx(0.03)


@pytest.mark.integration
def test_tied_embedding_is_ready_only_after_its_earliest_use():
    ids, y = next(_tied_batches(0, 1))
    model = TiedLM()
    model(ids)
    p = profile.profile_model(model, _mse(), ids, y, warmup_steps=1, timed_steps=1)
    assert p.ready_order[-1] == "tied/embedding/embeddings"


@pytest.mark.integration
def test_profile_rejects_zero_steps():
    ids, y = next(_ids_batches(0, 1))
    with pytest.raises(ValueError, match="timed_steps must be >= 1|warmup_steps and timed_steps"):
        profile.profile_model(_lookup_model(), _mse(), ids, y, warmup_steps=1, timed_steps=0)


def _per_example_squares(y_true, y_pred):
    return (y_pred - y_true) ** 2


def _loss_def(loss):
    return ModelDef(name="loss", model_fn=_lookup_model, loss_fn=lambda: loss, optimizer_fn=_sgd,
                    dataset_fn=_ids_batches, batch_size=BATCH)


@pytest.mark.integration
def test_model_def_loss_averages_a_per_example_function_as_compile_does():
    """A plain function's per-example values, a Keras name and a Loss object all give the batch
    mean; so the workers' gradients are those of the mean, not of the sum over the batch."""
    import keras

    y_true = np.array([[0.0], [1.0], [2.0], [4.0]], np.float32)
    y_pred = np.array([[1.0], [1.0], [0.0], [1.0]], np.float32)
    expected = float(np.mean((y_pred - y_true) ** 2))   # (1 + 0 + 4 + 9) / 4
    for given in (_per_example_squares, "mse", keras.losses.MeanSquaredError()):
        loss = _loss_def(given).loss()
        assert isinstance(loss, keras.losses.Loss)
        assert float(loss(y_true, y_pred)) == pytest.approx(expected)
    # a function that already returns the mean is left as it is
    mean_loss = _loss_def(lambda t, p: keras.ops.mean((p - t) ** 2)).loss()   # named "<lambda>"
    assert float(mean_loss(y_true, y_pred)) == pytest.approx(expected)


@pytest.mark.integration
@pytest.mark.parametrize("given, message", [("no_such_loss", "not a Keras loss name"), (3, "not a loss")])
def test_model_def_loss_refuses_what_is_not_a_loss(given, message):
    with pytest.raises(ConfigError, match=message):
        _loss_def(given).loss()


@pytest.mark.integration
def test_zoo_lm_loss_is_scaled_by_keras_under_a_distribution_strategy():
    """The sampled-softmax LM's loss hands Keras its per-token values: under a two-replica
    strategy Keras divides the replica's loss by two before the gradients are summed (a loss
    that returned the mean itself escaped that, and Ray Train's all-reduce doubled its gradients)."""
    import tensorflow as tf

    from autosync.sources import load_model_def

    md = load_model_def("zoo:lm1b")
    per_token = tf.constant([[2.0, 4.0], [6.0, 8.0]])
    loss = md.loss()
    assert float(loss(tf.zeros_like(per_token), per_token)) == pytest.approx(5.0)
    assert float(keras_compiled_loss(md.loss_fn(), per_token, replicas=2)) == pytest.approx(2.5)


def keras_compiled_loss(loss_fn, y_pred, replicas):
    """What Keras' compiled loss gives for ``y_pred`` inside a replica of a ``replicas``-way
    strategy (logical CPU devices cannot be added after start-up: a fake strategy count)."""
    from unittest import mock

    import tensorflow as tf
    from keras.src.trainers.compile_utils import CompileLoss

    compiled = CompileLoss(loss_fn)
    compiled.build(tf.zeros_like(y_pred), y_pred)
    strategy = mock.Mock(num_replicas_in_sync=replicas)
    with mock.patch.object(tf.distribute, "get_strategy", return_value=strategy):
        return compiled(tf.zeros_like(y_pred), y_pred)


def test_batches_carry_sample_weights_in_their_targets():
    """(inputs, targets, sample_weight) as keras.Model.fit takes it: the weights ride in the
    targets (every path that carries a pair carries them); None weights are no weights; anything
    else is refused with what it got."""
    x, y, w = np.zeros((2, 3)), np.ones((2, 1)), np.array([0.5, 2.0])
    assert fit_batch.split_batch((x, y), "m") == (x, y)
    got_x, got_y = fit_batch.split_batch([x, y, w], "m")
    assert got_x is x and got_y == {fit_batch.TARGETS: y, fit_batch.SAMPLE_WEIGHT: w}
    assert fit_batch.split_batch((x, y, None), "m") == (x, y)
    for bad, what in [((x,), "tuple of length 1"), ((x, y, w, w), "tuple of length 4"), (x, "got ndarray")]:
        with pytest.raises(ConfigError, match=f"m: dataset_fn must yield .*{what}"):
            fit_batch.split_batch(bad, "m")
    md = ModelDef(name="m", model_fn=_lookup_model, loss_fn=_mse, optimizer_fn=_sgd, batch_size=2,
                  dataset_fn=lambda i, n: [(x, y, w), (x, y)])
    stream = md.batches(0, 1)
    weighted = sorted([fit_batch.TARGETS, fit_batch.SAMPLE_WEIGHT])
    assert [sorted(b[1]) if isinstance(b[1], dict) else "plain" for b in (next(stream), next(stream), next(stream))] \
        == [weighted, "plain", weighted]
    with pytest.raises(ConfigError, match="ModelDef m: dataset_fn must yield"):
        next(dataclasses.replace(md, dataset_fn=lambda i, n: [x]).batches(0, 1))


def _model_with_a_name_tensorflow_refuses():
    import keras

    ids = keras.Input((WIDTH,), dtype="int32")
    x = keras.layers.Flatten()(keras.layers.Embedding(VOCAB, DIM, name="lookup [users]*")(ids))
    return keras.Model(ids, keras.layers.Dense(1, name="out")(x))


@pytest.mark.integration
def test_a_step_that_fails_to_trace_is_a_config_error_saying_why():
    """Eager ingestion passes, the traced step (as fit traces it) fails: a message with the cause,
    not a traceback (``autosync tune`` and ``inspect --profile`` exited 1 with one)."""
    md = ModelDef(name="m", model_fn=_model_with_a_name_tensorflow_refuses, loss_fn=_mse, optimizer_fn=_sgd,
                  dataset_fn=_ids_batches, batch_size=BATCH)
    assert ingest.model_spec_from_def(md).var("lookup [users]*/embeddings").sparse
    with pytest.raises(ConfigError, match=r"ModelDef m: tracing and timing the model's training step in a "
                                          r"tf.function failed: ValueError: .*'lookup \[users\]\*' is not a valid "
                                          r"scope name.*; the model must train under keras.Model.fit") as e:
        profile.profiled_model_spec(md)
    assert "\x1b" not in str(e.value) and 'File "' not in str(e.value)
    from keras.src.backend.common.name_scope import current_path

    assert current_path() == ""   # the scope the failed trace opened is closed again



BRANCHING = """
import keras
import numpy as np
from autosync.model_def import ModelDef


def build():
    ids = keras.Input((2,), dtype="int32")
    x = keras.layers.Flatten()(keras.layers.Embedding(9, 3)(ids))
    return keras.Model(ids, keras.layers.Dense(1, name="out")(x))


def branching_mse(y_true, y_pred):
    if keras.ops.mean(y_true) > 0:   # a Python branch on a tensor's value: fit's traced step cannot take it
        return keras.ops.mean((y_true - y_pred) ** 2)
    return keras.ops.mean(keras.ops.abs(y_true - y_pred))


def data(worker, num_workers):
    rng = np.random.RandomState(worker)
    while True:
        yield rng.randint(0, 9, size=(4, 2)).astype("int32"), rng.rand(4, 1).astype("float32")


def m():
    return ModelDef(name="m", model_fn=build, loss_fn=lambda: branching_mse,
                    optimizer_fn=lambda: keras.optimizers.SGD(0.1), dataset_fn=data, batch_size=4)
"""


@pytest.mark.integration
def test_a_python_branch_on_a_tensor_fails_the_traced_step_as_under_fit_and_says_how_to_write_it(tmp_path):
    """A loss that branches in Python on a tensor's value runs eagerly, but not in a traced step
    (fit's, the profile's, a worker's: Keras calls the loss without AutoGraph): said with the fix,
    not only TensorFlow's advice to decorate the function with @tf.function."""
    from autosync.sources import load_model_def

    (tmp_path / "branching.py").write_text(BRANCHING)
    md = load_model_def(f"{tmp_path / 'branching.py'}:m")
    assert ingest.model_spec_from_def(md).names   # eager: the branch is a Python bool there
    with pytest.raises(ConfigError, match=r"ModelDef m: tracing and timing the model's training step in a tf.function "
                                          r"failed: OperatorNotAllowedInGraphError: .*; the model's code \(a layer's "
                                          r"call, the loss\) uses a tensor's value in a Python if.*keras.ops.cond"):
        profile.profiled_model_spec(md, warmup_steps=1, timed_steps=1)
