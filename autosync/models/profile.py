"""Measure a model's compute cost on this machine: forward+backward time per step and the order
in which gradients become ready in the backward pass.

Step time: the gradient computation (no optimizer update, no synchronization) runs inside one
``tf.function``; after ``warmup_steps`` untimed calls (tracing, allocator warm-up) the median of
``timed_steps`` wall-clock times is reported. TensorFlow's thread pools are left as configured
by the caller.

Gradient-ready order: the order in which TensorFlow's tape emits the gradients. The tape builds
the backward graph one forward op at a time, processing an op only once the gradients of all its
consumers exist, so the creation position of the op that finally produces a variable's gradient
is when that gradient becomes available in the tape's (sequential, reverse-topological)
schedule. Gradients are ordered by that position in the traced ``tf.function`` graph. For a chain
of layers this is the reverse of the forward order; a variable used in several places (a tied
embedding) is ready only after every use has been back-propagated and its parts summed. Creation
order rather than a count of ancestor ops is used because one op can hide a whole loop (an LSTM's
backward pass is a single ``While`` op).
"""
from __future__ import annotations

import os
import re
import statistics
import time
from dataclasses import replace
from typing import Any, Callable

from strategy_space import ComputeProfile, ModelSpec

from . import keras_names
from .fit_batch import batch_loss
from .ingest import built_model_spec, user_code, variable_names


def device_description() -> str:
    """What compute is measured on, e.g. ``cpu:Intel Xeon Processor @ 2.50GHz x2`` or
    ``gpu:NVIDIA H100 80GB HBM3 x1``."""
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        details = tf.config.experimental.get_device_details(gpus[0])
        return f"gpu:{details.get('device_name', 'GPU')} x{len(gpus)}"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return f"cpu:{_cpu_model()} x{cores}"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1]
                    return re.sub(r"\s+", " ", re.sub(r"\((R|TM)\)", "", name)).strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "unknown"


def _gradient_step(model, loss: Callable, variables: list):
    import tensorflow as tf

    @tf.function(autograph=False)
    def step(inputs, targets):
        with tf.GradientTape() as tape:
            value = loss(targets, model(inputs, training=True))
        return tape.gradient(value, variables)

    return step


def train_step(model, loss: Callable, optimizer) -> Callable:
    """A compiled training step of one process, ``step(x, y) -> loss``: the gradient of ``loss``
    over the model's trainable variables, applied by ``optimizer`` (what the runtime's results are
    checked against, and what a single-process baseline runs)."""
    import tensorflow as tf

    variables = list(model.trainable_variables)

    @tf.function(autograph=False)
    def step(inputs, targets):
        with tf.GradientTape() as tape:
            value = batch_loss(model, loss, inputs, targets)
        optimizer.apply_gradients(zip(tape.gradient(value, variables), variables))
        return value

    return step


def ready_order_from_graph(graph, gradients: list, names: list[str]) -> list[str]:
    """Variable names in the order the tape created the ops producing their gradients.

    Args:
        graph: the traced ``FuncGraph`` of the gradient step.
        gradients: its structured outputs, one per variable (Tensor, IndexedSlices or None).
        names: variable names, aligned with ``gradients``.

    Returns:
        Every name once, earliest-ready first (ties: later-created variable first; variables
        without a gradient last).
    """
    import tensorflow as tf

    position = {op.name: i for i, op in enumerate(graph.get_operations())}
    output_ops = {t.op.name for t in graph.outputs}

    def produced_at(tensor) -> int:
        op = tensor.op
        # a function's outputs are Identity copies added after the backward pass: look through them
        while op.type == "Identity" and op.inputs and op.name in output_ops:
            op = op.inputs[0].op
        return position.get(op.name, -1)

    keys = []
    for i, grad in enumerate(gradients):
        if grad is None:
            keys.append((len(position), -i))
        else:
            keys.append((max(produced_at(t) for t in tf.nest.flatten(grad, expand_composites=True)), -i))
    return [names[i] for i in sorted(range(len(names)), key=lambda i: keys[i])]


def _traced_gradient_step(model, loss: Callable, inputs: Any, targets: Any):
    import tensorflow as tf

    variables = list(model.trainable_variables)
    inputs = tf.nest.map_structure(tf.convert_to_tensor, inputs)
    targets = tf.nest.map_structure(tf.convert_to_tensor, targets)
    step = _gradient_step(model, loss, variables)
    concrete = step.get_concrete_function(inputs, targets)
    order = ready_order_from_graph(concrete.graph, list(concrete.structured_outputs), variable_names(variables))
    return step, inputs, targets, order


