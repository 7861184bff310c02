"""A scalar trainable variable (a learned temperature, shape ``()``) trains on every synchronizer as
one process on the global batch trains it: TensorFlow hands a scalar's value and gradient over as a
numpy scalar, not an array, which the parameter servers could not serve and the pull could not
place (every trial of such a model failed)."""
from __future__ import annotations

import numpy as np
import pytest

from strategy_space import AllReduce, PS, Strategy, VarConfig
from tests import runtime_models as rm
from tests.runtime_helpers import PAIR
from tests.test_runtime_ps import _model_spec

pytestmark = pytest.mark.integration
STEPS = 3


def _strategy(name: str, spec) -> Strategy:
    from strategy_space.builders import get_builder

    if name == "mixed":   # the scalar all-reduced in the graph, the rest on parameter servers
        return Strategy(tuple(VarConfig(v.name, (AllReduce(backend="graph"),) if not v.shape else (PS("node1"),))
                              for v in spec.variables))
    return get_builder(name).build(spec, PAIR)


@pytest.mark.parametrize("optimizer, name", [("adam", "ps"), ("RMSprop", "ps"), ("adam", "all_reduce"),
                                             ("adagrad", "partitioned_ps"), ("adam", "mixed")])
def test_a_scalar_variable_trains_as_one_process_trains_it(pool, optimizer, name):
    from autosync.runtime.trainer import Trainer

    md = rm.tempered_model_def(optimizer, learning_rate=0.05)
    spec = _model_spec(pool, md)
    assert any(v.shape == () for v in spec.variables)
    with Trainer(md, _strategy(name, spec), PAIR, pool=pool, timeout_s=120) as trainer:
        trainer.fit(steps=STEPS)
        weights = trainer.get_weights()
    expected = rm.reference_weights(md, num_workers=2, steps=STEPS)
    initial = rm.reference_weights(md, num_workers=2, steps=0)
    scalar = next(i for i, w in enumerate(expected) if np.ndim(w) == 0)
    assert abs(float(expected[scalar]) - float(initial[scalar])) > 1e-3   # the temperature moved
    for got, want in zip(weights, expected):
        assert np.shape(got) == np.shape(want)
        assert np.allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["ps", "mixed"])
def test_a_scalar_variable_is_saved_where_keras_reads_it_and_restored(pool, tmp_path, name):
    """The checkpoint of a scalar's shard (selected whole, a 0-d array) is Keras' weights file and
    the PS's slots; a run restored from it ends where the uninterrupted run ends."""
    from autosync.runtime.trainer import Trainer

    md = rm.tempered_model_def("adam", learning_rate=0.05)
    strategy = _strategy(name, _model_spec(pool, md))
    with Trainer(md, strategy, PAIR, pool=pool, timeout_s=120) as trainer:
        trainer.fit(steps=2)
        info = trainer.save(tmp_path / "ckpt")
        saved = trainer.get_weights()
    fresh = md.model_fn()
    fresh.load_weights(info.weights_path)
    assert all(np.array_equal(a, b) for a, b in zip(fresh.get_weights(), saved))
    with Trainer(md, strategy, PAIR, pool=pool, timeout_s=120, restore=tmp_path / "ckpt") as again:
        assert all(np.shape(a) == np.shape(b) and np.array_equal(a, b) for a, b in zip(again.get_weights(), saved))
        again.fit(steps=STEPS - 2)
        continued = again.get_weights()
    for got, want in zip(continued, rm.reference_weights(md, num_workers=2, steps=STEPS)):
        assert np.allclose(got, want, rtol=1e-5, atol=1e-6)
