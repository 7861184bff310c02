"""The ``graph`` backend on real Ray + TensorFlow: fusion groups reduced by TensorFlow's collective
ops inside the workers' training step and applied by the model's own Keras optimizer train
exactly like one process on the global batch (fp16 within fp16 tolerance), alone and mixed with
parameter servers; and a group's collective finishes before the backward pass has produced its
last gradient."""
from __future__ import annotations

import numpy as np
import pytest

from strategy_space import PS, AllReduce, Strategy, VarConfig
from tests import runtime_models as rm
from tests.runtime_helpers import PAIR
from tests.test_runtime_ps import STEPS, _model_spec, _train

pytestmark = pytest.mark.integration

EXACT = {"rtol": 1e-5, "atol": 1e-6}
FP16 = {"rtol": 1e-2, "atol": 2e-3}


def _close(weights, expected, spec, **tol):
    for got, want, var in zip(weights, expected, spec.variables):
        assert np.allclose(got, want, **tol), (var.name, np.abs(got - want).max())


def _in_graph_members(trainer) -> int:
    from autosync.runtime.sync.graph import split_groups

    graph, _ = split_groups(list(trainer.plan.ar_groups), list(trainer.plan.layout))
    return sum(len(g.members) for g in graph)


@pytest.mark.parametrize("builder,options", [
    ("all_reduce", {"chunk_bytes": 64}),             # several fusion groups, the embedding gathered
    ("partitioned_all_reduce", {"min_partition_bytes": 1}),   # shards reduced apart, put together
    ("parallax", {}),                                 # sparse embedding on PS, dense in the graph
])
@pytest.mark.parametrize("compressor", ["none", "fp16", "fp16_ef"])
def test_graph_all_reduce_equals_single_process(pool, builder, options, compressor):
    from strategy_space.builders import get_builder

    md = rm.model_def("adam", learning_rate=0.05)
    spec = _model_spec(pool, md)
    strategy = get_builder(builder, backend="graph", compressor=compressor, **options).build(spec, PAIR)
    trainer, history, weights = _train(pool, md, strategy)
    _close(weights, rm.reference_weights(md, num_workers=2, steps=STEPS), spec,
           **(EXACT if compressor == "none" else FP16))
    initial = rm.reference_weights(md, num_workers=2, steps=0)
    assert any(not np.allclose(a, b) for a, b in zip(weights, initial))
    assert trainer.plan.backends == ("graph",)
    # every dense all-reduced variable was reduced and updated inside the graph (a split sparse
    # one, in partitioned_all_reduce, is gathered eagerly by the same collectives)
    members = [m for g in trainer.plan.ar_groups for m in g.members]
    split_sparse = [m for m in members if m.sparse and m.num_shards > 1]
    assert _in_graph_members(trainer) == len(members) - len(split_sparse) > 0
    assert bool(split_sparse) == (builder == "partitioned_all_reduce")
    if builder == "all_reduce":
        assert len(trainer.plan.ar_groups) >= 2
        assert any(m.sparse for g in trainer.plan.ar_groups for m in g.members)


def test_powersgd_in_graph_trains_like_uncompressed(pool):
    from strategy_space.builders import get_builder

    md = rm.model_def("sgd", learning_rate=0.1)
    spec = _model_spec(pool, md)
    losses = {}
    for comp in ("none", "powersgd_ef(1)"):
        strategy = get_builder("all_reduce", backend="graph", compressor=comp).build(spec, PAIR)
        trainer, history, _ = _train(pool, md, strategy, steps=80)
        assert _in_graph_members(trainer) == sum(len(g.members) for g in trainer.plan.ar_groups)
        losses[comp] = history.loss
    start = np.mean(losses["none"][:4])
    end = {c: np.mean(l[-8:]) for c, l in losses.items()}
    assert end["none"] < 0.5 * start
    assert end["powersgd_ef(1)"] < 1.5 * end["none"] + 0.05 * start, (start, end)
    assert not np.allclose(losses["none"], losses["powersgd_ef(1)"])  # it really compressed


@pytest.mark.parametrize("compressor", ["powersgd(2)", "powersgd_ef(1)"])
def test_powersgd_in_graph_matches_the_numpy_protocol(pool, compressor):
    """Same Q draw, same rounds, same error feedback: the graph and the numpy path over gloo end
    at the same parameters (to float tolerance: QR and matmul differ in rounding only)."""
    from strategy_space.builders import get_builder

    md = rm.model_def("sgd", learning_rate=0.1)
    spec = _model_spec(pool, md)
    weights = {}
    for backend in ("gloo", "graph"):
        strategy = get_builder("all_reduce", backend=backend, compressor=compressor).build(spec, PAIR)
        _, _, weights[backend] = _train(pool, md, strategy, steps=6)
    _close(weights["graph"], weights["gloo"], spec, rtol=1e-4, atol=1e-5)
    exact = rm.reference_weights(md, num_workers=2, steps=6)
    assert any(not np.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(weights["graph"], exact))


