"""The Keras optimizer applied to numpy shards (``KerasOptimizer``) updates like the optimizer on
the whole variables, chunk by chunk at the global step; what it cannot honour is refused."""
import numpy as np
import pytest

from autosync.runtime.keras_update import new_optimizer
from autosync.runtime.optimizer_config import keras_optimizer_config
from autosync.runtime.optimizers import check_optimizer_config, make_optimizer, numpy_rules
from strategy_space.errors import ConfigError
from tests import runtime_models as rm

pytestmark = pytest.mark.integration
SHAPES = {"a": (5, 3), "b": (4,)}


def _optimizers():
    import keras

    sched = keras.optimizers.schedules.CosineDecay(0.1, decay_steps=3, warmup_target=0.2, warmup_steps=2)
    return {
        "rmsprop": lambda: keras.optimizers.RMSprop(0.01, momentum=0.5),
        "adadelta": lambda: keras.optimizers.Adadelta(1.0),
        "adamax": lambda: keras.optimizers.Adamax(0.05),
        "nadam": lambda: keras.optimizers.Nadam(0.05),
        "ftrl": lambda: keras.optimizers.Ftrl(0.1, l1_regularization_strength=0.01),
        "lion": lambda: keras.optimizers.Lion(0.01),
        "lamb": lambda: keras.optimizers.Lamb(0.05),
        "adafactor": lambda: keras.optimizers.Adafactor(0.05),
        "muon": lambda: keras.optimizers.Muon(0.05),
        "schedule_free_adamw": lambda: keras.optimizers.ScheduleFreeAdamW(0.05, warmup_steps=2),
        "sgd_schedule": lambda: keras.optimizers.SGD(sched, momentum=0.9),
        "adam_clipnorm": lambda: keras.optimizers.Adam(0.05, clipnorm=0.5),
        "adagrad_clipvalue": lambda: keras.optimizers.Adagrad(0.2, clipvalue=0.1),
        "subclass": lambda: rm.HalfStepSGD(0.1),
    }


# named here, not by calling _optimizers(): collecting the fast suite must not import Keras
NAMES = ("rmsprop", "adadelta", "adamax", "nadam", "ftrl", "lion", "lamb", "adafactor", "muon", "schedule_free_adamw",
         "sgd_schedule",
         "adam_clipnorm", "adagrad_clipvalue", "subclass")


def test_every_optimizer_built_is_tested():
    assert tuple(_optimizers()) == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_shards_applied_in_chunks_match_keras(name):
    import keras

    rng = np.random.default_rng(3)
    init = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    ref = _optimizers()[name]()
    config = keras_optimizer_config(ref)
    assert not numpy_rules(config)
    check_optimizer_config(config)
    ours = make_optimizer(config)
    params = {k: v.copy() for k, v in init.items()}
    for k, v in init.items():
        ours.add_variable(k, v)
    variables = [keras.Variable(init[k].copy()) for k in SHAPES]
    for step in range(4):
        g = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
        ref.apply([g[k] for k in SHAPES], variables)
        for k in SHAPES:  # each key its own chunk, applied separately, at the same global step
            ours.apply(step, params, {k: g[k]})
    for k, var in zip(SHAPES, variables):
        np.testing.assert_allclose(ours.value(params, k), var.numpy(), rtol=2e-6, atol=2e-6, err_msg=name)
        assert not np.allclose(params[k], init[k])


