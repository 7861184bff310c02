"""Per-step TensorFlow functions (a worker's step and pull assignments, a PS's Keras optimizer)
called without ``tf.function``'s per-call dispatch.

Each call of a ``tf.function`` (and of a concrete function's ``__call__``) binds its arguments to
the function's type, canonicalizes them, builds their trace types and casts each one before it runs
the traced graph; on small models that is a large part of a step. What skipping it does to steps is
measured in ``benchmarks/results/worker_dispatch_2x200mbit.json`` and, for the Keras optimizer on a
PS, ``ps_apply_numpy_vs_keras.json``.

``FlatFunction`` traces the function once for one flat list of arguments and calls the concrete
function's flat entry point, checking only what the entry point trusts its caller with (the number
of arguments, their dtypes and shapes); arguments it was not traced for go through the
``tf.function`` as before (a retrace there, as ever).

The flat entry point is TensorFlow's own (``ConcreteFunction._call_flat``, what its ``__call__``
ends in); where a TensorFlow lacks it, the public ``__call__`` of the concrete function runs
(``fast`` says which; a test holds it true for the TensorFlow this project pins). Below that entry
point, where no tape records, the graph's flat outputs are packed by a packer made once
(``concrete_flat``; ``lowest`` says so): measured on ncf-small's gradient call, 0.44 -> 0.21 ms.

Every function the runtime traces (here, a worker's step, the ``graph`` step, a PS's Keras update,
the profile's step) is traced with ``autograph=False``, as Keras' ``fit`` traces its own train step
(``do_not_convert``). AutoGraph never reached the user's code anyway (Keras calls the model, its
losses and its optimizer unconverted); it converted only the runtime's own functions, whose loops
run over Python lists, at 0.3-0.6 s of CPU in each process's first trace (see ``docs/cli.md``).
"""
from __future__ import annotations

import numpy as np

from autosync.runtime.tf_arrays import row_groups


class FlatFunction:
    """``function(*args)`` over the nested arguments ``example`` has the structure of, traced for
    their flat dtypes and shapes (``None`` where ``relaxed`` gives a dimension as None).

    Args:
        function: a ``tf.function`` (its Python function is traced here; the ``tf.function``
            itself serves calls of other shapes).
        example: arguments of one call, as nested lists, tuples and dicts of arrays.
        relaxed: per flat argument, its shape with None where calls may differ (default: the
            example's own shapes).
    """

    def __init__(self, function, example: tuple, relaxed: list | None = None):
        import tensorflow as tf

        self._function = function
        flat = tf.nest.flatten(example)
        # the nesting alone: keeping the example would keep its arrays (a model's initial values,
        # as big as the model) alive as long as the function
        self._structure = structure = tf.nest.map_structure(lambda _: 0, example)
        self._dtypes = [tf.as_dtype(np.asarray(a).dtype) for a in flat]
        self._shapes = [tuple(s) for s in relaxed] if relaxed is not None else [tuple(np.shape(a)) for a in flat]
        if len(self._shapes) != len(flat):
            raise ValueError(f"{len(self._shapes)} relaxed shapes for {len(flat)} arguments")
        specs = [tf.TensorSpec(shape, dtype) for shape, dtype in zip(self._shapes, self._dtypes)]
        python = function.python_function
        self._call, self.fast = concrete_flat(lambda tensors: python(*tf.nest.pack_sequence_as(structure, tensors)),
                                              specs)
        self.lowest = getattr(self._call, "lowest", False)   # outputs packed here (``concrete_flat``)
        self.fallbacks = 0   # calls served by the tf.function (other shapes, dtypes or structure)
        self._tensors = _tensor_maker(self._dtypes)

    def _fits(self, flat: list) -> bool:
        if len(flat) != len(self._shapes):
            return False
        for a, want, dtype in zip(flat, self._shapes, self._dtypes):
            shape = np.shape(a)
            if len(shape) != len(want) or getattr(a, "dtype", None) != dtype.as_numpy_dtype:
                return False
            if any(w is not None and w != s for w, s in zip(want, shape)):
                return False
        return True

    def __call__(self, *args):
        import tensorflow as tf

        try:
            flat = tf.nest.flatten(args)
            tf.nest.assert_same_structure(args, self._structure)
        except (TypeError, ValueError):
            flat = None
        if flat is None or not self._fits(flat):
            self.fallbacks += 1
            return self._function(*args)
        return self._call(self._tensors(flat))


