"""Language models of the zoo: a BERT encoder with a masked-LM head and an LSTM language model
with sampled softmax (LM1B style).

BERT ties its output projection to the token embedding (as the original does), so the token
embedding's gradient mixes a sparse lookup with a dense matmul and is dense. The LSTM language
model gathers rows of both its input embedding and its softmax weights, so both are sparse.
"""
from __future__ import annotations

import math

import keras
from keras import ops


def masked_lm_loss():
    """Cross-entropy of the target token at every position, from logits."""
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def adamw(learning_rate: float = 1e-4):
    """AdamW, BERT's optimizer."""
    return keras.optimizers.AdamW(learning_rate=learning_rate, weight_decay=0.01)


class TransformerBlock(keras.layers.Layer):
    """Post-norm transformer encoder block (self-attention, then a GELU feed-forward)."""

    def __init__(self, hidden: int, heads: int, intermediate: int, dropout: float, **kwargs):
        super().__init__(**kwargs)
        self.attention = keras.layers.MultiHeadAttention(heads, hidden // heads, dropout=dropout, name="attention")
        self.attention_norm = keras.layers.LayerNormalization(epsilon=1e-12, name="attention_norm")
        self.ffn_in = keras.layers.Dense(intermediate, activation="gelu", name="ffn_in")
        self.ffn_out = keras.layers.Dense(hidden, name="ffn_out")
        self.ffn_norm = keras.layers.LayerNormalization(epsilon=1e-12, name="ffn_norm")
        self.dropout = keras.layers.Dropout(dropout)

    def call(self, x, training=None):
        x = self.attention_norm(x + self.dropout(self.attention(x, x, training=training), training=training))
        return self.ffn_norm(x + self.dropout(self.ffn_out(self.ffn_in(x)), training=training))


class BertMaskedLM(keras.Model):
    """BERT encoder (token, position and segment embeddings, ``layers`` transformer blocks) with
    a masked-LM head whose output projection is the token embedding (tied weights).

    Inputs are ``(token_ids, segment_ids)``, both ``(batch, seq_len)``; the output is
    ``(batch, seq_len, vocab)`` logits.
    """

    def __init__(self, vocab: int, hidden: int, layers: int, heads: int, intermediate: int,
                 max_positions: int = 512, segments: int = 2, dropout: float = 0.1, **kwargs):
        super().__init__(**kwargs)
        self.token_embedding = keras.layers.Embedding(vocab, hidden, name="token_embedding")
        self.segment_embedding = keras.layers.Embedding(segments, hidden, name="segment_embedding")
        self.position_embedding = self.add_weight(shape=(max_positions, hidden), name="position_embedding",
                                                  initializer=keras.initializers.TruncatedNormal(stddev=0.02))
        self.embedding_norm = keras.layers.LayerNormalization(epsilon=1e-12, name="embedding_norm")
        self.dropout = keras.layers.Dropout(dropout)
        self.blocks = [TransformerBlock(hidden, heads, intermediate, dropout, name=f"layer_{i:02d}")
                       for i in range(layers)]
        self.head_transform = keras.layers.Dense(hidden, activation="gelu", name="mlm_transform")
        self.head_norm = keras.layers.LayerNormalization(epsilon=1e-12, name="mlm_norm")
        self.output_bias = self.add_weight(shape=(vocab,), name="mlm_output_bias", initializer="zeros")

    def call(self, inputs, training=None):
        tokens, segments = inputs
        seq_len = ops.shape(tokens)[1]
        # positions are a slice, not a lookup (as in the original BERT): a dense gradient
        x = self.token_embedding(tokens) + self.segment_embedding(segments) + self.position_embedding[:seq_len]
        x = self.dropout(self.embedding_norm(x), training=training)
        for block in self.blocks:
            x = block(x, training=training)
        h = self.head_norm(self.head_transform(x))
        return ops.matmul(h, ops.transpose(self.token_embedding.embeddings)) + self.output_bias


def bert(vocab: int, hidden: int, layers: int, heads: int, intermediate: int, seq_len: int):
    """A built ``BertMaskedLM`` (its variables exist on return)."""
    model = BertMaskedLM(vocab, hidden, layers, heads, intermediate, name="bert")
    tokens = ops.zeros((1, seq_len), dtype="int32")
    model((tokens, tokens))
    return model


class SampledSoftmaxLoss(keras.layers.Layer):
    """Softmax output layer trained with sampled softmax (Jean et al. 2015), as in the LM1B
    models: only the true and ``num_sampled`` log-uniformly sampled classes' rows of the
    ``(vocab, dim)`` weights are gathered each step, so their gradient is sparse.

    Called on ``(hidden, labels)``; returns the per-position loss ``(batch, seq_len)``.
    """

    def __init__(self, vocab: int, num_sampled: int, seed: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.vocab = vocab
        self.num_sampled = num_sampled
        self.seed = seed

    def build(self, input_shape):
        dim = input_shape[0][-1]
        self.kernel = self.add_weight(shape=(self.vocab, dim), name="softmax_weights",
                                      initializer=keras.initializers.RandomNormal(stddev=dim ** -0.5))
        # the bias starts at the log-frequencies of the sampler's log-uniform law (the usual
        # unigram initialization of an output bias): the model starts at the unigram model and
        # learns the context from there
        self.bias = self.add_weight(shape=(self.vocab,), name="softmax_bias", initializer=self._log_prior)

    def _log_prior(self, shape, dtype=None):
        ids = ops.arange(shape[0], dtype="float32")
        return ops.cast(ops.log(ops.log((ids + 2.0) / (ids + 1.0)) / ops.log(float(self.vocab) + 1.0)), dtype or "float32")

    # the rows a step reads depend only on the labels (input 1): a parameter-server worker can
    # compute them before the step (see autosync.runtime.rows) and pull only those rows
    row_read_inputs = (1,)

    def sample(self, labels):
        """``num_sampled`` candidate classes drawn log-uniformly, with replacement, from a
        stateless generator seeded by the labels: the same batch always gets the same negatives,
        so the candidates can be computed before the step (and in any process)."""
        import tensorflow as tf

        flat = tf.reshape(tf.cast(labels, tf.int64), (-1,))
        weights = tf.range(1, tf.size(flat, out_type=tf.int64) + 1) * 2654435761 % 2147483647
        key = tf.reduce_sum(flat * weights) % 2147483647
        u = tf.random.stateless_uniform((self.num_sampled,), seed=tf.stack([tf.constant(self.seed, tf.int64), key]),
                                        dtype=tf.float64)
        log_range = tf.math.log(tf.constant(self.vocab + 1.0, tf.float64))
        ids = tf.cast(tf.floor(tf.exp(u * log_range)), tf.int64) - 1
        return tf.clip_by_value(ids, 0, self.vocab - 1)

    def expected_count(self, ids):
        """Expected occurrences of each class in a draw of ``num_sampled`` (log-uniform)."""
        import tensorflow as tf

        ids = tf.cast(ids, tf.float64)
        p = (tf.math.log(ids + 2.0) - tf.math.log(ids + 1.0)) / tf.math.log(tf.constant(self.vocab + 1.0, tf.float64))
        return tf.cast(p * self.num_sampled, tf.float32)

    def row_reads(self, inputs):
        """The rows of ``kernel`` and ``bias`` a call on ``inputs`` (``[labels]``) reads."""
        import tensorflow as tf

        labels = tf.reshape(tf.cast(inputs[0], tf.int64), (-1,))
        ids = tf.concat([labels, self.sample(inputs[0])], axis=0)
        return {self.kernel.path: ids, self.bias.path: ids}

    def call(self, inputs):
        if keras.backend.backend() != "tensorflow":
            return self.portable_loss(*inputs)
        import tensorflow as tf

        hidden, labels = inputs
        shape = tf.shape(labels)
        flat_labels = tf.reshape(tf.cast(labels, tf.int64), (-1, 1))
        flat_hidden = tf.reshape(hidden, (-1, hidden.shape[-1]))
        sampled = self.sample(labels)
        candidates = (sampled, self.expected_count(flat_labels), self.expected_count(sampled))
        loss = tf.nn.sampled_softmax_loss(
            weights=self.kernel, biases=self.bias, labels=flat_labels, inputs=flat_hidden,
            num_sampled=self.num_sampled, num_classes=self.vocab, sampled_values=candidates,
            remove_accidental_hits=True)
        return tf.reshape(loss, shape)

    def portable_loss(self, hidden, labels, sampled=None):
        """The same loss in ``keras.ops`` alone, so that the model runs on Keras' other backends
        (where compute is measured on accelerators TensorFlow is not installed for): true and
        sampled logits corrected by their log expected counts, accidental hits removed, softmax
        cross-entropy against the true class. ``sampled`` defaults to ``num_sampled`` log-uniform
        draws from a fixed seed (the TensorFlow path's label-keyed draws need TensorFlow)."""
        if sampled is None:
            u = keras.random.uniform((self.num_sampled,), dtype="float32", seed=self.seed)
            sampled = ops.clip(ops.cast(ops.floor(ops.exp(u * math.log(self.vocab + 1.0))), "int32") - 1,
                               0, self.vocab - 1)
        sampled = ops.cast(sampled, "int32")
        flat_labels = ops.reshape(ops.cast(labels, "int32"), (-1,))
        flat_hidden = ops.reshape(hidden, (-1, ops.shape(hidden)[-1]))

        def log_expected(ids):
            ids = ops.cast(ids, "float32")
            p = ops.log((ids + 2.0) / (ids + 1.0)) / math.log(self.vocab + 1.0)
            return ops.log(p * self.num_sampled)

        true_logits = (ops.sum(flat_hidden * ops.take(self.kernel, flat_labels, axis=0), axis=-1)
                       + ops.take(self.bias, flat_labels) - log_expected(flat_labels))
        sampled_logits = (ops.matmul(flat_hidden, ops.transpose(ops.take(self.kernel, sampled, axis=0)))
                          + ops.take(self.bias, sampled) - log_expected(sampled))
        hit = ops.cast(ops.equal(ops.expand_dims(flat_labels, 1), ops.expand_dims(sampled, 0)), "int32")
        # as TensorFlow's compute_accidental_hits: a class drawn several times is removed once,
        # at its last draw
        hits_from_here = ops.flip(ops.cumsum(ops.flip(hit, axis=1), axis=1), axis=1)
        hit = ops.logical_and(ops.equal(hit, 1), ops.equal(hits_from_here, 1))
        sampled_logits = ops.where(hit, sampled_logits - 3.4e38, sampled_logits)
        logits = ops.concatenate([ops.expand_dims(true_logits, 1), sampled_logits], axis=1)
        loss = ops.logsumexp(logits, axis=1) - true_logits
        return ops.reshape(loss, ops.shape(labels))

    def compute_output_shape(self, input_shape):
        return tuple(input_shape[1])


def mean_of_outputs():
    """Loss for models that output their own per-example loss (the sampled-softmax LM): the
    model's outputs themselves, which Keras (and ``ModelDef.loss``) average over the batch; the
    targets are ignored. Returning the mean here instead would escape Keras' division by the
    number of replicas under a ``tf.distribute`` strategy (the replicas' gradients would be
    summed, not averaged)."""
    return _outputs_as_loss


def _outputs_as_loss(y_true, y_pred):
    del y_true
    return y_pred


def lstm_lm(vocab: int, embedding_dim: int, hidden: int, seq_len: int, num_sampled: int):
    """LSTM language model: token embedding, one LSTM layer, a projection to ``embedding_dim``
    and a sampled-softmax output. Inputs ``(tokens, next_tokens)``; output per-token loss."""
    tokens = keras.Input((seq_len,), dtype="int32", name="tokens")
    next_tokens = keras.Input((seq_len,), dtype="int32", name="next_tokens")
    x = keras.layers.Embedding(vocab, embedding_dim, name="embedding")(tokens)
    x = keras.layers.LSTM(hidden, return_sequences=True, name="lstm")(x)
    x = keras.layers.Dense(embedding_dim, name="projection")(x)
    loss = SampledSoftmaxLoss(vocab, num_sampled, name="softmax")([x, next_tokens])
    return keras.Model([tokens, next_tokens], loss, name="lm1b_lstm")