@pytest.mark.parametrize("xla", [False, True], ids=["traced", "compiled"])
@pytest.mark.parametrize("name", ["SGD", "Adam", "Adagrad", "RMSprop"])
def test_many_tables_in_one_update_match_keras(name, xla):
    """The update of several tables (two of one row shape: a row-local rule's on one scratch), a
    dense variable beside them, is Keras' own on each, and a pull's gather of them (their ids
    joined into one array) returns each table's rows."""
    import keras
    import tensorflow as tf

    from autosync.runtime.keras_optimizer import KerasOptimizer

    rng = np.random.default_rng(11)
    shapes = {"a": (30, 4), "w": (4, 3), "b": (20, 4), "c": (25, 2), "d": (12, 4)}
    tables = ("a", "b", "c", "d")
    init = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    ref = getattr(keras.optimizers, name)(learning_rate=0.05)
    ours = KerasOptimizer(keras_optimizer_config(ref), xla_after=0 if xla else None)
    params = {k: v.copy() for k, v in init.items()}
    for k, v in init.items():
        ours.add_variable(k, v)
    variables = {k: keras.Variable(init[k].copy()) for k in shapes}
    for step in range(4):
        grads = {"w": rng.standard_normal((4, 3)).astype(np.float32)}
        for k in tables:
            ids = np.sort(rng.choice(shapes[k][0], int(rng.integers(1, 9)), replace=False))
            grads[k] = (ids, rng.standard_normal((len(ids),) + shapes[k][1:]).astype(np.float32), None)
        ref.apply([tf.IndexedSlices(grads[k][1], grads[k][0], shapes[k]) if k in tables else grads[k] for k in shapes],
                  list(variables.values()))
        ours.apply(step, params, grads)
        wanted = {k: rng.integers(0, shapes[k][0], 5) for k in tables}
        got = ours.gather(params, wanted)
        for k in tables:
            np.testing.assert_allclose(got[k], variables[k].numpy()[wanted[k]], rtol=2e-6, atol=2e-6, err_msg=k)
    assert (ours.updates.compiled > 0) == (xla and name != "Adagrad")   # Adagrad: by its rows, traced
    assert ours.updates.xla_fallbacks == 0
    for k in shapes:
        np.testing.assert_allclose(ours.value(params, k), variables[k].numpy(), rtol=2e-6, atol=2e-6, err_msg=k)


