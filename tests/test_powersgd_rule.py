"""What PowerSGD compresses and how many values it sends is one rule: the runtime's channel, the
features and the network simulation agree on it, shape by shape (no Ray, no TensorFlow)."""
from __future__ import annotations

import numpy as np
import pytest

from autosync.runtime.sync.allreduce import AllReduceChannel, ARGroup, ARMember
from autosync.runtime.sync.compression import wire_values
from strategy_space import AllReduce, ClusterSpec, ModelSpec, NodeSpec, Strategy, VarConfig, VariableSpec
from strategy_space.compressor import Compressor, matrix_dims, powersgd_compressible, powersgd_wire_values
from strategy_space.space import StrategySpace
from tuner.features.batch import COL, featurize
from tuner.features.tables import FeatureTables
from tuner.synthetic.netsim import powersgd_matrix

# (shape, rank, values sent): r(m + n) for a matrix PowerSGD shrinks, else every value
CASES = [((10, 3), 4, 30), ((64, 64), 4, 512), ((1000,), 2, 1000), ((5, 4, 4), 4, 80),
         ((16, 3, 3, 8), 2, 176), ((7, 5), 2, 24), ((6, 6), 3, 36)]


class _CountingBackend:
    """A one-worker collective that counts the values it is handed."""

    def __init__(self):
        self.values = 0

    def allreduce(self, buf, tag):
        self.values += buf.size
        return buf


def _runtime_values(shape, rank, axis=0, shards=1) -> int:
    codec = Compressor.parse(f"powersgd({rank})")
    step = shape[axis] // shards
    members = tuple(ARMember((0, k), k * step, (k + 1) * step, axis, shards, False, codec, "counting")
                    for k in range(shards))
    values = {m.key: np.zeros(m.take(np.zeros(shape)).shape, np.float32) for m in members}
    ch = AllReduceChannel(0, 1, [ARGroup(0, members)], {"counting": None}, values,
                          {"name": "SGD", "learning_rate": 0.1, "momentum": 0.0, "nesterov": False})
    backend = ch._backends["counting"] = _CountingBackend()
    ch.push(0, [np.random.default_rng(0).standard_normal(shape).astype(np.float32)])
    return backend.values


def _feature_values(shape, rank, axis=0, shards=1) -> float:
    model = ModelSpec("m", (VariableSpec("w", shape),), batch_size=4)
    cluster = ClusterSpec("c", tuple(NodeSpec(f"n{i}", workers=1, bandwidth_gbps=1.0) for i in range(2)))
    strategy = Strategy((VarConfig("w", (AllReduce(compressor=f"powersgd({rank})"),) * shards, axis),))
    X = featurize(FeatureTables.from_specs(model, cluster), StrategySpace(model, cluster).encode([strategy]))
    return float(X[0, COL["ar_wire_bytes"]]) / 4   # float32 values


def _netsim_values(shape, rank) -> int:
    low = powersgd_matrix(shape, 0, shape[0], Compressor.parse(f"powersgd({rank})"))
    return int(np.prod(shape)) if low is None else rank * (low[0] + low[1])


@pytest.mark.parametrize("shape, rank, sent", CASES)
def test_runtime_features_and_netsim_send_the_same_values(shape, rank, sent):
    assert _runtime_values(shape, rank) == sent
    assert wire_values(shape, Compressor.parse(f"powersgd({rank})")) == (sent, 4)
    assert _feature_values(shape, rank) == sent
    assert _netsim_values(shape, rank) == sent


def test_the_rule_is_elementwise_over_arrays_and_numbers():
    shapes = [s for s, _, _ in CASES]
    ranks = np.array([r for _, r, _ in CASES])
    m, n = np.array([matrix_dims(s) for s in shapes]).T
    assert powersgd_wire_values(m, n, ranks).tolist() == [sent for _, _, sent in CASES]
    assert powersgd_compressible(m, n, ranks).tolist() == [bool(powersgd_compressible(*matrix_dims(s), r))
                                                            for s, r, _ in CASES]
    # thin matrices: r(m + n) < m n already implies min(m, n) > r
    assert not powersgd_compressible(1000, 4, 4) and powersgd_compressible(1000, 5, 4)


def test_a_shard_along_a_later_axis_is_the_runtime_matrix_of_the_shard():
    # a (8, 4, 10) variable in two shards along axis 1: each shard (8, 2, 10) is the 8 x 20 matrix
    # the runtime compresses (28 values at rank 1), not 2 slices x 80 values (82)
    assert powersgd_matrix((8, 4, 10), 1, 2, Compressor.parse("powersgd(1)")) == (8, 20)
    assert powersgd_matrix((8, 4, 10), 1, 2, Compressor.parse("fp16")) is None
    assert _runtime_values((8, 4, 10), 1, axis=1, shards=2) == 2 * 28
    assert _feature_values((8, 4, 10), 1, axis=1, shards=2) == 2 * 28


def test_compressor_value_round_trips_its_spec():
    for spec in ("none", "fp16", "fp16_ef", "powersgd(4)", "powersgd_ef(1)"):
        c = Compressor.parse(spec)
        assert str(c) == spec and Compressor.parse(spec) is c
    assert Compressor.parse("powersgd_ef(3)") == Compressor("powersgd", 3, True)
    with pytest.raises(ValueError, match="takes no rank"):
        Compressor.parse("fp16(2)")
    with pytest.raises(ValueError, match="not one of"):
        Compressor.parse(["fp16"])
