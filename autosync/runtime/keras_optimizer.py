"""The model's own Keras optimizer object applied to variable shards held as numpy arrays: what a
parameter server or the numpy all-reduce channel runs when the numpy rules of ``optimizers`` do
not cover the configuration (another optimizer, a user's subclass, a learning-rate schedule,
clipping).

The optimizer is rebuilt from ``keras_optimizer_config`` (its ``get_config()`` plus its class) with
the class's own ``from_config``, so a ``LearningRateSchedule`` is deserialized with it. Each shard
is a ``keras.Variable``; an update is one ``apply`` of the shards that have a gradient, with the
optimizer's ``iterations`` set to the global step first, so a schedule is evaluated at the global
step whatever the number of chunks or shards applied separately.

What is exact and what is not (``check_keras_apply`` refuses the rest before any PS starts):
- ``clipvalue`` and ``weight_decay`` are element-wise: exact on any shard.
- ``clipnorm`` clips each variable by its own norm: exact when the variable is one shard.
- Lamb, Adafactor and Muon read whole variables: exact when the variable is one shard. A user's
  subclass is taken to be element-wise (its ``update_step`` sees a shard as a variable).
- ``global_clipnorm`` needs the norm over every gradient of the step, whichever synchronizer
  carries it: the shards agree on it before any update (``sync.base``'s held steps: each channel
  gives its part of the squared norm, the worker sums them and hands every channel the same
  scale), so the optimizer here is built without it and is given gradients already scaled. In
  the graph alone, Keras clips itself; ``check_global_clipnorm`` refuses staleness.
- ``use_ema``: Keras updates the moving average of every variable the optimizer holds at each
  ``apply``, so an actor under it applies one chunk per step (``engine``), and ``finalize`` at the
  end of ``Trainer.fit`` gives every shard its average, as Keras' ``fit`` ends.
- ``gradient_accumulation_steps`` (n): a worker draws n batches per step and sends the mean of
  their gradients (``worker._gradients_of``), so update ``t`` is applied here as Keras applies its
  (t+1)-th: the update rule sees ``iterations`` t (Keras counts updates there), a learning-rate
  schedule the batch count ``(t + 1) n - 1`` (Keras evaluates it at every batch's count).
- Speed: a chunk's update runs traced, and XLA-compiled once the chunk has run ``XLA_AFTER``
  times (``KerasOptimizer``: Keras' own optimizers, sparse rows padded with zero slices to a few
  shapes); a row-local rule (Adagrad) updates the rows a sparse gradient touches, not the table.
- A sparse gradient is applied as one ``IndexedSlices`` in the form the rule reads it
  (``optimizers.sparse_form``): rows summed per worker (``slices.dedup_rows``) for an optimizer
  linear in its slices (SGD, Lion); every slice as the workers' tapes made it, repeated rows not
  summed, for one that transforms each slice first (RMSprop's or Adam's square, Adamax's abs,
  Ftrl, clipping by value or by the slices' norm), as Keras applies the ``IndexedSlices`` of the
  global batch (the numpy all-reduce gathers the slices as they are too); rows summed over every
  worker under ``global_clipnorm`` or gradient accumulation, where Keras hands the rule a dense
  gradient, and unique rows make the dense update.
"""
from __future__ import annotations

import importlib
import logging
import os

import numpy as np

from autosync.runtime.optimizer_state import keras_state, keras_state_sizes
from strategy_space.errors import ConfigError

# built-in optimizers whose update reads a sparse gradient only through linear operations before
# it is densified: summed rows give them the same update as the single slices
_LINEAR_IN_SLICES = frozenset({"sgd", "lion"})
# built-in optimizers whose update reads a whole variable (a norm, a row/column factor, a matrix
# iteration): a shard alone gives another update
_WHOLE_VARIABLE = frozenset({"lamb", "adafactor", "muon"})
# built-in optimizers whose update leaves a row without gradient as it was and reads no other row,
# though Keras computes it over the whole variable (Adagrad's sparse step divides by, and checks
# for zeros, the whole table's sqrt(accumulator + epsilon)): the rows a step touches, gathered,
# updated by the rule and written back, give the same values (``KerasOptimizer._row_update``)
_ROW_LOCAL = frozenset({"adagrad"})
# wrappers of other optimizers: apply the inner one in optimizer_fn instead
_WRAPPERS = frozenset({"LossScaleOptimizer", "MultiOptimizer", "OptimizerMap"})
# the alignment TensorFlow's CPU kernels require of a tensor's buffer (Eigen's largest packet)
TF_ALIGN = 64
# the fewest rows a sparse gradient is padded to for the compiled update (see ``padded_rows``)
MIN_ROW_BUCKET = 8
# updates of a chunk run traced before XLA compiles it (``KerasOptimizer``)
XLA_AFTER = 256
_log = logging.getLogger(__name__)