def test_sparse_rows_of_a_linear_optimizer_match_keras():
    import keras
    import tensorflow as tf

    init = np.random.default_rng(1).standard_normal((6, 2)).astype(np.float32)
    ref, var = keras.optimizers.Lion(0.01), keras.Variable(init.copy())
    ours = make_optimizer(keras_optimizer_config(ref))
    params = {"e": init.copy()}
    ours.add_variable("e", init)
    for step in range(3):
        idx = np.array([1, 4, 1, 5])
        vals = np.random.default_rng(step).standard_normal((4, 2)).astype(np.float32)
        ref.apply([tf.IndexedSlices(vals, idx, (6, 2))], [var])
        ours.apply(step, params, {"e": (np.array([1, 4, 5]), np.stack([vals[0] + vals[2], vals[1], vals[3]]), None)})
    np.testing.assert_allclose(ours.gather(params, {"e": [5, 1]})["e"], var.numpy()[[5, 1]], rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(ours.value(params, "e"), var.numpy(), rtol=2e-6, atol=2e-6)


def _builtin_optimizers() -> dict:
    """Every built-in Keras optimizer (those that take a plain learning rate) by name."""
    import inspect

    import keras

    return {n: c for n, c in vars(keras.optimizers).items() if inspect.isclass(c)
            and issubclass(c, keras.optimizers.Optimizer) and c is not keras.optimizers.Optimizer
            and n not in ("LossScaleOptimizer", "MultiOptimizer", "OptimizerMap")}


BUILTIN = ("SGD", "Adam", "RMSprop", "Nadam", "Adamax", "Adadelta", "Adagrad", "Ftrl", "Lion", "AdamW", "Lamb",
           "Adafactor", "Muon", "ScheduleFreeAdamW")


@pytest.mark.parametrize("name", sorted(BUILTIN))
@pytest.mark.parametrize("options", [{}, {"clipvalue": 0.05}, {"clipnorm": 0.05}, {"global_clipnorm": 0.05},
                                     {"gradient_accumulation_steps": 2}, {"learning_rate": "schedule"}],
                         ids=["plain", "clipvalue", "clipnorm", "global_clipnorm", "accumulate", "schedule"])
def test_the_sparse_form_of_every_builtin_optimizer_is_how_keras_reads_slices(name, options):
    """``sparse_form`` against Keras itself: where it says ``rows`` (and the Keras object runs),
    an ``IndexedSlices`` with repeated rows updates as its rows summed do; where it says
    ``dense``, as the dense gradient does; ``slices`` is said only where summing changes the update."""
    import keras
    import tensorflow as tf

    from autosync.runtime.optimizers import sparse_form

    cls = _builtin_optimizers()[name]
    if options.get("learning_rate") == "schedule":
        options = {"learning_rate": keras.optimizers.schedules.ExponentialDecay(0.05, 2, 0.5)}
    form = sparse_form(keras_optimizer_config(cls(**options)))
    rng = np.random.default_rng(3)
    init = rng.standard_normal((6, 3)).astype(np.float32)
    idx = np.array([1, 3, 1, 4, 3, 1])
    vals = rng.standard_normal((6, 3)).astype(np.float32)
    rows, inverse = np.unique(idx, return_inverse=True)
    summed = np.zeros((len(rows), 3), np.float32)
    np.add.at(summed, inverse, vals)
    dense = np.zeros((6, 3), np.float32)
    np.add.at(dense, idx, vals)

    clip = options.get("global_clipnorm")

    def run(make_grad, **given):
        opt, var = cls(**given), keras.Variable(init.copy())
        for step in range(4):
            opt.apply([make_grad(step + 1.0)], [var])
        return var.numpy()

    def scale(k):   # global_clipnorm's: of the norm of the slices, each squared (held_sq)
        return min(1.0, clip / (k * float(np.sqrt(np.sum(np.square(vals, dtype=np.float64)))))) if clip else 1.0

    got = run(lambda k: tf.IndexedSlices(vals * k, idx, (6, 3)), **options)
    assert not np.allclose(got, init)
    unclipped = {k: v for k, v in options.items() if k != "global_clipnorm"}
    if form == "dense":   # the rule reads the dense gradient (times global_clipnorm's scale)
        as_dense = run(lambda k: tf.constant(dense * k * scale(k)), **unclipped)
        np.testing.assert_allclose(got, as_dense, rtol=1e-5, atol=1e-6)
        if clip:
            assert scale(1.0) < 1.0
    elif form == "rows" and not numpy_rules(keras_optimizer_config(cls(**options))):
        np.testing.assert_allclose(got, run(lambda k: tf.IndexedSlices(summed * k, rows, (6, 3)), **options),
                                   rtol=1e-5, atol=1e-6)
    # "slices" is exact by construction: every slice reaches the rule as Keras' tape made it


def test_the_list_of_builtin_optimizers_checked_is_keras_own():
    """A Keras release that adds an optimizer fails here until it is in the test above."""
    assert set(_builtin_optimizers()) <= set(BUILTIN)


def _schedule_sgd():
    """A configuration the numpy rules do not cover (a schedule): the Keras path."""
    import keras

    config = keras_optimizer_config(keras.optimizers.SGD(keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)))
    assert not numpy_rules(config)
    return make_optimizer(config)


def test_values_are_read_from_the_variables_only_when_asked_and_never_change_under_a_reader():
    ours = _schedule_sgd()
    init = {"w": np.ones((4, 3), np.float32), "e": np.zeros((50, 2), np.float32)}
    params = {k: v.copy() for k, v in init.items()}
    for k, v in init.items():
        ours.add_variable(k, v)
    ours.apply(0, params, {"w": np.ones((4, 3), np.float32), "e": (np.array([3, 7]), np.ones((2, 2), np.float32), None)})
    # between an update and a read a table's entry is a placeholder that cannot pass for weights;
    # a dense value comes out of the update itself (the pull that follows reads it), read-only
    assert params["e"].shape == (50, 2) and np.isnan(params["e"]).all() and not params["e"].flags.writeable
    assert not params["w"].flags.writeable
    np.testing.assert_allclose(ours.gather(params, {"e": [7, 0]})["e"], [[-0.1, -0.1], [0, 0]], rtol=1e-6)
    assert np.isnan(params["e"]).all()   # rows were gathered, the table was not copied out
    held = ours.snapshots(params, ["w"])["w"]
    np.testing.assert_allclose(held, 0.9, rtol=1e-6)
    assert ours.snapshot(params, "w") is held is params["w"]   # read once per update, by the update
    with pytest.raises(ValueError):
        held[0, 0] = 5.0   # read-only
    address = held.__array_interface__["data"][0]
    ours.apply(1, params, {"w": np.ones((4, 3), np.float32)})
    np.testing.assert_allclose(held, 0.9, rtol=1e-6)   # the reader's value did not move
    now = ours.snapshot(params, "w")
    assert now.__array_interface__["data"][0] != address   # copied on write: a reader held it
    np.testing.assert_allclose(now, 0.9 - 0.1 * 0.5 ** 0.1, rtol=1e-6)
    del held
    address = now.__array_interface__["data"][0]
    del now
    ours.apply(2, params, {"w": np.ones((4, 3), np.float32)})
    assert ours.value(params, "w").__array_interface__["data"][0] == address   # nobody held it: in place


