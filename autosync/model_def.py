"""ModelDef: everything the runtime needs to train a user's model, as plain factories.

A training script hands AutoSync a function that returns a ``ModelDef``; the zoo builds them too.
Factories (not objects) are stored because every worker process builds its own model, optimizer
and data shard; they must therefore be picklable (module-level functions or ``functools.partial``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

Batch = tuple  # (inputs, targets); inputs may be a tensor/array or a tuple/dict of them


@dataclass(frozen=True)
class ModelDef:
    """A trainable model, described by factories.

    Attributes:
        name: a short name used in reports (``ncf``, ``my_model``).
        model_fn: ``() -> keras.Model``; builds the model. Weights are created with the seed
            that the runtime sets before calling it, so every worker starts identical.
        loss_fn: ``() -> loss``: a ``keras.losses.Loss`` instance, a Keras loss name (``"mse"``)
            or a function ``(y_true, y_pred)`` returning per-example values or their mean, or a
            list or dict of them (one per model output), as ``keras.Model.compile`` takes it. The
            runtime uses ``ModelDef.loss()``, which reduces it as ``fit`` does.
        optimizer_fn: ``() -> keras.optimizers.Optimizer``.
        dataset_fn: ``(worker_index, num_workers) -> iterable of (inputs, targets)`` batches of
            ``batch_size`` examples for that worker (its shard of the data), or of
            ``(inputs, targets, sample_weight)`` as ``keras.Model.fit`` takes them. It may be
            infinite; the runtime cycles a finite one.
        batch_size: per-worker batch size.
        seed: initial-weight seed.
        metadata: free-form facts shown by ``autosync inspect`` (e.g. the zoo variant).
        keras_settings: the Keras settings every process builds the model under (``floatx``,
            ``epsilon``, ``image_data_format``, ``dtype_policy``: ``autosync.models.keras_settings``).
            None: those of the process that sends the ModelDef to Ray's processes, taken when it
            is pickled, so that a script's ``keras.mixed_precision.set_global_policy(...)`` holds
            on every worker as in the script's own process.
        name_counts: the Keras name counters ``model_fn`` starts from (``{"dense": 1}``: the next
            unnamed Dense is ``dense_1``), so that every process names the model's layers, and so
            its variables, alike whatever it built before (``autosync.models.keras_names``). A
            script's loader sets it to what the script's top level named; None: from nothing.
    """

    name: str
    model_fn: Callable[[], Any]
    loss_fn: Callable[[], Callable]
    optimizer_fn: Callable[[], Any]
    dataset_fn: Callable[[int, int], Iterable[Batch]]
    batch_size: int
    seed: int = 0
    metadata: dict = field(default_factory=dict, compare=False)
    keras_settings: dict | None = field(default=None, compare=False, repr=False)
    name_counts: dict | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        from strategy_space.errors import ConfigError

        problems = []
        if not (isinstance(self.name, str) and self.name.strip() and self.name.isprintable() and len(self.name) <= 200):
            problems.append(f"ModelDef name must be a non-empty printable string of at most 200 characters (reports "
                            f"and trial records show it), got {self.name!r:.80}")
        for attr in ("model_fn", "loss_fn", "optimizer_fn", "dataset_fn"):
            if not callable(getattr(self, attr)):
                problems.append(f"ModelDef {self.name}: {attr} must be callable, got {type(getattr(self, attr)).__name__}")
        if not isinstance(self.batch_size, int) or isinstance(self.batch_size, bool) or self.batch_size < 1:
            problems.append(f"ModelDef {self.name}: batch_size must be an integer >= 1, got {self.batch_size!r}")
        if self.keras_settings is not None and not isinstance(self.keras_settings, dict):
            problems.append(f"ModelDef {self.name}: keras_settings must be a dict (or None: the sending process's), "
                            f"got {type(self.keras_settings).__name__}")
        if self.name_counts is not None and not (
                isinstance(self.name_counts, dict)
                and all(isinstance(k, str) and isinstance(n, int) and not isinstance(n, bool) and n >= 0
                        for k, n in self.name_counts.items())):
            problems.append(f"ModelDef {self.name}: name_counts must be a dict of layer-name prefixes to counts >= 0 "
                            f"(or None), got {self.name_counts!r:.80}")
        if problems:
            raise ConfigError(problems)

    def __getstate__(self):
        # sent to another process: with the Keras settings it is built under here
        state = dict(self.__dict__)
        if state.get("keras_settings") is None:
            from autosync.models.keras_settings import current

            state["keras_settings"] = current()
        return state

    def build_model(self):
        """``model_fn()`` under the ModelDef's Keras settings (``keras_settings``, set first when
        it carries them), its unnamed layers named from ``name_counts``, not from what this
        process built before."""
        from autosync.models.keras_names import counting_from
        from autosync.models.keras_settings import apply

        apply(self.keras_settings, f"ModelDef {self.name}")
        with counting_from(self.name_counts):
            return self.model_fn()

    def loss(self):
        """A new loss object from ``loss_fn``, reduced as ``keras.Model.compile`` reduces it: a
        ``keras.losses.Loss`` as it is, a name through ``keras.losses.get``, a function's values
        averaged over every element (a function that returns the mean already is left as it is).

        Under a ``tf.distribute`` strategy Keras divides a reduced loss by the number of
        replicas before the gradients are summed; a function returning a scalar escapes that
        and trains with the replicas' summed gradients, which is why per-example values are
        the portable form.

        Raises:
            ConfigError: ``loss_fn`` returned something that is not a loss.
        """
        from autosync.models.losses import as_keras_loss

        return as_keras_loss(self.loss_fn(), f"ModelDef {self.name}: loss_fn()")

    def batches(self, worker_index: int, num_workers: int) -> Iterator[Batch]:
        """Endless iterator over this worker's (inputs, targets) batches (a finite dataset is
        cycled; sample weights ride in the targets, see ``fit_batch.split_batch``)."""
        from autosync.models.fit_batch import split_batch

        while True:
            empty = True
            for batch in self.dataset_fn(worker_index, num_workers):
                empty = False
                yield split_batch(batch, f"ModelDef {self.name}")
            if empty:
                from strategy_space.errors import ConfigError

                raise ConfigError(f"ModelDef {self.name}: dataset_fn({worker_index}, {num_workers}) yielded no batches")
