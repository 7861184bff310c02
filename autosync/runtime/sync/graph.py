"""All-reduce inside the worker's training step (the ``graph`` backend).

For the variables it owns, ``GraphAllReduceChannel`` replaces the worker's gradient function with
one ``tf.function`` that computes the gradients, reduces them with TensorFlow's collective ops
and applies the model's own Keras optimizer to them, all in one graph:

* one collective per (fusion group, compressor), its members flattened and packed into one
  buffer pre-divided by the number of workers (the sum is the mean); groups are issued in the
  plan's gradient-ready order, and each collective depends only on its own members' gradients,
  so it starts while the rest of the backward pass still runs;
* ``fp16`` casts the buffer to half precision in the graph (2 bytes per value on the wire);
  ``fp16_ef`` first adds the residual of the previous step, kept in a variable;
* PowerSGD runs its two rounds in the graph (P matrices plus uncompressible members, then Q
  matrices), warm Q and error-feedback residuals in variables;
* sparse members (``IndexedSlices``) are all-gathered, indices and values, and applied as
  ``IndexedSlices`` (duplicate rows add up, as in one process);
* a variable split into shards is reduced shard by shard (each shard in its own group) and put
  together again before the update; the optimizers are element-wise, so this is exact.

Gradients of every other variable leave the graph as before (parameter servers, other
backends); the graph's own come back as None, so no other channel sends them. A variable can be
reduced in the graph only if every shard of it is a ``graph`` member (and, if sparse, it is not
split); ``split_groups`` sends the others (a variable shared with a parameter server or another
backend, a split sparse one) to the numpy channel, which uses the same collectives eagerly through
``autosync.runtime.sync.tf_collective.GraphBackend``.

On a GPU the gradients, the collectives (NCCL) and the optimizer stay on the device; collectives
are then chained in issue order, as NCCL needs one order on every worker.
"""
from __future__ import annotations

import numpy as np

from autosync.models.fit_batch import batch_loss
from autosync.runtime.loss_scale import scaled_gradients
from autosync.runtime.sync.allreduce import ARGroup, ARMember, split_by
from autosync.runtime.sync.base import SyncChannel
from autosync.runtime.sync.early_push import in_step
from autosync.runtime.sync.graph_powersgd import PowerSGDGraphState
from autosync.runtime.sync.graph_state import GraphCheckpoint
from autosync.runtime.sync.tf_collective import SESSION_KEYS, all_gather, all_reduce, communication_hint
from strategy_space.compressor import Compressor


def split_groups(groups: list[ARGroup], layout: list[tuple[int, int]]) -> tuple[list[ARGroup], list[ARGroup]]:
    """(groups reduced in the graph, groups left to the numpy channel), order kept, empty ones
    dropped. ``layout[v]`` is variable v's (number of shards, axis)."""
    return split_by(groups, layout, lambda m: m.backend == "graph")