def optimizer_class(config: dict):
    """The Keras optimizer class named by ``config['class']`` (a Keras name such as ``RMSprop`` or
    a qualified ``module.Class`` of a subclass).

    Raises:
        ConfigError: the class cannot be imported or is not a Keras optimizer.
    """
    from autosync.tflog import quiet_startup

    quiet_startup()   # a parameter server's process may import TensorFlow here first
    import keras

    name = str(config.get("class", config.get("name", "")))
    if "." not in name:
        cls = getattr(keras.optimizers, name, None)
    else:
        module, _, qual = name.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), qual, None)
        except ImportError as e:
            raise ConfigError(f"optimizer class {name!r} cannot be imported where updates run ({e}); "
                              f"define it in an importable module") from None
    if name in _WRAPPERS:
        raise ConfigError(f"optimizer {name} wraps other optimizers, which the runtime cannot split across "
                          f"shards; return the inner optimizer from optimizer_fn")
    if not (isinstance(cls, type) and issubclass(cls, keras.optimizers.Optimizer)):
        raise ConfigError(f"optimizer {name!r} is not a keras.optimizers.Optimizer class")
    return cls


def reads_whole_variables(config: dict) -> bool:
    """Whether this optimizer's update reads a whole variable (a norm, a factor), so a shard alone
    gets another update."""
    return str(config.get("class", "")).lower() in _WHOLE_VARIABLE


def linear_in_slices(config: dict) -> bool:
    """Whether summed sparse rows give this optimizer the update its single slices would."""
    return str(config.get("class", "")).lower() in _LINEAR_IN_SLICES


def check_keras_apply(config: dict, shards, names) -> None:
    """Refuse what a Keras optimizer applied shard by shard cannot honour (see the module doc): for
    a configuration the numpy rules do not run (``optimizers.numpy_rules``).

    Args:
        config: the optimizer's ``keras_optimizer_config``.
        shards: the shards updated outside the training graph (parameter servers, the numpy
            all-reduce channel): objects with ``var_index``/``key``, ``num_shards`` and ``sparse``.
        names: variable names by index, for messages.

    Raises:
        ConfigError: ``clipnorm``, Lamb, Adafactor or Muon on a partitioned variable; see also
            ``check_global_clipnorm``.
    """
    problems = []
    for s in shards:
        var = s.key[0] if hasattr(s, "key") and isinstance(s.key, tuple) else s.var_index
        if config.get("clipnorm") is not None and s.num_shards > 1:
            problems.append(f"optimizer option clipnorm={config['clipnorm']!r} clips each variable by its own norm, "
                            f"but {names[var]} is split into {s.num_shards} shards updated separately; "
                            f"do not partition it, or use clipvalue")
        if reads_whole_variables(config) and s.num_shards > 1:
            problems.append(f"optimizer {config.get('class')!r} reads whole variables (norms or factors), "
                            f"but {names[var]} is split into {s.num_shards} shards updated separately; "
                            f"do not partition it")
    if problems:
        raise ConfigError(sorted(set(problems)))


