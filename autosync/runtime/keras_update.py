"""How a ``KerasOptimizer`` runs the update of a chunk of its shards: the chunk's function, traced
and then compiled by XLA (a tier, as a JIT has), sparse rows padded to a few compiled shapes, and a
row-local rule's update on the rows a sparse gradient touches instead of the whole table (the
tables of one row shape together, on one scratch).

Tiers: a chunk's update runs traced (its first call traces in ~0.1-0.5 s), and once it has run
``XLA_AFTER`` times XLA compiles it, fusing the rule's dozens of small kernels (Adam's update
and pull 1.1-1.7x faster on CPU, plain SGD 0.8-1.4x: dlrm's 26 tables once slower;
``benchmarks/results/ps_apply_keras_xla.json``). A compile costs 0.2-3.3 s a chunk, which a trial
of a hundred steps would not earn back, while a training run does. Only
Keras' own optimizers compile: their rules treat a zero slice as no gradient, so sparse rows are
padded to a few compiled shapes; a user's subclass may not, and stays traced. A chunk XLA cannot
compile runs traced.
"""
from __future__ import annotations

import logging
import os

import numpy as np

from autosync.runtime.tf_arrays import aligned_empty, row_groups, spec, tensor
from strategy_space.errors import ConfigError

_log = logging.getLogger(__name__)
# the fewest rows a sparse gradient is padded to for the compiled update (see ``padded_rows``)
MIN_ROW_BUCKET = 8
# updates of a chunk run traced before XLA compiles it (``ChunkUpdates``)
XLA_AFTER = 256
# built-in optimizers whose update leaves a row without gradient as it was and reads no other row,
# though Keras computes it over the whole variable (Adagrad's sparse step divides by, and checks
# for zeros, the whole table's sqrt(accumulator + epsilon)): the rows a step touches, gathered,
# updated by the rule and written back, give the same values, and so do the rows of many tables
# of one row shape updated on one scratch at once (``ChunkUpdates._row_update``)
ROW_LOCAL = frozenset({"adagrad"})


def xla_after_from_env() -> int | None:
    """``AUTOSYNC_KERAS_XLA_AFTER`` (read where the update runs, and checked by every command before
    Ray starts: ``optimizers.check_optimizer_config``): the updates of a chunk before XLA compiles
    it, or ``off``; ``XLA_AFTER`` when unset.

    Raises:
        ConfigError: neither a count nor ``off``.
    """
    text = os.environ.get("AUTOSYNC_KERAS_XLA_AFTER", "").strip().lower()
    if not text:
        return XLA_AFTER
    if text == "off":
        return None
    if not text.isdigit():
        raise ConfigError(f"AUTOSYNC_KERAS_XLA_AFTER={text!r}: give a count of updates (0 compiles from the first) "
                          f"or 'off'")
    return int(text)


def row_bucket(n: int) -> int:
    """The number of rows ``n`` sparse rows are padded to: the next power of two, at least
    ``MIN_ROW_BUCKET``, so that XLA compiles a chunk's update for a few shapes, not one per row
    count (a push's rows vary from step to step)."""
    return max(MIN_ROW_BUCKET, 1 << max(int(n) - 1, 0).bit_length())


def padded_rows(ids, values, dtype, size: int | None = None, num_rows: int | None = None) -> tuple:
    """``(ids, values)`` padded to ``size`` rows (default ``row_bucket``) with zero slices of rows
    0, 1, 2, ... (below ``num_rows``, the variable's: distinct rows, so that no row takes many
    writes), ``values`` as ``dtype``. A zero slice changes nothing in the updates of Keras' own
    optimizers: they add the slices up, or transform each one by a function that keeps zero (a
    square, an absolute value, a clip), before any arithmetic reads them, and a norm over the
    slices is the same with zeros beside them."""
    ids, values = np.asarray(ids), np.asarray(values)
    n = len(ids)
    size = row_bucket(n) if size is None else size
    if size == n:
        return ids, values
    out_ids = aligned_empty((size,), np.int64)
    out_ids[:n] = ids
    out_ids[n:] = np.arange(size - n) % (num_rows or 1)
    out_values = aligned_empty((size,) + values.shape[1:], dtype)
    out_values[:n] = values
    out_values[n:] = 0
    return out_ids, out_values