def test_a_checkpoint_state_that_does_not_fit_changes_nothing():
    ours = _schedule_sgd()
    params = {"w": np.ones((4, 3), np.float32)}
    ours.add_variable("w", params["w"])
    assert ours.load_state(params, {"keras/0": np.zeros(()), "keras/9": np.zeros(3)})
    assert not ours.variables   # still unbuilt: the next update builds from the values kept
    ours.apply(0, params, {"w": np.ones((4, 3), np.float32)})
    state = ours.state()
    assert ours.load_state({"w": np.zeros((4, 3), np.float32)}, {**state, "keras/0": np.zeros(5)})
    np.testing.assert_allclose(ours.value(params, "w"), 0.9, rtol=1e-6)
    restored = {"w": np.zeros((4, 3), np.float32)}
    assert not ours.load_state(restored, state)
    ours.apply(1, restored, {"w": np.ones((4, 3), np.float32)})
    np.testing.assert_allclose(ours.value(restored, "w"), -0.1 * 0.5 ** 0.1, rtol=1e-6)


def test_options_that_cannot_be_honoured_are_refused_with_the_reason():
    import keras

    for accepted in (keras.optimizers.SGD(global_clipnorm=1.0), keras.optimizers.SGD(gradient_accumulation_steps=2),
                     keras.optimizers.Adam(use_ema=True)):
        check_optimizer_config(keras_optimizer_config(accepted))   # held steps, accumulating workers, averages
    # dynamic loss scaling: described by the inner optimizer, with its settings (``loss_scale``)
    scaled = keras_optimizer_config(keras.optimizers.LossScaleOptimizer(keras.optimizers.RMSprop(0.01), 256.0, 50))
    check_optimizer_config(scaled)
    assert scaled["class"] == "RMSprop" and scaled["learning_rate"] == pytest.approx(0.01)
    assert scaled["loss_scale"] == {"initial_scale": 256.0, "dynamic_growth_steps": 50}
    fixed = keras_optimizer_config(keras.optimizers.Adam(loss_scale_factor=128.0))   # undone by the worker's step
    check_optimizer_config(fixed)
    assert numpy_rules(fixed)   # the gradients a rule gets are unscaled: the numpy rules run it
    assert new_optimizer(keras.optimizers.Adam, fixed).loss_scale_factor is None   # and a Keras one, without it
    for opt, match in [(keras.optimizers.SGD(loss_scale_factor=0.0), r"loss_scale_factor=0.0 is not a number > 0"),
                       ({"class": "LossScaleOptimizer"}, r"wraps other optimizers")]:
        with pytest.raises(ConfigError, match=match):
            check_optimizer_config(opt if isinstance(opt, dict) else keras_optimizer_config(opt))