def test_mixed_ps_graph_and_numpy_path(pool):
    """PS variables, in-graph variables, and graph members that must take the numpy path (a
    variable whose shards are split between PS and all-reduce; PowerSGD-free so exact)."""
    md = rm.model_def("sgd", learning_rate=0.1, momentum=0.9)
    spec = _model_spec(pool, md)
    strategy = Strategy((
        VarConfig("emb/embeddings", (PS("node0"),)),
        VarConfig("hidden/kernel", (AllReduce(backend="graph", group=0), PS("node1")), axis=1),
        VarConfig("hidden/bias", (AllReduce(backend="graph", group=0),)),
        VarConfig("out/kernel", (AllReduce(backend="graph", group=1),)),
        VarConfig("out/bias", (PS("node1"),)),
    ))
    trainer, _, weights = _train(pool, md, strategy)
    _close(weights, rm.reference_weights(md, num_workers=2, steps=STEPS), spec, **EXACT)
    assert _in_graph_members(trainer) == 2   # hidden/bias and out/kernel; hidden/kernel's shard eagerly
    assert len(trainer.plan.ps_actors) == 2


def test_collective_starts_before_the_last_gradient(ray_session, tmp_path):
    """A convolution whose filter gradient is computed last and takes long, under a dense output
    layer: TensorFlow's profiler shows the output layer's collective running before the
    backward pass has produced its last gradient.

    Whether an op that may start early does so is up to TensorFlow's scheduler (on a loaded
    2-core machine it once started 13 us late; in another CI run one of three workers started it
    7 us late in each of three traced steps while the other two overlapped; in a CI run of
    2026-12-06, while the other xdist worker ran its tests, all three workers 7-10 us late in all
    three steps), so up to six steps are traced (stopping at one where every worker overlaps) and
    overlap on any worker in any of them suffices: every worker runs the same graph, and a
    collective that has to wait for every gradient (a control dependency) can overlap on none of
    them in none of the steps."""
    from autosync.runtime.binding import ClusterBinding
    from autosync.runtime.engine import WorkerPool
    from autosync.runtime.sync.graph_trace import overlap_from_trace, trace_step
    from autosync.runtime.trainer import Trainer
    from strategy_space.builders import get_builder

    md = rm.deep_model_def()
    pool = WorkerPool(ClusterBinding.bind(PAIR))
    tries = []
    try:
        spec = _model_spec(pool, md)
        strategy = get_builder("all_reduce", backend="graph", chunk_bytes=1).build(spec, PAIR)
        with Trainer(md, strategy, PAIR, pool=pool, timeout_s=300) as trainer:
            trainer.fit(steps=2)
            workers = trainer.session.workers
            for attempt in range(6):
                traces = ray_session.get([w.__ray_call__.remote(trace_step, str(tmp_path / f"a{attempt}w{i}"))
                                          for i, w in enumerate(workers)], timeout=300)
                for events in traces:
                    names = [n for n, _, _ in events]
                    assert any("Conv2DBackpropFilter" in n for n in names), sorted(set(names))[:50]
                found = [overlap_from_trace(events) for events in traces]
                assert all(f["first_collective_start"] is not None for f in found), found
                tries.append(found)
                if all(f["first_collective_start"] < f["last_gradient_end"] and f["hidden_share"] > 0.0
                       for f in found):
                    break
    finally:
        pool.kill_all()
    assert len(trainer.plan.ar_groups) == len(spec.variables)   # one group per variable
    assert any(f["first_collective_start"] < f["last_gradient_end"] and f["hidden_share"] > 0.0
               for found in tries for f in found), tries


def test_a_long_graph_training_keeps_its_threads(pool):
    """A collective given a timeout costs TensorFlow a thread for the whole timeout: the workers of
    a long training piled up thousands and died (ncf: 7,000 after 500 steps). Over 200 more steps
    of several collectives each, a worker's threads do not grow."""
    import ray

    from autosync.runtime.trainer import Trainer
    from strategy_space.builders import get_builder

    md = rm.model_def("sgd", learning_rate=0.05)
    spec = _model_spec(pool, md)
    strategy = get_builder("all_reduce", backend="graph", chunk_bytes=64).build(spec, PAIR)
    with Trainer(md, strategy, PAIR, pool=pool, timeout_s=120) as trainer:
        trainer.fit(steps=20, steps_per_call=20)
        threads = lambda: [i["threads"] for i in ray.get([w.info.remote() for w in trainer.session.workers])]  # noqa: E731
        before = threads()
        trainer.fit(steps=200, steps_per_call=100)
        after = threads()
        assert len(trainer.plan.ar_groups) >= 2 and before[0] is not None
    assert all(a - b < 40 for a, b in zip(after, before)), (before, after)