def new_optimizer(cls, config: dict):
    """A ``cls`` optimizer from ``config`` as the runtime applies it: without ``global_clipnorm``
    (its scale is applied before: clipping here would use the norm of these shards alone), loss
    scaling, dynamic or fixed (the gradients arrive unscaled, a skipped step never arrives) and
    ``gradient_accumulation_steps`` (accumulated gradients arrive averaged), a schedule then
    evaluated at Keras' count of batches (module doc)."""
    import keras

    from autosync.runtime.optimizer_config import CONSTRAINED, NO_DECAY, USER_CLASSES

    from autosync.runtime.loss_scale import LOSS_SCALE

    own = ("class", "global_clipnorm", "gradient_accumulation_steps", "loss_scale_factor", USER_CLASSES, NO_DECAY,
           CONSTRAINED, LOSS_SCALE)
    # a user's schedule class is found by its name among the classes the config carries
    with keras.saving.custom_object_scope(config.get(USER_CLASSES) or {}):
        optimizer = cls.from_config({k: v for k, v in config.items() if k not in own})
    accumulate = int(config.get("gradient_accumulation_steps") or 1)
    schedule = getattr(optimizer, "_learning_rate", None)   # the property gives its value
    if accumulate > 1 and isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
        optimizer.learning_rate = at_batches(schedule, accumulate)
    return optimizer


def at_batches(schedule, n: int):
    """``schedule`` evaluated where Keras evaluates it under gradient accumulation of ``n``
    batches: update ``t`` at batch count ``(t + 1) n - 1``."""
    import keras

    class AtBatches(keras.optimizers.schedules.LearningRateSchedule):
        def __call__(self, step):
            return schedule((step + 1) * n - 1)

        def get_config(self):
            return {"schedule": keras.saving.serialize_keras_object(schedule), "n": n}

    return AtBatches()


def traced(function, specs: list, xla: bool = False):
    """``function`` of one list of tensors traced once for ``specs``, called through the concrete
    function's flat entry point (``fast_call``: tf.function's per-call binding of arguments costs
    more than a small shard's update or read); compiled by XLA, once per shape, if ``xla``."""
    from autosync.runtime.fast_call import concrete_flat

    return concrete_flat(function, specs, jit_compile=xla)[0]


