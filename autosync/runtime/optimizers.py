"""Keras optimizer update rules re-implemented in numpy, for parameter-server shards and the
all-reduced variables' local updates.

Importing TensorFlow in a parameter-server process costs seconds (see
``benchmarks/runtime_overhead.py``): pooled PS actors (``ps_pool``) pay it once across trials, a
fresh one per trial; these numpy versions of the Keras 3 formulas need no TensorFlow at all. The
arithmetic follows Keras step by step in the variable's dtype (float32 scalars, same operation
order), so results match a single-process Keras optimizer to float rounding. They run the common
configurations (SGD, Adam, AdamW, Adagrad, a constant learning rate, no per-variable clipping;
``global_clipnorm`` and loss scaling, dynamic or fixed, act before them); any other (another Keras
optimizer, a subclass, a schedule, clipnorm, clipvalue) runs the Keras optimizer itself (``keras_optimizer``), and
``check_optimizer_config`` refuses, before Ray starts, the options no synchronizer can honour.
Small dense variables update together where their holder asks (``fused``).

Sparse gradients arrive as ``(indices, values)`` with possibly repeated indices (one slice per
embedding lookup, exactly what ``tf.IndexedSlices`` holds), or as ``(indices, values, squares)``
where the sender already summed repeated slices and ``squares`` holds each row's sum of squared
slices. Keras treats them as follows, and so do we: repeated indices add up; for Adam,
``square(gradient)`` squares each slice *before* they are added up (Keras squares the
``IndexedSlices`` values), so ``v`` sees the sum of squared slices.
"""
from __future__ import annotations

import abc
import math
import weakref

import numpy as np

from autosync.runtime.blocks import in_blocks
from autosync.runtime.fused import FusedUpdates
from autosync.runtime.loss_scale import LOSS_SCALE, wrapped_for_policy
from autosync.runtime.update_ahead import UpdateAhead, row_sums as _row_sums, row_sums_many
from autosync.runtime.optimizer_config import CONSTRAINED, NO_DECAY, check_learning_rate, keras_optimizer_config
from strategy_space.errors import ConfigError, short_repr

# config keys that change the update rule; any non-default value is rejected, not ignored
_UNSUPPORTED = {"clipnorm": None, "clipvalue": None, "use_ema": False, "gradient_accumulation_steps": None}
# handled by every optimizer here (weight decay by the base class) or not part of the update rule;
# global_clipnorm's scale (and loss scaling's, ``loss_scale``) is applied before any rule sees the
# gradients, on every synchronizer alike (``ps_clip``, ``sync.base``'s held steps); a fixed loss
# scale (``loss_scale_factor``) is undone by the worker's step (``loss_scale``)
_IGNORED = {"name", "class", "learning_rate", "weight_decay", "ema_momentum", "ema_overwrite_frequency",
            "global_clipnorm", "loss_scale_factor", NO_DECAY, CONSTRAINED, LOSS_SCALE}


def _toward(slot: np.ndarray, g, rows, out: np.ndarray) -> np.ndarray:
    """``g - slot`` into ``out`` for a dense ``g``, or for row sums ``g`` on ``rows`` (zero elsewhere:
    ``-slot`` there, which moves the slot exactly as ``0 - slot`` does)."""
    if rows is None:
        return np.subtract(g, slot, out=out)
    np.negative(slot, out=out)
    out[rows] = g - slot[rows]
    return out


