"""Emulated clusters in the features: compute is the profile times the dilation, and it leaves
the CPUs free (workers sleep), as GPUs do."""
from __future__ import annotations

import dataclasses

import numpy as np

from strategy_space.builders import get_builder
from tests.fakes import three_node_cluster, tiny_model
from tuner.features.batch import COL, featurize
from tuner.features.tables import FeatureTables
from strategy_space.space import StrategySpace


def _row(model, cluster, builder="ps"):
    enc = StrategySpace(model, cluster).encode([get_builder(builder).build(model, cluster)])
    return featurize(FeatureTables.from_specs(model, cluster), enc)[0]


def test_emulated_compute_is_dilated_and_leaves_the_cpus_free():
    model, real = tiny_model(profile=True), three_node_cluster()
    emulated = dataclasses.replace(real, compute="emulated")
    dilated = dataclasses.replace(real, compute="emulated", compute_dilation=8.0)
    r, e, d = _row(model, real), _row(model, emulated), _row(model, dilated)
    assert r[COL["compute_s"]] == e[COL["compute_s"]] == np.float32(model.profile.step_time_s)
    assert d[COL["compute_s"]] == np.float32(8.0 * model.profile.step_time_s)
    assert r[COL["cpu_contention"]] == 1.0 and e[COL["cpu_contention"]] == 0.0
    assert e[COL["analytic_s"]] < r[COL["analytic_s"]] < d[COL["analytic_s"]]
