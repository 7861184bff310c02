"""The model's own Keras optimizer (other optimizers, a subclass, a schedule, clipping) on every
synchronizer trains like one process on the global batch (real Ray + TF); what a strategy cannot
honour is refused before any parameter server starts; a bounded-stale PS converges with Adagrad
and with a schedule."""
from __future__ import annotations

import dataclasses
import functools
import re

import numpy as np
import pytest

from strategy_space import PS, AllReduce, Strategy, VarConfig
from strategy_space.errors import ConfigError
from tests import runtime_models as rm
from tests.runtime_helpers import PAIR
from tests.test_runtime_ps import _model_spec, _train

pytestmark = pytest.mark.integration
STEPS = 3
COSINE = {"cosine": {"initial_learning_rate": 0.05, "decay_steps": 3, "warmup_target": 0.1, "warmup_steps": 1}}
OPTIMIZERS = {
    "sgd_cosine": ("sgd", {"learning_rate": COSINE, "momentum": 0.9}),
    "adam_clipvalue": ("adam", {"learning_rate": 0.05, "clipvalue": 0.05}),
    "lion_clipnorm": ("Lion", {"learning_rate": 0.01, "clipnorm": 0.1}),
    "rmsprop_cosine": ("RMSprop", {"learning_rate": COSINE}),
    "subclass": ("subclass", {"learning_rate": 0.1}),
    # global_clipnorm small enough that every step is clipped (checked below)
    "sgd_global_clip": ("sgd", {"learning_rate": 0.1, "momentum": 0.9, "global_clipnorm": 0.02}),
    "adamw_global_clip": ("AdamW", {"learning_rate": COSINE, "global_clipnorm": 0.02}),
    "rmsprop_global_clip": ("RMSprop", {"learning_rate": COSINE, "global_clipnorm": 0.02}),
    # a constant rate: the numpy rules, an embedding's rows with their summed squares, then scaled
    "adam_global_clip": ("adam", {"learning_rate": 0.05, "global_clipnorm": 0.02}),
    # a step draws n batches and syncs their mean; a schedule and Adam's bias correction see Keras'
    # count of batches
    "sgd_accumulate": ("sgd", {"learning_rate": COSINE, "momentum": 0.9, "gradient_accumulation_steps": 2}),
    "adam_accumulate": ("adam", {"learning_rate": 0.05, "gradient_accumulation_steps": 3}),
    # Keras accumulates into dense gradients: the rule sees an embedding's rows summed over everything
    "rmsprop_accumulate": ("RMSprop", {"learning_rate": 0.05, "gradient_accumulation_steps": 2}),
    "sgd_accumulate_clip": ("sgd", {"learning_rate": 0.1, "global_clipnorm": 0.02, "gradient_accumulation_steps": 2}),
    # the model ends with the moving averages, as Keras' fit ends (overwritten every 2 steps too)
    "sgd_ema": ("sgd", {"learning_rate": 0.1, "momentum": 0.9, "use_ema": True, "ema_momentum": 0.5,
                        "ema_overwrite_frequency": 2}),
    "adam_ema": ("adam", {"learning_rate": 0.05, "use_ema": True, "ema_momentum": 0.6}),
    # weight decay that leaves biases and the embedding alone, as transformer recipes do: a constant
    # rate (the numpy rules) and a schedule (the Keras optimizer on the shards)
    "adamw_exclude": ("AdamW", {"learning_rate": 0.05, "weight_decay": 0.5,
                                "exclude_from_weight_decay": ["bias", "embeddings"]}),
    "adamw_exclude_cosine": ("AdamW", {"learning_rate": COSINE, "weight_decay": 0.5,
                                       "exclude_from_weight_decay": ["bias", "embeddings"]}),
}


