"""Small hand-made specs and fake runners shared by the unit tests."""
import dataclasses

import numpy as np

from strategy_space import ClusterSpec, ComputeProfile, ModelSpec, NodeSpec, VariableSpec
from tuner.synthetic.runner import SyntheticRunner


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


class Noisy(SyntheticRunner):
    """Every baseline strategy measures 0.1 s per step and every searched one 0.1 / ``gain`` s (a
    strategy's role is that of its first measurement), each measurement times its own factor
    exp(N(0, ``spread``)): a known gain under a known noise between measurements."""

    def __init__(self, *a, gain: float, spread: float, **k):
        super().__init__(*a, **k)
        self.gain, self.spread = gain, spread
        self.noise = np.random.default_rng(11)
        self.role: dict[str, str] = {}

    def run(self, strategies, origins=None):
        out = []
        for t, origin in zip(super().run(strategies, origins), origins or ["search"] * len(strategies)):
            if not t.ok:
                out.append(t)
                continue
            role = self.role.setdefault(t.strategy.fingerprint, "search" if origin in ("search", "explore")
                                        else "baseline")
            level = (0.1 / self.gain if role == "search" else 0.1) * np.exp(self.noise.normal(0, self.spread))
            out.append(dataclasses.replace(t, step_times=(level,) * 3))
        return out


def patch_tune_runner(monkeypatch, model, cluster, seed: int = 2) -> None:
    """Make ``autosync.tune`` measure with the synthetic runner instead of Ray (it reads what a
    RayRunner has besides ``run``: ``given_spec`` and ``close``)."""
    import autosync.api

    class Fake(SyntheticRunner):
        given_spec = model

        def close(self):
            pass

    monkeypatch.setattr(autosync.api, "make_runner", lambda *a, **k: Fake(model, cluster, seed=seed))
