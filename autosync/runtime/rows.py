"""Which rows of its sparse variables a training step reads, known before the step runs.

A parameter-server worker pulls only the rows of an embedding table its next step looks up, so it
must know them before it computes: it draws the batch first and runs a pruned function of the
model inputs that yields the lookup ids. The common case is found from the Keras functional graph:
a ``keras.layers.Embedding`` whose every call in the model is fed by tensors computed from the
model inputs (directly, or through slicing and other preprocessing). The ids are then the inputs
of those calls, computed by ``keras.Model(model.inputs, [those tensors])``. A custom layer may
declare its reads (``row_reads`` and ``row_read_inputs``, see ``find_row_reads``).

Any other sparse variable (a gather inside a custom layer, a table read by a sampler inside the
step, an embedding in a subclassed model) cannot be predicted this way; it is pulled whole every
step, and ``RowReads.full_pull`` says which and why.

The worker also checks every step that the rows its gradient touches were among those predicted,
so a wrong prediction fails loudly instead of training on stale rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class RowReads:
    """The predictable row reads of a model's sparse variables.

    Attributes:
        outputs: variable index -> where its rows come from (for messages and tests).
        full_pull: variable path -> why its rows cannot be known before the step (a clause).
        ids: ``ids(x) -> {variable index: int64 row ids}`` (a tensor, or an array where read from
            the batch itself; None when none is predictable).
    """

    outputs: dict[int, list[str]] = field(default_factory=dict)
    full_pull: dict[str, str] = field(default_factory=dict)
    ids: object = None

    def rows(self, x) -> dict[int, np.ndarray]:
        """Variable index -> sorted unique int64 rows the step on inputs ``x`` reads."""
        if not self.outputs:
            return {}
        return {v: np.unique(np.asarray(t)) for v, t in self.ids(x).items()}


def find_row_reads(model, variables: list, sparse: list[bool]) -> RowReads:
    """Find how to compute the rows each sparse variable's step reads from the model inputs.

    Two kinds of readers are understood: ``keras.layers.Embedding`` (rows = its inputs), and any
    layer that declares its reads with a ``row_reads(inputs) -> {variable path: ids}`` method and
    a ``row_read_inputs`` tuple (the positions, among its call's inputs, that ``row_reads`` takes;
    e.g. a sampled softmax reads the label rows plus candidates drawn from the labels).

    Args:
        model: the built Keras model.
        variables: its trainable variables (model order).
        sparse: per variable, whether its gradient is ``IndexedSlices``.

    Returns:
        RowReads (``full_pull`` lists every sparse variable that is not predictable).
    """
    import keras

    out = RowReads()
    wanted = {v.path: i for i, v, s in zip(range(len(variables)), variables, sparse) if s}
    if not wanted:
        return out
    readers: dict[str, list] = {}  # variable path -> layers that read it by rows
    for layer in model._flatten_layers(include_self=False):
        if isinstance(layer, keras.layers.Embedding):
            paths = [layer.embeddings.path]
        elif callable(getattr(layer, "row_reads", None)) and hasattr(layer, "row_read_inputs"):
            paths = [w.path for w in layer.trainable_weights]
        else:
            continue
        for path in paths:
            if path in wanted:
                readers.setdefault(path, []).append(layer)
    inputs = getattr(model, "inputs", None)
    tensors: list = []
    plan: dict[int, list] = {}  # variable index -> [(layer, positions of its feeds in tensors)]
    for path, index in wanted.items():
        layers = readers.get(path)
        if not layers:
            out.full_pull[path] = ("it is not read by a keras.layers.Embedding or a layer declaring row_reads "
                                   "(a gather inside a custom layer?)")
            continue
        if not inputs:
            out.full_pull[path] = "the model is not functional: its embedding inputs cannot be traced"
            continue
        uses, feeds = [], []
        for layer in layers:
            for node in layer._inbound_nodes:
                given = list(node.input_tensors)
                picked = given if isinstance(layer, keras.layers.Embedding) else [given[i] for i in layer.row_read_inputs]
                uses.append((layer, list(range(len(tensors) + len(feeds), len(tensors) + len(feeds) + len(picked)))))
                feeds.extend(picked)
        if not feeds:
            out.full_pull[path] = _nested_reason(model, layers)
            continue
        try:
            keras.Model(inputs, feeds)  # only succeeds when every feed is computed from the inputs
        except Exception as e:  # noqa: BLE001 - any failure means: not predictable from the inputs
            why = " ".join(str(e).split())
            why = f"{type(e).__name__}: {why[:160]}{'...' if len(why) > 160 else ''}" if why else type(e).__name__
            out.full_pull[path] = (f"its lookup ids are not computed from the model inputs alone (building a model "
                                   f"from the inputs to them failed with {why})")
            continue
        plan[index] = [(layer, pos, path) for layer, pos in uses]
        out.outputs[index] = [layer.name for layer, _ in uses]
        tensors.extend(feeds)
    if tensors:
        traced = _ids_function(keras.Model(inputs, tensors), plan)
        direct = _input_positions(inputs, tensors, plan)
        out.ids = _InputIds(direct, plan, len(inputs), traced) if direct is not None else traced
    return out


def _input_positions(inputs: list, tensors: list, plan: dict) -> list | None:
    """Per feed, ``(position of the model input, numpy index or None)``: every reader an Embedding
    fed by a model input itself (recommenders' id inputs), or by a basic slice of one taken in the
    functional graph (``cats[:, t]``: one column per table, as DLRM's); None where any feed is
    computed otherwise or a reader declares its reads."""
    import keras

    if any(not isinstance(layer, keras.layers.Embedding) for uses in plan.values() for layer, _, _ in uses):
        return None
    feeds = [_input_feed(inputs, t) for t in tensors]
    return None if any(f is None for f in feeds) else feeds


def _input_feed(inputs: list, tensor) -> tuple | None:
    """``(i, None)`` for ``inputs[i]`` itself, ``(i, key)`` for ``inputs[i][key]`` with a basic
    index (ints, slices, None, Ellipsis: numpy gives what TensorFlow's strided slice does)."""
    direct = next((i for i, x in enumerate(inputs) if x is tensor), None)
    if direct is not None:
        return direct, None
    history = getattr(tensor, "_keras_history", None)
    if history is None or type(history.operation).__name__ != "GetItem":
        return None
    node = history.operation._inbound_nodes[history.node_index]
    args = node.arguments.args
    if len(args) != 2 or node.arguments.kwargs:
        return None
    source, key = args
    whole = lambda b: isinstance(b, int) and not isinstance(b, bool)  # noqa: E731
    basic = all(p is None or p is Ellipsis or whole(p) or
                (isinstance(p, slice) and all(b is None or whole(b) for b in (p.start, p.stop, p.step)))
                for p in (key if isinstance(key, tuple) else (key,)))
    position = next((i for i, x in enumerate(inputs) if x is source), None)
    return (position, key) if basic and position is not None else None


class _InputIds:
    """``ids(x)`` where every feed is a model input or a basic slice of one (``cats[:, t]``): read
    from the batch's own arrays (numpy), without running TensorFlow; the same ids, in the same
    order, as ``traced`` (the ``_ids_function``), which serves a batch given another way (a dict of
    inputs)."""

    def __init__(self, feeds: list, plan: dict, num_inputs: int, traced):
        self.feeds, self.plan, self.num_inputs, self.traced = feeds, plan, num_inputs, traced

    def __call__(self, x) -> dict:
        if isinstance(x, (list, tuple)) and len(x) == self.num_inputs:
            arrays = list(x)
        elif self.num_inputs == 1 and not isinstance(x, (dict, list, tuple)):
            arrays = [x]
        else:
            return self.traced(x)

        def feed(i):   # each feed is read by one use
            position, key = self.feeds[i]
            value = np.asarray(arrays[position])
            return (value if key is None else value[key]).reshape(-1).astype(np.int64)

        return {index: np.concatenate([feed(pos[0]) for _, pos, _ in uses]) for index, uses in self.plan.items()}


def _nested_reason(model, layers: list) -> str:
    """Why the tables read by ``layers`` are pulled whole when the functional graph has no call of
    them: they are called inside another layer's ``call`` (a position table looked up on
    ``arange(sequence length)``, typically), whose inner lookups the graph does not record."""
    names = ", ".join(sorted({layer.name for layer in layers}))
    outer = [top.name for top in model._flatten_layers(include_self=False, recursive=False)
             if any(layer is not top and any(inner is layer for inner in top._flatten_layers(include_self=False))
                    for layer in layers)]
    where = f"inside layer {', '.join(outer[:3])}'s own call" if outer else "outside the model's functional graph"
    return (f"it is looked up by {names} {where}, where the functional graph does not record its lookup ids; "
            f"a table every step reads whole (positions 0..n-1) loses nothing by this; otherwise call the Embedding "
            f"in the functional model, or declare row_reads and row_read_inputs on the outer layer")


def _ids_function(feeds_model, plan: dict):
    """A tf.function from model inputs to each predictable variable's row ids."""
    import keras
    import tensorflow as tf

    def ids(x):
        feeds = tf.nest.flatten(feeds_model(x, training=False))
        out = {}
        for index, uses in plan.items():
            parts = []
            for layer, pos, path in uses:
                if isinstance(layer, keras.layers.Embedding):
                    parts.append(feeds[pos[0]])
                else:
                    parts.append(layer.row_reads([feeds[p] for p in pos])[path])
            out[index] = tf.concat([tf.reshape(tf.cast(p, tf.int64), [-1]) for p in parts], axis=0)
        return out

    return tf.function(ids, autograph=False)


def check_row_ids(variables: list, rows: dict, batch: int) -> None:
    """The row ids a step's batch looks up (``rows``: variable index -> sorted unique ids) lie in
    their tables, as Keras requires on a CPU (on a GPU it would read zeros): a parameter server
    cannot serve a row it does not hold, and a negative id would wrap to another row in a narrow
    index dtype. ``batch``: the batch's number in the worker's data (from 1), for the message.

    Raises:
        ValueError: naming the table, its size, the ids and the batch.
    """
    for v, ids in rows.items():   # sorted: the ends say whether any id lies outside
        size = variables[v].shape[0]
        if ids.size and (ids[0] < 0 or ids[-1] >= size):
            bad = ids[(ids < 0) | (ids >= size)]
            raise ValueError(
                f"batch {batch} looks up rows {bad[:5].tolist()} of {variables[v].path}, a table of {size} "
                f"rows (ids must be in [0, {size}), as Keras requires on a CPU): map the ids into the table "
                f"in the dataset (e.g. unknown ids to an out-of-vocabulary row) or give the table more rows")


def check_pulled_rows(variables: list, rows: dict, grads: list) -> None:
    """The gradient of a row-pulled variable (``rows``: variable index -> the sorted, unique row
    ids pulled for the step) touches only rows that were pulled; ``variables`` (each with a
    ``path``) name them in the error.

    Raises:
        RuntimeError: naming the variable and rows read but not pulled.
    """
    for v, ids in rows.items():
        g = grads[v]
        if isinstance(g, tuple):
            # ``ids`` is sorted and unique: each touched row is found where it would sort
            at = np.minimum(np.searchsorted(ids, g[0]), max(len(ids) - 1, 0))
            missed = np.unique(g[0] if not len(ids) else g[0][ids[at] != g[0]])
            if missed.size:
                raise RuntimeError(
                    f"variable {variables[v].path}: the step read rows {missed[:5].tolist()} that the "
                    f"lookup-id function did not predict (a model that reads it outside its Embedding "
                    f"layer?); the prediction is wrong for this model, so row pulls cannot be used")


def index_dtype(rows: int) -> np.dtype:
    """The narrowest integer dtype that numbers ``rows`` rows: what row ids cross the network in
    (a 20,000-row table's ids take 2 bytes, not 4 or 8), as the cost model counts them
    (``strategy_space.builders.index_bytes``)."""
    from strategy_space.builders import index_bytes

    width = index_bytes(rows)
    return np.dtype(np.int64 if width == 8 else f"uint{8 * width}")


def received_grad(key, g, shape: tuple, dtype, sparse: bool):
    """A pushed gradient of the shard ``key`` (``shape`` and ``dtype``) as a parameter server applies it: a
    dense array, or ``(indices, values, squares or None)`` for a sparse one; checked against the
    shard first, so that a gradient of another shape never broadcasts into it or reaches rows it
    does not hold.

    Raises:
        ValueError: which shape, dtype or row is wrong, and what the shard holds.
    """
    if not sparse:
        g = np.asarray(g)
        if g.shape != shape or (g.dtype.kind != "f" and g.dtype != dtype):
            raise ValueError(f"a gradient of shape {g.shape} and dtype {g.dtype} was pushed for {key}, whose shard is "
                             f"{shape} of floats")
        return g
    indices, values = np.asarray(g[0]), np.asarray(g[1])
    if (indices.ndim != 1 or indices.dtype.kind not in "iu" or values.shape != (len(indices),) + shape[1:]
            or (values.dtype.kind != "f" and values.dtype != dtype)):
        raise ValueError(f"sparse gradient rows {indices.dtype}{list(indices.shape)} with values "
                         f"{values.dtype}{list(values.shape)} were pushed for {key}, whose shard is {shape}: values "
                         f"must be (rows,) + {shape[1:]} floats, one per row id")
    if len(indices) and (indices.min() < 0 or indices.max() >= shape[0]):
        raise ValueError(f"row ids {int(indices.min())}..{int(indices.max())} were pushed for {key}, which holds rows "
                         f"0..{shape[0] - 1}")
    if len(g) == 2:
        return indices, values, None
    squares = np.square(values)
    squares[np.asarray(g[2])] = np.asarray(g[3])
    return indices, values, squares


def payload_bytes(obj) -> int:
    """Bytes of the arrays in a (nested) payload: what crosses the network, less framing."""
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    if isinstance(obj, dict):
        return sum(payload_bytes(v) for v in obj.values())
    if isinstance(obj, (tuple, list)):
        return sum(payload_bytes(v) for v in obj)
    return 0


def first_gradient(model_def) -> tuple:
    """Build ``model_def``'s model and take one gradient on its first batch: ``(model, variables,
    grads)``, grads as the tape gives them (``tf.IndexedSlices`` for a sparse variable)."""
    import keras

    from autosync.models import ingest

    keras.utils.set_random_seed(model_def.seed)
    inputs, targets = ingest.first_batch(model_def)
    model = model_def.build_model()
    variables, grads = ingest.compute_gradients(model, model_def.loss(), inputs, targets)
    return model, variables, grads


def row_reads_of(model_def, gradient: tuple | None = None) -> RowReads:
    """Find ``model_def``'s row reads from one gradient on its first batch (``first_gradient``,
    or the one given): what ``autosync inspect`` reports; workers do the same in ``load``."""
    import tensorflow as tf

    model, variables, grads = gradient or first_gradient(model_def)
    return find_row_reads(model, variables, [isinstance(g, tf.IndexedSlices) for g in grads])
