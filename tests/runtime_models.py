"""Small trainable ModelDefs for the runtime tests: a real sparse embedding plus dense layers.

Ray workers unpickle these factories; tests register this module to be pickled by value
(``ray.cloudpickle.register_pickle_by_value``) because the tests folder is not importable there.
"""
from __future__ import annotations

import functools
import os
import time

import numpy as np

from autosync.model_def import ModelDef

VOCAB, DIM, IDS = 40, 4, 3


def build_model(vocab: int = VOCAB):
    import keras

    ids = keras.Input((IDS,), dtype="int32", name="ids")
    emb = keras.layers.Embedding(vocab, DIM, name="emb")(ids)
    x = keras.layers.Flatten()(emb)
    x = keras.layers.Dense(6, activation="tanh", name="hidden")(x)
    out = keras.layers.Dense(1, name="out")(x)
    return keras.Model(ids, out)


CUT = 0.05   # ``build_cut_backward_model``'s bound on the gradient reaching its hidden layer


def build_cut_backward_model():
    """Two dense layers whose backward pass cuts the gradient reaching the hidden layer's output to
    [-CUT, CUT], as a float16 backward pass loses what is out of its range: under a loss scale,
    which gradients are cut depends on the scale (a step that does not scale the loss differs).
    Dense gradients only: Keras' own ``loss_scale_factor`` divides a gradient with ``/``, which a
    ``tf.IndexedSlices`` does not take (the runtime divides its values)."""
    import keras
    import tensorflow as tf

    class CutBackward(keras.layers.Layer):
        def call(self, x):
            @tf.custom_gradient
            def cut(v):
                return tf.identity(v), lambda dy: tf.clip_by_value(dy, -CUT, CUT)

            return cut(x)

    ids = keras.Input((IDS,), dtype="int32", name="ids")   # read as numbers: dense gradients only
    x = keras.layers.Dense(6, activation="tanh", name="hidden")(keras.ops.cast(ids, "float32") / VOCAB)
    return keras.Model(ids, keras.layers.Dense(1, name="out")(CutBackward(name="cut")(x)))


def mse():
    import keras

    return keras.losses.MeanSquaredError()


def make_optimizer(kind: str, **kw):
    import keras

    exclude = kw.pop("exclude_from_weight_decay", None)   # var_names, as Keras' method takes them
    scaling = kw.pop("loss_scale", None)   # dynamic loss scaling: a LossScaleOptimizer's options
    if scaling is not None:
        return keras.optimizers.LossScaleOptimizer(make_optimizer(kind, **kw), **scaling)
    if kind == "subclass":
        return __getattr__("HalfStepSGD")(**kw)
    if isinstance(kw.get("learning_rate"), dict):  # a schedule, as {"cosine": kwargs}
        (name, args), = kw.pop("learning_rate").items()
        kw["learning_rate"] = {"cosine": keras.optimizers.schedules.CosineDecay}[name](**args)
    optimizer = getattr(keras.optimizers, {"sgd": "SGD", "adam": "Adam"}.get(kind, kind))(**kw)
    if exclude:
        optimizer.exclude_from_weight_decay(var_names=exclude)
    return optimizer


def _half_step_sgd():
    import keras

    class HalfStepSGD(keras.optimizers.SGD):
        """A user's own update rule: SGD at half the learning rate."""

        def update_step(self, gradient, variable, learning_rate):
            super().update_step(gradient, variable, learning_rate * 0.5)

    HalfStepSGD.__module__, HalfStepSGD.__qualname__ = __name__, "HalfStepSGD"
    return HalfStepSGD


def __getattr__(name):
    # the subclass is made on first use (keras imported then), and found by name where updates run
    if name == "HalfStepSGD":
        globals()[name] = _half_step_sgd()
        return globals()[name]
    raise AttributeError(name)


def make_batches(worker: int, num_workers: int, batch: int = 8, count: int = 4, vocab: int = VOCAB):
    """``count`` fixed batches for this worker; the target is a smooth function of the ids."""
    rng = np.random.RandomState(1000 + 17 * worker + num_workers)
    out = []
    for _ in range(count):
        x = rng.randint(0, vocab, size=(batch, IDS)).astype("int32")
        y = (np.sin(x.sum(axis=1, keepdims=True) / 7.0)).astype("float32")
        out.append((x, y))
    return out


def nan_batches(worker: int, num_workers: int, at: int = 1):
    """``make_batches`` with a nan target in worker 1's batch ``at``: that step's global-batch
    gradient is not finite (a loss-scaled step is skipped; anything else diverges)."""
    out = make_batches(worker, num_workers)
    if worker == 1:
        out[at][1][0] = np.nan
    return out


