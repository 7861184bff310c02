"""The zoo: names and options, data shards, every small variant trains, ResNet-50 full matches Keras."""
from __future__ import annotations

import pickle

import numpy as np
import pytest

from autosync.models import ingest, zoo
from strategy_space.errors import ConfigError

NAMES = ("resnet50", "vgg16", "bert", "lm1b", "ncf", "dlrm")
EMBEDDING_HEAVY = ("lm1b", "ncf", "dlrm")


def test_list_models_names_descriptions_and_defaults():
    models = zoo.list_models()
    assert tuple(m.name for m in models) == NAMES
    for m in models:
        assert m.default == "small" and set(m.sizes) == {"small", "full"} and m.description and m.full_size_note


@pytest.mark.parametrize("text, message", [
    ("alexnet", r"unknown zoo model 'alexnet'; valid models: resnet50, vgg16, bert, lm1b, ncf, dlrm"),
    ("ncf?size=huge", r"unknown size 'huge'; valid sizes of ncf: full, small"),
    ("ncf?sizes=small", r"unknown option 'sizes'; allowed options: size, batch_size"),
    ("ncf?size", r"query item 'size' must look like key=value"),
    ("ncf?size=small&size=full", r"option 'size' is given twice"),
    ("ncf?batch_size=0", r"batch_size must be a positive integer, got '0'"),
])
def test_bad_names_and_options_are_config_errors(text, message):
    with pytest.raises(ConfigError, match=message):
        zoo.get_model_def(text)


def test_names_sizes_batch_size_and_source():
    d = zoo.get_model_def("ncf")
    assert d.name == "ncf-small" and d.metadata["source"] == "zoo:ncf?size=small"
    assert zoo.get_model_def("ncf?size=small").batch_size == d.batch_size == 256
    d = zoo.get_model_def("bert?size=full&batch_size=8")
    assert d.name == "bert-full" and d.batch_size == 8 and d.metadata["source"] == "zoo:bert?size=full&batch_size=8"


def test_model_defs_pickle():
    for name in NAMES:
        d = zoo.get_model_def(name)
        back = pickle.loads(pickle.dumps(d))
        assert back.name == d.name and back.batch_size == d.batch_size



@pytest.mark.integration
@pytest.mark.parametrize("name", NAMES)
def test_small_variant_trains_a_step_and_has_the_right_character(name):
    from autosync.models.profile import train_step

    d = zoo.get_model_def(name)
    inputs, targets = ingest.first_batch(d, 0, 2)
    model, loss, optimizer = d.model_fn(), d.loss(), d.optimizer_fn()
    spec = ingest.model_spec_from_model(model, loss, inputs, targets, name=d.name, batch_size=d.batch_size)
    variables = list(model.trainable_variables)
    before = [v.numpy().copy() for v in variables]

    step = train_step(model, loss, optimizer)

    first = float(step(inputs, targets))
    assert np.isfinite(first)
    traced = step.experimental_get_tracing_count()
    step(inputs, targets)
    assert step.experimental_get_tracing_count() == traced  # the second step reuses the traced graph
    changed = [not np.array_equal(b, v.numpy()) for b, v in zip(before, variables)]
    assert sum(changed) >= len(variables) - 1  # every variable with a gradient moved
    if name in EMBEDDING_HEAVY:
        assert spec.sparse_share > 0.9
        for v in spec.variables:
            if v.sparse:
                assert 1 <= v.rows_per_step <= min(v.shape[0], d.batch_size * 64)
    else:
        assert spec.sparse_share < 0.01
    if name == "bert":  # the token embedding is tied to the output projection, hence dense
        assert not spec.var("bert/token_embedding/embeddings").sparse
        assert spec.var("bert/segment_embedding/embeddings").sparse
    if name == "lm1b":  # sampled softmax gathers rows of the output weights too
        assert [v.name for v in spec.variables if v.sparse] == [
            "embedding/embeddings", "softmax/softmax_weights", "softmax/softmax_bias"]


@pytest.mark.integration
def test_resnet50_full_matches_the_keras_model():
    import keras

    d = zoo.get_model_def("resnet50?size=full&batch_size=2")
    spec = ingest.model_spec_from_def(d)
    reference = keras.applications.ResNet50(weights=None)
    trainable = reference.trainable_weights
    assert len(spec.variables) == len(trainable) == 214  # conv kernels and biases, BN gamma and beta
    assert spec.total_params == sum(int(np.prod(w.shape)) for w in trainable) == 25_583_592
    assert not any(v.sparse for v in spec.variables)
    assert spec.names[0] == "conv1_conv/kernel" and spec.var("predictions/kernel").shape == (2048, 1000)


@pytest.mark.integration
def test_the_backend_neutral_sampled_softmax_is_tensorflows():
    """lm1b's loss in keras.ops alone (what Keras' torch backend runs) equals TensorFlow's
    sampled_softmax_loss on the same draws, a class drawn twice and hitting the label included."""
    import tensorflow as tf

    from autosync.models._text import SampledSoftmaxLoss

    layer = SampledSoftmaxLoss(vocab=300, num_sampled=40, seed=3)
    rng = np.random.default_rng(0)
    hidden = tf.constant(rng.normal(size=(4, 5, 16)).astype("float32"))
    labels = tf.constant(rng.integers(0, 300, size=(4, 5)).astype("int32"))
    reference = layer([hidden, labels]).numpy()
    sampled = layer.sample(labels).numpy()
    assert any((sampled == label).sum() >= 2 for label in labels.numpy().ravel())   # the case TF removes once
    portable = layer.portable_loss(hidden, labels, sampled=sampled)
    np.testing.assert_allclose(np.asarray(portable), reference, rtol=1e-5, atol=1e-4)
    drawn = layer.portable_loss(hidden, labels)    # its own draws: a finite loss of the labels' shape
    assert drawn.shape == labels.shape and np.isfinite(np.asarray(drawn)).all()


@pytest.mark.integration
def test_vgg_small_centres_its_pixels_as_rescaling_did():
    import keras

    from autosync.models._vision import Centre

    x = np.random.default_rng(1).uniform(size=(2, 4, 4, 3)).astype("float32")
    np.testing.assert_allclose(np.asarray(Centre()(x)), np.asarray(keras.layers.Rescaling(2.0, offset=-1.0)(x)),
                               rtol=1e-6)
