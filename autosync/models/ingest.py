"""Keras model -> ModelSpec: trainable variables, and which of them get sparse gradients.

Sparsity is measured, not guessed: one real gradient of the loss on a sample batch is computed
with ``tf.GradientTape`` and a variable is sparse exactly when its gradient is a
``tf.IndexedSlices``. On the TensorFlow backend ``keras.layers.Embedding`` (and any ``tf.gather``
of a variable) yields ``IndexedSlices``; a variable that is also used densely (e.g. an embedding
tied to the output projection) gets the sum of both uses, which TensorFlow densifies, so it is
reported dense. ``rows_per_step`` is the number of distinct rows in the gradient's indices for
that batch.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools

import warnings
from typing import Any, Callable, Sequence

import numpy as np

from autosync.exception_text import python_branch, what_failed
from autosync.models.fit_batch import batch_loss, check_model, split_batch
from strategy_space import ModelSpec, VariableSpec
from strategy_space.errors import ConfigError


def variable_names(variables: Sequence[Any]) -> list[str]:
    """Unique names for Keras variables: their ``path`` (``dense/kernel``), with ``_1``, ``_2``
    ... appended to repeats (possible in hand-named subclassed models). The runtime must use the
    same function so names in strategies match its variables."""
    names: list[str] = []
    seen: set[str] = set()
    for v in variables:
        base = getattr(v, "path", None) or v.name
        name, k = base, 0
        while name in seen:
            k += 1
            name = f"{base}_{k}"
        seen.add(name)
        names.append(name)
    return names


def first_batch(model_def, worker_index: int = 0, num_workers: int = 1) -> tuple[Any, Any]:
    """The first (inputs, targets) batch of ``model_def.dataset_fn(worker_index, num_workers)``.

    Raises:
        ConfigError: the dataset is empty or does not yield pairs (or triples with weights).
    """
    where = f"ModelDef {model_def.name}"
    for batch in model_def.dataset_fn(worker_index, num_workers):
        inputs, targets = split_batch(batch, where)
        number = _python_number_at(inputs, "inputs") or _python_number_at(targets, "targets")
        if number is not None:
            raise ConfigError(f"{where}: the first batch of dataset_fn({worker_index}, {num_workers}) holds a Python "
                              f"value at {number} where an array belongs (a list of numbers, strings or lists is read "
                              f"as that many separate inputs, as Keras reads a list); give each input and target as a "
                              f"numpy array (np.asarray(...)) or a tensor")
        examples = _leading_dim(inputs)
        if examples is not None and examples != model_def.batch_size:
            raise ConfigError(f"{where}: the first batch of dataset_fn({worker_index}, {num_workers}) holds {examples} "
                              f"examples, but batch_size is {model_def.batch_size}; batch_size is the number of "
                              f"examples in each batch one worker draws (what samples/s, the cost model and the "
                              f"global batch count): set batch_size={examples} or batch the data by "
                              f"{model_def.batch_size}")
        return inputs, targets
    raise ConfigError(f"{where}: dataset_fn({worker_index}, {num_workers}) yielded no batches; it must yield "
                      f"(inputs, targets) batches of batch_size examples")


def _python_number_at(value: Any, path: str, depth: int = 0) -> str | None:
    """Where a batch's structure (lists, tuples and dicts of arrays) holds a Python number or
    string instead of an array, e.g. ``inputs['a'][0][0]``; None where it holds none (its first 64
    entries of each list, to a depth of 8: what a structure of inputs holds)."""
    if isinstance(value, (bool, int, float, complex, str, bytes)) and not isinstance(value, np.generic):
        return path
    if depth >= 8 or not isinstance(value, (dict, list, tuple)):
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value)
    for key, item in itertools.islice(items, 64):
        found = _python_number_at(item, f"{path}[{key!r}]", depth + 1)
        if found is not None:
            return found
    return None


def _leading_dim(inputs: Any) -> int | None:
    """The leading dimension of the first array in a batch's inputs (an array, or a list, tuple
    or dict of them), or None where it has none or it is not known."""
    while isinstance(inputs, (list, tuple, dict)):
        if not inputs:
            return None
        inputs = next(iter(inputs.values())) if isinstance(inputs, dict) else inputs[0]
    shape = getattr(inputs, "shape", None)
    try:
        return int(shape[0]) if shape is not None and len(shape) and shape[0] is not None else None
    except (TypeError, ValueError):
        return None


def compute_gradients(model, loss: Callable, inputs: Any, targets: Any):
    """One eager forward and backward pass. Returns (trainable variables, gradients); the model is
    built by the call if it was not, and variables created inside the tape are watched."""
    import tensorflow as tf

    with tf.GradientTape() as tape:
        value = batch_loss(model, loss, inputs, targets)
    variables = list(model.trainable_variables)
    if not variables:
        raise ConfigError(f"model {model.name} has no trainable variables; nothing to synchronize")
    return variables, tape.gradient(value, variables)


def model_spec_from_model(model, loss: Callable, inputs: Any, targets: Any, *, name: str,
                          batch_size: int) -> ModelSpec:
    """The ModelSpec of a Keras model, from one real gradient on ``(inputs, targets)``.

    Args:
        model: a ``keras.Model`` (built or not).
        loss: ``(y_true, y_pred) -> scalar``.
        inputs, targets: one batch of ``batch_size`` examples.
        name: ModelSpec name.
        batch_size: the batch size ``rows_per_step`` refers to.

    Returns:
        ModelSpec with variables in ``model.trainable_variables`` order and no profile.

    Raises:
        ConfigError: the model has no trainable variables.
    """
    import tensorflow as tf

    variables, grads = compute_gradients(model, loss, inputs, targets)
    specs = []
    unused = []
    for var_name, var, grad in zip(variable_names(variables), variables, grads):
        sparse = isinstance(grad, tf.IndexedSlices)
        rows = int(np.unique(grad.indices.numpy()).size) if sparse else None
        if grad is None:
            unused.append(var_name)
        specs.append(VariableSpec(name=var_name, shape=tuple(int(d) for d in var.shape),
                                  dtype=_dtype_name(var.dtype), sparse=sparse, rows_per_step=rows))
    if unused:
        warnings.warn(f"model {name}: the loss does not depend on {len(unused)} trainable variable(s) "
                      f"({', '.join(unused[:5])}); they are listed as dense but will never change",
                      stacklevel=2)
    synced = [layer.name for layer in _all_layers(model) if getattr(layer, "synchronized", False) is True]
    if synced:
        warnings.warn(f"model {name}: {', '.join(synced[:5])} normalize(s) with synchronized=True, which shares "
                      f"batch statistics across the replicas of a tf.distribute strategy; AutoSync's workers each "
                      f"normalize over their own batch, as with synchronized=False", stacklevel=2)
    return ModelSpec(name=name, variables=tuple(specs), batch_size=batch_size)


def _all_layers(layer, depth: int = 0) -> list:
    """``layer``'s layers and theirs, nested models included (32 deep at most)."""
    if depth >= 32:
        return []
    found = []
    for inner in getattr(layer, "layers", None) or ():
        found += [inner, *_all_layers(inner, depth + 1)]
    return found