def skipping_batches(worker: int, num_workers: int, skip: int = 1):
    """``make_batches`` without batch ``skip``: what a run whose step ``skip`` was skipped trained on."""
    return [b for i, b in enumerate(make_batches(worker, num_workers)) if i != skip]


def weighted_batches(worker: int, num_workers: int, count: int = 4):
    """``make_batches`` with a weight per example, as ``keras.Model.fit`` takes them:
    ``(inputs, targets, sample_weight)``."""
    rng = np.random.RandomState(500 + worker)
    return [(x, y, rng.uniform(0.0, 2.0, size=(len(x),)).astype("float32"))
            for x, y in make_batches(worker, num_workers, count=count)]


def build_two_output_model():
    """``build_model`` with two heads, ``score`` and ``pair`` (a dict of outputs)."""
    import keras

    ids = keras.Input((IDS,), dtype="int32", name="ids")
    x = keras.layers.Flatten()(keras.layers.Embedding(VOCAB, DIM, name="emb")(ids))
    x = keras.layers.Dense(6, activation="tanh", name="hidden")(x)
    return keras.Model(ids, {"score": keras.layers.Dense(1, name="score")(x),
                             "pair": keras.layers.Dense(2, name="pair")(x)})


def build_regularized_model():
    """``build_model`` with an L2 weight regularizer on the hidden kernel and an L1 activity
    regularizer on its output (the losses ``fit`` adds to the compiled loss)."""
    import keras

    ids = keras.Input((IDS,), dtype="int32", name="ids")
    x = keras.layers.Flatten()(keras.layers.Embedding(VOCAB, DIM, name="emb")(ids))
    x = keras.layers.Dense(6, activation="tanh", name="hidden", kernel_regularizer=keras.regularizers.L2(0.05),
                           activity_regularizer=keras.regularizers.L1(0.01))(x)
    return keras.Model(ids, keras.layers.Dense(1, name="out")(x))


def two_output_losses():
    import keras

    return {"score": "mse", "pair": keras.losses.Huber()}


def one_head_loss():
    """A loss for the ``score`` head alone: ``pair`` is not trained through, as ``compile`` leaves it."""
    return {"score": "mse"}


def two_output_batches(worker: int, num_workers: int):
    """``weighted_batches`` with a target per head."""
    return [(x, {"score": y, "pair": np.concatenate([y, -y], axis=1)}, w)
            for x, y, w in weighted_batches(worker, num_workers)]


def faulty_batches(worker: int, num_workers: int, flag: str, at: int = 3):
    """Like ``make_batches``, but worker 1 misbehaves at batch ``at`` while file ``flag`` exists:
    it raises if the file says ``raise``, hangs if it says ``hang``, yields ids -1 and ``VOCAB``
    (outside the embedding) if it says ``badid`` and a nan target if it says ``nan``."""
    for i, b in enumerate(make_batches(worker, num_workers, count=1000)):
        if worker == 1 and i == at and os.path.exists(flag):
            with open(flag) as f:
                mode = f.read().strip()
            if mode == "raise":
                raise ValueError("injected failure in worker 1")
            if mode == "badid":
                b[0][0, :2] = -1, VOCAB
            elif mode == "nan":
                b[1][0] = np.nan
            if mode in ("badid", "nan"):
                yield b
                continue
            time.sleep(3600)
        yield b


def build_unseeded_model():
    """``build_model`` with one layer initialized from the process id: every worker (a process of
    its own) builds different initial weights, whatever the seed."""
    model = build_model()
    out = model.get_layer("out")
    out.kernel.assign(np.full(out.kernel.shape, (os.getpid() % 997) / 997.0, "float32"))
    return model


def build_copy_saving_model():
    """``build_model`` whose hidden layer saves copies of its weights, not the variables (as a
    layer that saves a computed value does): the weights file's layout is Keras' alone to know."""
    import keras

    class CopySaving(keras.layers.Dense):
        def save_own_variables(self, store):
            for i, v in enumerate(self.trainable_variables):
                store[str(i)] = np.array(v.numpy())

    ids = keras.Input((IDS,), dtype="int32", name="ids")
    x = keras.layers.Flatten()(keras.layers.Embedding(VOCAB, DIM, name="emb")(ids))
    x = CopySaving(6, activation="tanh", name="hidden")(x)
    return keras.Model(ids, keras.layers.Dense(1, name="out")(x))