def _strategy(name, spec):
    from strategy_space.builders import get_builder

    if name == "stale_ps":
        return Strategy(tuple(VarConfig(v.name, (PS(f"node{i % 2}", staleness=2),))
                              for i, v in enumerate(spec.variables)))
    if name in ("mix", "mix_gloo"):
        # one variable's shards on a PS and all-reduced, another's in the graph (mix_gloo: with
        # gloo) and on a PS
        backend = "gloo" if name == "mix_gloo" else "graph"
        return Strategy((
            VarConfig("emb/embeddings", (PS("node0"), PS("node1"))),
            VarConfig("hidden/kernel", (AllReduce(backend=backend, group=0), PS("node1")), axis=1),
            VarConfig("hidden/bias", (AllReduce(backend="gloo", group=1),)),
            VarConfig("out/kernel", (PS("node0"),)),
            VarConfig("out/bias", (AllReduce(backend=backend, group=0),)),
        ))
    if name.startswith("emb_in_graph"):   # the sparse embedding in the graph, the dense rest on a PS or gloo
        rest = (PS("node1"),) if name.endswith("ps") else (AllReduce(backend="gloo", group=1),)
        return Strategy((VarConfig("emb/embeddings", (AllReduce(backend="graph", group=0),)),)
                        + tuple(VarConfig(v.name, rest) for v in spec.variables[1:]))
    builder, options = {"ps": ("ps", {}), "partitioned_ps": ("partitioned_ps", {"min_partition_bytes": 1}),
                        "parallax": ("parallax", {"backend": "gloo"}),
                        "graph": ("all_reduce", {"backend": "graph"}),
                        "gloo": ("all_reduce", {"backend": "gloo", "chunk_bytes": 64})}[name]
    return get_builder(builder, **options).build(spec, PAIR)


@pytest.mark.parametrize("optimizer,strategy", [
    ("sgd_cosine", s) for s in ("ps", "partitioned_ps", "parallax", "graph", "gloo", "mix")] + [
    (o, "graph") for o in ("lion_clipnorm", "adam_clipvalue", "rmsprop_cosine", "subclass")] + [
    # each PS trial on the Keras path imports TensorFlow in its PS actors (seconds): one PS and one
    # numpy all-reduce case per option, not every pair
    ("lion_clipnorm", "emb_in_graph_ps"), ("adam_clipvalue", "emb_in_graph_gloo"),
    ("rmsprop_cosine", "emb_in_graph_ps"), ("subclass", "emb_in_graph_gloo")] + [
    # the embedding outside the graph under a rule that transforms each slice: every slice travels
    # (PS pushes, node-less partitioned shards; the numpy all-reduce gathers them as they are)
    ("rmsprop_cosine", "ps"), ("rmsprop_cosine", "partitioned_ps"), ("adam_clipvalue", "parallax"),
    ("adam_clipvalue", "gloo"), ("lion_clipnorm", "ps")] + [
    ("rmsprop_accumulate", s) for s in ("ps", "gloo")] + [
    # the norm over every gradient of the step, whichever synchronizer carries it
    ("sgd_global_clip", s) for s in ("ps", "partitioned_ps", "parallax", "gloo", "mix_gloo", "mix", "graph")] + [
    ("adamw_global_clip", s) for s in ("graph", "emb_in_graph_ps", "emb_in_graph_gloo")] + [
    # a schedule: the Keras path, with the embedding's rows summed over the workers (Keras hands a
    # globally clipped rule a dense gradient)
    ("adamw_global_clip", s) for s in ("ps", "partitioned_ps", "gloo")] + [
    ("rmsprop_global_clip", s) for s in ("ps", "parallax")] + [
    ("adam_global_clip", s) for s in ("ps", "partitioned_ps", "gloo")] + [
    ("sgd_accumulate", s) for s in ("ps", "parallax", "gloo", "mix")] + [
    ("adam_accumulate", s) for s in ("graph", "emb_in_graph_ps")] + [("sgd_accumulate_clip", "mix_gloo")] + [
    ("sgd_ema", s) for s in ("ps", "partitioned_ps", "parallax", "gloo", "mix")] + [
    ("adam_ema", s) for s in ("graph", "emb_in_graph_ps", "emb_in_graph_gloo")] + [
    ("adamw_exclude", s) for s in ("ps", "partitioned_ps", "gloo")] + [
    ("adamw_exclude_cosine", s) for s in ("ps", "gloo", "graph")])