class RowAssign:
    """One graph call that assigns whole variables and scatters pulled rows into the row-pulled
    ones, the rows of every table of one row shape and dtype passed as one array (joined here,
    split in the graph): a step that pulls dozens of tables makes a few tensors, not two per table.

    Called as ``(whole values, row ids, row values)``: ``whole`` in ``whole``'s order, the other
    two one array per variable of ``row_vars``, in its order (row counts vary per step).
    """

    def __init__(self, variables: list, whole: list[int], row_vars: list[int], initial: list):
        import tensorflow as tf

        self.groups = row_groups([variables[i].shape for i in row_vars], [variables[i].dtype for i in row_vars])
        targets = [[variables[row_vars[j]] for j in g] for g in self.groups]
        signature = [
            [tf.TensorSpec(variables[i].shape, variables[i].dtype) for i in whole],
            [tf.TensorSpec([None], tf.int64) for _ in targets],
            [tf.TensorSpec([None] + list(t[0].shape[1:]), t[0].dtype) for t in targets],
            [tf.TensorSpec([len(t)], tf.int64) for t in targets],
        ]

        @tf.function(input_signature=signature, autograph=False)
        def assign(values, ids, rows, sizes):
            for i, value in zip(whole, values):
                variables[i].assign(value)
            for tables, gi, gv, gs in zip(targets, ids, rows, sizes):
                parts = zip(tf.split(gi, gs, num=len(tables)), tf.split(gv, gs, num=len(tables)))
                for table, (r, value) in zip(tables, parts):
                    table.value.scatter_update(tf.IndexedSlices(value, r))

        example = ([initial[i] for i in whole], [np.zeros(0, np.int64) for _ in targets],
                   [initial[row_vars[g[0]]][:0] for g in self.groups], [np.zeros(len(g), np.int64) for g in self.groups])
        self._flat = FlatFunction(assign, example, relaxed=[tuple(s.shape) for part in signature for s in part])

    @property
    def fallbacks(self) -> int:
        return self._flat.fallbacks

    def __call__(self, whole: list, ids: list, values: list):
        return self._flat(whole, [np.concatenate([ids[j] for j in g]).astype(np.int64, copy=False) for g in self.groups],
                          [np.concatenate([values[j] for j in g]) for g in self.groups],
                          [np.array([len(ids[j]) for j in g], np.int64) for g in self.groups])


JOIN_VALUES = 1 << 15   # variables of at most this many values travel joined into one array (``JoinedAssign``)
MIN_JOINED = 4   # fewer small variables of one dtype than this: one array each


class JoinedAssign:
    """One graph call that assigns a value to every variable, the small ones of each dtype joined
    into one array (here) and split again in the graph: a step that pulls hundreds of small
    variables makes a few tensors, not one per variable (each ~6 us to make).

    Called with one value per variable, in ``variables``' order.
    """

    def __init__(self, variables: list, initial: list):
        import tensorflow as tf

        by_dtype: dict = {}
        for i, value in enumerate(initial):
            if np.size(value) <= JOIN_VALUES:
                by_dtype.setdefault(np.asarray(value).dtype.str, []).append(i)
        self.groups = [g for g in by_dtype.values() if len(g) >= MIN_JOINED]
        joined = {i for g in self.groups for i in g}
        self.alone = [i for i in range(len(variables)) if i not in joined]
        self._dtypes = [np.asarray(initial[g[0]]).dtype for g in self.groups]
        sizes = [[int(np.size(initial[i])) for i in g] for g in self.groups]
        shapes = [[tuple(np.shape(initial[i])) for i in g] for g in self.groups]
        alone, groups = self.alone, self.groups

        @tf.function(autograph=False)
        def assign(values, flats):
            for i, value in zip(alone, values):
                variables[i].assign(value)
            for g, flat, size, shape in zip(groups, flats, sizes, shapes):
                for i, part, s in zip(g, tf.split(flat, size), shape):
                    variables[i].assign(tf.reshape(part, s))

        self._flat = FlatFunction(assign, ([initial[i] for i in self.alone], self._join(initial)))

    def _join(self, values: list) -> list:
        return [np.concatenate([np.ravel(values[i]) for i in g]).astype(d, copy=False)
                for g, d in zip(self.groups, self._dtypes)]

    @property
    def fallbacks(self) -> int:
        return self._flat.fallbacks

    def __call__(self, values: list):
        return self._flat([values[i] for i in self.alone], self._join(values))


