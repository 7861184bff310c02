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
  times (``keras_update``: Keras' own optimizers, sparse rows padded with zero slices to a few
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

import numpy as np

from autosync.runtime.keras_update import ChunkUpdates, new_optimizer, traced
from autosync.runtime.optimizer_state import keras_state, keras_state_sizes
from autosync.runtime.reshard import from_keras_names, keras_names, key_text
from autosync.runtime.optimizer_config import CONSTRAINED, NO_DECAY, USER_CLASSES
from autosync.runtime.tf_arrays import joined, spec, tensor
from strategy_space.errors import ConfigError

# built-in optimizers whose update reads a sparse gradient only through linear operations before
# it is densified: summed rows give them the same update as the single slices
_LINEAR_IN_SLICES = frozenset({"sgd", "lion"})
# built-in optimizers whose update reads a whole variable (a norm, a row/column factor, a matrix
# iteration): a shard alone gives another update
_WHOLE_VARIABLE = frozenset({"lamb", "adafactor", "muon"})
# wrappers of other optimizers: apply the inner one in optimizer_fn instead
# (a LossScaleOptimizer is described by its inner one: ``loss_scale``)
_WRAPPERS = frozenset({"LossScaleOptimizer", "MultiOptimizer", "OptimizerMap"})


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
    carried = config.get(USER_CLASSES) or {}
    if "." not in name:
        cls = getattr(keras.optimizers, name, None)
    elif name.rpartition(".")[2] in carried:   # a user's class, carried by value (keras_optimizer_config)
        cls = carried[name.rpartition(".")[2]]
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


def whole_variable_reasons(config: dict) -> list[tuple[str, str]]:
    """Why this optimizer cannot update a variable split into shards updated separately, as
    ``(reason, fix)`` pairs (its rule reads the whole variable: ``clipnorm``'s norm, Lamb's trust
    ratio, Adafactor's factors); empty when shards are exact. Read by ``check_keras_apply`` and by
    the search, which then proposes no partitioned variable (``autosync.search_limits``)."""
    out = []
    if config.get("clipnorm") is not None:
        out.append((f"optimizer option clipnorm={config['clipnorm']!r} clips each variable by its own norm",
                    "do not partition it, or use clipvalue"))
    if reads_whole_variables(config):
        out.append((f"optimizer {config.get('class')!r} reads whole variables (norms or factors)",
                    "do not partition it"))
    return out


def check_keras_apply(config: dict, shards, names) -> None:
    """Refuse what a Keras optimizer applied shard by shard, outside the training graph, cannot
    honour (see the module doc; its shard-wise part is empty for the configurations the numpy rules
    run, ``optimizers.numpy_rules``).

    Args:
        config: the optimizer's ``keras_optimizer_config``.
        shards: the shards updated outside the training graph (parameter servers, the numpy
            all-reduce channel): objects with ``var_index``/``key``, ``num_shards`` and ``sparse``.
        names: variable names by index, for messages.

    Raises:
        ConfigError: ``clipnorm``, Lamb, Adafactor or Muon on a partitioned variable
            (``whole_variable_reasons``: none under the numpy rules' configurations), or a variable
            with a constraint among ``shards`` (``check_constraints``); see also ``check_global_clipnorm``.
    """
    check_constraints(config, shards, names)
    problems = []
    reasons = whole_variable_reasons(config)
    for s in shards:
        if s.num_shards > 1:
            problems.extend(f"{reason}, but {names[_var_index(s)]} is split into {s.num_shards} shards updated separately; "
                            f"{fix}" for reason, fix in reasons)
    if problems:
        raise ConfigError(sorted(set(problems)))


def _var_index(shard) -> int:
    """The variable a PS shard (``ShardRef``) or an all-reduce member (``ARMember``) belongs to."""
    key = getattr(shard, "key", None)
    return key[0] if isinstance(key, tuple) else shard.var_index


def check_constraints(config: dict, outside, names) -> None:
    """Refuse a variable with a constraint updated outside the training graph: Keras' optimizer
    applies ``kernel_constraint=NonNeg()``, ``MaxNorm`` ... to the variable after each update, and
    only the ``graph`` all-reduce updates with the model's own optimizer and variables; a parameter
    server or the numpy all-reduce channel would train the variable unconstrained.

    Args:
        config: the optimizer's ``keras_optimizer_config`` (with the workers' variables).
        outside: the shards updated outside the graph (objects with ``var_index`` or a ``key``).
        names: variable names by index.

    Raises:
        ConfigError: naming each such variable, its constraint, and what to do.
    """
    constrained = config.get(CONSTRAINED) or {}
    hit = sorted({names[_var_index(s)] for s in outside} & constrained.keys())
    if hit:
        raise ConfigError([f"variable {n} has a constraint ({constrained[n]}), which Keras applies after each update; "
                           f"only the graph all-reduce applies it here (a parameter server or the gloo/objectstore "
                           f"all-reduce would train it unconstrained): give it all_reduce with backend graph, one "
                           f"shard (autosync tune does), or drop the constraint" for n in hit])


def check_global_clipnorm(config: dict, plan, graph_beside_others: bool) -> None:
    """Refuse a ``global_clipnorm``, or dynamic loss scaling (``loss_scale``), a plan cannot honour:
    every gradient of a step must be in before any update (no staleness, no asynchronous PS), and
    under gradient accumulation the ``graph`` backend cannot hold its part beside other
    synchronizers (loss scaling is refused with accumulation altogether).

    Args:
        config: the optimizer's ``keras_optimizer_config``.
        plan: the trial's ``SyncPlan``.
        graph_beside_others: some variables are all-reduced in the graph, others elsewhere.

    Raises:
        ConfigError: saying which part of the strategy and what to change.
    """
    from autosync.runtime.loss_scale import LOSS_SCALE

    clip, scaled = config.get("global_clipnorm"), config.get(LOSS_SCALE) is not None
    if clip is None and not scaled:
        return
    head = (f"optimizer option global_clipnorm={clip!r} clips by the norm of all of a step's gradients"
            if clip is not None else "the optimizer scales the loss dynamically (a LossScaleOptimizer, what compile "
                                     "gives a mixed_float16 model) and skips a step unless all its gradients are finite")
    accumulate = int(config.get("gradient_accumulation_steps") or 1)
    if scaled and accumulate > 1:
        raise ConfigError(f"the optimizer scales the loss dynamically (a LossScaleOptimizer, or a mixed_float16 "
                          f"model's) and its inner optimizer accumulates gradient_accumulation_steps={accumulate}: "
                          f"AutoSync does not run the two together; drop the accumulation (a larger batch), or "
                          f"train in mixed_bfloat16 or float32 (no loss scaling)")
    if plan.ps_actors and (not plan.sync or plan.staleness):
        mode = "asynchronous" if not plan.sync else f"staleness {plan.staleness}"
        raise ConfigError(f"{head}, but this strategy's parameter servers apply updates without waiting for every "
                          f"worker ({mode}); use staleness 0{', or clipnorm (per variable)' if clip is not None else ''}")
    if accumulate > 1 and graph_beside_others:
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

    ``xla_after`` and ``row_local``: how the updates run (``keras_update.ChunkUpdates``).
    """

    squares_slices = False  # Keras squares what it is given; the summed squares are of no use
    ahead = 0   # updates finished from an update ahead: none (``update_ahead``)

    def __init__(self, config: dict, xla_after: int | None = -1, row_local: bool = True):
        cls = optimizer_class(config)
        self.optimizer = new_optimizer(cls, config)
        self.no_decay = frozenset(config.get(NO_DECAY) or ())   # set only with weight_decay
        # the chunks' updates: traced, then compiled by XLA after ``xla_after`` of them (Keras' own
        # optimizers); a row-local rule's on the rows touched (``keras_update``)
        self.updates = ChunkUpdates(self, config, cls.__module__.startswith("keras."), xla_after, row_local)
        self.variables, self._order, self._functions = {}, [], {}   # key -> keras.Variable; keys; traced reads
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
        view = np.asarray(tensor._numpy())   # (a scalar: a 0-d array)
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
                fn = self._functions[("read", stale)] = traced(
                    lambda _: [self.variables[k].value.read_value() for k in stale], [])
            for key, tensor in zip(stale, fn([])):
                self._fresh(params, key, tensor)
        return {k: params[k] for k in keys}

    def gather(self, params: dict, rows: dict) -> dict:
        """Copies of some rows of some keys (``key -> row ids``), gathered from the variables in
        one call, not from whole copies; the ids of every table go in as one array
        (``tf_arrays.joined``: a pull of dozens of tables makes two tensors, not one per table)."""
        out = {k: params[k][ids] for k, ids in rows.items() if k not in self._stale}
        keys = tuple(k for k in self._order if k in rows and k in self._stale)
        if keys:
            fn = self._functions.get(("gather", keys)) or self._gatherer(keys)
            if len(keys) == 1:
                flat = [tensor(rows[keys[0]], np.int64)]
            else:
                ids, sizes = joined([rows[k] for k in keys], np.int64)
                flat = [tensor(ids, np.int64), tensor(sizes, np.int64)]
            for key, value in zip(keys, fn(flat)):
                out[key] = np.asarray(value._numpy())
        return out

    def _gatherer(self, keys: tuple):
        """The traced gather of ``keys``' rows: their ids as one array and its split (one key: its
        ids alone)."""
        import tensorflow as tf

        variables = [self.variables[k] for k in keys]

        def gather(flat):
            parts = tf.split(flat[0], flat[1], num=len(keys)) if len(keys) > 1 else flat
            return [tf.gather(v.value, p) for v, p in zip(variables, parts)]

        specs = [spec((None,), np.int64)] * min(len(keys), 2)
        fn = self._functions[("gather", keys)] = traced(gather, specs)
        return fn

    def _build(self, params: dict) -> None:
        import keras

        for i, key in enumerate(self._order):   # named apart: the slots of each are named after it
            self.variables[key] = keras.Variable(np.array(params[key]), name=f"shard{i}")
        if self.no_decay:   # the shards of the variables the user's optimizer does not decay
            self.optimizer.exclude_from_weight_decay(var_list=[self.variables[k] for k in self._order
                                                               if k[0] in self.no_decay])
        self.updates.reset()
        self.optimizer.build([self.variables[k] for k in self._order])
        # state of the optimizer as a whole, beyond ``iterations`` (Nadam's ``u_product``): an
        # update of several chunks at one step must start each from the step's state. Slots of
        # the shards are named after them (``shard<i>_...``), so they are told apart by name.
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

    def canonical_names(self) -> dict:
        """What each array ``state`` returns holds, in names any holder reads (``reshard``)."""
        prefixes = {f"shard{i}": key_text(k) for i, k in enumerate(self._order)}   # the shards' names
        return keras_names(self.optimizer.variables, prefixes, self.optimizer.iterations) if self.variables else {}

    def load_state(self, params: dict, arrays: dict, canonical: bool = False) -> list[str]:
        """Set the variables to ``params`` and the optimizer's state to ``state()``'s arrays (none:
        the checkpoint was taken before the first update; with ``canonical``: arrays named as
        ``canonical_names`` names them, of any holder). Returns the problems (nothing set)."""
        from autosync.runtime.optimizer_state import state_problems

        built_now = not self.variables
        if built_now:
            self._build(params)
        problems = []
        if canonical:
            found, problems = from_keras_names(self.canonical_names(), arrays)
            arrays = {**self.state(), **found} if found else {}   # what it lacks stays as it is
        if arrays and not problems:
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
        run = self.updates.flat(iteration, keys, sparse, grads)
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
        dense = [k for k, is_sparse in zip(keys, sparse) if not is_sparse]
        for key, value in zip(dense, self.updates.run(*run)):   # (traced) what the pull that follows reads
            self._fresh(params, key, value)


def _placeholder(value: np.ndarray) -> np.ndarray:
    """A read-only array of ``value``'s shape and dtype that takes no memory: NaN (zero for a
    dtype without NaN)."""
    dtype = np.asarray(value).dtype
    fill = np.array(np.nan if np.issubdtype(dtype, np.inexact) else 0, dtype=dtype)
    return np.broadcast_to(fill, np.shape(value))