def test_user_optimizer_equals_single_process(pool, optimizer, strategy):
    kind, kw = OPTIMIZERS[optimizer]
    md = rm.model_def(kind, **kw)
    spec = _model_spec(pool, md)
    _, _, weights = _train(pool, md, _strategy(strategy, spec), steps=STEPS)
    # one process applies once every n batches: STEPS steps of the runtime are n * STEPS of Keras'
    expected = rm.reference_weights(md, num_workers=2, steps=STEPS * kw.get("gradient_accumulation_steps", 1))
    for got, want, var in zip(weights, expected, spec.variables):
        assert np.allclose(got, want, rtol=1e-5, atol=1e-6), (var.name, np.abs(got - want).max())
    initial = rm.reference_weights(md, num_workers=2, steps=0)
    assert all(not np.allclose(a, b) for a, b in zip(weights, initial))
    if "global_clipnorm" in kw:   # the clipping changed the result: it was not a no-op
        unclipped = rm.reference_weights(rm.model_def(kind, **{k: v for k, v in kw.items() if k != "global_clipnorm"}),
                                         num_workers=2, steps=STEPS * kw.get("gradient_accumulation_steps", 1))
        assert any(not np.allclose(a, b, rtol=1e-3, atol=1e-4) for a, b in zip(weights, unclipped))
    if "exclude_from_weight_decay" in kw:   # the exclusions changed the result: every variable decayed differs
        decayed = rm.reference_weights(rm.model_def(kind, **{k: v for k, v in kw.items()
                                                             if k != "exclude_from_weight_decay"}),
                                       num_workers=2, steps=STEPS)
        assert any(not np.allclose(a, b, rtol=1e-3, atol=1e-4) for a, b in zip(weights, decayed))


@pytest.mark.parametrize("optimizer,strategy,match", [
    ("lion_clipnorm", "partitioned_ps", r"clipnorm=0.1 clips each variable by its own norm, but \S+ is split"),
    ("sgd_global_clip", "stale_ps", r"global_clipnorm=0.02 .* apply updates without waiting for every worker "
                                    r"\(staleness 2\)"),
    ("sgd_accumulate_clip", "mix", r"with gradient_accumulation_steps the graph all-reduce backend accumulates inside"),
])
def test_what_a_strategy_cannot_honour_is_refused(pool, optimizer, strategy, match):
    kind, kw = OPTIMIZERS[optimizer]
    md = rm.model_def(kind, **kw)
    with pytest.raises(ConfigError, match=match):
        _train(pool, md, _strategy(strategy, _model_spec(pool, md)), steps=1)


STALE_STEPS = 40
STALE_COSINE = {"cosine": {"initial_learning_rate": 0.2, "decay_steps": STALE_STEPS, "warmup_target": 0.3,
                           "warmup_steps": 4}}


@pytest.mark.parametrize("optimizer,options", [("Adagrad", {"learning_rate": 0.5}),
                                               ("sgd", {"learning_rate": STALE_COSINE})], ids=["adagrad", "sgd_cosine"])
def test_a_bounded_stale_ps_converges(pool, optimizer, options):
    """Staleness 2 on every variable: Adagrad (the PS shards' numpy rule) and SGD under a
    cosine-decay schedule (the Keras optimizer in the PS actors) fit a linear teacher."""
    from autosync.runtime.trainer import Trainer

    md = dataclasses.replace(rm.teacher_model_def(),
                             optimizer_fn=functools.partial(rm.make_optimizer, optimizer, **options))
    spec = _model_spec(pool, md)
    stale = Strategy(tuple(VarConfig(v.name, (PS(f"node{i % 2}", staleness=2),)) for i, v in enumerate(spec.variables)))
    with Trainer(md, stale, PAIR, pool=pool, timeout_s=120) as trainer:
        loss = np.asarray(trainer.fit(steps=STALE_STEPS, steps_per_call=10).loss)
    assert np.all(np.isfinite(loss))
    first, last = loss[:4].mean(), loss[-8:].mean()
    # the teacher's targets have variance ~16 (x @ W, W standard normal) and a noise floor of 0.01
    assert last < 0.25 * first, (first, last)