class ChunkUpdates:
    """The update functions of ``owner``'s chunks (a ``KerasOptimizer``: its ``optimizer`` and
    ``variables``), by chunk: the keys updated together and which of them are sparse.

    Args:
        owner: the ``KerasOptimizer``.
        config: its optimizer's ``keras_optimizer_config``.
        compiles: whether XLA may compile its updates (Keras' own optimizers).
        xla_after: updates of a chunk before XLA compiles it; None: never; -1:
            ``AUTOSYNC_KERAS_XLA_AFTER`` (``xla_after_from_env``).
        row_local: whether a row-local rule (``ROW_LOCAL``) updates a sparse gradient's rows
            alone (False: on the whole variable, for comparison); never under weight decay or
            a moving average, which Keras applies to every row.
    """

    def __init__(self, owner, config: dict, compiles: bool, xla_after: int | None = -1, row_local: bool = True):
        if xla_after == -1:
            xla_after = xla_after_from_env()
        self.owner, self.config = owner, config
        self.xla_after = xla_after if compiles else None
        self.row_local = (row_local and str(config.get("class", "")).lower() in ROW_LOCAL
                          and not config.get("weight_decay") and not config.get("use_ema"))
        self.xla_fallbacks = 0   # chunks whose compiled update failed to build, run as traced instead
        self.compiled = 0   # updates run compiled by XLA
        self.reset()

    def reset(self) -> None:
        """Forget every function and scratch (the owner's variables were made anew)."""
        self.functions: dict = {}   # chunk (+ xla, rows) -> its traced or compiled update
        self.calls: dict = {}   # chunk -> its updates so far (traced until ``xla_after``)
        self.rows: dict = {}    # (chunk, i) -> the rows sparse gradient i of the chunk is padded to
        self.groups: dict = {}   # chunk -> its row-local rule's groups of sparse keys (``row_groups``)
        # row shape and dtype -> (rows, scratch variable, its optimizer, its slots) of ``_row_update``
        self.row_opts: dict = {}
        self.slots: dict = {}   # sparse key -> its slots in the order of a scratch's (``_row_slots``)

    def flat(self, iteration: int, keys: tuple, sparse: tuple, grads: dict) -> tuple:
        """The chunk's arguments, and how it runs: ``(chunk, flat, compiled, rows)`` for ``run``
        (``rows``: per key, the scratch rows of its ``_row_update``, 0 for none). Joining the
        sparse gradients of one row shape into one array, as a pull's ids are (``gather``),
        measured neither faster nor slower here (ncf and dlrm, SGD and Adam, compiled and traced,
        interleaved in one process: within 3 %), so each goes in as it is."""
        chunk = (keys, sparse)
        rows = [0] * len(keys)
        for group in self.row_groups(chunk):
            size = self._row_scratch(keys[group[0]], sum(len(grads[keys[i]][0]) for i in group))
            for i in group:
                rows[i] = size
        rows = tuple(rows)
        compiled = self._xla_ready(chunk) and not any(rows)   # (the distinct rows' count is not static)
        flat = [tensor(np.array(iteration, np.int64), np.int64)]
        for i, (key, is_sparse) in enumerate(zip(keys, sparse)):
            g, dtype = grads[key], self.owner.variables[key].dtype
            if is_sparse:
                ids, values = self._padded(chunk, i, g[0], g[1], dtype) if compiled else (g[0], g[1])
                flat += [tensor(ids, np.int64), tensor(values, dtype)]
            else:
                flat.append(tensor(g, dtype))
        return chunk, flat, compiled, rows

    def row_groups(self, chunk: tuple) -> list[list[int]]:
        """Positions in the chunk's keys of the sparse gradients a row-local rule updates together
        on one scratch: those of one row shape and dtype (``tf_arrays.row_groups``), each alone
        under ``clipnorm`` (which clips each variable by its own norm); none when the rule is not
        row-local."""
        if not self.row_local:
            return []
        groups = self.groups.get(chunk)
        if groups is None:
            keys, sparse = chunk
            at = [i for i, is_sparse in enumerate(sparse) if is_sparse]
            variables = [self.owner.variables[keys[i]] for i in at]
            groups = [[at[j] for j in g]
                      for g in row_groups([v.shape for v in variables], [v.dtype for v in variables])]
            if self.config.get("clipnorm") is not None:
                groups = [[i] for g in groups for i in g]
            self.groups[chunk] = groups
        return groups

    def _xla_ready(self, chunk: tuple) -> bool:
        """Whether this update of ``chunk`` (its keys, which of them are sparse) runs compiled."""
        calls = self.calls[chunk] = self.calls.get(chunk, 0) + 1
        return self.xla_after is not None and calls > self.xla_after and (chunk + ("traced",)) not in self.functions

    def _padded(self, chunk: tuple, i: int, ids, values, dtype) -> tuple:
        """Sparse gradient ``i`` of ``chunk`` padded for its compiled update: to ``row_bucket`` rows,
        or to the most rows it was compiled for already (zero slices cost less than a compile)."""
        size = self.rows[chunk + (i,)] = max(row_bucket(len(ids)), self.rows.get(chunk + (i,), 0))
        return padded_rows(ids, values, dtype, size, self.owner.variables[chunk[0][i]].shape[0])

    def run(self, chunk: tuple, flat: list, compiled: bool, rows: tuple = ()) -> list:
        """The chunk's update on ``flat``, ``compiled`` by XLA or traced; returns (traced) the
        values of its dense variables after it (``function``). A chunk whose compiled update
        cannot be built (an operation XLA lacks) runs as traced from then on: XLA builds before it
        runs anything, so nothing was applied by the failed call (an error the traced update raises
        too is raised from there). The rows it was padded to change nothing."""
        import tensorflow as tf

        if not compiled:
            return self.function(*chunk, xla=False, rows=rows)(flat)
        try:
            out = self.function(*chunk, xla=True)(flat)
            self.compiled += 1
            return out
        except (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError, tf.errors.InternalError) as e:
            self.functions[chunk + ("traced",)] = True
            self.xla_fallbacks += 1
            _log.info("the optimizer's update runs without XLA (%s)", str(e).splitlines()[0][:200])
            return self.function(*chunk, xla=False)(flat)

    def function(self, keys: tuple, sparse: tuple, xla: bool = False, rows: tuple = ()):
        """One traced update per chunk (its keys, which of them get rows): eager Keras pays Python
        per operation. It takes the step's iteration, then the gradients flat (a sparse one as its
        row ids then its values, any number of rows), builds the ``IndexedSlices`` inside, and,
        traced, returns the dense variables' values after the update (the pull that follows reads
        them: one call, not two). ``rows``: per key, the scratch rows of its ``_row_update`` (0: the
        rule on the variable)."""
        import tensorflow as tf

        rows = rows or (0,) * len(keys)
        name = (keys, sparse, xla) + ((rows,) if any(rows) else ())
        fn = self.functions.get(name)
        if fn is None:
            variables = [self.owner.variables[k] for k in keys]
            together = self.row_groups((keys, sparse))
            shapes = [tf.constant(v.shape, tf.int64) for v in variables]
            specs = [spec((), np.int64)]   # the step's iteration, set inside (an eager assign: 0.05-0.1 ms)
            for var, is_sparse in zip(variables, sparse):
                specs += ([spec((None,), np.int64), spec((None,) + tuple(var.shape[1:]), var.dtype)] if is_sparse
                          else [spec(tuple(var.shape), var.dtype)])

            def update(flat):
                self.owner.optimizer.iterations.assign(flat[0])
                given, at = [], 1
                for is_sparse in sparse:
                    given.append((flat[at], flat[at + 1]) if is_sparse else flat[at])
                    at += 2 if is_sparse else 1
                for group in together:
                    self._row_update([keys[i] for i in group], flat[0], [given[i] for i in group])
                grads, on = [], []
                for g, var, is_sparse, shape, n in zip(given, variables, sparse, shapes, rows):
                    if n:
                        continue   # updated by its rows above
                    grads.append(tf.IndexedSlices(g[1], g[0], shape) if is_sparse else g)
                    on.append(var)
                if on:
                    self.owner.optimizer.apply(grads, on)
                # compiled: none (XLA would copy each value into an output of its own, 13 MB a
                # step for lm1b-small's softmax); traced, a read shares the variable's buffer
                return [] if xla else [v.value.read_value() for v, is_sparse in zip(variables, sparse) if not is_sparse]

            fn = self.functions[name] = traced(update, specs, xla)
        return fn

    def _row_scratch(self, key, slices: int) -> int:
        """The scratch rows of ``key``'s row shape and dtype for ``_row_update``s of ``slices``
        slices (``row_bucket``), made (or made larger) first: a variable of that many rows and an
        optimizer of its own, configured as this one, whose slots stand for the tables' slots'
        rows; every table of that row shape and dtype uses it."""
        import keras

        var = self.owner.variables[key]
        kind = (tuple(var.shape[1:]), np.dtype(var.dtype))
        need = row_bucket(slices)
        have = self.row_opts.get(kind)
        if have is not None and have[0] >= need:
            return have[0]
        scratch = keras.Variable(np.zeros((need,) + kind[0], kind[1]), name="rows")
        optimizer = new_optimizer(type(self.owner.optimizer), self.config)
        optimizer.build([scratch])
        self.row_opts[kind] = (need, scratch, optimizer, [v for v in optimizer.variables if v.name.startswith("rows_")])
        return need

    def _row_slots(self, key, mine: list) -> list:
        """``key``'s slots in the order of a scratch's slots ``mine`` (checked alike)."""
        slots = self.slots.get(key)
        if slots is None:
            name = self.owner.variables[key].name
            slots = self.slots[key] = [v for v in self.owner.optimizer.variables if v.name.startswith(f"{name}_")]
            if len(slots) != len(mine) or any(tuple(a.shape[1:]) != tuple(b.shape[1:]) for a, b in zip(slots, mine)):
                raise RuntimeError(f"the slots of {name} ({[v.name for v in slots]}) do not match a scratch "
                                   f"variable's ({[v.name for v in mine]})")
        return slots

    def _row_update(self, keys: list, iteration, given: list) -> None:
        """Inside a traced update: the rule on the rows that the sparse gradients ``given``
        (``(ids, values)`` of each of ``keys``, tables of one row shape and dtype) touch, alone (a
        row-local rule, ``ROW_LOCAL``). Each table's distinct rows and their slots' rows are
        gathered into the scratch variable and slots one table after the other (the rows past them
        hold row 0 of the last and get no gradient), the optimizer of the scratch applies all the
        slices there at once as Keras applies them to each table (repeated rows, each slice squared
        as it comes; element-wise, so a table's rows see only its own slices), and each table's
        rows are written back."""
        import tensorflow as tf

        variables = [self.owner.variables[k] for k in keys]
        size, scratch, optimizer, mine = self.row_opts[(tuple(variables[0].shape[1:]), np.dtype(variables[0].dtype))]
        slots = [self._row_slots(k, mine) for k in keys]
        distinct, where, counts, total = [], [], [], tf.constant(0, tf.int64)
        for ids, _ in given:
            rows, at = tf.unique(ids)
            distinct.append(rows)
            where.append(tf.cast(at, tf.int64) + total)
            counts.append(tf.size(rows, out_type=tf.int64))
            total += counts[-1]
        take = distinct[:-1] + [tf.pad(distinct[-1], [[0, size - total]])]

        def rows_of(tables):
            return tf.concat([tf.gather(t.value, r) for t, r in zip(tables, take)], 0)

        scratch.assign(rows_of(variables))
        for j, row in enumerate(mine):
            row.assign(rows_of([s[j] for s in slots]))
        optimizer.iterations.assign(iteration)
        shape = tf.constant(tuple(scratch.shape), tf.int64)
        values = tf.concat([v for _, v in given], 0)
        optimizer.apply([tf.IndexedSlices(values, tf.concat(where, 0), shape)], [scratch])
        sizes = tf.stack(counts + [size - total])

        def write_back(source, tables):
            for table, part, rows in zip(tables, tf.split(source.value, sizes, num=len(keys) + 1), distinct):
                table.value.scatter_update(tf.IndexedSlices(part, rows))

        write_back(scratch, variables)
        for j, row in enumerate(mine):
            write_back(row, [s[j] for s in slots])