class NumpyOptimizer(FusedUpdates, UpdateAhead, abc.ABC):
    """Base class: holds hyper-parameters and per-variable slots; ``apply`` updates one step.

    Updates write in place, a row-sparse one only the rows it touches, except where that could
    reach a reader: an array the optimizer did not allocate (a value received from elsewhere, e.g.
    a read-only view of Ray's object store, or the caller's own array) and a variable with a whole
    value handed out by ``snapshot`` that is still alive (a parameter server's pull that Ray is
    still serializing: it does so on another thread after the coroutine returned, while later
    updates run). Such a variable is copied once, and that copy is updated (copy on write).
    A parameter server may have a row-updated variable's step computed ahead (``update_ahead``).
    """

    slot_names: tuple[str, ...] = ()
    keras_name = ""
    squares_slices = False  # the update reads the square of each sparse slice (Adam, Adagrad)
    blocks = False  # a whole-variable update runs in blocks (``_update_blocked``): rules of many passes
    _options: dict = {}

    def __init__(self, config: dict):
        self.learning_rate = float(config["learning_rate"])
        wd = config.get("weight_decay")
        self.weight_decay = float(wd) if wd else None
        self.no_decay = frozenset(config.get(NO_DECAY) or ())   # variable indices Keras does not decay
        self.options = {k: config.get(k, v) for k, v in self._options.items()}
        self.slots: dict = {}
        self._owned: dict = {}  # key -> weak reference to the array it allocated for that variable
        self._readers: dict = {}  # key -> weak references to the snapshots handed out since
        self._ahead, self._spare, self._fused = {}, {}, {}  # updates ahead (``update_ahead``), ``fused`` buffers
        self.copies = 0  # copies made on write (a received value's first update, or a live snapshot)

    def add_variable(self, key, value: np.ndarray) -> None:
        """Create zero slots (momentum, velocity, ...) for the variable stored under ``key``."""
        self.slots[key] = {name: np.zeros_like(value) for name in self.slot_names}

    def finalize(self, params: dict) -> None:
        """The end of ``fit`` (``KerasOptimizer.finalize``): the numpy rules keep no moving average."""

    def adopt(self, params: dict, key) -> None:
        """``params[key]`` was allocated for this optimizer's variable alone (nobody else holds
        it): updates may write it in place from the first one."""
        self._owned[key] = weakref.ref(params[key])

    def value(self, params: dict, key) -> np.ndarray:
        """The current whole value of ``params[key]``, for its holder (updates may change it)."""
        return params[key]

    def gather(self, params: dict, rows: dict) -> dict:
        """Copies of some rows of some keys (``key -> row ids``)."""
        return {k: params[k][ids] for k, ids in rows.items()}

    def snapshots(self, params: dict, keys) -> dict:
        """``snapshot`` of each of ``keys``."""
        return {k: self.snapshot(params, k) for k in keys}

    def snapshot(self, params: dict, key) -> np.ndarray:
        """The whole value of ``params[key]`` for a reader that may still read it while later
        updates run: a read-only view that no update changes (while it is alive, an update writes
        a copy of the variable instead)."""
        view = params[key].view()
        view.flags.writeable = False
        self._readers.setdefault(key, []).append(weakref.ref(view))
        return view

    def _writable(self, params: dict, key) -> np.ndarray:
        """``params[key]``, made safe to update in place (see the class doc)."""
        var = params[key]
        readers = self._readers.pop(key, ())
        owned = self._owned.get(key)
        if owned is None or owned() is not var or any(r() is not None for r in readers):
            var = params[key] = np.array(var, copy=True, order="C")
            self._owned[key] = weakref.ref(var)
            self.copies += 1
        return var

    def apply(self, iteration: int, params: dict, grads: dict) -> None:
        """Apply one optimizer step to every variable in ``grads``.

        Args:
            iteration: the optimizer's step counter before this update (Keras ``iterations``).
            params: key -> current value; updated in place, or replaced by an updated copy where
                the value may have readers (see the class doc).
            grads: key -> dense ndarray, or ``(indices, values)`` / ``(indices, values, squares)``;
                keys absent are not updated (Keras skips variables whose gradient is None).
        """
        if type(self)._apply_one is NumpyOptimizer._apply_one:   # rules that sum repeated rows first
            sparse = {k: g for k, g in grads.items() if isinstance(g, tuple)}
            grads = {**grads, **row_sums_many(sparse, {k: params[k].dtype for k in sparse}, self.squares_slices)}
        if self.fuse_small:   # small dense variables together (``fused``)
            grads = self._apply_fused(iteration, params, grads)
        for key, grad in grads.items():
            if self._finish_ahead(iteration, params, key, grad):
                continue
            var = self._writable(params, key)
            self._decay(var, key)
            self._apply_one(iteration, key, var, grad)

    def _apply_one(self, iteration, key, var: np.ndarray, grad) -> None:
        """One variable's step after weight decay: the gradient as ``_update`` takes it."""
        if isinstance(grad, tuple):
            rows, g, g2 = _row_sums(grad, var.dtype, self.squares_slices)
        else:
            rows, g = None, np.asarray(grad)
            g2 = np.square(g) if self.squares_slices else None
        self._update_blocked(iteration, key, var, rows, g, g2)

    def _update_blocked(self, iteration, key, var: np.ndarray, rows, g, g2, slots: dict | None = None) -> None:
        """``_update`` a block at a time where it passes over the whole variable (a dense gradient,
        or a rule that moves untouched rows: Adam's moments) for a rule of many passes (``blocks``:
        SGD's momentum makes two, which blocks slow down: ncf-full 18.4-18.8 -> 20.6-24.4 ms)."""
        slots = self.slots[key] if slots is None else slots
        whole = self.blocks and (rows is None or getattr(self, "moves_untouched_rows", False))
        in_blocks(lambda *part: self._update(iteration, key, *part), var, rows, g, g2, slots, whole)

    def _decay(self, var: np.ndarray, key) -> None:
        """Weight decay, in place, as Keras decays every variable with a gradient before its update
        (``var - var * wd * lr``) but those excluded (``NO_DECAY``; ``key``: (variable, shard))."""
        if self.weight_decay is not None and key[0] not in self.no_decay:
            decay = var * var.dtype.type(self.weight_decay)
            decay *= var.dtype.type(self.learning_rate)
            var -= decay

    @abc.abstractmethod
    def _update(self, iteration, key, var: np.ndarray, rows, g: np.ndarray, g2, slots: dict | None = None) -> None:
        """Update ``var`` in place. ``rows`` None: ``g`` is the dense gradient; otherwise ``g``
        holds the summed gradient of each of ``rows`` (ascending, distinct) and the gradient is
        zero elsewhere. ``g2``: the gradient squared as Keras squares it (optimizers that read it).
        ``slots``: the slot arrays to update with ``var`` (default: the variable's own)."""