@pytest.mark.parametrize("optimizer, cut", [("rmsprop_cosine", True), ("lion_clipnorm", False)])
def test_row_blocks_for_pipelining_only_where_the_optimizer_updates_them_alike(pool, monkeypatch, optimizer, cut):
    """A PS actor's large whole variables are cut into row blocks for pipelining only where the
    Keras optimizer updates a block as it updates the whole variable: RMSprop with a schedule is
    cut, clipnorm (a variable's own norm) is not; both train like one process."""
    from autosync.runtime import engine
    from autosync.runtime.trainer import Trainer

    monkeypatch.setattr(engine, "PS_CHUNK_MIN_BYTES", 1)
    monkeypatch.setenv("AUTOSYNC_PS_CHUNKS", "4")
    kind, kw = OPTIMIZERS[optimizer]
    md = rm.model_def(kind, **kw)
    spec = _model_spec(pool, md)
    with Trainer(md, _strategy("emb_in_graph_ps", spec), PAIR, pool=pool, timeout_s=120) as trainer:
        trainer.fit(steps=STEPS, steps_per_call=STEPS)
        weights = trainer.get_weights()
        planned, ran = trainer.plan, trainer.session.plan
    kernel = spec.names.index("hidden/kernel")
    assert (ran.layout[kernel][0] > 1) == cut and planned.layout[kernel] == (1, 0), ran.layout
    for got, want, var in zip(weights, rm.reference_weights(md, num_workers=2, steps=STEPS), spec.variables):
        assert np.allclose(got, want, rtol=1e-5, atol=1e-6), (var.name, np.abs(got - want).max())


def test_the_runner_says_what_optimizer_the_workers_built(pool):
    """What tuning reads to keep staleness out of a search under global_clipnorm (``autosync.tune``)."""
    from autosync.runtime.runner import RayRunner

    kind, kw = OPTIMIZERS["adamw_global_clip"]
    runner = RayRunner(rm.model_def(kind, **kw), PAIR, warmup=0, steps=1, pool=pool, trial_timeout_s=120)
    config = runner.optimizer_config()
    assert config["class"].endswith("AdamW") and config["global_clipnorm"] == 0.02
    # trials are recorded against a spec that says the step is held (its own fingerprint), and a
    # spec given for the same model that says otherwise is refused before any trial
    assert runner.model.global_clipnorm
    plain = RayRunner(rm.model_def("sgd"), PAIR, warmup=0, steps=1, pool=pool, trial_timeout_s=120).model
    assert not plain.global_clipnorm
    wrong = RayRunner(rm.model_def(kind, **kw), PAIR, warmup=0, steps=1, pool=pool, trial_timeout_s=120,
                      model_spec=dataclasses.replace(runner.model, global_clipnorm=False))
    with pytest.raises(ConfigError, match="says global_clipnorm false but the workers' optimizer clips"):
        wrong.model