def check_global_clipnorm(config: dict, plan, graph_beside_others: bool) -> None:
    """Refuse a ``global_clipnorm`` a plan cannot honour: every gradient of a step must be in
    before any update (no staleness, no asynchronous PS), and under gradient accumulation the
    ``graph`` backend cannot hold its part beside other synchronizers.

    Args:
        config: the optimizer's ``keras_optimizer_config``.
        plan: the trial's ``SyncPlan``.
        graph_beside_others: some variables are all-reduced in the graph, others elsewhere.

    Raises:
        ConfigError: saying which part of the strategy and what to change.
    """
    clip = config.get("global_clipnorm")
    if clip is None:
        return
    head = f"optimizer option global_clipnorm={clip!r} clips by the norm of all of a step's gradients"
    if plan.ps_actors and (not plan.sync or plan.staleness):
        mode = "asynchronous" if not plan.sync else f"staleness {plan.staleness}"
        raise ConfigError(f"{head}, but this strategy's parameter servers apply updates without waiting for every "
                          f"worker ({mode}); use staleness 0, or clipnorm (per variable)")
    if (config.get("gradient_accumulation_steps") or 1) > 1 and graph_beside_others:
        raise ConfigError(f"{head}, but with gradient_accumulation_steps the graph all-reduce backend accumulates "
                          f"inside the training step, which cannot wait for the other synchronizers' part of the "
                          f"norm; beside parameter servers use backend auto (nccl on GPUs there), nccl or gloo, "
                          f"or put every variable in the graph")