def build_dropout_model():
    """Dense features through Dropout and GaussianNoise (two seed generators) into a linear head."""
    import keras

    x = keras.Input((FEATURES,), name="x")
    h = keras.layers.Dense(8, activation="tanh", name="hidden")(keras.layers.Dropout(0.5, name="drop")(x))
    h = keras.layers.GaussianNoise(0.3, name="noise")(h)
    return keras.Model(x, keras.layers.Dense(1, name="out")(h))


FEATURES = 6


def build_lazy_model():
    """A subclassed model whose layer makes its weights and their initializer only when first
    called (its initializer's seed drawn then, from Python's global generator)."""
    import keras

    class Lazy(keras.layers.Layer):
        def build(self, shape):
            self.w = self.add_weight(shape=(shape[-1], 1), initializer=keras.initializers.RandomNormal())

        def call(self, x):
            return keras.ops.matmul(x, self.w)

    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.lazy = Lazy()

        def call(self, x, training=False):
            return self.lazy(x)

    return Net()


def same_batches(worker: int, num_workers: int, count: int = 8):
    """The same ``count`` batches for every worker: what tells the workers' updates apart is then
    their random layers alone."""
    rng = np.random.RandomState(77)
    x = rng.normal(size=(count, 8, FEATURES)).astype("float32")
    return [(x[i], np.tanh(x[i].sum(axis=1, keepdims=True)).astype("float32")) for i in range(count)]


def global_rng_batches(worker: int, num_workers: int):
    """Batches sampled from numpy's process-wide generator, unseeded here (as quick scripts do):
    what each worker draws depends on the seed the runtime set where it draws."""
    while True:
        x = np.random.normal(size=(8, FEATURES)).astype("float32")
        yield x, np.tanh(x.sum(axis=1, keepdims=True)).astype("float32")


def dropout_model_def(optimizer: str = "sgd", dataset=same_batches, **opt_kw) -> ModelDef:
    return ModelDef(name="tiny_dropout", model_fn=build_dropout_model, loss_fn=mse,
                    optimizer_fn=functools.partial(make_optimizer, optimizer, **opt_kw), dataset_fn=dataset,
                    batch_size=8, seed=11)


def model_def(optimizer: str = "sgd", batch: int = 8, dataset=None, vocab: int = VOCAB, **opt_kw) -> ModelDef:
    return ModelDef(
        name="tiny_emb" if vocab == VOCAB else f"emb_{vocab}", model_fn=functools.partial(build_model, vocab),
        loss_fn=mse, optimizer_fn=functools.partial(make_optimizer, optimizer, **opt_kw),
        dataset_fn=dataset or functools.partial(make_batches, batch=batch, vocab=vocab), batch_size=batch, seed=7)


def reference_weights(md: ModelDef, num_workers: int, steps: int, then: tuple = ()) -> list:
    """Single-process training on the global batch (all workers' batches of each step); ``then``:
    ``(workers, steps)`` phases after it, each on the global batch of that many workers, every one
    going on in its own part of the data past the batches the last phase's workers drew together
    (a restore onto another number of workers: ``session_state.resized_position``)."""
    import keras

    keras.utils.set_random_seed(md.seed)
    model = md.model_fn()
    loss_fn = md.loss()
    opt = md.optimizer_fn()
    position, before = 0, num_workers
    for workers, count in [(num_workers, steps), *then]:
        position = position * before // workers
        streams = [md.batches(i, workers) for i in range(workers)]
        for s in streams:
            for _ in range(position):
                next(s)
        _train_on(model, loss_fn, opt, streams, count)
        position, before = position + count, workers
    if steps + sum(c for _, c in then) and opt.use_ema:   # as Keras' fit ends
        opt.finalize_variable_values(model.trainable_variables)
    return model.get_weights()


def _train_on(model, loss_fn, opt, streams: list, steps: int) -> None:
    import tensorflow as tf

    for _ in range(steps):
        parts = [next(s) for s in streams]
        if isinstance(parts[0][0], list):  # several model inputs: join each across workers
            x = [np.concatenate([p[0][k] for p in parts]) for k in range(len(parts[0][0]))]
        else:
            x = np.concatenate([p[0] for p in parts])
        y = np.concatenate([p[1] for p in parts])
        with tf.GradientTape() as tape:
            loss = opt.scale_loss(loss_fn(y, model(x, training=True)))   # a LossScaleOptimizer's scale, or 1
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))