SCRIPT_OPTIMIZER = '''
import functools
import re

import keras

from autosync.model_def import ModelDef
from tests import runtime_models as rm


class WarmupLinear(keras.optimizers.schedules.LearningRateSchedule):
    """A user's own schedule class: only this script defines it."""

    def __init__(self, peak, warmup):
        self.peak, self.warmup = peak, warmup

    def __call__(self, step):
        step = keras.ops.cast(step, "float32")
        return self.peak * keras.ops.minimum(1.0, (step + 1.0) / self.warmup)

    def get_config(self):
        return {"peak": self.peak, "warmup": self.warmup}


class Scaled(keras.optimizers.schedules.LearningRateSchedule):
    """A user's schedule around another of the user's: its from_config deserializes the inner
    one, which it finds only if that class travelled too."""

    def __init__(self, inner, scale):
        self.inner = keras.saving.deserialize_keras_object(inner) if isinstance(inner, dict) else inner
        self.scale = scale

    def __call__(self, step):
        return self.scale * self.inner(step)

    def get_config(self):
        return {"inner": keras.saving.serialize_keras_object(self.inner), "scale": self.scale}


class SignMomentum(keras.optimizers.Optimizer):
    """A user's own update rule with a slot of its own: only this script defines it."""

    def build(self, variables):
        super().build(variables)
        self.moments = [self.add_variable_from_reference(v, "moment") for v in variables]

    def update_step(self, gradient, variable, learning_rate):
        m = self.moments[self._get_variable_index(variable)]
        self.assign(m, 0.5 * m + keras.ops.convert_to_tensor(gradient))
        self.assign_sub(variable, keras.ops.cast(learning_rate, variable.dtype) * keras.ops.sign(m))


def make_optimizer():
    return SignMomentum(learning_rate=Scaled(WarmupLinear(0.1, 2), 0.5))


def build():
    return ModelDef(name="script_opt", model_fn=functools.partial(rm.build_model, rm.VOCAB), loss_fn=rm.mse,
                    optimizer_fn=make_optimizer, dataset_fn=functools.partial(rm.make_batches, batch=8),
                    batch_size=8, seed=7)
'''


@pytest.mark.parametrize("strategy", ["ps", "gloo"])
def test_an_optimizer_and_a_schedule_a_script_defines_train_wherever_updates_run(pool, tmp_path, strategy):
    """The classes live in a model script, a module no other process can import by its name:
    they travel by value (``optimizer_config.USER_CLASSES``) to the parameter servers and the numpy
    all-reduce, which train as one process does (they failed to import there before), a schedule
    nested in the user's own schedule among them."""
    from autosync.models.script import load_model_def

    path = tmp_path / "opt_script.py"
    path.write_text(SCRIPT_OPTIMIZER)
    md = load_model_def(str(path), "build")
    spec = _model_spec(pool, md)
    config = pool.description["optimizer"]
    assert config["class"].endswith(".SignMomentum")
    assert set(config["_user_classes"]) == {"SignMomentum", "Scaled", "WarmupLinear"}
    _, _, weights = _train(pool, md, _strategy(strategy, spec), steps=STEPS)
    expected = rm.reference_weights(md, num_workers=2, steps=STEPS)
    for got, want, var in zip(weights, expected, spec.variables):
        assert np.allclose(got, want, rtol=1e-5, atol=1e-6), (var.name, np.abs(got - want).max())
    initial = rm.reference_weights(md, num_workers=2, steps=0)
    assert all(not np.allclose(a, b) for a, b in zip(weights, initial))


def _constant_rate():
    return 0.05


def _callable_rate_optimizer(rate):
    import keras

    return keras.optimizers.Adam(learning_rate=rate)


@pytest.mark.parametrize("rate,name", [(_constant_rate, "_constant_rate"), (lambda: 0.05, "<lambda>")])
def test_a_callable_learning_rate_is_refused_before_ray_starts(rate, name):
    """Keras calls it at every update; here updates run in other processes, which never see what
    the user's process changes: it was accepted, and every parameter server then failed
    ('Could not locate function'), or Keras' get_config raised 'could not get source code'."""
    from autosync.runtime.optimizers import check_model_optimizer

    md = dataclasses.replace(rm.model_def("adam"), optimizer_fn=functools.partial(_callable_rate_optimizer, rate))
    with pytest.raises(ConfigError, match=rf"learning_rate={re.escape(name)} is a callable, .* give a float or a "
                                          r"keras.optimizers.schedules.LearningRateSchedule"):
        check_model_optimizer(md)
    kind, kw = OPTIMIZERS["sgd_cosine"]   # a schedule is a function of the step: accepted
    assert check_model_optimizer(rm.model_def(kind, **kw))["class"] == "SGD"