class KerasOptimizer:
    """The interface of ``optimizers.NumpyOptimizer`` over a real Keras optimizer.

    The shards live in ``keras.Variable``s, updated in place by TensorFlow. ``params[key]`` is
    filled from its variable only when read (``value``, ``snapshot(s)``, ``gather``): a parameter server
    whose workers pull an embedding by rows gathers those rows and never copies the whole table,
    and a dense value is handed out as a read-only view of the variable's buffer (no copy).
    Between an update and the next read, ``params[key]`` is a read-only placeholder of the right
    shape that holds NaN (a read that bypasses this class shows at once, never as old weights).

    A value handed out is never changed under its reader: TensorFlow updates a variable's buffer in
    place only while nothing else holds it, and copies it first otherwise (copy on write); a
    variable updated by rows keeps its buffer to itself and every whole read is a copy.
    """

    squares_slices = False  # Keras squares what it is given; the summed squares are of no use
    ahead = 0   # updates finished from an update ahead: none (``update_ahead``)

    def __init__(self, config: dict, xla_after: int | None = -1, row_local: bool = True):
        cls = optimizer_class(config)
        # Tiers, as a JIT does: a chunk's update runs traced (its first call traces in ~0.1-0.5 s),
        # and once it has run ``xla_after`` times XLA compiles it, fusing the rule's dozens of
        # small kernels (1.1-2x faster updates on CPU, Adam the most; ``runtime_overhead.py
        # --apply``). A compile costs 0.2-3 s a chunk, which a trial of a hundred steps would not
        # earn back, while a training run does. Only Keras' own
        # optimizers compile: their rules treat a zero slice as no gradient, so sparse rows are
        # padded to a few compiled shapes; a user's subclass may not, and stays traced.
        # None: never; -1: AUTOSYNC_KERAS_XLA_AFTER (a count, or "off"), else XLA_AFTER.
        if xla_after == -1:
            xla_after = xla_after_from_env()
        self.xla_after = xla_after if cls.__module__.startswith("keras.") else None
        self.xla_fallbacks = 0   # chunks whose compiled update failed to build, run as traced instead
        self.compiled = 0   # updates run compiled by XLA
        self._calls: dict = {}   # chunk -> its updates so far (traced until ``xla_after``)
        self._rows: dict = {}    # chunk -> the rows each of its sparse gradients is padded to
        self._config = config
        self.optimizer = _new_optimizer(cls, config)
        # a row-local rule on a sparse gradient runs on the rows it touches (``_row_update``); not
        # under weight decay or a moving average, which Keras applies to every row (``row_local``
        # False: the rule on the whole variable, for comparison)
        self.row_local = (row_local and str(config.get("class", "")).lower() in _ROW_LOCAL
                          and not config.get("weight_decay") and not config.get("use_ema"))
        self._row_opts: dict = {}   # sparse key -> (rows, scratch variable, its optimizer, slot pairs)
        self.variables, self._order, self._functions = {}, [], {}   # key -> keras.Variable; keys; traced calls
        self._stale, self.copies = set(), 0   # keys whose params entry is a placeholder (the variable holds it)

    def add_variable(self, key, value: np.ndarray) -> None:
        self._order.append(key)

    def update_ahead(self, iteration: int, params: dict, keys) -> None:
        """Nothing is computed ahead (``update_ahead``): the Keras rule runs in one traced call."""

    def adopt(self, params: dict, key) -> None:
        """Nothing to do: the variables are this optimizer's own."""

    def value(self, params: dict, key) -> np.ndarray:
        """The current whole value of ``key`` (read-only; stored back into ``params``)."""
        if key in self._stale:
            self._fresh(params, key, self.variables[key].value.read_value())
        return params[key]

    def _fresh(self, params: dict, key, tensor) -> None:
        """Store ``tensor`` (the variable's value just read) as ``params[key]``: a read-only view."""
        view = tensor._numpy()
        view.flags.writeable = False
        params[key] = view
        self._stale.discard(key)

    def snapshot(self, params: dict, key) -> np.ndarray:
        """The whole value of ``key`` for a reader that may keep it while later updates run (see
        the class doc: TensorFlow copies on write)."""
        return self.value(params, key)

    def snapshots(self, params: dict, keys) -> dict:
        """``snapshot`` of each of ``keys``, those to read from the variables read in one call."""
        keys = list(keys)
        asked = set(keys)
        stale = tuple(k for k in self._order if k in self._stale and k in asked)
        if stale:
            fn = self._functions.get(("read", stale))
            if fn is None:
                fn = self._functions[("read", stale)] = self._concrete(
                    lambda _: [self.variables[k].value.read_value() for k in stale], [])
            for key, tensor in zip(stale, fn([])):
                self._fresh(params, key, tensor)
        return {k: params[k] for k in keys}

    def gather(self, params: dict, rows: dict) -> dict:
        """Copies of some rows of some keys (``key -> row ids``), gathered from the variables in
        one call, not from whole copies."""
        out = {k: params[k][ids] for k, ids in rows.items() if k not in self._stale}
        keys = tuple(k for k in self._order if k in rows and k in self._stale)
        if keys:
            import tensorflow as tf

            fn = self._functions.get(("gather", keys))
            if fn is None:
                fn = self._functions[("gather", keys)] = self._concrete(
                    lambda ids: [tf.gather(self.variables[k].value, i) for k, i in zip(keys, ids)],
                    [_spec((None,), np.int64) for _ in keys])
            for key, value in zip(keys, fn([_tensor(rows[k], np.int64) for k in keys])):
                out[key] = value._numpy()
        return out

    @staticmethod
    def _concrete(function, specs: list, xla: bool = False):
        """``function`` of one list of tensors traced once for ``specs``, called through the concrete
        function's flat entry point (``fast_call``): tf.function's per-call binding of arguments
        costs more than the update of a small shard. ``xla``: compiled by XLA (once per shape)."""
        from autosync.runtime.fast_call import concrete_flat

        return concrete_flat(function, specs, jit_compile=xla)[0]

    def _xla_ready(self, chunk: tuple) -> bool:
        """Whether this update of ``chunk`` (its keys, which of them are sparse) runs compiled."""
        calls = self._calls[chunk] = self._calls.get(chunk, 0) + 1
        return self.xla_after is not None and calls > self.xla_after and (chunk + ("traced",)) not in self._functions

    def _padded(self, chunk: tuple, i: int, ids, values, dtype) -> tuple:
        """Sparse gradient ``i`` of ``chunk`` padded for its compiled update: to ``row_bucket`` rows,
        or to the most rows it was compiled for already (zero slices cost less than a compile)."""
        size = self._rows[chunk + (i,)] = max(row_bucket(len(ids)), self._rows.get(chunk + (i,), 0))
        return padded_rows(ids, values, dtype, size, self.variables[chunk[0][i]].shape[0])

    def _run_update(self, chunk: tuple, flat: list, compiled: bool, rows: tuple = ()) -> None:
        """The chunk's update on ``flat``, ``compiled`` by XLA or traced. A chunk whose compiled
        update cannot be built (an operation XLA lacks) runs as traced from then on: XLA builds
        before it runs anything, so nothing was applied by the failed call (an error the traced
        update raises too is raised from there). The rows it was padded to change nothing."""
        import tensorflow as tf

        if not compiled:
            return self._compiled(*chunk, xla=False, rows=rows)(flat)
        try:
            out = self._compiled(*chunk, xla=True)(flat)
            self.compiled += 1
            return out
        except (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError, tf.errors.InternalError) as e:
            self._functions[chunk + ("traced",)] = True
            self.xla_fallbacks += 1
            _log.info("the optimizer's update runs without XLA (%s)", str(e).splitlines()[0][:200])
            return self._compiled(*chunk, xla=False)(flat)

    def _compiled(self, keys: tuple, sparse: tuple, xla: bool = False, rows: tuple = ()):
        """One traced update per chunk (its keys, which of them get rows): eager Keras pays Python
        per operation. It takes the step's iteration, then the gradients flat (a sparse one as its
        row ids then its values, any number of rows) and builds the ``IndexedSlices`` inside.
        ``rows``: per key, the scratch rows of its ``_row_update`` (0: the rule on the variable)."""
        import tensorflow as tf

        rows = rows or (0,) * len(keys)
        fn = self._functions.get((keys, sparse, xla) + ((rows,) if any(rows) else ()))
        if fn is None:
            variables = [self.variables[k] for k in keys]
            shapes = [tf.constant(v.shape, tf.int64) for v in variables]
            specs = [_spec((), np.int64)]   # the step's iteration, set inside (an eager assign: 0.05-0.1 ms)
            for var, is_sparse in zip(variables, sparse):
                specs += ([_spec((None,), np.int64), _spec((None,) + tuple(var.shape[1:]), var.dtype)] if is_sparse
                          else [_spec(tuple(var.shape), var.dtype)])

            def update(flat):
                self.optimizer.iterations.assign(flat[0])
                grads, on, at = [], [], 1
                for key, var, is_sparse, shape, n in zip(keys, variables, sparse, shapes, rows):
                    if n:
                        self._row_update(key, flat[0], flat[at], flat[at + 1])
                    elif is_sparse:
                        grads.append(tf.IndexedSlices(flat[at + 1], flat[at], shape))
                        on.append(var)
                    else:
                        grads.append(flat[at])
                        on.append(var)
                    at += 2 if is_sparse else 1
                if on:
                    self.optimizer.apply(grads, on)
                return []

            fn = self._functions[(keys, sparse, xla) + ((rows,) if any(rows) else ())] = self._concrete(
                update, specs, xla)
        return fn

    def _row_scratch(self, key, slices: int) -> int:
        """The scratch rows ``key``'s ``_row_update`` of ``slices`` slices uses (``row_bucket``),
        made (or made larger) first: a variable of that many rows and an optimizer of its own,
        configured as this one, whose slots stand for the variable's slots' rows."""
        import keras

        need = row_bucket(slices)
        have = self._row_opts.get(key)
        if have is not None and have[0] >= need:
            return have[0]
        var = self.variables[key]
        scratch = keras.Variable(np.zeros((need,) + tuple(var.shape[1:]), var.dtype), name="rows")
        optimizer = _new_optimizer(type(self.optimizer), self._config)
        optimizer.build([scratch])
        slots = [v for v in self.optimizer.variables if v.name.startswith(f"{var.name}_")]
        mine = [v for v in optimizer.variables if v.name.startswith("rows_")]
        if len(slots) != len(mine) or any(tuple(a.shape[1:]) != tuple(b.shape[1:]) for a, b in zip(slots, mine)):
            raise RuntimeError(f"the slots of {var.name} ({[v.name for v in slots]}) do not match a scratch "
                               f"variable's ({[v.name for v in mine]})")
        self._row_opts[key] = (need, scratch, optimizer, list(zip(slots, mine)))
        return need

    def _row_update(self, key, iteration, ids, values) -> None:
        """Inside a traced update: the rule on the rows ``ids`` touches alone (a row-local rule,
        ``_ROW_LOCAL``). The distinct rows and their slots' rows are gathered into the scratch
        variable and slots (the rows past them hold row 0 and get no gradient), the optimizer of
        the scratch applies the slices there as Keras applies them (repeated rows, each slice
        squared as it comes), and the distinct rows are written back."""
        import tensorflow as tf

        size, scratch, optimizer, slots = self._row_opts[key]
        distinct, where = tf.unique(ids)
        count = tf.size(distinct)
        take = tf.pad(distinct, [[0, size - count]])
        scratch.assign(tf.gather(self.variables[key].value, take))
        for slot, row in slots:
            row.assign(tf.gather(slot.value, take))
        optimizer.iterations.assign(iteration)
        shape = tf.constant(tuple(scratch.shape), tf.int64)
        optimizer.apply([tf.IndexedSlices(values, tf.cast(where, tf.int64), shape)], [scratch])
        self.variables[key].value.scatter_update(tf.IndexedSlices(scratch.value[:count], distinct))
        for slot, row in slots:
            slot.value.scatter_update(tf.IndexedSlices(row.value[:count], distinct))

    def _build(self, params: dict) -> None:
        import keras

        for i, key in enumerate(self._order):   # named apart: the slots of each are named after it
            self.variables[key] = keras.Variable(np.array(params[key]), name=f"shard{i}")
        self._row_opts = {}
        self.optimizer.build([self.variables[k] for k in self._order])
        # state of the optimizer as a whole, beyond ``iterations`` (Nadam's ``u_product``): an
        # update of several chunks at one step must start each from the step's state. Slots of
        # the shards are named after them (``shard_...``), so they are told apart by name.
        self._global = [v for v in self.optimizer.variables
                        if v is not self.optimizer.iterations and not v.name.startswith("shard")]
        self._step_state = (None, [])

    def state(self, names=None) -> dict:
        """The optimizer's variables (iterations, slots, ...) as ``"keras/<i>" -> array``, in the
        optimizer's order (only ``names`` when given); empty before its first update built them."""
        return keras_state(self.optimizer.variables if self.variables else (), names)

    def state_sizes(self) -> dict:
        """name -> bytes of each array ``state`` returns."""
        return keras_state_sizes(self.optimizer.variables if self.variables else ())

    def load_state(self, params: dict, arrays: dict) -> list[str]:
        """Set the variables to ``params`` and the optimizer's state to ``state()``'s arrays (none:
        the checkpoint was taken before the first update). Returns the problems (nothing set)."""
        from autosync.runtime.optimizer_state import state_problems

        built_now = not self.variables
        if built_now:
            self._build(params)
        if arrays:
            want = {f"keras/{i}": tuple(v.shape) for i, v in enumerate(self.optimizer.variables)}
            problems = state_problems(want, arrays)
            if problems:
                if built_now:   # unbuilt again: the next update builds from the values kept
                    self.optimizer = type(self.optimizer).from_config(self.optimizer.get_config())
                    self.variables, self._functions = {}, {}
                return problems
        if not built_now:
            for key in self._order:
                self.variables[key].assign(params[key])
        for key in self._order:   # the variables hold the values: the arrays given are let go
            params[key] = _placeholder(params[key])
        self._stale = set(self._order)
        for i, v in enumerate(self.optimizer.variables if arrays else ()):
            v.assign(arrays[f"keras/{i}"])
        self._step_state = (None, [])
        return []

    def finalize(self, params: dict) -> None:
        """The end of ``fit`` under ``use_ema``: every shard takes its moving average (Keras'
        ``finalize_variable_values``); ``params`` entries become placeholders until read."""
        if not (self.variables and self.optimizer.use_ema):
            return
        self.optimizer.finalize_variable_values([self.variables[k] for k in self._order])
        for key in self._order:
            if key not in self._stale:
                params[key] = _placeholder(params[key])
                self._stale.add(key)

    def apply(self, iteration: int, params: dict, grads: dict) -> None:
        """One step of the Keras optimizer on the shards in ``grads`` (see ``NumpyOptimizer.apply``);
        ``params`` entries of the updated keys become placeholders until read (see the class doc)."""
        if not self.variables:
            self._build(params)
        keys = tuple(k for k in self._order if k in grads)
        sparse = tuple(isinstance(grads[k], tuple) for k in keys)
        chunk = (keys, sparse)
        rows = tuple(self._row_scratch(k, len(grads[k][0])) if is_sparse and self.row_local else 0
                     for k, is_sparse in zip(keys, sparse))
        compiled = self._xla_ready(chunk) and not any(rows)   # (the distinct rows' count is not static)
        flat = [_tensor(np.array(iteration, np.int64), np.int64)]
        for i, (key, is_sparse) in enumerate(zip(keys, sparse)):
            g, dtype = grads[key], self.variables[key].dtype
            if is_sparse:
                ids, values = self._padded(chunk, i, g[0], g[1], dtype) if compiled else (g[0], g[1])
                flat += [_tensor(ids, np.int64), _tensor(values, dtype)]
            else:
                flat.append(_tensor(g, dtype))
        if self._step_state[0] == iteration:   # another chunk of the same step
            for v, value in zip(self._global, self._step_state[1]):
                v.assign(value)
        else:
            self._step_state = (iteration, [v.numpy() for v in self._global])
        # (``ema_overwrite_frequency`` may overwrite every variable, not only those updated)
        for key in self._order if self.optimizer.use_ema else keys:
            # drop this holder's view of the old value, so that TensorFlow updates the variable
            # in place unless a reader still holds it
            if key not in self._stale:
                params[key] = _placeholder(params[key])
                self._stale.add(key)
        self._run_update(chunk, flat, compiled, rows)


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
    writes), ``values`` as ``dtype``. A zero slice
    changes nothing in the updates of Keras' own optimizers: they add the slices up, or transform
    each one by a function that keeps zero (a square, an absolute value, a clip), before any
    arithmetic reads them, and a norm over the slices is the same with zeros beside them."""
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


def _new_optimizer(cls, config: dict):
    """A ``cls`` optimizer from ``config`` as the runtime applies it: without ``global_clipnorm``
    (its scale is applied before: clipping here would use the norm of these shards alone) and
    ``gradient_accumulation_steps`` (accumulated gradients arrive averaged), a schedule then
    evaluated at Keras' count of batches (module doc)."""
    import keras

    own = ("class", "global_clipnorm", "gradient_accumulation_steps")
    optimizer = cls.from_config({k: v for k, v in config.items() if k not in own})
    accumulate = int(config.get("gradient_accumulation_steps") or 1)
    schedule = getattr(optimizer, "_learning_rate", None)   # the property gives its value
    if accumulate > 1 and isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
        optimizer.learning_rate = _at_batches(schedule, accumulate)
    return optimizer