def gradient_ready_order(model, loss: Callable, inputs: Any, targets: Any) -> list[str]:
    """The gradient-ready order of ``model``'s variables on one batch (see the module docstring),
    from the traced gradient step alone: nothing is executed, so it is cheap for models far too
    large to train here. The order is the graph's, not the device's: it holds wherever the step
    runs."""
    return _traced_gradient_step(model, loss, inputs, targets)[3]


def _check_steps(warmup_steps: int, timed_steps: int) -> None:
    if warmup_steps < 1 or timed_steps < 1:
        raise ValueError(f"warmup_steps and timed_steps must be >= 1, got {warmup_steps} and {timed_steps}")


def profiled_model_spec(model_def, *, warmup_steps: int = 3, timed_steps: int = 10, apart: bool = True,
                        digest_workers: int | None = None) -> ModelSpec:
    """``ingest.model_spec_from_def`` with the measured compute profile (step time, device and
    gradient-ready order; see ``profile_model``) of the model it built. Under the optimizer's
    ``gradient_accumulation_steps`` n a worker's step computes n batches before it synchronizes
    once: the step time is n batches'. A large model is read and timed in a process of its own
    (``models.apart``) unless ``apart`` is False (a process that exits afterwards anyway); with
    ``digest_workers`` its probe key for that many workers is taken there too
    (``training_key.read_with_digest``: ``tune``'s probes ask for it next).

    Raises:
        ConfigError: as ``model_spec_from_def``.
        ValueError: warmup_steps < 1 or timed_steps < 1.
    """
    _check_steps(warmup_steps, timed_steps)
    from . import apart as child

    if apart and digest_workers:
        from .training_key import read_with_digest

        return read_with_digest(_profiled_here, model_def, (warmup_steps, timed_steps), digest_workers)
    if apart:
        return child.read(_profiled_here, model_def, warmup_steps, timed_steps)
    return _profiled_here(model_def, warmup_steps, timed_steps)


def _profiled_here(model_def, warmup_steps: int, timed_steps: int) -> ModelSpec:
    return profiled_built(model_def, warmup_steps, timed_steps)[0]


def profiled_built(model_def, warmup_steps: int = 3, timed_steps: int = 10) -> tuple:
    """``profiled_model_spec`` read in this process, and the Keras model it built: (spec, model)."""
    spec, model, loss, inputs, targets = built_model_spec(model_def)
    # the step traced as keras.Model.fit traces it: what fails here (a layer name TensorFlow refuses
    # as a scope name, a Python branch on a tensor) fails the user's own fit too, and every worker
    with user_code(model_def, "tracing and timing the model's training step in a tf.function",
                   fix="the model must train under keras.Model.fit (which traces its step in a tf.function "
                       "too); fix model_fn or loss_fn"):
        measured = profile_model(model, loss, inputs, targets, warmup_steps=warmup_steps, timed_steps=timed_steps)
        n = int(getattr(model_def.optimizer_fn(), "gradient_accumulation_steps", None) or 1)
    return replace(spec, profile=replace(measured, step_time_s=n * measured.step_time_s)), model


def profile_model(model, loss: Callable, inputs: Any, targets: Any, *, warmup_steps: int = 3,
                  timed_steps: int = 10) -> ComputeProfile:
    """Measure one worker's forward+backward step on one batch.

    Args:
        model: a built ``keras.Model`` (its trainable variables exist).
        loss: ``(y_true, y_pred) -> scalar``.
        inputs, targets: one batch of the model's per-worker batch size.
        warmup_steps: untimed calls first (>= 1; the first one traces).
        timed_steps: timed calls; their median is reported.

    Returns:
        ComputeProfile with the median step time, this machine's device string and the
        gradient-ready order.

    Raises:
        ValueError: warmup_steps < 1 or timed_steps < 1.
    """
    _check_steps(warmup_steps, timed_steps)
    with keras_names.scopes_closed_on_failure():
        step, inputs, targets, order = _traced_gradient_step(model, loss, inputs, targets)
    for _ in range(warmup_steps):
        step(inputs, targets)
    times = []
    for _ in range(timed_steps):
        start = time.perf_counter()
        step(inputs, targets)
        times.append(time.perf_counter() - start)
    return ComputeProfile(step_time_s=statistics.median(times), device=device_description(), ready_order=tuple(order))