# ---- a model with several embeddings: one shared by two inputs, one tied to the output layer ----
SHARED_VOCAB, OTHER_VOCAB, TIED_VOCAB = 300, 50, 12


def build_multi_embedding_model():
    """Inputs ``a`` (3 ids) and ``b`` (2 ids) look up one shared table, ``c`` (2 ids) another;
    ``d`` (2 ids) looks up a table that is also the output projection (tied: dense gradient)."""
    import keras
    from keras import ops

    class TiedOutput(keras.layers.Layer):
        def __init__(self, embedding, **kwargs):
            super().__init__(**kwargs)
            self.embedding = embedding

        def call(self, x):
            return ops.matmul(x, ops.transpose(self.embedding.embeddings))

    a = keras.Input((3,), dtype="int32", name="a")
    b = keras.Input((2,), dtype="int32", name="b")
    c = keras.Input((2,), dtype="int32", name="c")
    d = keras.Input((2,), dtype="int32", name="d")
    shared = keras.layers.Embedding(SHARED_VOCAB, DIM, name="shared")
    other = keras.layers.Embedding(OTHER_VOCAB, DIM, name="other")
    tied = keras.layers.Embedding(TIED_VOCAB, DIM, name="tied")
    x = keras.layers.Concatenate(axis=1)([shared(a), shared(b), other(c), tied(d)])
    x = keras.layers.Flatten()(x)
    h = keras.layers.Dense(DIM, activation="tanh", name="hidden")(x)
    return keras.Model([a, b, c, d], TiedOutput(tied, name="tied_out")(h))


def multi_batches(worker: int, num_workers: int, batch: int = 8, count: int = 6, nan_at: int | None = None):
    """Fixed batches; ids drawn from a skewed distribution so rows repeat within a batch (worker 1's
    batch ``nan_at`` with a nan target: that step's gradient is not finite)."""
    rng = np.random.RandomState(2000 + 31 * worker + num_workers)
    out = []
    for _ in range(count):
        a = (rng.zipf(1.3, size=(batch, 3)) % SHARED_VOCAB).astype("int32")
        b = rng.randint(0, SHARED_VOCAB, size=(batch, 2)).astype("int32")
        c = rng.randint(0, OTHER_VOCAB, size=(batch, 2)).astype("int32")
        d = rng.randint(0, TIED_VOCAB, size=(batch, 2)).astype("int32")
        y = np.sin((a.sum(1, keepdims=True) + c.sum(1, keepdims=True) + np.arange(TIED_VOCAB)) / 9.0)
        out.append(([a, b, c, d], y.astype("float32")))
    if worker == 1 and nan_at is not None:
        out[nan_at][1][0] = np.nan
    return out


def make_any_optimizer(kind: str, **kw):
    import keras

    if kw.get("loss_scale") is not None:
        return keras.optimizers.LossScaleOptimizer(make_any_optimizer(kind, **{k: v for k, v in kw.items()
                                                                               if k != "loss_scale"}), **kw["loss_scale"])
    if kind in ("sgd", "adam", "adamw", "adagrad"):
        return {"sgd": keras.optimizers.SGD, "adam": keras.optimizers.Adam, "adamw": keras.optimizers.AdamW,
                "adagrad": keras.optimizers.Adagrad}[kind](**kw)
    return make_optimizer(kind, **kw)   # any keras.optimizers name, "subclass", a {"cosine": ...} schedule


def multi_model_def(optimizer: str = "sgd", batch: int = 8, nan_at: int | None = None, **opt_kw) -> ModelDef:
    return ModelDef(
        name="multi_emb", model_fn=build_multi_embedding_model, loss_fn=mse,
        optimizer_fn=functools.partial(make_any_optimizer, optimizer, **opt_kw),
        dataset_fn=functools.partial(multi_batches, batch=batch, nan_at=nan_at), batch_size=batch, seed=11)


def build_conv_model():
    """A convolution with few weights but a long backward pass (its filter gradient is computed
    last), under a dense output layer: the output layer's gradients are ready long before."""
    import keras

    img = keras.Input((32, 32, 8), name="img")
    x = keras.layers.Conv2D(32, 3, padding="same", activation="relu", name="conv")(img)
    x = keras.layers.Flatten()(x)
    out = keras.layers.Dense(1, name="out")(x)
    return keras.Model(img, out)


def conv_batches(worker: int, num_workers: int, batch: int = 16, count: int = 2):
    rng = np.random.RandomState(2000 + 17 * worker + num_workers)
    return [(rng.standard_normal((batch, 32, 32, 8)).astype("float32"),
             rng.standard_normal((batch, 1)).astype("float32")) for _ in range(count)]