class SGD(NumpyOptimizer):
    """``keras.optimizers.SGD`` (plain, momentum, nesterov)."""

    keras_name = "sgd"
    _options = {"momentum": 0.0, "nesterov": False}

    def __init__(self, config):
        super().__init__(config)
        self.slot_names = ("momentum",) if self.options["momentum"] != 0 else ()
        self.moves_untouched_rows = bool(self.slot_names)   # the momentum carries every row

    def _apply_one(self, iteration, key, var, grad):
        if self.slot_names:
            return super()._apply_one(iteration, key, var, grad)
        lr = var.dtype.type(self.learning_rate)
        if isinstance(grad, tuple):
            # each slice subtracted in turn, as Keras' scatter_sub does with repeated rows
            np.subtract.at(var, grad[0], grad[1] * lr)
        else:
            var -= np.asarray(grad) * lr

    def _update(self, iteration, key, var, rows, g, g2, slots=None):
        # momentum only (plain SGD is ``_apply_one``): m = m * momentum - g * lr, then var += m (or,
        # nesterov, var += m * momentum - g * lr); where g is zero that subtracts exactly 0
        lr = var.dtype.type(self.learning_rate)
        mom = var.dtype.type(self.options["momentum"])
        m = (slots or self.slots[key])["momentum"]  # never handed out: updated in place
        m *= mom
        step = g * lr
        if rows is None:
            m -= step
        else:
            m[rows] -= step
        if self.options["nesterov"]:
            ahead = m * mom
            if rows is None:
                ahead -= step
            else:
                ahead[rows] -= step
            var += ahead
        else:
            var += m


