"""The checkpoint's weights file written and read without a Keras model in the driver
(``autosync.runtime.weights_file``): byte for byte the groups, attributes and datasets Keras' own
``save_weights`` writes, readable by ``load_weights``, for functional, sequential and subclassed
models with non-trainable and shared weights; refused (None) where the walk cannot say."""
from __future__ import annotations

import numpy as np
import pytest

from autosync.runtime import weights_file

pytestmark = pytest.mark.integration   # Keras


def _functional():
    import keras

    ids = keras.Input((3,), dtype="int32")
    x = keras.layers.Flatten()(keras.layers.Embedding(20, 4, name="emb")(ids))
    x = keras.layers.BatchNormalization(name="bn")(keras.layers.Dense(5, name="hidden")(x))   # non-trainable stats
    x = keras.layers.Dropout(0.1)(x)
    return keras.Model(ids, keras.layers.Dense(2, name="out")(x))


def _sequential():
    import keras

    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(3), keras.layers.LayerNormalization(),
                             keras.layers.Dense(1)])


def _subclassed():
    import keras

    class TiedOutput(keras.layers.Layer):
        """Logits from the embedding table itself: the embedding layer has two parents."""

        def __init__(self, embedding):
            super().__init__()
            self.embedding = embedding

        def call(self, x):
            return keras.ops.matmul(x, keras.ops.transpose(self.embedding.embeddings))

    class Tied(keras.Model):
        """Nested layers, and a layer (with its weight) two parents track."""

        def __init__(self):
            super().__init__()
            self.emb = keras.layers.Embedding(30, 4)
            self.block = keras.Sequential([keras.layers.Dense(4), keras.layers.Dense(4)])
            self.tied = TiedOutput(self.emb)

        def call(self, ids):
            return self.tied(self.block(self.emb(ids)))

    model = Tied()
    model(np.zeros((2, 3), "int32"))
    return model


def _compiled():
    """Compiled and trained a step: ``save_weights`` also writes the optimizer's and the metrics'
    variables, which are not the model's weights."""
    model = _sequential()
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    model.fit(np.ones((4, 6), "float32"), np.ones((4, 1), "float32"), verbose=0)
    return model


def _tree(path) -> dict:
    import h5py

    out = {}
    with h5py.File(path) as f:
        f.visititems(lambda name, obj: out.__setitem__(name, (sorted(obj.attrs.items()), np.array(obj) if isinstance(
            obj, h5py.Dataset) else None)))
    return out


def _randomized(model):
    rng = np.random.default_rng(0)
    for w in model.weights:
        w.assign(rng.normal(size=w.shape).astype(w.dtype) if w.dtype.startswith("float") else w.numpy())
    return model


@pytest.mark.parametrize("build", [_functional, _sequential, _subclassed, _compiled])
def test_the_file_is_the_one_save_weights_writes_and_load_weights_reads(tmp_path, build):
    model = _randomized(build())
    layout = weights_file.layout(model)
    assert layout is not None
    specs = [(tuple(w.shape), str(np.dtype(w.dtype))) for w in model.weights]
    model.save_weights(tmp_path / "keras.weights.h5")
    ours = str(tmp_path / "ours.weights.h5")
    # the weights arrive in any order (parameter servers' last)
    weights_file.write(ours, layout, specs, ((i, w.numpy()) for i, w in reversed(list(enumerate(model.weights)))))
    theirs, mine = _tree(tmp_path / "keras.weights.h5"), _tree(ours)
    assert theirs.keys() == mine.keys()
    for name, (attrs, data) in theirs.items():
        assert mine[name][0] == attrs, name
        assert (data is None) == (mine[name][1] is None) and (data is None or np.array_equal(data, mine[name][1])), name
    fresh = build()
    fresh.load_weights(ours)
    assert all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(model.weights, fresh.weights))
    with weights_file.Weights(ours, layout, specs) as saved:   # read back by index, each when asked
        assert not saved.problems and len(saved) == len(specs)
        assert all(np.array_equal(saved[i][()], w.numpy()) for i, w in enumerate(model.weights))