def model_spec_from_def(model_def) -> ModelSpec:
    """The ModelSpec of a ModelDef: build its model and take one gradient on the first batch of
    ``dataset_fn(0, 1)`` (``autosync.models.profile.profiled_model_spec`` also measures its
    compute time). A large model is read in a process of its own (``apart``).

    Returns:
        ModelSpec named after ``model_def.name``.

    Raises:
        ConfigError: the dataset is empty or malformed, or the model has no trainable variables.
    """
    from autosync.models import apart

    return apart.read(spec_here, model_def)


def spec_here(model_def) -> ModelSpec:
    """``model_spec_from_def`` read in this process."""
    return built_model_spec(model_def)[0]


@contextlib.contextmanager
def user_code(model_def, what: str, fix: str = "check that model_fn returns a keras.Model and that dataset_fn's "
                                                "(inputs, targets) batches fit its inputs and loss_fn"):
    """Report an exception raised by the user's factories (or ``sys.exit`` called in them) as bad
    input: one ConfigError naming the ModelDef, what was being done, the error's first lines and
    ``fix``. The body is stopped past the driver's limit on the user's code (``autosync.time_limit``).

    Raises:
        ConfigError: whatever the body raised (a ConfigError passes through as it is).
    """
    from autosync.time_limit import bounded

    try:
        with bounded(f"ModelDef {getattr(model_def, 'name', '?')}: {what}"):
            yield
    except ConfigError:
        raise
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - the user's code (sys.exit included): any failure is bad input
        detail = what_failed(e)
        if isinstance(e, MemoryError) or type(e).__name__ == "ResourceExhaustedError":   # (TensorFlow's OOM)
            fix = (f"it needs more memory than this process could have: is a size in it (batch_size "
                   f"{getattr(model_def, 'batch_size', '?')}, the data, a layer) larger than meant?")
        fix = python_branch(detail)[2:] or fix
        raise ConfigError(f"ModelDef {getattr(model_def, 'name', '?')}: {what} failed: {detail}; {fix}") from None


def built_model_spec(model_def) -> tuple[ModelSpec, Any, Callable, Any, Any]:
    """``model_spec_from_def`` and what it built: (spec, model, loss, inputs, targets)."""
    with user_code(model_def, "building the model and one gradient on its first batch"):
        inputs, targets = first_batch(model_def)
        model = model_def.build_model()
        if not hasattr(model, "trainable_variables") or not callable(model):
            raise ConfigError(f"ModelDef {model_def.name}: model_fn returned {type(model).__name__}, not a "
                              f"keras.Model; make model_fn build and return the model")
        check_model(model, f"ModelDef {model_def.name}")
        loss = model_def.loss()
        spec = model_spec_from_model(model, loss, inputs, targets, name=model_def.name,
                                     batch_size=model_def.batch_size)
        # the cost of a held step (``ModelSpec.global_clipnorm``) and the optimizer's state a node
        # must hold (``optimizer_slots``) are the optimizer's to say
        from autosync.runtime.loss_scale import holds_steps, wrapped_for_policy
        from autosync.runtime.optimizer_config import full_size_slots, keras_optimizer_config

        # as compile trains it (a mixed_float16 model's optimizer scales the loss: its steps are held)
        optimizer = wrapped_for_policy(model_def.optimizer_fn(), model)
        spec = dataclasses.replace(spec, global_clipnorm=holds_steps(keras_optimizer_config(optimizer)),
                                   optimizer_slots=full_size_slots(optimizer))
    return spec, model, loss, inputs, targets


def _dtype_name(dtype: Any) -> str:
    return dtype if isinstance(dtype, str) else getattr(dtype, "name", str(dtype))