def deep_model_def() -> ModelDef:
    return ModelDef(name="conv_overlap", model_fn=build_conv_model, loss_fn=mse,
                    optimizer_fn=functools.partial(make_optimizer, "sgd", learning_rate=0.01),
                    dataset_fn=conv_batches, batch_size=16, seed=3)


def build_batchnorm_model():
    """``build_model`` with a BatchNormalization layer: non-trainable state (moving mean and
    variance) that every training-mode forward pass moves."""
    import keras

    ids = keras.Input((IDS,), dtype="int32", name="ids")
    x = keras.layers.Flatten()(keras.layers.Embedding(VOCAB, DIM, name="emb")(ids))
    x = keras.layers.Dense(6, activation="tanh", name="hidden")(x)
    x = keras.layers.BatchNormalization(momentum=0.5, name="bn")(x)
    return keras.Model(ids, keras.layers.Dense(1, name="out")(x))


def batchnorm_model_def() -> ModelDef:
    return ModelDef(name="tiny_bn", model_fn=build_batchnorm_model, loss_fn=mse,
                    optimizer_fn=functools.partial(make_optimizer, "sgd", learning_rate=0.1),
                    dataset_fn=make_batches, batch_size=8, seed=7)


# ---- a linear teacher: every direction of the gradient matters (PowerSGD rank 1 loses most) ----
TEACHER_DIM = 16


def build_linear_student():
    import keras

    x = keras.Input((TEACHER_DIM,), name="x")
    return keras.Model(x, keras.layers.Dense(TEACHER_DIM, use_bias=False, name="w")(x))


def teacher_batches(worker: int, num_workers: int, batch: int = 16, seed: int = 0):
    """Endless batches: x standard normal, y = x @ W + noise for a fixed full-rank teacher W."""
    w = np.random.default_rng(seed).normal(size=(TEACHER_DIM, TEACHER_DIM)).astype("float32")
    rng = np.random.default_rng([seed, worker, num_workers])
    while True:
        x = rng.normal(size=(batch, TEACHER_DIM)).astype("float32")
        yield x, (x @ w + 0.1 * rng.normal(size=(batch, TEACHER_DIM))).astype("float32")


def teacher_model_def(batch: int = 16) -> ModelDef:
    return ModelDef(name="linear_teacher", model_fn=build_linear_student, loss_fn=mse,
                    optimizer_fn=functools.partial(make_optimizer, "sgd", learning_rate=0.25),
                    dataset_fn=functools.partial(teacher_batches, batch=batch), batch_size=batch, seed=3)


# ---- a scalar trainable variable (a learned temperature) beside an embedding and a dense layer ----
def build_tempered_model():
    import keras

    class Temperature(keras.layers.Layer):
        def build(self, shape):
            self.t = self.add_weight(shape=(), initializer="ones", name="t")

        def call(self, x):
            return x * self.t

    ids = keras.Input((IDS,), dtype="int32", name="ids")
    x = keras.layers.Flatten()(keras.layers.Embedding(VOCAB, DIM, name="emb")(ids))
    return keras.Model(ids, Temperature(name="temperature")(keras.layers.Dense(1, name="out")(x)))


def tempered_model_def(optimizer: str = "adam", **opt_kw) -> ModelDef:
    return ModelDef(name="tempered", model_fn=build_tempered_model, loss_fn=mse,
                    optimizer_fn=functools.partial(make_any_optimizer, optimizer, **opt_kw),
                    dataset_fn=functools.partial(make_batches, batch=8), batch_size=8, seed=7)


# ---- variables with constraints, which Keras' optimizer applies after each update ----
def build_constrained_model():
    import keras

    ids = keras.Input((IDS,), dtype="int32", name="ids")
    x = keras.layers.Flatten()(keras.layers.Embedding(VOCAB, DIM, name="emb")(ids))
    x = keras.layers.Dense(6, activation="tanh", name="hidden", kernel_constraint=keras.constraints.NonNeg())(x)
    return keras.Model(ids, keras.layers.Dense(1, name="out", kernel_constraint=keras.constraints.MaxNorm(0.3))(x))


def constrained_model_def(optimizer: str = "adam", **opt_kw) -> ModelDef:
    return ModelDef(name="constrained", model_fn=build_constrained_model, loss_fn=mse,
                    optimizer_fn=functools.partial(make_any_optimizer, optimizer, **opt_kw),
                    dataset_fn=functools.partial(make_batches, batch=8), batch_size=8, seed=7)
