"""Recommenders of the zoo: NCF (NeuMF) and DLRM, dominated by large embedding tables whose
gradients are sparse (``IndexedSlices``): ``keras.layers.Embedding`` gathers rows, and on the
TensorFlow backend its gradient is an ``IndexedSlices`` of the rows the batch touched.
"""
from __future__ import annotations

import keras
from keras import ops

from .batches import CRITEO_DENSE_FEATURES


def click_loss():
    """Binary cross-entropy on logits."""
    return keras.losses.BinaryCrossentropy(from_logits=True)


def adagrad(learning_rate: float = 0.05):
    """Adagrad, the common choice for sparse embedding tables."""
    return keras.optimizers.Adagrad(learning_rate=learning_rate)


def adam(learning_rate: float = 1e-3):
    """Adam (NCF's optimizer)."""
    return keras.optimizers.Adam(learning_rate=learning_rate)


def ncf(users: int, items: int, factors: int, mlp_layers: tuple[int, ...]):
    """NeuMF (He et al. 2017; the MLPerf NCF model): a GMF branch of ``factors``-wide user and
    item embeddings and an MLP branch whose embeddings are ``mlp_layers[0] // 2`` wide."""
    user = keras.Input((), dtype="int32", name="user")
    item = keras.Input((), dtype="int32", name="item")
    gmf = keras.layers.Multiply(name="gmf")([
        keras.layers.Embedding(users, factors, name="gmf_user_embedding")(user),
        keras.layers.Embedding(items, factors, name="gmf_item_embedding")(item),
    ])
    half = mlp_layers[0] // 2
    x = keras.layers.Concatenate(name="mlp_concat")([
        keras.layers.Embedding(users, half, name="mlp_user_embedding")(user),
        keras.layers.Embedding(items, half, name="mlp_item_embedding")(item),
    ])
    for i, units in enumerate(mlp_layers[1:], start=1):
        x = keras.layers.Dense(units, activation="relu", name=f"mlp_dense{i}")(x)
    x = keras.layers.Concatenate(name="neumf_concat")([gmf, x])
    logits = keras.layers.Dense(1, name="logits")(x)
    return keras.Model([user, item], logits, name="ncf")


class DotInteraction(keras.layers.Layer):
    """DLRM's feature interaction: dot products of every pair of feature vectors (upper
    triangle), concatenated with the dense feature vector."""

    def call(self, features):
        dense = features[0]
        stacked = ops.stack(features, axis=1)
        n = len(features)
        dots = ops.reshape(ops.matmul(stacked, ops.transpose(stacked, (0, 2, 1))), (-1, n * n))
        upper = [i * n + j for i in range(n) for j in range(i + 1, n)]
        return ops.concatenate([dense, ops.take(dots, upper, axis=1)], axis=1)

    def compute_output_shape(self, input_shape):
        n = len(input_shape)
        return (input_shape[0][0], input_shape[0][-1] + n * (n - 1) // 2)


def dlrm(table_sizes: tuple[int, ...], dim: int, bottom: tuple[int, ...], top: tuple[int, ...],
         dense_features: int = CRITEO_DENSE_FEATURES):
    """DLRM (Naumov et al. 2019): a bottom MLP on the dense features, one ``dim``-wide embedding
    table per categorical feature, pairwise dot interactions and a top MLP."""
    dense_in = keras.Input((dense_features,), name="dense")
    cats_in = keras.Input((len(table_sizes),), dtype="int32", name="categorical")
    x = dense_in
    for i, units in enumerate(bottom, start=1):
        x = keras.layers.Dense(units, activation="relu", name=f"bottom_dense{i}")(x)
    x = keras.layers.Dense(dim, activation="relu", name="bottom_out")(x)
    embedded = [keras.layers.Embedding(n, dim, name=f"embedding_{t:02d}")(cats_in[:, t])
                for t, n in enumerate(table_sizes)]
    z = DotInteraction(name="interaction")([x] + embedded)
    for i, units in enumerate(top, start=1):
        z = keras.layers.Dense(units, activation="relu", name=f"top_dense{i}")(z)
    logits = keras.layers.Dense(1, name="logits")(z)
    return keras.Model([dense_in, cats_in], logits, name="dlrm")
