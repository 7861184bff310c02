"""Hierarchical all-reduce (real Ray + TF): with two workers on each of two nodes, reducing on the
node, all-reducing among the node leaders and broadcasting on the node trains exactly like one
process, for dense (fused, compressed-free) and sparse (all-gathered) members."""
from __future__ import annotations

import numpy as np
import pytest

from tests import runtime_models as rm
from tests.runtime_helpers import warm_pool
from strategy_space import AllReduce, ClusterSpec, NodeSpec, Strategy, VarConfig

pytestmark = pytest.mark.integration

STEPS = 3
QUAD = ClusterSpec(name="quad", nodes=(
    NodeSpec(name="node0", address="127.0.0.1", cpus=1, workers=2, chief=True),
    NodeSpec(name="node1", address="127.0.0.1", cpus=1, workers=2),
))


@pytest.fixture(scope="module")
def pool(ray_session):
    yield from warm_pool(ray_session, QUAD)


@pytest.mark.parametrize("backend", ["gloo", "objectstore"])
def test_hierarchical_allreduce_equals_single_process(pool, backend):
    from autosync.runtime.plan import SyncPlan, model_spec_from_vars
    from autosync.runtime.trainer import Trainer

    md = rm.multi_model_def("adam", learning_rate=0.05)
    pool.ensure(md, QUAD.devices)
    spec = model_spec_from_vars(md.name, pool.description["variables"], md.batch_size)
    hier = AllReduce(backend=backend, hierarchical=True)
    strategy = Strategy(tuple(VarConfig(v.name, (hier,)) for v in spec.variables))
    plan = SyncPlan.build(strategy, spec, QUAD)
    assert plan.backends == ("hierarchical",) and plan.num_workers == 4
    with Trainer(md, strategy, QUAD, pool=pool, timeout_s=180) as trainer:
        trainer.fit(steps=STEPS, steps_per_call=STEPS)
        weights = trainer.get_weights()
    expected = rm.reference_weights(md, num_workers=4, steps=STEPS)
    initial = rm.reference_weights(md, num_workers=4, steps=0)
    for got, want, var in zip(weights, expected, spec.variables):
        assert np.allclose(got, want, rtol=1e-5, atol=5e-6), (var.name, np.abs(got - want).max())
    assert all(not np.allclose(a, b) for a, b in zip(weights, initial))