class GraphAllReduceChannel(GraphCheckpoint, SyncChannel):
    """In-graph all-reduce for one worker: a SyncChannel with nothing to pull or push, plus
    ``bind``, with which the worker gets its training-step function.

    Args:
        rank, world: this worker's position and the number of workers.
        groups: fusion groups in gradient-ready order (only members ``split_groups`` kept).
        setup: the ``graph`` backend's session setup, ``{"group", "base"}``.
        seed: PowerSGD's shared seed (Q's first draw, equal on every worker).
    """

    in_graph = True
    phase = "graph"

    def __init__(self, rank: int, world: int, groups: list[ARGroup], setup: dict, seed: int = 0):
        self.rank, self.world, self.seed = rank, world, seed
        self.groups = list(groups)
        # the eager GraphBackend counts up from "base"; the graph takes the upper half
        self.key_base = int(setup["base"]) + SESSION_KEYS // 2
        self.calls = 0
        # what the collectives move stays inside TensorFlow and is not counted here: a trial's
        # bytes per step cover the parameter servers and the numpy all-reduce path only
        self.bytes_sent = self.bytes_received = 0

    # ---- SyncChannel: the variables are updated in the graph, nothing to pull or push ----------
    def pull(self, step: int, fresh: bool = False, rows: dict | None = None) -> dict:
        """The variables live in the model and are updated there: nothing to hand back."""
        return {}

    def push(self, step: int, grads: list) -> None:
        """The graph already reduced and applied this channel's gradients (they arrive as None)."""

    # held steps (``global_clipnorm`` beside other channels; ``bind(..., hold=True)``): the step
    # returned the reduced gradients and their squared norm instead of applying them
    def push_held(self, step: int, grads: list) -> tuple:
        """The step already reduced this channel's gradients and kept them (and their norm)."""
        return self._held

    def held_sq(self, held: tuple) -> float:
        return float(held[1])

    def release(self, step: int, scale, iteration: int | None = None) -> None:
        """Apply the held gradients (times ``scale``); a skipped step (``scale`` None) applies nothing,
        so Keras' ``iterations`` counts applied updates only, as ``iteration`` does."""
        import tensorflow as tf

        reduced, self._held = self._held[0], None
        if scale is not None:
            self._apply_held(reduced, tf.constant(scale, tf.float32))
        else:   # skipped: the compressors' state as before the step
            for variable, value in self._kept:
                variable.assign(value)
        self._kept = []

    def finish(self) -> None:
        """Collectives complete inside the step: nothing is outstanding."""

    def finalize(self) -> None:
        self._finalize()   # the variables reduced here are the model's own

    # ---- the step ------------------------------------------------------------------------------
    def bind(self, model, loss_fn, optimizer, hold: bool = False, scale=None, skips: bool = True, early=None):
        """The worker's step function ``(x, y) -> (loss, grads)`` for this trial: gradients of the
        variables reduced here come back as None, the others as computed. With ``hold`` the step
        does not apply the reduced gradients: it keeps them and their squared norm (Keras squares
        ``IndexedSlices`` values one by one) for ``release``, which applies them times the
        ``global_clipnorm`` scale of the whole step with an optimizer that does not clip again.
        ``scale``: what loss scaling multiplies the loss by (``loss_scale.scaled_gradients``: the
        worker's ``tf.Variable``), or None; where it ``skips`` (dynamic, not a fixed scale) and without
        ``hold`` the step applies only finite reduced gradients, as Keras': ``step_finite`` says.
        ``early``: an ``early_push.EarlyPush`` handed what it carries once it exists (back as None), or None."""
        import tensorflow as tf

        variables = list(model.trainable_variables)
        owned = sorted({m.key[0] for g in self.groups for m in g.members})
        optimizer.build([variables[v] for v in owned])
        self._optimizer_variables = list(optimizer.variables)   # what a checkpoint keeps, and its slots' names
        self._named = ({variables[v].path.replace("/", "_"): str(v) for v in owned}, optimizer.iterations)
        self._finalize = lambda: optimizer.finalize_variable_values([variables[v] for v in owned])
        memory, powersgd = self._compressor_state(variables)
        world, hint, base, groups, held_vars = self.world, communication_hint(), self.key_base, self.groups, []
        chain = hint == "nccl"
        # what the compressors keep across steps: put back when a step is skipped
        kept = self._memory = list(memory.values()) + [v for p in powersgd.values() for v in p.variables()]
        check = scale is not None and skips and not hold   # dynamic scaling in the graph alone: decided in the step
        early = None if hold or check else early   # a held or checked step hands over after it (``early_push``)

        @tf.function(autograph=False)
        def step(x, y):
            before = [v.read_value() for v in kept] if check else []
            with tf.GradientTape() as tape:
                loss = batch_loss(model, loss_fn, x, y)
            grads = scaled_gradients(tape, loss, variables, scale)
            rest, pushed = in_step(grads, early) if early is not None else (grads, None)
            shards: dict = {}
            last = None
            keys = iter(range(base, base + SESSION_KEYS // 2))
            for g in groups:
                for i, (comp, ms) in enumerate(_by_compressor(g)):
                    ms = [m for m in ms if grads[m.key[0]] is not None]
                    if not ms:
                        continue
                    deps = [last] if chain and last is not None else []
                    if comp is None:
                        for m in ms:
                            with tf.control_dependencies(deps):
                                shards[m.key] = out = _gather_sparse(grads[m.key[0]], world, keys, hint)
                            last = out.values
                        continue
                    parts = [_take(grads[m.key[0]], m) for m in ms]
                    if comp.kind == "powersgd":
                        with tf.control_dependencies(deps):
                            out = powersgd[(g.group, i)].reduce(ms, parts, world, keys, hint)
                        shards.update(out)
                        last = out[ms[-1].key]
                        continue
                    total = _reduce_elementwise(comp, parts, world, memory.get((g.group, i)), deps, next(keys), hint)
                    last = total
                    offset = 0
                    for m, p in zip(ms, parts):
                        n = _size(variables[m.key[0]], m)
                        shards[m.key] = tf.cast(tf.reshape(total[offset:offset + n], tf.shape(p)), p.dtype)
                        offset += n
            done = [v for v in owned if grads[v] is not None]
            reduced = [_assemble(variables[v], [shards[k] for k in sorted(k for k in shards if k[0] == v)], groups, v)
                       for v in done]
            others = [None if v in owned else rest[v] for v in range(len(variables))]
            if hold:
                held_vars[:] = done   # fixed for the trace: which variables get a gradient
                return loss, others, reduced, _squared_norm(reduced)
            if check:
                return loss, others, _apply_if_finite(optimizer, reduced, [variables[v] for v in done], kept, before)
            optimizer.apply_gradients(zip(reduced, [variables[v] for v in done]))
            return (loss, others) if pushed is None else (loss, others, pushed)   # an output, so the push runs

        if hold:
            return self._holding(step, optimizer, held_vars, variables, kept)
        if check:
            return self._checking(step)
        return step if early is None else lambda x, y: step(x, y)[:2]

    def _compressor_state(self, variables: list) -> tuple[dict, dict]:
        """What the step's compressors keep across steps, per (group, compressor index): fp16's error
        feedback residuals (``tf.Variable``) and PowerSGD's state."""
        import tensorflow as tf

        memory, powersgd = {}, {}
        for g in self.groups:
            for i, (comp, ms) in enumerate(_by_compressor(g)):
                if comp is not None and comp.kind == "fp16" and comp.error_feedback:
                    n = sum(_size(variables[m.key[0]], m) for m in ms)
                    memory[(g.group, i)] = tf.Variable(tf.zeros([n], tf.float32), trainable=False)
                elif comp is not None and comp.kind == "powersgd":
                    powersgd[(g.group, i)] = PowerSGDGraphState([(m, _shape(variables[m.key[0]], m)) for m in ms],
                                                                 comp, self.seed)
        return memory, powersgd

    def _checking(self, step):
        """``bind``'s step under loss scaling in the graph alone: the third value ``step`` returns
        (whether it applied the update) kept for ``step_finite``."""
        def checked(x, y):
            loss, others, self._finite = step(x, y)
            return loss, others

        return checked

    def step_finite(self) -> bool:
        """Whether the last step's reduced gradients were all finite (and applied): loss scaling
        in the graph alone, which decides inside the step."""
        return bool(self._finite)

    def _holding(self, step, optimizer, held_vars: list, variables: list, kept: list):
        """``bind``'s held step around ``step`` (which returns the reduced gradients and their
        squared norm), and the graph call ``release`` applies them with. The compressors' state
        (``kept``: fp16 residuals, PowerSGD's Qs and residuals) is read before each step: a step
        skipped under dynamic loss scaling puts it back (a residual that is not finite would poison
        every later step). The values read stay the old buffers: the step writes new ones."""
        import tensorflow as tf

        clipped = optimizer.global_clipnorm is not None
        optimizer.global_clipnorm = None   # the step's scale comes from every channel's part

        @tf.function(reduce_retracing=True, autograph=False)
        def apply_held(reduced, scale):
            # as Keras' clip_by_global_norm scales them: ``*`` makes an IndexedSlices dense (its
            # repeated rows summed), which an optimizer that squares gradients sees; held for loss
            # scaling alone (scale 1), they are applied as they are
            grads = [g * scale for g in reduced] if clipped else reduced
            optimizer.apply_gradients(zip(grads, [variables[v] for v in held_vars]))

        def held_step(x, y):
            self._kept = [(v, v.read_value()) for v in kept]
            loss, others, reduced, sq = step(x, y)
            self._held = (reduced, sq)
            return loss, others

        self._apply_held = apply_held
        return held_step


def _apply_if_finite(optimizer, reduced: list, variables: list, kept: list, before: list):
    """Inside a traced step: apply ``reduced`` to ``variables`` if every value is finite, else put
    the compressors' state ``kept`` back to ``before`` (as if the step never ran); returns whether
    it applied. Every worker sees the same reduced gradients, so all decide alike."""
    import tensorflow as tf

    finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g.values if isinstance(g, tf.IndexedSlices) else g))
                            for g in reduced] or [tf.constant(True)])

    def apply():
        optimizer.apply_gradients(zip(reduced, variables))
        return tf.constant(True)

    def skip():
        for v, value in zip(kept, before):
            v.assign(value)
        return tf.constant(False)

    return tf.cond(finite, apply, skip)


