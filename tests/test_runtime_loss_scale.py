"""Dynamic loss scaling (a ``LossScaleOptimizer``, what ``compile`` gives a mixed_float16 model) on
every synchronizer trains as one process does with Keras' own: a step whose global-batch gradient is
not finite is skipped by every synchronizer together, the scale halves and grows as Keras', and the
optimizer counts only applied updates (real Ray + TF)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from strategy_space.errors import ConfigError
from tests import runtime_models as rm
from tests.runtime_helpers import PAIR
from tests.test_runtime_ps import _train
from tests.test_runtime_user_optimizer import _strategy

pytestmark = pytest.mark.integration
STEPS = 3
# growth after every applied step: step 0 doubles the scale, step 1 (nan) halves it, step 2 doubles
SCALE = {"initial_scale": 2.0 ** 10, "dynamic_growth_steps": 1}
COSINE = {"cosine": {"initial_learning_rate": 0.05, "decay_steps": 3, "warmup_target": 0.1, "warmup_steps": 1}}
OPTIMIZERS = {
    "adam": ("adam", {"learning_rate": 0.05}),   # the numpy rules: Adam's bias correction counts updates
    "rmsprop_cosine": ("RMSprop", {"learning_rate": COSINE}),   # the Keras optimizer: the schedule too
    "sgd_global_clip": ("sgd", {"learning_rate": 0.1, "momentum": 0.9, "global_clipnorm": 0.02}),
}


def _model_spec(pool, md):
    """The spec as the runner builds it: from the workers' variables and optimizer."""
    from autosync.runtime.plan import model_spec_from_vars

    pool.ensure(md, PAIR.devices)
    return model_spec_from_vars(md.name, pool.description["variables"], md.batch_size, pool.description["optimizer"])


@pytest.mark.parametrize("optimizer,strategy", [
    ("adam", s) for s in ("ps", "partitioned_ps", "parallax", "graph", "gloo", "mix")] + [
    ("rmsprop_cosine", s) for s in ("ps", "graph", "mix_gloo")] + [
    ("sgd_global_clip", s) for s in ("ps", "gloo", "graph")])
def test_a_step_not_finite_is_skipped_everywhere_as_keras_skips_it(pool, optimizer, strategy):
    kind, kw = OPTIMIZERS[optimizer]
    md = rm.model_def(kind, dataset=rm.nan_batches, loss_scale=SCALE, **kw)
    spec = _model_spec(pool, md)
    assert spec.global_clipnorm   # held steps: the cost model counts them
    _, history, weights = _train(pool, md, _strategy(strategy, spec), steps=STEPS)
    assert not np.isfinite(history.loss[1]) and np.isfinite(history.loss[0]) and np.isfinite(history.loss[2])
    expected = rm.reference_weights(md, num_workers=2, steps=STEPS)
    for got, want, var in zip(weights, expected, spec.variables):
        assert np.all(np.isfinite(got)), var.name   # the nan step changed nothing
        assert np.allclose(got, want, rtol=1e-5, atol=1e-6), (var.name, np.abs(got - want).max())
    # the skipped step counts in neither the schedule nor the bias correction: as if it never ran
    two = rm.reference_weights(rm.model_def(kind, loss_scale=SCALE, **kw), num_workers=2, steps=1)
    assert any(not np.allclose(a, b) for a, b in zip(weights, two))   # step 2 applied on top


def test_loss_scaling_with_staleness_or_accumulation_is_refused(pool):
    md = rm.model_def("sgd", learning_rate=0.1, loss_scale=SCALE)
    with pytest.raises(ConfigError, match=r"scales the loss dynamically .* without waiting for every worker"):
        _train(pool, md, _strategy("stale_ps", _model_spec(pool, md)), steps=1)
    md = rm.model_def("sgd", learning_rate=0.1, gradient_accumulation_steps=2, loss_scale=SCALE)
    with pytest.raises(ConfigError, match=r"gradient_accumulation_steps=2: AutoSync does not run the two together"):
        _train(pool, md, _strategy("ps", _model_spec(pool, md)), steps=1)


def _mixed(md):
    """``md`` built under the mixed_float16 policy (float16 compute, float32 variables), as a script
    that sets it before building its model: Keras' compile would wrap its optimizer for loss scaling."""
    import dataclasses

    from autosync.models.keras_settings import current

    return dataclasses.replace(md, keras_settings={**current(), "dtype_policy": "mixed_float16"})


