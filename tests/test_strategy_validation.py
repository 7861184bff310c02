"""One test per validation rule; each checks the message names the variable, value and what is allowed."""
import pytest

from strategy_space import PS, AllReduce, ClusterSpec, NodeSpec, Strategy, StrategyError, VarConfig, loads, validate
from strategy_space.builders import get_builder
from tests.fakes import tiny_model, two_node_cluster

MODEL = tiny_model()
CLUSTER = two_node_cluster()


def base(**override) -> Strategy:
    """A valid strategy (ps on node a) with some variables' configs replaced."""
    configs = [override.pop(v.name, VarConfig(v.name, (PS("a"),))) for v in MODEL.variables]
    return Strategy(tuple(c for c in configs if c is not None), **override)


def check(strategy, match):
    with pytest.raises(StrategyError, match=match):
        validate(strategy, MODEL, CLUSTER)


def test_valid_base():
    assert validate(base(), MODEL, CLUSTER)


def test_every_variable_covered():
    check(base(**{"dense/bias": None}), r"1 variable\(s\) of model tiny have no synchronizer: dense/bias")


def test_no_variable_twice():
    s = base()
    check(Strategy(s.variables + (s.variables[0],)), r"variable embedding/embeddings: configured 2 times")


def test_unknown_variable():
    s = base()
    check(Strategy(s.variables + (VarConfig("nope", (PS("a"),)),)), r"variable nope: not a trainable variable of model tiny")


def test_shards_at_most_axis_length():
    check(base(**{"dense/kernel": VarConfig("dense/kernel", (PS("a"),) * 33)}),
          r"variable dense/kernel: 33 shards along axis 0 but that axis has only 32 slices; allowed 1..32")


def test_shards_at_least_one_in_yaml():
    with pytest.raises(Exception, match=r"partition.shards must be from 1 to 65536, got 0"):
        loads("kind: strategy\nvariables:\n- var: x\n  partition: {shards: 0}\n  ps: {destination: a}\n")


def test_partition_axis_in_range():
    check(base(**{"dense/bias": VarConfig("dense/bias", (PS("a"), PS("b")), axis=1)}),
          r"variable dense/bias: partition axis 1 is out of range for shape \[512\] \(allowed 0..0\)")


def test_sparse_partitioned_on_rows_only():
    check(base(**{"embedding/embeddings": VarConfig("embedding/embeddings", (PS("a"), PS("b")), axis=1)}),
          r"sparse \(embedding\) variables can only be partitioned along axis 0")


def test_destination_exists():
    check(base(**{"dense/bias": VarConfig("dense/bias", (PS("c"),))}),
          r"variable dense/bias: ps.destination 'c' is not a node of cluster two; allowed: a, b")


def test_staleness_non_negative():
    with pytest.raises(StrategyError.__mro__[1], match=r"ps.staleness must be an integer from 0 to 1000000, got -1"):
        PS("a", staleness=-1)


def test_staleness_needs_sync():
    check(base(**{v.name: VarConfig(v.name, (PS("a", sync=False, staleness=2),)) for v in MODEL.variables}),
          r"staleness 2 needs sync: true")


def test_one_ps_mode_per_strategy():
    check(base(**{"dense/bias": VarConfig("dense/bias", (PS("a", staleness=3),))}),
          r"parameter servers must share one sync mode and staleness per strategy")


def test_ps_options_not_on_all_reduce():
    with pytest.raises(Exception, match=r"all_reduce: unknown key\(s\) destination; allowed keys are backend, compressor, group"):
        loads("kind: strategy\nvariables:\n- var: x\n  all_reduce: {destination: a}\n")


def test_ar_options_not_on_ps():
    with pytest.raises(Exception, match=r"ps: unknown key\(s\) compressor"):
        loads("kind: strategy\nvariables:\n- var: x\n  ps: {destination: a, compressor: fp16}\n")


