"""Which all-reduce backend a plan resolves ``auto`` to: under global_clipnorm with gradient
accumulation, a GPU cluster's ``auto`` beside parameter servers leaves the graph (which cannot
hold its part of the step there) for NCCL; alone, or without that optimizer, it stays in the graph."""
from __future__ import annotations

import pytest

from autosync.runtime.plan import SyncPlan
from strategy_space import PS, AllReduce, ClusterSpec, ModelSpec, NodeSpec, Strategy, VarConfig, VariableSpec

MODEL = ModelSpec(name="two", batch_size=8, variables=(
    VariableSpec(name="dense/kernel", shape=(16, 4), dtype="float32"),
    VariableSpec(name="emb/embeddings", shape=(100, 4), dtype="float32", sparse=True)))
HOLDING = {"class": "SGD", "global_clipnorm": 1.0, "gradient_accumulation_steps": 2}


def _cluster(gpus: int) -> ClusterSpec:
    return ClusterSpec(name="pair", nodes=(NodeSpec(name="a", address="10.0.0.1", gpus=gpus, chief=True),
                                           NodeSpec(name="b", address="10.0.0.2", gpus=gpus)))


def _backend_of(plan, var_index: int) -> str:
    return next(m.backend for g in plan.ar_groups for m in g.members if m.key[0] == var_index)


def _strategy(embedding) -> Strategy:
    return Strategy((VarConfig("dense/kernel", (AllReduce(backend="auto"),)), VarConfig("emb/embeddings", (embedding,))))


@pytest.mark.parametrize("optimizer, embedding, want", [
    (HOLDING, PS("a"), "nccl"),                                   # graph beside a PS: NCCL outside the graph
    (HOLDING, AllReduce(backend="gloo", group=1), "nccl"),        # beside another backend, likewise
    (HOLDING, AllReduce(backend="auto", group=1), "graph"),       # every variable in the graph: Keras clips there
    ({**HOLDING, "gradient_accumulation_steps": 1}, PS("a"), "graph"),   # no accumulation: the graph holds
    ({"class": "SGD", "gradient_accumulation_steps": 2}, PS("a"), "graph"),   # no global norm to wait for
    (None, PS("a"), "graph"),                                     # optimizer unknown: as before
])
def test_auto_on_gpus_leaves_the_graph_only_where_it_cannot_hold_the_step(monkeypatch, optimizer, embedding, want):
    from autosync.runtime.sync import backends

    monkeypatch.setattr(backends, "graph_available", lambda: True)   # auto's GPU choice where TensorFlow is
    plan = SyncPlan.build(_strategy(embedding), MODEL, _cluster(gpus=1), optimizer)
    assert _backend_of(plan, 0) == want


def test_auto_on_cpus_is_unchanged_by_the_optimizer():
    plans = [SyncPlan.build(_strategy(PS("a")), MODEL, _cluster(gpus=0), o) for o in (HOLDING, None)]
    assert _backend_of(plans[0], 0) == _backend_of(plans[1], 0) in ("gloo", "objectstore")


@pytest.mark.parametrize("optimizer, embedding, want", [
    (HOLDING, PS("a"), "nccl"),
    (HOLDING, AllReduce(backend="gloo", group=1), "nccl"),
    (HOLDING, AllReduce(backend="auto", group=1), "graph"),
    (None, PS("a"), "graph"),
])
def test_in_step_marks_on_any_cluster_what_gpu_workers_reduce_in_their_step(monkeypatch, optimizer, embedding, want):
    """An emulated worker overlaps its collectives with its compute exactly where GPU workers
    would reduce them in the graph: the flag does not depend on the cluster having GPUs."""
    from autosync.runtime.sync import backends

    monkeypatch.setattr(backends, "graph_available", lambda: True)
    for gpus in (1, 0):
        plan = SyncPlan.build(_strategy(embedding), MODEL, _cluster(gpus=gpus), optimizer)
        flags = {m.key[0]: m.in_step for g in plan.ar_groups for m in g.members}
        assert flags[0] is (want == "graph")
        if 1 in flags:   # the embedding's own all-reduce: in the step only where it asked for auto
            assert flags[1] is (embedding.backend == "auto" and want == "graph")


def test_in_step_is_off_for_comparison_when_asked(monkeypatch):
    monkeypatch.setenv("AUTOSYNC_IN_STEP", "0")
    plan = SyncPlan.build(_strategy(AllReduce(backend="auto", group=1)), MODEL, _cluster(gpus=0), None)
    assert [m.in_step for g in plan.ar_groups for m in g.members] == [False, False]
    monkeypatch.delenv("AUTOSYNC_IN_STEP")
    plan = SyncPlan.build(_strategy(AllReduce(backend="auto", group=1)), MODEL, _cluster(gpus=0), None)
    assert [m.in_step for g in plan.ar_groups for m in g.members] == [True, True]
