"""A model whose layers Keras names by itself gets the same variable names in every process that
builds it, whatever that process built before: a driver that had built the model once (a notebook
trying it, a user's check before ``make_trainer``) named them ``dense_2/kernel`` where a fresh
worker said ``dense/kernel``, and every strategy was refused."""
from __future__ import annotations

import functools
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from autosync.model_def import ModelDef
from autosync.models import keras_names, script
from strategy_space.errors import ConfigError
from tests import runtime_models as rm

pytestmark = pytest.mark.integration   # Keras builds the models

def unnamed_model():
    """``rm.build_model`` with no layer named: Keras names each from its counters."""
    import keras

    ids = keras.Input((rm.IDS,), dtype="int32")
    x = keras.layers.Flatten()(keras.layers.Embedding(rm.VOCAB, rm.DIM)(ids))
    x = keras.layers.Dense(6, activation="tanh")(x)
    return keras.Model(ids, keras.layers.Dense(1)(x))


def unnamed_def(**kw) -> ModelDef:
    return ModelDef(name="unnamed", model_fn=unnamed_model, loss_fn=rm.mse,
                    optimizer_fn=functools.partial(rm.make_optimizer, "adam", learning_rate=0.05),
                    dataset_fn=functools.partial(rm.make_batches, batch=8), batch_size=8, seed=7, **kw)


def paths(model) -> list[str]:
    return [v.path for v in model.trainable_variables]


WANT = ["embedding/embeddings", "dense/kernel", "dense/bias", "dense_1/kernel", "dense_1/bias"]


def test_a_model_built_before_does_not_rename_the_next_build():
    import keras

    unnamed_model(), unnamed_model()   # the user's own builds advance this process's counters
    md = unnamed_def()
    assert paths(md.build_model()) == WANT
    assert paths(md.build_model()) == WANT
    # the process's own numbering goes on as if AutoSync had built nothing
    before = keras_names.counts()
    md.build_model()
    assert keras_names.counts() == before
    assert keras.layers.Dense(1).name == f"dense_{before['dense']}"


def test_counters_come_back_when_model_fn_raises():
    import keras

    def broken():
        keras.layers.Dense(1)
        raise RuntimeError("boom")

    keras.layers.Dense(1)
    before = keras_names.counts()
    md = ModelDef(name="broken", model_fn=broken, loss_fn=rm.mse, optimizer_fn=rm.make_optimizer,
                  dataset_fn=rm.make_batches, batch_size=8)
    with pytest.raises(RuntimeError):
        md.build_model()
    assert keras_names.counts() == before


SCRIPT = '''
import functools

import keras

from autosync.model_def import ModelDef
from tests import runtime_models as rm

SHARED = keras.layers.Dense(rm.DIM)   # a module-level layer the model reuses: named "dense" at import


def make_model():
    ids = keras.Input((rm.IDS,), dtype="int32")
    x = SHARED(keras.layers.Embedding(rm.VOCAB, rm.DIM)(ids))
    return keras.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(x)))


def build():
    return ModelDef(name="shared_layer", model_fn=make_model, loss_fn=rm.mse,
                    optimizer_fn=functools.partial(rm.make_optimizer, "sgd", learning_rate=0.1),
                    dataset_fn=functools.partial(rm.make_batches, batch=8), batch_size=8)
'''


def test_a_module_level_layer_keeps_its_name_and_another_process_names_the_model_alike(tmp_path):
    import cloudpickle
    import keras

    keras.layers.Dense(1), keras.layers.Embedding(3, 2)   # this process named some layers already
    path = tmp_path / "shared_layer.py"
    path.write_text(SCRIPT)
    md = script.load_model_def(path, "build")
    shared = sys.modules[next(n for n in sys.modules if n.startswith("autosync_user_shared_layer"))].SHARED.name
    # counted on from the top level's names: the model's own Dense layers never take the shared one's
    assert md.name_counts == keras_names.counts() and md.name_counts["dense"] >= 2
    here = paths(md.build_model())
    assert f"{shared}/kernel" in here and len(set(here)) == len(here) == 5
    assert paths(md.build_model()) == here
    blob = tmp_path / "model_def.pkl"
    blob.write_bytes(cloudpickle.dumps(md))
    # a fresh process that cannot import the script, having named layers of its own first
    code = ("import pickle, sys, keras; keras.layers.Dense(1); keras.layers.Dense(1); d = pickle.loads(open(sys.argv[1], 'rb').read()); "
            "print(' '.join(v.path for v in d.build_model().trainable_variables))")
    out = subprocess.run([sys.executable, "-c", code, str(blob)], capture_output=True, text=True, cwd="/",
                         timeout=180, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == here


@pytest.mark.parametrize("bad", [{"dense": -1}, {"dense": 1.5}, {3: 1}, ["dense"], {"dense": True}])
def test_name_counts_are_checked(bad):
    with pytest.raises(ConfigError, match="name_counts must be a dict"):
        unnamed_def(name_counts=bad)


def test_a_model_def_without_counts_pickles_and_builds_alike():
    md = pickle.loads(pickle.dumps(unnamed_def()))
    assert md.name_counts is None and paths(md.build_model()) == WANT


def test_a_driver_that_built_the_model_before_trains_it_with_its_own_names(pool):
    """The strategy comes from the driver's ingestion (as make_trainer's does) after the driver built
    the model twice itself; the workers, warm from other tests, built other models before."""
    from autosync.models.ingest import model_spec_from_def
    from autosync.runtime.trainer import Trainer
    from strategy_space.builders import get_builder
    from tests.runtime_helpers import PAIR

    unnamed_model(), unnamed_model()
    md = unnamed_def()
    spec = model_spec_from_def(md)
    assert [v.name for v in spec.variables] == WANT
    strategy = get_builder("ps").build(spec, PAIR)
    with Trainer(md, strategy, PAIR, pool=pool, timeout_s=120) as trainer:
        trainer.fit(steps=3)
        weights = trainer.get_weights()
    for got, want in zip(weights, rm.reference_weights(md, num_workers=2, steps=3)):
        assert np.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_scope_left_open_by_a_failed_trace_does_not_prefix_the_next_build():
    """Keras' name scope entered by a traced call that failed on a layer name TensorFlow refuses
    is never left; a build after it named every variable ``functional/...`` in the driver only."""
    from keras.src.backend.common import name_scope

    scope = name_scope.name_scope("functional")
    scope.__enter__()   # as the failed trace left it: entered, never exited
    try:
        assert name_scope.current_path() == "functional"
        assert paths(unnamed_def().build_model()) == WANT
        assert name_scope.current_path() == "functional"   # the process's own scopes given back
    finally:
        scope.__exit__(None, None, None)