def test_shard_wise_limits_are_refused_per_strategy():
    import keras
    from types import SimpleNamespace as S

    from autosync.runtime.keras_optimizer import check_keras_apply

    names = ["emb", "dense"]
    split = S(var_index=1, num_shards=2, sparse=False)
    rows = S(var_index=0, num_shards=1, sparse=True)
    with pytest.raises(ConfigError, match=r"clipnorm=1.0 .* dense is split into 2 shards"):
        check_keras_apply(keras_optimizer_config(keras.optimizers.SGD(clipnorm=1.0)), [split], names)
    with pytest.raises(ConfigError, match=r"'Lamb' reads whole variables"):
        check_keras_apply(keras_optimizer_config(keras.optimizers.Lamb()), [split], names)
    # sparse shards: their slices travel in the form the rule reads them (``sparse_form``)
    for ok in (keras.optimizers.RMSprop(), keras.optimizers.Lion(clipvalue=1.0), keras.optimizers.Lion(),
               keras.optimizers.RMSprop(global_clipnorm=1.0), keras.optimizers.SGD(clipnorm=1.0)):
        check_keras_apply(keras_optimizer_config(ok), [rows], names)
    check_keras_apply(keras_optimizer_config(keras.optimizers.Lion()), [split, rows], names)
    assert numpy_rules(keras_optimizer_config(keras.optimizers.Adam()))   # not asked: the numpy rules run it


def _compiled_cases():
    """Keras' own optimizers under the options users give them, by name (built when called)."""
    import keras

    cosine = keras.optimizers.schedules.CosineDecay(0.1, decay_steps=4, warmup_target=0.2, warmup_steps=2)
    cases = {n: (lambda c=c: c()) for n, c in _builtin_optimizers().items()}
    cases.update({
        "SGD_momentum_cosine": lambda: keras.optimizers.SGD(cosine, momentum=0.9, nesterov=True),
        "Adam_clipnorm_decay": lambda: keras.optimizers.Adam(0.05, clipnorm=0.5, weight_decay=0.01),
        "Adagrad_clipvalue": lambda: keras.optimizers.Adagrad(0.2, clipvalue=0.1),
        "RMSprop_ema": lambda: keras.optimizers.RMSprop(0.01, use_ema=True, ema_overwrite_frequency=2),
        "Nadam_accumulate": lambda: keras.optimizers.Nadam(0.05, gradient_accumulation_steps=2),
    })
    return cases


COMPILED_CASES = BUILTIN + ("SGD_momentum_cosine", "Adam_clipnorm_decay", "Adagrad_clipvalue", "RMSprop_ema",
                            "Nadam_accumulate")


def test_every_compiled_case_is_listed():
    assert sorted(_compiled_cases()) == sorted(COMPILED_CASES)


@pytest.mark.parametrize("name", COMPILED_CASES)
def test_the_compiled_update_of_keras_own_optimizers_is_the_traced_one(name):
    """XLA's update (sparse rows padded to a few shapes with zero slices) gives the traced update's
    values, chunk by chunk, for every built-in optimizer, and really runs compiled."""
    from autosync.runtime.keras_optimizer import KerasOptimizer

    config = keras_optimizer_config(_compiled_cases()[name]())
    rng = np.random.default_rng(5)
    shapes = {"e": (40, 3), "f": (30, 3), "w": (5, 3), "b": (4,)}   # two tables of one row shape
    init = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    ours = {xla: KerasOptimizer(config, xla_after=0 if xla else None) for xla in (True, False)}
    params = {xla: {k: v.copy() for k, v in init.items()} for xla in ours}
    for xla, o in ours.items():
        for k, v in init.items():
            o.add_variable(k, v)
    for step in range(5):
        grads = {"w": rng.standard_normal((5, 3)).astype(np.float32), "b": rng.standard_normal(4).astype(np.float32)}
        for key in "ef":
            n = int(rng.integers(1, 12))   # rows vary from step to step, as a push's do
            ids = np.sort(rng.choice(shapes[key][0], n, replace=False))
            grads[key] = (ids, rng.standard_normal((n, 3)).astype(np.float32), None)
        for xla, o in ours.items():
            o.apply(step, params[xla], {k: grads[k] for k in "efw"})   # two chunks of one step
            o.apply(step, params[xla], {"b": grads["b"]})
    assert ours[True].updates.xla_fallbacks == 0
    assert any(key[2] is True for key in ours[True].updates.functions)
    for k in shapes:
        got, want = ours[True].value(params[True], k), ours[False].value(params[False], k)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"{name} {k}")
        assert np.any(want != init[k])   # the update moved it (Adadelta by its tiny default steps)