@pytest.mark.parametrize("strategy", ["ps", "graph", "mix_gloo"])
def test_a_mixed_float16_model_trains_with_keras_loss_scaling(pool, strategy):
    """A mixed_float16 model with a plain optimizer gets Keras' default dynamic loss scaling (what
    compile gives it): the nan step is skipped and the rest trains as Keras' own on the global batch
    (float16 compute: the workers' half batches round otherwise than one batch, hence the tolerance)."""
    import keras

    from autosync.models import keras_settings

    md = _mixed(rm.model_def("adam", dataset=rm.nan_batches, learning_rate=0.05))
    spec = _model_spec(pool, md)
    assert spec.global_clipnorm   # held steps
    _, history, weights = _train(pool, md, _strategy(strategy, spec), steps=STEPS)
    before = keras_settings.current()
    keras_settings.apply(md.keras_settings)
    try:
        reference = rm.model_def("adam", dataset=rm.nan_batches, learning_rate=0.05, loss_scale={})
        expected = rm.reference_weights(reference, num_workers=2, steps=STEPS)
        assert keras.config.dtype_policy().name == "mixed_float16"
    finally:
        keras_settings.apply(before)
    for got, want, var in zip(weights, expected, spec.variables):
        assert got.dtype == np.float32 and np.all(np.isfinite(got)), var.name
        assert np.allclose(got, want, rtol=1e-2, atol=2e-3), (var.name, np.abs(got - want).max())
    initial = rm.reference_weights(md, num_workers=2, steps=0)
    assert all(not np.allclose(a, b, atol=1e-4) for a, b in zip(weights, initial))


@pytest.mark.parametrize("kind,strategy", [("adam", "ps"), ("RMSprop", "ps_and_graph")])
def test_a_fixed_loss_scale_factor_scales_the_backward_pass_and_is_undone_once(pool, kind, strategy):
    """An optimizer's own ``loss_scale_factor`` (Keras multiplies the loss by it and divides the
    gradients by it before the update) trains as Keras' own on the global batch, with the numpy rules
    on a PS, and with a Keras optimizer on a PS and in the graph: in a model whose backward pass cuts
    large gradients (as float16 loses them) the scale changes what is cut, so a step that did not
    scale the loss ends elsewhere, and so does one that divides twice."""
    import dataclasses

    from strategy_space import PS, AllReduce, Strategy, VarConfig

    def defined(**kw):
        return dataclasses.replace(rm.model_def(kind, learning_rate=0.05, **kw), name="cut_backward",
                                   model_fn=rm.build_cut_backward_model)

    md = defined(loss_scale_factor=64.0)
    spec = _model_spec(pool, md)
    names = [v.name for v in spec.variables]
    assert names == ["hidden/kernel", "hidden/bias", "out/kernel", "out/bias"], names
    plan = _strategy("ps", spec) if strategy == "ps" else Strategy(
        tuple(VarConfig(n, (PS(f"node{i}"),)) for i, n in enumerate(names[:2]))
        + tuple(VarConfig(n, (AllReduce(backend="graph", group=0),)) for n in names[2:]))
    _, _, weights = _train(pool, md, plan, steps=STEPS)
    expected = rm.reference_weights(md, num_workers=2, steps=STEPS)
    for got, want, name in zip(weights, expected, names):
        assert np.allclose(got, want, rtol=1e-5, atol=1e-6), (name, np.abs(got - want).max())
    unscaled = rm.reference_weights(defined(), num_workers=2, steps=STEPS)
    assert not np.allclose(weights[0], unscaled[0], rtol=1e-3, atol=1e-4)   # the scale cut the backward pass


@pytest.mark.parametrize("strategy", ["ps", "gloo"])
def test_a_checkpoint_keeps_the_loss_scale_and_the_skipped_steps(pool, tmp_path, strategy):
    """Saved after the skipped step and restored: the optimizer's count goes on from the applied
    updates (Adam's bias correction would differ otherwise) and the scale from where it was."""
    from autosync.runtime.trainer import Trainer

    kind, kw = OPTIMIZERS["adam"]
    md = rm.model_def(kind, dataset=rm.nan_batches, loss_scale=SCALE, **kw)
    plan = _strategy(strategy, _model_spec(pool, md))
    with Trainer(md, plan, PAIR, pool=pool, timeout_s=120) as trainer:
        trainer.fit(steps=2, steps_per_call=1)
        trainer.save(tmp_path / "ckpt")
    state = np.load(tmp_path / "ckpt" / json.loads((tmp_path / "ckpt" / "manifest.json").read_text())["directory"]
                    / "state.npz")
    # step 0 applied (2 ** 10 grows to 2 ** 11), step 1 skipped (halved back): [scale, counter, skipped]
    assert list(state["loss_scale"]) == [2.0 ** 10, 0, 1]
    with Trainer(md, plan, PAIR, pool=pool, timeout_s=120, restore=tmp_path / "ckpt") as again:
        again.fit(steps=2, steps_per_call=1)
        weights = again.get_weights()
    expected = rm.reference_weights(md, num_workers=2, steps=4)
    for got, want in zip(weights, expected):
        assert np.allclose(got, want, rtol=1e-5, atol=1e-6), np.abs(got - want).max()


