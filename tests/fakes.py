"""Small hand-made specs shared by the unit tests."""
from strategy_space import ClusterSpec, ComputeProfile, ModelSpec, NodeSpec, VariableSpec


def tiny_model(profile: bool = False) -> ModelSpec:
    """An embedding-plus-MLP model: one sparse variable, dense matrices, a bias and an int counter."""
    vars_ = (
        VariableSpec("embedding/embeddings", (50_000, 32), sparse=True, rows_per_step=300),
        VariableSpec("dense/kernel", (32, 512)),
        VariableSpec("dense/bias", (512,)),
        VariableSpec("dense_1/kernel", (512, 1024)),
        VariableSpec("dense_1/bias", (1024,)),
        VariableSpec("steps", (1,), dtype="int64"),
    )
    prof = ComputeProfile(0.01, "test", tuple(v.name for v in reversed(vars_))) if profile else None
    return ModelSpec("tiny", vars_, batch_size=64, profile=prof)


def two_node_cluster() -> ClusterSpec:
    return ClusterSpec("two", (NodeSpec("a", address="10.0.0.1", workers=2, bandwidth_gbps=1.0),
                               NodeSpec("b", address="10.0.0.2", workers=1, bandwidth_gbps=1.0)))


def three_node_cluster() -> ClusterSpec:
    return ClusterSpec("three", tuple(NodeSpec(f"h{i}", address=f"10.0.0.{i + 1}", bandwidth_gbps=1.0 + i)
                                      for i in range(3)))