def _tensor_maker(dtypes: list):
    """``tensors(flat)``: the arrays of one call as eager tensors of ``dtypes``, each made by the
    eager tensor's own constructor, as ``tf.convert_to_tensor`` ends up doing after ~4 us of
    Python per argument (a step that pulls dozens of tables converts ~60); tensors pass as they
    are. Where a TensorFlow lacks that constructor, ``tf.convert_to_tensor``."""
    import tensorflow as tf

    try:
        from tensorflow.python.eager import context
        from tensorflow.python.framework.ops import EagerTensor

        context.ensure_initialized()
        enums = [d.as_datatype_enum for d in dtypes]
    except (ImportError, AttributeError):
        return lambda flat: [tf.convert_to_tensor(a) for a in flat]

    def tensors(flat: list) -> list:
        device = context.context().device_name
        return [a if isinstance(a, tf.Tensor) else EagerTensor(a, device, e) for a, e in zip(flat, enums)]

    return tensors


def concrete_flat(function, specs: list, jit_compile: bool = False) -> tuple:
    """``function`` of one list of tensors, traced once for the flat ``specs``, as ``(call, fast)``:
    ``call(tensors)`` runs the concrete function's flat entry point (``fast``), or its ``__call__``
    where TensorFlow has none. ``call`` checks nothing: its caller passes tensors of ``specs``.

    Where no gradient tape can record (a worker's step, a PS's update: the function takes its own
    gradients inside) and the outputs are tensors, ``IndexedSlices`` and None in lists and tuples,
    ``call`` goes one level lower still: the graph's flat outputs, put back into that structure by
    a packer made once here (``_packer``), instead of TensorFlow's own packing, which rebuilds and
    type-checks the output's trace types on every call (half of a small model's call).
    ``jit_compile``: the function is compiled by XLA, once per distinct shape of its arguments."""
    import tensorflow as tf

    concrete = tf.function(function, input_signature=[specs], jit_compile=jit_compile or None,
                           autograph=False).get_concrete_function()
    entry = getattr(concrete, "_call_flat", None)
    if not callable(entry):
        return concrete, False
    slow = lambda tensors: entry(tensors, concrete.captured_inputs)  # noqa: E731
    slow.lowest = False
    pack, flat_call, quiet = _lowest(concrete)
    if pack is None:
        return slow, True

    def call(tensors):
        if not quiet():
            return slow(tensors)   # a tape may record: TensorFlow's own path
        return pack(flat_call(*tensors, *concrete.captured_inputs))

    call.lowest = True
    return call, True


class _Unpackable(Exception):
    """An output structure ``_packer`` does not rebuild."""


def _lowest(concrete) -> tuple:
    """``(pack, call_flat, quiet)`` of a concrete function's inference graph, or Nones where this
    TensorFlow lacks one of them or its outputs are not what ``_packer`` rebuilds."""
    try:
        from tensorflow.python.eager import record

        flat_call = concrete._inference_function.call_flat  # noqa: SLF001
        quiet = lambda: not record.could_possibly_record()  # noqa: E731
        pack = _packer(concrete.structured_outputs, list(concrete.outputs))
    except (AttributeError, ImportError, _Unpackable):
        return None, None, None
    return pack, flat_call, quiet


def _packer(structure, flat: list):
    """``pack(outputs)``: ``structure`` (the symbolic outputs) rebuilt from the graph's flat
    outputs, whose symbolic tensors are ``flat``; raises ``_Unpackable`` for anything but
    tensors, ``IndexedSlices`` and None in lists and tuples, or a leaf not found in ``flat``.
    Checked on ``flat`` itself: it must give back ``structure``'s own tensors."""
    import tensorflow as tf

    at = {id(t): i for i, t in enumerate(flat)}

    def position(t) -> int:
        if id(t) not in at:
            raise _Unpackable(t)
        return at[id(t)]

    def build(s):
        if s is None:
            return lambda out: None
        if isinstance(s, tf.IndexedSlices):
            v, i = position(s.values), position(s.indices)
            d = None if s.dense_shape is None else position(s.dense_shape)
            return lambda out: tf.IndexedSlices(out[v], out[i], None if d is None else out[d])
        if isinstance(s, tf.Tensor):
            i = position(s)
            return lambda out: out[i]
        if type(s) in (list, tuple):
            parts, kind = [build(x) for x in s], type(s)
            return lambda out: kind([p(out) for p in parts])
        raise _Unpackable(type(s).__name__)

    pack = build(structure)
    got, want = (tf.nest.flatten(s, expand_composites=True) for s in (pack(flat), structure))
    if len(got) != len(want) or any(a is not b for a, b in zip(got, want)):
        raise _Unpackable(structure)
    return pack