def test_padded_rows_keep_the_rows_and_bound_the_shapes():
    from autosync.runtime.keras_update import padded_rows, row_bucket
    from autosync.runtime.tf_arrays import TF_ALIGN

    assert [row_bucket(n) for n in (0, 1, 8, 9, 16, 17, 1000)] == [8, 8, 8, 16, 16, 32, 1024]
    ids, values = np.array([3, 1, 4]), np.ones((3, 2), np.float64)
    got_ids, got_values = padded_rows(ids, values, np.float32, num_rows=3)
    assert got_ids.tolist() == [3, 1, 4, 0, 1, 2, 0, 1] and got_values.dtype == np.float32
    np.testing.assert_array_equal(got_values, np.vstack([np.ones((3, 2)), np.zeros((5, 2))]))
    assert got_ids.ctypes.data % TF_ALIGN == 0 and got_values.ctypes.data % TF_ALIGN == 0
    exact = (np.arange(8), np.ones((8, 2), np.float32))
    assert padded_rows(*exact, np.float32)[0] is exact[0]


def test_updates_run_traced_until_the_chunk_has_run_xla_after_times():
    from autosync.runtime.keras_optimizer import KerasOptimizer
    from autosync.runtime.keras_update import XLA_AFTER

    config = keras_optimizer_config(_compiled_cases()["RMSprop"]())
    assert KerasOptimizer(config).updates.xla_after == XLA_AFTER
    ours = KerasOptimizer(config, xla_after=2)
    params = {"w": np.ones((4, 3), np.float32), "e": np.ones((30, 2), np.float32)}
    for k, v in params.items():
        ours.add_variable(k, v)
    seen = []
    for step, n in enumerate((3, 3, 3, 5, 11, 4)):
        ours.apply(step, params, {"w": np.ones((4, 3), np.float32),
                                  "e": (np.arange(n), np.ones((n, 2), np.float32), None)})
        seen.append(sorted(str(k[2]) for k in ours.updates.functions))
    assert seen[:2] == [["False"]] * 2 and seen[2] == ["False", "True"]
    # 3, 5 and 4 rows padded to 8, 11 to 16, then 4 to 16 (the most it was compiled for)
    assert ours.updates.rows[(("w", "e"), (False, True), 1)] == 16
    assert ours.updates.xla_fallbacks == 0


def test_the_count_before_compiling_is_read_from_the_environment(monkeypatch):
    from autosync.runtime.keras_optimizer import KerasOptimizer

    config = keras_optimizer_config(_compiled_cases()["SGD"]())
    for text, want in (("0", 0), ("12", 12), (" OFF ", None)):
        monkeypatch.setenv("AUTOSYNC_KERAS_XLA_AFTER", text)
        assert KerasOptimizer(config).updates.xla_after == want
    monkeypatch.setenv("AUTOSYNC_KERAS_XLA_AFTER", "soon")
    with pytest.raises(ConfigError, match=r"AUTOSYNC_KERAS_XLA_AFTER='soon': give a count .* or 'off'"):
        KerasOptimizer(config)