class Adam(NumpyOptimizer):
    """``keras.optimizers.Adam`` with bias correction and optional AMSGrad. Its moments decay on
    every row, so even a row-sparse gradient updates the whole variable (in place, with one
    scratch array of its size)."""

    keras_name = "adam"
    squares_slices = True
    moves_untouched_rows = True
    blocks = True
    _options = {"beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7, "amsgrad": False}

    def __init__(self, config):
        super().__init__(config)
        self.slot_names = ("m", "v", "v_hat") if self.options["amsgrad"] else ("m", "v")

    def _update(self, iteration, key, var, rows, g, g2, slots=None):
        f = var.dtype.type
        o = self.options
        lr = f(self.learning_rate)
        step = f(iteration + 1)
        beta_1_power = np.power(f(o["beta_1"]), step)
        beta_2_power = np.power(f(o["beta_2"]), step)
        alpha = lr * np.sqrt(f(1) - beta_2_power) / (f(1) - beta_1_power)
        s = slots or self.slots[key]  # never handed out: updated in place
        scratch = np.empty_like(var)
        s["m"] += _scaled(_toward(s["m"], g, rows, scratch), f(1 - o["beta_1"]))
        s["v"] += _scaled(_toward(s["v"], g2, rows, scratch), f(1 - o["beta_2"]))
        v = s["v"]
        if o["amsgrad"]:
            np.maximum(s["v_hat"], v, out=s["v_hat"])
            v = s["v_hat"]
        # var - (m * alpha) / (sqrt(v) + epsilon)
        np.multiply(s["m"], alpha, out=scratch)
        denom = np.sqrt(v)
        denom += f(o["epsilon"])
        scratch /= denom
        del denom
        var -= scratch


def _scaled(x: np.ndarray, factor) -> np.ndarray:
    x *= factor
    return x


class AdamW(Adam):
    """``keras.optimizers.AdamW``: Adam plus decoupled weight decay (applied by the base class)."""

    keras_name = "adamw"


class Adagrad(NumpyOptimizer):
    """``keras.optimizers.Adagrad``. For a sparse gradient Keras squares each slice before the
    slices are added up, so the accumulator gets the sum of squared slices. A row-sparse gradient
    updates its rows only: elsewhere Keras adds 0 to the accumulator and subtracts exactly 0 from
    the variable, so skipping those rows changes no bit."""

    keras_name = "adagrad"
    squares_slices = True
    blocks = True   # (a dense gradient: a sparse one touches its rows alone)
    slot_names = ("accumulator",)
    _options = {"initial_accumulator_value": 0.1, "epsilon": 1e-7}

    def add_variable(self, key, value: np.ndarray) -> None:
        self.slots[key] = {"accumulator": np.full_like(value, self.options["initial_accumulator_value"])}

    def _update(self, iteration, key, var, rows, g, g2, slots=None):
        f = var.dtype.type
        lr = f(self.learning_rate)
        eps = f(self.options["epsilon"])
        acc = (slots or self.slots[key])["accumulator"]  # never handed out: updated in place
        if rows is None:
            acc += g2
            step = lr * g
            denom = np.add(acc, eps, out=np.empty_like(acc))   # (an array even for a scalar variable)
            np.sqrt(denom, out=denom)
            step /= denom
            var -= step
            return
        acc_rows = acc[rows] + g2
        acc[rows] = acc_rows
        var[rows] = var[rows] - (lr * g) / np.sqrt(acc_rows + eps)


OPTIMIZERS = {cls.keras_name: cls for cls in (SGD, Adam, AdamW, Adagrad)}


def numpy_rules(config: dict) -> bool:
    """Whether the numpy rules above run ``config`` exactly (one of their optimizers, a constant
    learning rate, no per-variable clipping, no option they do not implement); otherwise updates
    run the Keras optimizer itself (``keras_optimizer.KerasOptimizer``)."""
    name = _kind(config)
    if name not in OPTIMIZERS or not isinstance(config.get("learning_rate"), (int, float)):
        return False
    if any(config.get(k, v) != v for k, v in _UNSUPPORTED.items()):
        return False
    return not (set(config) - set(OPTIMIZERS[name]._options) - set(_UNSUPPORTED) - _IGNORED)


def check_optimizer_config(config: dict) -> None:
    """Raise if a Keras optimizer config (``keras_optimizer_config``) cannot be run by the runtime.

    Raises:
        ConfigError: an optimizer class that is not a Keras optimizer or cannot be imported, a
            ``loss_scale_factor`` that is not a number > 0, or an
            ``AUTOSYNC_KERAS_XLA_AFTER`` that is neither a count nor ``off``.
    """
    from autosync.runtime.keras_optimizer import optimizer_class
    from autosync.runtime.keras_update import xla_after_from_env

    problems = []
    try:
        xla_after_from_env()   # read again where updates run; a typo is said here, before Ray starts
    except ConfigError as e:
        problems.append(str(e))
    factor = config.get("loss_scale_factor")
    if factor is not None and not (isinstance(factor, (int, float)) and not isinstance(factor, bool)
                                   and math.isfinite(factor) and factor > 0):
        problems.append(f"optimizer option loss_scale_factor={short_repr(factor)} is not a number > 0: the loss is "
                        f"multiplied by it and the gradients divided by it; give a float > 0 (a power of two "
                        f"scales exactly) or leave it None")
    if not numpy_rules(config):
        try:
            optimizer_class(config)
        except ConfigError as e:
            problems.extend(e.problems if hasattr(e, "problems") else [str(e)])
    if problems:
        raise ConfigError(problems)


def check_model_optimizer(model_def, variables=None, model=None) -> dict:
    """The one optimizer check every command runs on a trainable model, before Ray starts
    (``tune``, ``run``, ``baselines`` refuse; ``inspect`` warns). With the model's trainable
    ``variables`` the config also says their constraints and weight-decay exclusions; with the
    ``model`` (built), the loss scaling Keras' compile gives a mixed_float16 one (``loss_scale``).

    Returns:
        the optimizer's ``keras_optimizer_config`` (``plan`` keeps out what the runtime refuses
        under it: ``autosync.search_limits``).

    Raises:
        ConfigError: see ``check_optimizer_config``, attributed to the model.
    """
    from autosync.models.ingest import user_code

    try:
        fix = "make optimizer_fn build and return a keras optimizer"
        with user_code(model_def, "optimizer_fn()", fix):
            optimizer = wrapped_for_policy(model_def.optimizer_fn(), model)   # (None: as it is)
            if not callable(getattr(optimizer, "get_config", None)):
                raise ConfigError(f"optimizer_fn returned {type(optimizer).__name__}, not a keras optimizer; {fix}")
            check_learning_rate(optimizer)
            config = keras_optimizer_config(optimizer, variables)   # the optimizer's own get_config may raise too
        check_optimizer_config(config)
    except ConfigError as e:
        raise e.with_source(f"model {model_def.name}") from None
    return config


def squares_slices(config: dict) -> bool:
    """Whether the optimizer of ``config`` needs the sum of squared slices of repeated sparse rows
    (a sender that sums repeated rows must then send those squares as well). Not under
    ``global_clipnorm``: Keras' clipping hands the rule a dense gradient, repeated rows summed."""
    return numpy_rules(config) and OPTIMIZERS[_kind(config)].squares_slices and config.get("global_clipnorm") is None


def sparse_form(config: dict) -> str:
    """How the update rule of ``config`` reads a sparse (``IndexedSlices``) gradient, so in what
    form a sparse gradient travels to where the update runs:

    - ``"dense"``: Keras hands the rule a dense gradient (under ``global_clipnorm``, or gradient
      accumulation into its dense accumulators): a row's slices summed over every worker;
    - ``"slices"``: the Keras rule transforms each slice before repeated rows add up (RMSprop's
      square, Adamax's abs, Ftrl, clipping by value or by the slices' norm): every slice travels
      as it is, never summed with another (more bytes where rows repeat, the same update as Keras);
    - ``"rows"``: a row's summed slices give the rule the same update (the numpy rules, with the
      summed squares where they need them; a Keras optimizer linear in its slices: SGD, Lion).
    """
    from autosync.runtime.keras_optimizer import linear_in_slices

    if config.get("global_clipnorm") is not None or int(config.get("gradient_accumulation_steps") or 1) > 1:
        return "dense"
    if numpy_rules(config):
        return "rows"
    clipped = any(config.get(k) is not None for k in ("clipnorm", "clipvalue"))
    return "rows" if linear_in_slices(config) and not clipped else "slices"


def make_optimizer(config: dict):
    """The optimizer for a Keras optimizer config: the numpy rules where they apply exactly, the
    Keras optimizer itself otherwise (``keras_optimizer.KerasOptimizer``).

    Raises:
        ConfigError: see ``check_optimizer_config``.
    """
    check_optimizer_config(config)
    if numpy_rules(config):
        return OPTIMIZERS[_kind(config)](config)
    from autosync.runtime.keras_optimizer import KerasOptimizer

    return KerasOptimizer(config)


def _kind(config: dict) -> str:
    """``sgd``/``adam`` from the optimizer's class (Keras renames instances ``sgd_1``, ...)."""
    return str(config.get("class", config.get("name", ""))).lower()