def test_the_worker_loss_scale_moves_as_keras_loss_scale_optimizer():
    """``LossScale`` against Keras' own ``LossScaleOptimizer`` over a run of finite and non-finite
    steps (growth every 3 applied steps)."""
    import keras

    from autosync.runtime.loss_scale import LossScale

    var = keras.Variable(np.ones(2, np.float32))
    keras_lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=64.0,
                                                    dynamic_growth_steps=3)
    ours = LossScale(64.0, 3)
    for step, finite in enumerate([True, True, True, False, True, False, False, True, True, True, True]):
        grad = np.full(2, 1.0 if finite else np.inf, np.float32)
        keras_lso.apply([grad], [var])
        ours.after(finite)
        assert (float(keras_lso.dynamic_scale.numpy()), int(keras_lso.step_counter.numpy())) == (
            float(ours.scale), ours.counter), step
        assert int(keras_lso.iterations.numpy()) == ours.iteration(step + 1), step


@pytest.mark.parametrize("backend", ["gloo", "graph"])
@pytest.mark.parametrize("compressor", ["fp16_ef", "powersgd_ef(1)"])
def test_a_skipped_step_leaves_the_compressors_memory_as_it_was(pool, backend, compressor):
    """Error feedback keeps each step's compression residual for the next; a skipped step's (a
    gradient not finite) would poison every later step. Three steps with the second skipped train
    exactly as two steps on the other two batches: the residuals and PowerSGD's Qs are put back."""
    from strategy_space import AllReduce, Strategy, VarConfig

    kind, kw = "sgd", {"learning_rate": 0.1, "momentum": 0.9}   # (Adam's first steps hide fp16's rounding)
    md = rm.model_def(kind, dataset=rm.nan_batches, loss_scale=SCALE, **kw)
    spec = _model_spec(pool, md)
    lossy = Strategy(tuple(VarConfig(v.name, (AllReduce(backend=backend, compressor="none" if v.sparse else compressor),))
                           for v in spec.variables))
    _, history, skipped = _train(pool, md, lossy, steps=STEPS)
    assert not np.isfinite(history.loss[1])
    md_two = rm.model_def(kind, dataset=rm.skipping_batches, loss_scale=SCALE, **kw)
    _, _, two = _train(pool, md_two, lossy, steps=STEPS - 1)
    for got, want, var in zip(skipped, two, spec.variables):
        assert np.all(np.isfinite(got)), var.name
        assert np.allclose(got, want, rtol=1e-6, atol=1e-7), (var.name, np.abs(got - want).max())
    exact = rm.reference_weights(rm.model_def(kind, dataset=rm.skipping_batches, **kw), num_workers=2, steps=2)
    assert any(not np.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(two, exact))   # it was lossy


def test_a_trial_whose_skipped_step_had_a_nan_loss_is_not_called_divergent(pool):
    """The runner's divergence warning: under loss scaling a step whose loss is not finite was
    skipped (training went on, the last loss finite), so nothing is said."""
    import warnings

    from autosync.runtime.runner import RayRunner

    kind, kw = OPTIMIZERS["adam"]
    md = rm.model_def(kind, dataset=rm.nan_batches, loss_scale=SCALE, **kw)
    runner = RayRunner(md, PAIR, warmup=0, steps=3, pool=pool, trial_timeout_s=120)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = runner.run([_strategy("ps", runner.model)])[0]
    assert result.status == "ok", result.error
    assert not np.isfinite(result.meta["loss"][1]) and np.isfinite(result.meta["loss"][-1]), result.meta["loss"]


def test_in_the_graph_alone_a_loss_scaled_step_is_decided_inside_it(pool, tmp_path):
    """No held step there (no norm brought back, no second graph call to apply): the step applies
    the reduced gradients only when all are finite, and the skip and the scale's moves are Keras'
    ``LossScaleOptimizer``'s."""
    from autosync.runtime.trainer import Trainer

    kind, kw = OPTIMIZERS["adam"]
    md = rm.model_def(kind, dataset=rm.nan_batches, loss_scale=SCALE, **kw)
    with Trainer(md, _strategy("graph", _model_spec(pool, md)), PAIR, pool=pool, timeout_s=120) as trainer:
        trainer.fit(steps=STEPS, steps_per_call=1, timeline=tmp_path / "fit.json")
        weights = trainer.get_weights()
        trainer.save(tmp_path / "ckpt")
    spans = {e["name"] for e in json.loads((tmp_path / "fit.json").read_text())["traceEvents"] if e["ph"] == "X"}
    assert "compute" in spans and not any("held" in n or "norm" in n or "release" in n for n in spans), spans
    state = np.load(tmp_path / "ckpt" / json.loads((tmp_path / "ckpt" / "manifest.json").read_text())["directory"]
                    / "state.npz")
    assert list(state["loss_scale"]) == [2.0 ** 11, 0, 1]   # grown, halved at the skip, grown again
    for got, want in zip(weights, rm.reference_weights(md, num_workers=2, steps=STEPS)):
        assert np.allclose(got, want, rtol=1e-5, atol=1e-6), np.abs(got - want).max()