def test_a_subclass_and_an_update_xla_cannot_compile_run_traced():
    import tensorflow as tf

    from autosync.runtime.keras_optimizer import KerasOptimizer

    sub = KerasOptimizer(keras_optimizer_config(rm.HalfStepSGD(0.1)), xla_after=0)
    assert sub.updates.xla_after is None   # a user's rule may not keep zero slices as no gradient: never padded
    ours = KerasOptimizer(keras_optimizer_config(_compiled_cases()["SGD"]()), xla_after=0)
    # a dense variable, two tables of one row shape and one of another
    params = {"w": np.ones((4, 3), np.float32), "a": np.ones((9, 2), np.float32), "b": np.ones((7, 2), np.float32),
              "c": np.ones((5, 3), np.float32)}
    for k, v in params.items():
        ours.add_variable(k, v)
    real = ours.updates.function

    def no_xla(keys, sparse, xla=False, rows=()):   # what an operation without an XLA kernel does
        if xla:
            def fails(flat):
                raise tf.errors.InvalidArgumentError(None, None, "Detected unsupported operations")
            return fails
        return real(keys, sparse, xla=False, rows=rows)

    ours.updates.function = no_xla
    for step in range(2):
        ours.apply(step, params, {"w": np.ones((4, 3), np.float32),
                                  "a": (np.array([0, 3]), np.ones((2, 2), np.float32), None),
                                  "b": (np.array([6]), np.ones((1, 2), np.float32), None),
                                  "c": (np.array([1, 2, 4]), np.ones((3, 3), np.float32), None)})
    assert ours.updates.xla_fallbacks == 1   # tried once, then traced for that chunk
    np.testing.assert_allclose(ours.value(params, "w"), 1 - 2 * 0.01, rtol=1e-6)
    for key, touched in (("a", [0, 3]), ("b", [6]), ("c", [1, 2, 4])):
        want = np.ones_like(params[key]) if key in "ab" else np.ones((5, 3), np.float32)
        want[touched] -= 2 * 0.01
        np.testing.assert_allclose(ours.value(params, key), want, rtol=1e-6)


@pytest.mark.parametrize("options", [{}, {"learning_rate": "schedule", "clipvalue": 0.3}, {"clipnorm": 0.4},
                                     {"weight_decay": 0.1}], ids=["plain", "schedule_clipvalue", "clipnorm", "decay"])
def test_a_row_local_rule_updates_the_rows_it_touches_as_keras_updates_the_table(options):
    """Adagrad's sparse step on the rows touched alone (gathered into scratch rows, updated by the
    rule, written back) gives what Keras' step on the whole table gives, slices repeated and
    squared one by one, row counts growing past the scratch's (it is made anew), two tables of
    one row shape on one scratch (each alone under clipnorm: a norm per variable); under weight
    decay (which Keras applies to every row) the whole table runs as before."""
    import keras
    import tensorflow as tf

    from autosync.runtime.keras_optimizer import KerasOptimizer

    def make():
        given = dict(options)
        if given.get("learning_rate") == "schedule":
            given["learning_rate"] = keras.optimizers.schedules.CosineDecay(0.3, decay_steps=5)
        return keras.optimizers.Adagrad(**given)

    rng = np.random.default_rng(11)
    shapes = {"e": (50, 3), "w": (4, 2), "f": (30, 3)}
    init = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    ref = make()
    refs = {k: keras.Variable(v.copy()) for k, v in init.items()}
    ours = KerasOptimizer(keras_optimizer_config(make()), xla_after=None)
    params = {k: v.copy() for k, v in init.items()}
    for k, v in init.items():
        ours.add_variable(k, v)
    for step, n in enumerate((5, 7, 20, 3, 30)):
        grads = {"w": rng.standard_normal((4, 2)).astype(np.float32)}
        for key, m in (("e", n), ("f", max(1, n // 3))):
            grads[key] = (rng.integers(0, shapes[key][0], m), rng.standard_normal((m, 3)).astype(np.float32), None)
        ref.apply([tf.IndexedSlices(grads[k][1], grads[k][0], shapes[k]) if k != "w" else grads[k] for k in shapes],
                  list(refs.values()))
        ours.apply(step, params, grads)
    scratch = ours.updates.row_opts.get(((3,), np.dtype("float32")))
    assert (scratch is not None) == ("weight_decay" not in options) and len(ours.updates.row_opts) <= 1
    if scratch is not None:   # grown from 8 rows to the bucket of the 30 + 10 slices (clipnorm: of the 30)
        assert scratch[0] == (32 if "clipnorm" in options else 64)
    for k in shapes:
        np.testing.assert_allclose(ours.value(params, k), refs[k].numpy(), rtol=1e-5, atol=1e-6, err_msg=k)
    for i, v in enumerate(ref.variables):
        np.testing.assert_allclose(ours.state()[f"keras/{i}"], v.numpy(), rtol=1e-5, atol=1e-6, err_msg=v.name)
    table = refs["e"]
    assert not np.allclose(table.numpy(), init["e"])