def _squared_norm(grads: list):
    """The squared norm of ``grads`` as Keras' global norm takes it (an ``IndexedSlices``'s
    values squared one by one), in float64."""
    import tensorflow as tf

    return tf.add_n([tf.constant(0.0, tf.float64)] + [tf.reduce_sum(tf.square(tf.cast(
        g.values if isinstance(g, tf.IndexedSlices) else g, tf.float64))) for g in grads])


def _reduce_elementwise(comp: Compressor, parts: list, world: int, memory, deps: list, key: int, hint: str):
    """The mean of ``parts`` over the workers in one collective, under ``none`` or ``fp16``
    (``memory``: fp16's error-feedback residual, or None). Float64 gradients sent uncompressed
    are reduced in float64, as the numpy backends do; everything else in float32."""
    import tensorflow as tf

    acc = tf.float64 if comp.kind == "none" and any(p.dtype == tf.float64 for p in parts) else tf.float32
    flat = tf.concat([tf.reshape(tf.cast(p, acc), [-1]) for p in parts], 0) / world
    if comp.kind == "fp16" and memory is not None:
        flat = flat + memory
        wire = tf.cast(flat, tf.float16)
        memory.assign(flat - tf.cast(wire, tf.float32))
    elif comp.kind == "fp16":
        wire = tf.cast(flat, tf.float16)
    else:
        wire = flat
    with tf.control_dependencies(deps):
        return tf.cast(all_reduce(wire, world, key, hint), acc)


