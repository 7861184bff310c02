"""Variables with constraints (``kernel_constraint=NonNeg()``, ``MaxNorm``), which Keras' optimizer
applies to a variable after each update: the graph all-reduce, which updates with the model's own
optimizer and variables, trains them as one process does (backend ``auto`` reduces them there); a
parameter server or the gloo all-reduce would train them unconstrained, so such a plan is refused
before any worker trains (both trained silently without the constraint before)."""
from __future__ import annotations

import numpy as np
import pytest

from strategy_space import PS, AllReduce, ConfigError, Strategy, VarConfig
from tests import runtime_models as rm
from tests.runtime_helpers import PAIR
from tests.test_runtime_ps import _model_spec

pytestmark = pytest.mark.integration
STEPS = 3
CONSTRAINED = ("hidden/kernel", "out/kernel")


def _strategy(spec, constrained, others) -> Strategy:
    return Strategy(tuple(VarConfig(v.name, (constrained if v.name in CONSTRAINED else others,))
                          for v in spec.variables))


@pytest.mark.parametrize("constrained, others", [
    (AllReduce(backend="graph"), AllReduce(backend="graph")), (AllReduce(backend="graph"), PS("node1")),
    (AllReduce(backend="graph"), AllReduce(backend="gloo")),
    (AllReduce(), PS("node1")), (AllReduce(), AllReduce()),   # auto: the graph for a constrained variable
], ids=["graph", "graph+ps", "graph+gloo", "auto+ps", "auto"])
def test_constrained_variables_on_the_graph_all_reduce_train_as_one_process(pool, constrained, others):
    from autosync.runtime.trainer import Trainer

    md = rm.constrained_model_def("adam", learning_rate=0.2)
    spec = _model_spec(pool, md)
    with Trainer(md, _strategy(spec, constrained, others), PAIR, pool=pool, timeout_s=120) as trainer:
        backends = {m.backend for g in trainer.plan.ar_groups for m in g.members
                    if spec.variables[m.key[0]].name in CONSTRAINED}
        assert backends == {"graph"}
        trainer.fit(steps=STEPS)
        weights = trainer.get_weights()
    expected = rm.reference_weights(md, num_workers=2, steps=STEPS)
    hidden = [v.name for v in spec.variables].index("hidden/kernel")
    assert (expected[hidden] == 0).any()   # the constraint bit: some weights were clipped to 0
    for got, want in zip(weights, expected):
        assert np.allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("where", [PS("node0"), AllReduce(backend="gloo")], ids=["ps", "gloo"])
def test_a_constrained_variable_updated_outside_the_graph_is_refused_naming_it(pool, where):
    from autosync.runtime.trainer import Trainer

    md = rm.constrained_model_def("sgd", learning_rate=0.2)
    spec = _model_spec(pool, md)
    assert pool.description["optimizer"]["constrained_variables"] == {"hidden/kernel": "NonNeg", "out/kernel": "MaxNorm"}
    with pytest.raises(ConfigError) as e:
        Trainer(md, _strategy(spec, where, AllReduce(backend="graph")), PAIR, pool=pool, timeout_s=120)
    assert [p.split(",")[0] for p in e.value.problems] == [
        "variable hidden/kernel has a constraint (NonNeg)", "variable out/kernel has a constraint (MaxNorm)"]
    assert all("give it all_reduce with backend graph" in p for p in e.value.problems)
