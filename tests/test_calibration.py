"""The calibration section of a ClusterSpec and its use by the analytic model (pure: no Ray)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import yaml

from strategy_space import AllReduce, ClusterSpec, ConfigError, ModelSpec, NodeSpec, Strategy, VarConfig, VariableSpec
from strategy_space.calibration import Calibration, CostCurve, settled
from strategy_space.space import StrategySpace
from tuner.cost_models.analytic import AnalyticCostModel
from tuner.features.batch import COL, UPDATE_PASSES, featurize
from tuner.features.tables import FeatureTables

CAL = Calibration("gloo", 2, ((4096, 3e-4), (65536, 5e-4), (1 << 20, 4e-3)), ((4096, 1.1e-3), (1 << 20, 9e-3)))


def _cluster(calibration=None, nodes=2):
    return ClusterSpec("c", tuple(NodeSpec(f"n{i}", workers=1, bandwidth_gbps=1.0) for i in range(nodes)),
                       calibration=calibration)


def test_calibration_round_trips_exactly_and_keeps_the_fingerprint():
    c = _cluster(CAL)
    text = yaml.safe_dump(c.to_dict(), sort_keys=False)
    back = ClusterSpec.from_dict(yaml.safe_load(text))
    assert back == c and back.calibration == CAL
    assert back.to_dict() == c.to_dict()
    assert c.fingerprint == _cluster().fingerprint     # measuring a cluster does not make it another


@pytest.mark.parametrize("body,match", [
    ({"backend": "gloo", "workers": 2, "allreduce": [{"bytes": 10, "seconds": 1.0}]}, r"missing required key\(s\) ps_round_trip"),
    ({"backend": "gloo", "workers": 2, "allreduce": [{"bytes": 10, "seconds": 1.0, "x": 1}], "ps_round_trip": []},
     "unknown key"),
    ({"backend": "gloo", "workers": 2, "allreduce": [{"bytes": 20, "seconds": 1.0}, {"bytes": 10, "seconds": 2.0}],
      "ps_round_trip": [{"bytes": 10, "seconds": 1.0}]}, "strictly increasing"),
    ({"backend": "gloo", "workers": 2, "allreduce": [{"bytes": 10, "seconds": -1.0}],
      "ps_round_trip": [{"bytes": 10, "seconds": 1.0}]}, "seconds a finite number > 0"),
    ({"backend": "gloo", "workers": 0, "allreduce": [{"bytes": 10, "seconds": 1.0}],
      "ps_round_trip": [{"bytes": 10, "seconds": 1.0}]}, "workers must be an integer >= 1"),
])
def test_bad_calibration_is_rejected_with_what_to_fix(body, match):
    data = _cluster().to_dict()
    data["calibration"] = body
    with pytest.raises(ConfigError, match=match):
        ClusterSpec.from_dict(data)


def test_cost_curve_interpolates_and_extrapolates_physically():
    curve = CostCurve(CAL.allreduce)
    s = curve.seconds(np.array([0.0, 100.0, 4096.0, 65536.0, 1 << 20, 2 << 20]))
    assert s[0] == 0 and s[1] == pytest.approx(3e-4) and s[2] == pytest.approx(3e-4)   # latency floor
    assert s[3] == pytest.approx(5e-4) and s[4] == pytest.approx(4e-3)
    rate = ((1 << 20) - 65536) / (4e-3 - 5e-4)                 # the last segment's bandwidth
    assert s[5] == pytest.approx(4e-3 + (1 << 20) / rate)
    mid = curve.seconds(np.array([16384.0]))[0]
    assert 3e-4 < mid < 5e-4



def test_a_slow_small_size_is_settled_by_the_faster_larger_ones_not_carried_up():
    """Disturbances only add time, and a smaller message could be padded to a larger one: a size
    measured slower than a larger one takes the larger one's time, and nothing above it changes
    (a running maximum would have put every size up to 4 MiB at the slow 3.9 ms)."""
    points = ((4096, 3.9e-3), (16384, 2.6e-4), (65536, 4.3e-4), (1 << 20, 4.3e-3), (4 << 20, 4.0e-3),
              (16 << 20, 1.27e-2))
    assert settled(points).tolist() == [2.6e-4, 2.6e-4, 4.3e-4, 4.0e-3, 4.0e-3, 1.27e-2]
    curve = CostCurve(points)
    s = curve.seconds(np.array([1024.0, 4096.0, 16384.0, 65536.0, 1 << 20, 16 << 20]))
    assert s == pytest.approx([2.6e-4, 2.6e-4, 2.6e-4, 4.3e-4, 4.0e-3, 1.27e-2])
    # already non-decreasing: as measured
    assert settled(CAL.allreduce).tolist() == [t for _, t in CAL.allreduce]
    # the PS round trip of the smallest message: the least of the sizes at or above it
    from strategy_space import PS

    m = ModelSpec("m", (VariableSpec("a", (64, 64)),))
    slow_first = replace(CAL, ps_round_trip=((4096, 5e-3), (16384, 6e-4), (1 << 20, 9e-3)))
    tables = FeatureTables.from_specs(m, _cluster(slow_first))
    assert tables.ps_round_trip_s == pytest.approx(6e-4)
    space = StrategySpace(m, _cluster(slow_first))
    x = featurize(tables, space.encode([Strategy((VarConfig("a", (PS("n1"),)),))]))[0]
    from tuner.features.alpha_beta import AlphaBeta

    assert x[COL["ps_latency_rounds"]] == pytest.approx(2 * 6e-4 / AlphaBeta().alpha_ps_s, rel=1e-6)

def test_the_calibrate_summary_says_what_the_model_uses_and_what_was_measured_slower():
    """``autosync calibrate``'s line gives the smallest sizes' times as the cost model reads them
    (settled) and, where the measurement there was slower, says so with the measured figure."""
    from autosync.calibrate import summary

    slow = Calibration("gloo", 2, ((4096, 3.92e-3), (16384, 2.6e-4), (16 << 20, 1.4e-2)),
                       ((4096, 5e-3), (16384, 6e-4)))
    line = summary("local", slow)
    assert "all-reduce 0.26 ms at 4 KiB (measured 3.92 ms there, slower than at a larger size" in line
    assert "PS round trip 0.60 ms at 4 KiB (measured 5.00 ms there" in line
    assert line.startswith("calibrated local: gloo all-reduce over 2 workers, ") and "at 16 MiB" in line
    even = Calibration("gloo", 2, ((4096, 2.5e-4), (16384, 2.6e-4), (16 << 20, 1.4e-2)), ((4096, 6e-4), (16384, 6e-4)))
    assert "measured" not in summary("local", even) and "all-reduce 0.25 ms at 4 KiB;" in summary("local", even)


def test_the_analytic_model_reads_all_reduce_time_off_the_calibrated_curve():
    m = ModelSpec("m", (VariableSpec("a", (256, 256)), VariableSpec("b", (256,))))      # 263,168 bytes
    s = Strategy((VarConfig("a", (AllReduce(),)), VarConfig("b", (AllReduce(),))))
    split = Strategy((VarConfig("a", (AllReduce(),)), VarConfig("b", (AllReduce(group=1),))))
    plain, calibrated = _cluster(), _cluster(CAL)
    space = StrategySpace(m, calibrated)
    X = featurize(FeatureTables.from_specs(m, calibrated), space.encode([s, split]))
    assert X[0, COL["ar_curve_s"]] == pytest.approx(CostCurve(CAL.allreduce).seconds(np.array([263168.0]))[0],
                                                    rel=1e-6)
    # two buffers: each pays the curve's latency
    assert X[1, COL["ar_curve_s"]] == pytest.approx(CostCurve(CAL.allreduce).seconds(
        np.array([262144.0, 1024.0])).sum(), rel=1e-6)
    # in the curve, not twice: no ring bytes on the NICs, no ring steps, no CPU collective work (the
    # CPU bytes are each worker's update of its copy alone)
    assert X[0, COL["ring_steps"]] == 0 and X[0, COL["nic_out_s"]] == 0
    assert X[0, COL["cpu_bytes_max"]] == pytest.approx(UPDATE_PASSES * 263168)
    assert featurize(FeatureTables.from_specs(m, plain), space.encode([s]))[0, COL["ar_curve_s"]] == 0
    # a slower measured curve predicts a slower all-reduce
    slow = replace(CAL, allreduce=tuple((b, 10 * t) for b, t in CAL.allreduce))
    fast_t = AnalyticCostModel().predict_strategies(m, calibrated, space.encode([s]))[0]
    slow_t = AnalyticCostModel().predict_strategies(m, _cluster(slow), space.encode([s]))[0]
    assert slow_t > fast_t


def test_the_analytic_model_charges_ps_round_trips_at_the_calibrated_rate():
    """A calibrated cluster's PS round trip (its smallest message) replaces the default one in the
    latency term: a data plane measured at 1.1 ms costs 5.5x the default 0.2 ms per round trip."""
    from strategy_space import PS
    from tuner.features.alpha_beta import AlphaBeta

    m = ModelSpec("m", (VariableSpec("a", (64, 64)),))
    s = Strategy((VarConfig("a", (PS("n1"),)),))
    space = StrategySpace(m, _cluster(CAL))
    plain = featurize(FeatureTables.from_specs(m, _cluster()), space.encode([s]))[0]
    calibrated = featurize(FeatureTables.from_specs(m, _cluster(CAL)), space.encode([s]))[0]
    assert plain[COL["ps_latency_rounds"]] == 2
    assert calibrated[COL["ps_latency_rounds"]] == pytest.approx(2 * 1.1e-3 / AlphaBeta().alpha_ps_s, rel=1e-6)
    slow_t = AnalyticCostModel().predict_strategies(m, _cluster(CAL), space.encode([s]))[0]
    fast = replace(CAL, ps_round_trip=((4096, 1e-4), (1 << 20, 9e-3)))
    assert AnalyticCostModel().predict_strategies(m, _cluster(fast), space.encode([s]))[0] < slow_t