def test_a_layer_that_saves_something_else_or_more_leaves_it_to_keras():
    import keras

    class Scaled(keras.layers.Dense):
        def save_own_variables(self, store):   # a computed value, not the variable itself
            store["0"] = self.kernel.numpy() * 2
            store["1"] = self.bias

    class Summed(keras.layers.Dense):
        def save_own_variables(self, store):   # its weights, and a value computed from them beside
            super().save_own_variables(store)
            store["2"] = np.array(self.kernel.numpy().sum())

    for layer in (Scaled(2), Summed(2)):
        assert weights_file.layout(keras.Sequential([keras.Input((3,)), layer])) is None


def test_a_file_that_does_not_fit_is_named_and_a_missing_weight_refused(tmp_path):
    model = _functional()
    layout = weights_file.layout(model)
    specs = [(tuple(w.shape), str(np.dtype(w.dtype))) for w in model.weights]
    path = str(tmp_path / "w.weights.h5")
    with pytest.raises(ValueError, match=r"weights \[0\] were never written"):
        weights_file.write(path, layout, specs, ((i, w.numpy()) for i, w in enumerate(model.weights) if i))
    with pytest.raises(ValueError, match="weight 0 has shape"):
        weights_file.write(path, layout, specs, [(0, np.zeros((2, 2), "float32"))])
    weights_file.write(path, layout, specs, ((i, w.numpy()) for i, w in enumerate(model.weights)))
    other = [((21, 4), "float32")] + specs[1:]   # the checkpoint of a model with another vocabulary
    with weights_file.Weights(path, layout, other) as saved:
        assert saved.problems == ["the weights file's layers/embedding/vars/0 has shape (20, 4), "
                                  "model weight 0 (21, 4)"], saved.problems
    import h5py

    with h5py.File(path, "a") as f:
        del f[layout[-1][0] + "/vars/" + layout[-1][2][-1][0]]
    with weights_file.Weights(path, layout, specs) as saved:
        assert saved.problems == ["the weights file has no layers/dense_1/vars/1 (model weight 8, shape (2,))"], \
            saved.problems


def test_a_keras_without_the_walk_leaves_it_to_keras(monkeypatch):
    from keras.src.saving import saving_lib

    model = _sequential()
    assert weights_file.layout(model) is not None
    monkeypatch.delattr(saving_lib, "_save_state")   # another Keras: the private walk is gone
    assert weights_file.layout(model) is None


def test_a_large_weight_is_read_as_a_memory_map_of_the_file(tmp_path):
    """A restore sends a large weight on from the page cache, not from a private copy: in Keras'
    own file and in ours (contiguous datasets); small ones stay h5py datasets."""
    import keras

    from autosync.runtime.state_file import MAP_BYTES

    rows = MAP_BYTES // 16 + 1   # 4 float32 columns: just over MAP_BYTES
    model = _randomized(keras.Sequential([keras.Input((1,), dtype="int32"), keras.layers.Embedding(rows, 4),
                                          keras.layers.Dense(2)]))
    layout = weights_file.layout(model)
    specs = [(tuple(w.shape), str(np.dtype(w.dtype))) for w in model.weights]
    model.save_weights(tmp_path / "keras.weights.h5")
    ours = str(tmp_path / "ours.weights.h5")
    weights_file.write(ours, layout, specs, ((i, w.numpy()) for i, w in enumerate(model.weights)))
    for path in (str(tmp_path / "keras.weights.h5"), ours):
        with weights_file.Weights(path, layout, specs) as saved:
            table, kernel = saved[0], saved[1]
            assert isinstance(table, np.ndarray) and isinstance(table.base, np.memmap) and not table.flags.writeable
            assert not isinstance(kernel, np.ndarray)   # an h5py dataset, read when indexed
            assert all(np.array_equal(np.asarray(saved[i][()]), w.numpy()) for i, w in enumerate(model.weights))