def _at_batches(schedule, n: int):
    """``schedule`` evaluated where Keras evaluates it under gradient accumulation of ``n``
    batches: update ``t`` at batch count ``(t + 1) n - 1``."""
    import keras

    class AtBatches(keras.optimizers.schedules.LearningRateSchedule):
        def __call__(self, step):
            return schedule((step + 1) * n - 1)

        def get_config(self):
            return {"schedule": keras.saving.serialize_keras_object(schedule), "n": n}

    return AtBatches()


def _spec(shape: tuple, dtype):
    import tensorflow as tf

    return tf.TensorSpec(shape, tf.as_dtype(dtype))


def aligned_empty(shape, dtype) -> np.ndarray:
    """An uninitialized C-contiguous array whose data starts on a ``TF_ALIGN`` boundary: what
    TensorFlow can use without a copy (``_tensor``)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + TF_ALIGN, np.uint8)
    start = -raw.ctypes.data % TF_ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def aligned_copy(array, dtype=None) -> np.ndarray:
    """A writable copy of ``array`` (cast to ``dtype`` if given) in an ``aligned_empty`` array."""
    array = np.asarray(array)
    out = aligned_empty(array.shape, array.dtype if dtype is None else dtype)
    np.copyto(out, array, casting="unsafe")
    return out


def _tensor(array, dtype):
    """``array`` as a TensorFlow tensor of ``dtype``: the same memory when it is writable,
    contiguous, of that dtype and ``TF_ALIGN``-aligned (DLPack: no copy; TensorFlow aborts the
    process on a misaligned buffer, so nothing else goes that way), else one aligned copy."""
    import tensorflow as tf

    array = np.asarray(array)
    dtype = np.dtype(getattr(dtype, "as_numpy_dtype", dtype))
    if not (array.dtype == dtype and array.flags.c_contiguous and array.flags.writeable
            and array.ctypes.data % TF_ALIGN == 0):
        array = aligned_copy(array, dtype)
    return tf.experimental.dlpack.from_dlpack(array.__dlpack__())


def _placeholder(value: np.ndarray) -> np.ndarray:
    """A read-only array of ``value``'s shape and dtype that takes no memory: NaN (zero for a
    dtype without NaN)."""
    dtype = np.asarray(value).dtype
    fill = np.array(np.nan if np.issubdtype(dtype, np.inexact) else 0, dtype=dtype)
    return np.broadcast_to(fill, np.shape(value))