def test_compressor_only_dense_float():
    check(base(**{"embedding/embeddings": VarConfig("embedding/embeddings", (AllReduce(compressor="fp16"),))}),
          r"variable embedding/embeddings: compressor fp16 applies only to dense float gradients, this variable is sparse")
    check(base(**{"steps": VarConfig("steps", (AllReduce(compressor="powersgd(2)"),))}),
          r"variable steps: compressor powersgd\(2\) applies only to dense float gradients, this variable is of dtype int64")


def test_compressor_names_and_ranks():
    with pytest.raises(Exception, match=r"compressor 'zip' is not one of none, fp16, fp16_ef, powersgd\(RANK\)"):
        AllReduce(compressor="zip")
    with pytest.raises(Exception, match=r"needs a rank from 1 to 1024, e.g. powersgd\(4\)"):
        AllReduce(compressor="powersgd")
    with pytest.raises(Exception, match=r"compressor fp16 takes no rank"):
        AllReduce(compressor="fp16(2)")


def test_group_non_negative():
    with pytest.raises(Exception, match=r"all_reduce.group must be an integer from 0 to 1048575, got -1"):
        AllReduce(group=-1)


def test_backend_known_and_nccl_needs_gpus():
    with pytest.raises(Exception, match=r"all_reduce.backend 'mpi' is not one of auto, gloo, nccl, objectstore"):
        AllReduce(backend="mpi")
    check(base(**{"dense/bias": VarConfig("dense/bias", (AllReduce(backend="nccl"),))}),
          r"backend nccl needs GPUs but node\(s\) a, b have none")
    gpu = ClusterSpec("g", (NodeSpec("a", gpus=2), NodeSpec("b", gpus=1)))
    validate(base(**{"dense/bias": VarConfig("dense/bias", (AllReduce(backend="nccl"),))}), MODEL, gpu)


def test_replicas_exist_and_unique():
    check(base(replicas=("a:0", "a:7")), r"replica 'a:7' is not a worker slot of cluster two; allowed: a:0, a:1, b:0")
    check(base(replicas=("a:0", "a:0")), r"replicas listed more than once: a:0")


def test_several_errors_reported_together():
    s = base(**{"dense/bias": VarConfig("dense/bias", (PS("zz"),)), "steps": None}, replicas=("q:0",))
    with pytest.raises(StrategyError) as e:
        validate(s, MODEL, CLUSTER)
    assert len(e.value.problems) == 3
    assert "3 problems" in str(e.value)


def test_builder_output_for_another_cluster_is_rejected():
    s = get_builder("ps_lb").build(MODEL, ClusterSpec("x", (NodeSpec("p"), NodeSpec("q"))))
    check(s, r"ps.destination '[pq]' is not a node of cluster two")


def test_a_big_cluster_s_unknown_node_is_one_problem_with_a_short_list_of_what_is_allowed():
    big = ClusterSpec("big", tuple(NodeSpec(f"n{i}", address=f"10.0.{i}.1", workers=8) for i in range(64)))
    wrong = Strategy(tuple(VarConfig(v.name, (PS("n99"),) * 3) if len(v.shape) and v.shape[0] >= 3
                           else VarConfig(v.name, (PS("n99"),)) for v in MODEL.variables),
                     replicas=("n0:0", "n0:0", "n1:9"))
    with pytest.raises(StrategyError) as e:
        validate(wrong, MODEL, big)
    problems = e.value.problems
    unknown = [p for p in problems if "ps.destination 'n99'" in p]
    places = sum(c.num_shards for c in wrong.variables)
    assert len(unknown) == 1 and f"and {places - 1} more" in unknown[0]
    assert unknown[0].endswith("allowed: n0, n1, n2, n3, n4, n5, ..., n62, n63 (64 in all)")
    slot = next(p for p in problems if "replica 'n1:9'" in p)
    assert slot.endswith("allowed: n0:0, n0:1, n0:2, n0:3, n0:4, n0:5, ..., n63:6, n63:7 (512 in all)")
    assert any(p == "replicas listed more than once: n0:0" for p in problems)
    assert all(len(p) < 400 for p in problems)
