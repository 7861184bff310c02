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
* sparse members (``IndexedSlices``) are all-gathered, indices and values, and applied as
  ``IndexedSlices`` (duplicate rows add up, as in one process);
* a variable split into shards is reduced shard by shard (each shard in its own group) and put
  together again before the update; the optimizers are element-wise, so this is exact.

Gradients of every other variable leave the graph as before (parameter servers, other
backends); the graph's own come back as None, so no other channel sends them. A variable can be
reduced in the graph only if every shard of it is a ``graph`` member with compressor none, fp16
or fp16_ef (and, if sparse, it is not split); ``split_groups`` sends the others (PowerSGD, a
variable shared with a parameter server) to the numpy channel, which uses the same collectives
eagerly through ``autosync.comm.tf_collective.GraphBackend``.

On a GPU the gradients, the collectives (NCCL) and the optimizer stay on the device; collectives
are then chained in issue order, as NCCL needs one order on every worker.
"""
from __future__ import annotations

import numpy as np

from autosync.comm.channel import ARGroup, ARMember
from autosync.comm.tf_collective import SESSION_KEYS, all_gather, all_reduce, communication_hint

IN_GRAPH_COMPRESSORS = ("none", "fp16", "fp16_ef")
TIMELINE_STEPS = 10_000  # per-step timestamps kept for the overlap figure


def split_groups(groups: list[ARGroup], layout: list[tuple[int, int]]) -> tuple[list[ARGroup], list[ARGroup]]:
    """(groups reduced in the graph, groups left to the numpy channel), order kept, empty ones
    dropped. ``layout[v]`` is variable v's (number of shards, axis)."""
    members: dict[int, list[ARMember]] = {}
    for g in groups:
        for m in g.members:
            members.setdefault(m.key[0], []).append(m)
    inside = {v for v, ms in members.items()
              if len(ms) == layout[v][0]
              and all(m.backend == "graph" and m.compressor in IN_GRAPH_COMPRESSORS for m in ms)
              and not (ms[0].sparse and layout[v][0] > 1)}
    graph, rest = [], []
    for g in groups:
        mine = tuple(m for m in g.members if m.key[0] in inside)
        other = tuple(m for m in g.members if m.key[0] not in inside)
        if mine:
            graph.append(ARGroup(g.group, mine))
        if other:
            rest.append(ARGroup(g.group, other))
    return graph, rest


def hidden_share(times: np.ndarray) -> float:
    """Share of one step's collective time that ran before the last gradient existed.

    ``times`` = [last gradient, ready_1, done_1, ready_2, done_2, ...] (seconds)."""
    last, spans = times[0], times[1:].reshape(-1, 2)
    total = float(np.sum(spans[:, 1] - spans[:, 0]))
    if total <= 0:
        return 0.0
    hidden = np.clip(np.minimum(spans[:, 1], last) - spans[:, 0], 0.0, None)
    return float(np.sum(hidden) / total)