def _by_compressor(group: ARGroup) -> list[tuple[Compressor | None, list[ARMember]]]:
    """Members of a group by what goes on the wire (the compressor, None for sparse members),
    first-seen order."""
    out: dict[Compressor | None, list[ARMember]] = {}
    for m in group.members:
        out.setdefault(None if m.sparse else m.compressor, []).append(m)
    return list(out.items())


def _shape(variable, m: ARMember) -> tuple[int, ...]:
    shape = list(variable.shape)
    if shape:
        shape[m.axis] = m.stop - m.start
    return tuple(int(d) for d in shape)


def _size(variable, m: ARMember) -> int:
    return int(np.prod(_shape(variable, m)))


def _take(grad, m: ARMember):
    if m.num_shards == 1:
        return grad
    return grad[(slice(None),) * m.axis + (slice(m.start, m.stop),)]


def _gather_sparse(grad, world: int, keys, hint: str):
    """All-gather one IndexedSlices gradient; returns the mean as IndexedSlices.

    The row count must be equal on every worker for one instance key; it is the static count
    when the graph knows it (an embedding lookup of a fixed-shape batch), else the gradient is
    padded with zero rows at index 0 up to the variable's row count."""
    import tensorflow as tf

    indices = tf.cast(grad.indices, tf.int64)
    values = grad.values
    rows = grad.dense_shape[0]
    n = indices.shape[0]
    if n is None:
        n_rows = int(tf.get_static_value(rows)) if tf.get_static_value(rows) is not None else None
        if n_rows is None:
            raise ValueError("a sparse gradient with neither a static row count nor a static table size "
                             "cannot be all-gathered in the graph; give the model a fixed input shape")
        pad = n_rows - tf.shape(indices)[0]
        indices = tf.concat([indices, tf.zeros([pad], tf.int64)], 0)
        values = tf.concat([values, tf.zeros(tf.concat([[pad], tf.shape(values)[1:]], 0), values.dtype)], 0)
    all_indices = all_gather(indices, world, next(keys), hint)
    all_values = all_gather(values, world, next(keys), hint)
    return tf.IndexedSlices(all_values / tf.cast(world, values.dtype), all_indices, grad.dense_shape)


def _assemble(variable, parts: list, groups: list[ARGroup], v: int):
    """The reduced gradient of variable ``v`` from its reduced shards (in shard order)."""
    import tensorflow as tf

    if len(parts) == 1:
        return parts[0]
    axis = next(m.axis for g in groups for m in g.members if m.key[0] == v)
    return tf.concat(parts, axis)