class GraphAllReduceChannel:
    """In-graph all-reduce for one worker (a SyncChannel: ``pull``/``push``/``finish``, plus
    ``bind``, with which the worker gets its training-step function).

    Args:
        rank, world: this worker's position and the number of workers.
        groups: fusion groups in gradient-ready order (only members ``split_groups`` kept).
        setup: the ``graph`` backend's session setup, ``{"group", "base"}``.
    """

    def __init__(self, rank: int, world: int, groups: list[ARGroup], setup: dict):
        self.rank, self.world = rank, world
        self.groups = list(groups)
        # the eager GraphBackend counts up from "base"; the graph takes the upper half
        self.key_base = int(setup["base"]) + SESSION_KEYS // 2
        self.calls = 0
        self.timeline: list[np.ndarray] = []

    # ---- SyncChannel: the variables are updated in the graph, nothing to pull or push ----------
    def pull(self, step: int, fresh: bool = False) -> dict:
        return {}

    def push(self, step: int, grads: list) -> None:
        """The graph already reduced and applied this channel's gradients (they arrive as None)."""

    def finish(self) -> None:
        """Collectives complete inside the step: nothing is outstanding."""

    def summary(self) -> dict:
        """``{"ar_hidden": [share of collective time hidden behind the backward pass, per step]}``
        for the steps since the last summary."""
        shares = [hidden_share(t) for t in self.timeline]
        self.timeline = []
        return {"ar_hidden": shares}

    # ---- the step ------------------------------------------------------------------------------
    def bind(self, model, loss_fn, optimizer):
        """The worker's step function ``(x, y) -> (loss, grads)`` for this trial: gradients of the
        variables reduced here come back as None, the others as computed."""
        import tensorflow as tf

        variables = list(model.trainable_variables)
        owned = sorted({m.key[0] for g in self.groups for m in g.members})
        optimizer.build([variables[v] for v in owned])
        memory = {(g.group, i): tf.Variable(tf.zeros([n], tf.float32), trainable=False)
                  for g in self.groups for i, (comp, ms) in enumerate(_by_compressor(g))
                  if comp == "fp16_ef" for n in [sum(_size(variables[m.key[0]], m) for m in ms)]}
        world, hint, base = self.world, communication_hint(), self.key_base
        chain = hint == "nccl"
        groups = self.groups

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            grads = tape.gradient(loss, variables)
            shards: dict = {}
            stamps, last = [], None
            keys = iter(range(base, base + SESSION_KEYS // 2))
            for g in groups:
                for i, (comp, ms) in enumerate(_by_compressor(g)):
                    ms = [m for m in ms if grads[m.key[0]] is not None]
                    if not ms:
                        continue
                    deps = [last] if chain and last is not None else []
                    if comp == "sparse":
                        for m in ms:
                            with tf.control_dependencies(deps):
                                t0, out = _gather_sparse(grads[m.key[0]], world, keys, hint)
                            shards[m.key] = out
                            last = out.values
                            stamps += [t0, _stamp(last)]
                        continue
                    parts = [_take(grads[m.key[0]], m) for m in ms]
                    with tf.control_dependencies(deps + parts):
                        t0 = tf.timestamp()
                    flat = tf.concat([tf.reshape(tf.cast(p, tf.float32), [-1]) for p in parts], 0) / world
                    if comp == "fp16_ef":
                        mem = memory[(g.group, i)]
                        flat = flat + mem
                        wire = tf.cast(flat, tf.float16)
                        mem.assign(flat - tf.cast(wire, tf.float32))
                    elif comp == "fp16":
                        wire = tf.cast(flat, tf.float16)
                    else:
                        wire = flat
                    with tf.control_dependencies(deps):
                        total = tf.cast(all_reduce(wire, world, next(keys), hint), tf.float32)
                    last = total
                    stamps += [t0, _stamp(total)]
                    offset = 0
                    for m, p in zip(ms, parts):
                        n = _size(variables[m.key[0]], m)
                        shards[m.key] = tf.cast(tf.reshape(total[offset:offset + n], tf.shape(p)), p.dtype)
                        offset += n
            done = [v for v in owned if grads[v] is not None]
            with tf.control_dependencies([_flat_dep(grads[v]) for v in range(len(variables)) if grads[v] is not None]):
                backward_end = tf.timestamp()
            reduced = [_assemble(variables[v], [shards[k] for k in sorted(k for k in shards if k[0] == v)], groups, v)
                       for v in done]
            optimizer.apply_gradients(zip(reduced, [variables[v] for v in done]))
            mine = set(owned)
            times = tf.stack([backward_end] + stamps) if stamps else tf.reshape(backward_end, [1])
            return loss, [None if v in mine else grads[v] for v in range(len(variables))], times

        def compute(x, y):
            loss, grads, times = step(x, y)
            if len(self.timeline) < TIMELINE_STEPS:
                self.timeline.append(times.numpy())
            return loss, grads

        return compute


def _by_compressor(group: ARGroup) -> list[tuple[str, list[ARMember]]]:
    """Members of a group by what goes on the wire (``sparse`` or the compressor), first-seen order."""
    out: dict[str, list[ARMember]] = {}
    for m in group.members:
        out.setdefault("sparse" if m.sparse else m.compressor, []).append(m)
    return list(out.items())


def _size(variable, m: ARMember) -> int:
    shape = list(variable.shape)
    if shape:
        shape[m.axis] = m.stop - m.start
    return int(np.prod(shape))


def _take(grad, m: ARMember):
    if m.num_shards == 1:
        return grad
    return grad[(slice(None),) * m.axis + (slice(m.start, m.stop),)]


def _stamp(t):
    import tensorflow as tf

    with tf.control_dependencies([t]):
        return tf.timestamp()


def _flat_dep(grad):
    import tensorflow as tf

    return grad.values if isinstance(grad, tf.IndexedSlices) else grad


def _gather_sparse(grad, world: int, keys, hint: str):
    """All-gather one IndexedSlices gradient: (start timestamp, the mean as IndexedSlices).

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
    with tf.control_dependencies([indices, values]):
        t0 = tf.timestamp()
    all_indices = all_gather(indices, world, next(keys), hint)
    all_values = all_gather(values, world, next(keys), hint)
    return t0, tf.IndexedSlices(all_values / tf.cast(world, values.dtype), all_indices, grad.dense_shape)


def _assemble(variable, parts: list, groups: list[ARGroup], v: int):
    """The reduced gradient of variable ``v`` from its reduced shards (in shard order)."""
    import tensorflow as tf

    if len(parts) == 1:
        return parts[0]
    axis = next(m.axis for g in groups for m in g.members if m.key[0] == v)
    return tf.concat(parts, axis)
