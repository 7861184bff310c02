"""Synchronous PS strategies train exactly like one process on the global batch (real Ray + TF)."""
from __future__ import annotations

import numpy as np
import pytest

from tests import runtime_models as rm
from tests.runtime_helpers import PAIR
from strategy_space import PS, Strategy, VarConfig

STEPS = 4
pytestmark = pytest.mark.integration

BUILDER_OPTIONS = {
    "ps": {}, "ps_lb": {},
    "partitioned_ps": {"min_partition_bytes": 1},
    "uneven_partitioned_ps": {"min_partition_bytes": 1},
}


def _strategy(name: str, model_spec) -> Strategy:
    from strategy_space.builders import get_builder

    return get_builder(name, **BUILDER_OPTIONS[name]).build(model_spec, PAIR)


def _train(pool, md, strategy, steps=STEPS):
    from autosync.runtime.trainer import Trainer

    with Trainer(md, strategy, PAIR, pool=pool, timeout_s=120) as trainer:
        history = trainer.fit(steps=steps, steps_per_call=2)
        return trainer, history, trainer.get_weights()


@pytest.mark.parametrize("optimizer,options", [
    ("sgd", {"learning_rate": 0.1}),
    ("adam", {"learning_rate": 0.05}),
])
@pytest.mark.parametrize("builder", list(BUILDER_OPTIONS))
def test_sync_ps_equals_single_process(pool, builder, optimizer, options):
    md = rm.model_def(optimizer, **options)
    spec = _model_spec(pool, md)
    assert spec.var("emb/embeddings").sparse and not spec.var("hidden/kernel").sparse
    strategy = _strategy(builder, spec)
    trainer, history, weights = _train(pool, md, strategy)
    expected = rm.reference_weights(md, num_workers=2, steps=STEPS)
    assert len(history.loss) == STEPS and all(t > 0 for t in history.step_times)
    # wall-clock time per step from the start of fit: increasing, at least the steps' own time
    wall = history.history["wall_time_s"]
    assert len(wall) == STEPS and all(b > a for a, b in zip(wall, wall[1:]))
    # a step's time is the longest any worker took over it, which lies inside [start of fit, its end]
    # (not their sum: workers overlap, so the steps' times may add up to more than the wall clock)
    assert all(t <= w + 1e-3 for t, w in zip(history.step_times, wall)), (history.step_times, wall)
    for got, want, var in zip(weights, expected, spec.variables):
        assert np.allclose(got, want, rtol=1e-5, atol=1e-6), (builder, var.name, np.abs(got - want).max())
    # training moved the weights, so the comparison is not vacuous
    initial = rm.reference_weights(md, num_workers=2, steps=0)
    assert any(not np.allclose(a, b) for a, b in zip(weights, initial))
    if builder.startswith("partitioned") or builder.startswith("uneven"):
        assert trainer.plan.ps_actors and len(trainer.plan.ps_actors) == 2
        assert any(r.num_shards > 1 for p in trainer.plan.ps_actors for r in p.shards)


def _model_spec(pool, md):
    from autosync.runtime.plan import model_spec_from_vars

    pool.ensure(md, PAIR.devices)
    return model_spec_from_vars(md.name, pool.description["variables"], md.batch_size)


def test_momentum_nesterov_and_local_replication_partitioned_axis1(pool):
    """Hand-made strategy: the dense kernel split along axis 1 over both nodes, the embedding
    split by rows with local replication on one shard; SGD with Nesterov momentum."""
    md = rm.model_def("sgd", learning_rate=0.1, momentum=0.9, nesterov=True)
    strategy = Strategy((
        VarConfig("emb/embeddings", (PS("node1"), PS("node0", local_replication=True), PS("node1"))),
        VarConfig("hidden/kernel", (PS("node0"), PS("node1")), axis=1),
        VarConfig("hidden/bias", (PS("node1"),)),
        VarConfig("out/kernel", (PS("node0"),)),
        VarConfig("out/bias", (PS("node1", local_replication=True),)),
    ))
    _, _, weights = _train(pool, md, strategy)
    expected = rm.reference_weights(md, num_workers=2, steps=STEPS)
    for got, want in zip(weights, expected):
        assert np.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_staleness_converges(pool):
    """With staleness 2 workers run ahead on stale weights, yet the loss still falls."""
    md = rm.model_def("adam", learning_rate=0.05)
    names = _model_spec(pool, md).names
    strategy = Strategy(tuple(VarConfig(n, (PS("node0" if i % 2 else "node1", staleness=2),))
                              for i, n in enumerate(names)))
    trainer, history, weights = _train(pool, md, strategy, steps=60)
    assert trainer.plan.staleness == 2 and trainer.plan.sync
    first, last = np.mean(history.loss[:5]), np.mean(history.loss[-5:])
    assert last < 0.5 * first, (first, last)
    assert all(np.isfinite(w).all() for w in weights)


@pytest.mark.parametrize("staleness", [0, 2])
def test_pipelined_chunks_equal_single_process(pool, monkeypatch, staleness):
    """PS pipelining forced on the small model (every shard a chunk candidate): each PS actor's
    keys are pushed and pulled in several calls, and training equals one process (staleness 0)
    or still converges (staleness 2); dense, row-pulled sparse and locally replicated shards."""
    from autosync.runtime import engine

    monkeypatch.setattr(engine, "PS_CHUNK_MIN_BYTES", 1)
    monkeypatch.setenv("AUTOSYNC_PS_CHUNKS", "3")
    md = rm.model_def("adam", learning_rate=0.05)
    strategy = Strategy((
        VarConfig("emb/embeddings", (PS("node1", staleness=staleness), PS("node0", staleness=staleness))),
        VarConfig("hidden/kernel", (PS("node0", staleness=staleness), PS("node1", staleness=staleness)), axis=1),
        VarConfig("hidden/bias", (PS("node1", local_replication=True, staleness=staleness),)),
        VarConfig("out/kernel", (PS("node0", staleness=staleness),)),
        VarConfig("out/bias", (PS("node1", staleness=staleness),)),
    ))
    steps = STEPS if staleness == 0 else 40
    from autosync.runtime.trainer import Trainer

    with Trainer(md, strategy, PAIR, pool=pool, timeout_s=120) as trainer:
        history = trainer.fit(steps=steps, steps_per_call=2)
        weights = trainer.get_weights()
        chunks = trainer.session.chunks
        stats = trainer.session.ps_stats()
    assert all(c is not None and len(c) > 1 for c in chunks), chunks
    for chunk, s in zip(chunks, stats.values()):
        assert s["chunks"] == len(chunk) and s["pushes"] == 2 * steps * len(chunk)
    if staleness == 0:
        expected = rm.reference_weights(md, num_workers=2, steps=STEPS)
        for got, want in zip(weights, expected):
            assert np.allclose(got, want, rtol=1e-5, atol=1e-6)
    else:
        assert np.mean(history.loss[-5:]) < 0.5 * np.mean(history.loss[:5])


def test_a_trainer_pipelines_one_ps_nodes_tables_by_the_rows_its_workers_read(pool, monkeypatch):
    """``Trainer`` plans from the workers' description, whose ``rows`` (a sparse variable's distinct
    rows in a worker's first batch) weigh each table: one PS node holding two shards of the
    embedding pipelines them as two chunks beside the dense one (the link threshold set to 0 here:
    the pair's loopback link is fast), and trains as one process."""
    from autosync.runtime.sync import ps
    from autosync.runtime.trainer import Trainer

    monkeypatch.setattr(ps, "SPARSE_CHUNK_MIN_S", 0.0)
    md = rm.model_def("sgd", learning_rate=0.1)
    strategy = Strategy((
        VarConfig("emb/embeddings", (PS("node0"), PS("node0"))),
        VarConfig("hidden/kernel", (PS("node0"),)), VarConfig("hidden/bias", (PS("node0"),)),
        VarConfig("out/kernel", (PS("node0"),)), VarConfig("out/bias", (PS("node0"),)),
    ))
    with Trainer(md, strategy, PAIR, pool=pool, timeout_s=120) as trainer:
        trainer.fit(steps=STEPS, steps_per_call=STEPS)
        weights = trainer.get_weights()
        chunks = trainer.session.chunks
        rows = trainer.plan.rows_per_step
    assert rows[0] > 0 and not any(rows[1:]), rows
    assert chunks == [[[(1, 0), (2, 0), (3, 0), (4, 0)], [(0, 0)], [(0, 1)]]], chunks   # one actor, three chunks
    for got, want in zip(weights, rm.reference_weights(md, num_workers=2, steps=STEPS)):
        assert np.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_whole_variables_cut_into_row_blocks_train_as_one_process(pool, monkeypatch):
    """A whole variable holding most of a PS actor's bytes is cut into row blocks on that actor
    (``SyncPlan.segmented``) so its chunks pipeline; the workers reassemble it, and training
    equals one process. The strategy is not changed: only the session's plan is."""
    from autosync.runtime import engine
    from autosync.runtime.trainer import Trainer

    monkeypatch.setattr(engine, "PS_CHUNK_MIN_BYTES", 1)
    monkeypatch.setenv("AUTOSYNC_PS_CHUNKS", "4")
    md = rm.model_def("adam", learning_rate=0.05)
    names = _model_spec(pool, md).names
    strategy = Strategy(tuple(VarConfig(n, (PS("node1" if n.startswith("emb") else "node0"),)) for n in names))
    with Trainer(md, strategy, PAIR, pool=pool, timeout_s=120) as trainer:
        trainer.fit(steps=STEPS, steps_per_call=2)
        weights = trainer.get_weights()
        planned, ran = trainer.plan, trainer.session.plan
    kernel = names.index("hidden/kernel")
    assert planned.layout[kernel] == (1, 0) and ran.layout[kernel][0] > 1, ran.layout
    assert sum(r.var_index == kernel for p in ran.ps_actors for r in p.shards) == ran.layout[kernel][0]
    for got, want in zip(weights, rm.reference_weights(md, num_workers=2, steps=STEPS)):
        assert np.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_workers_that_build_different_initial_weights_are_refused(pool):
    """The driver compares the workers' digests of their initial weights (it receives the values
    of one worker only), and names what to fix."""
    import dataclasses

    from strategy_space.errors import ConfigError

    md = dataclasses.replace(rm.model_def(), name="unseeded", model_fn=rm.build_unseeded_model)
    with pytest.raises(ConfigError, match="built different initial weights.*make model_fn deterministic"):
        pool.ensure(md, PAIR.devices)
    assert not pool.actors, "workers of a refused model are killed"
    # the pool still serves a deterministic model afterwards, with one copy of the values
    pool.ensure(rm.model_def(), PAIR.devices)
    assert pool.description["initial"] is not None and pool.description["initial_digest"]


@pytest.mark.parametrize("transport", ["zmq", "ray"])
def test_each_ps_transport_carries_every_call_and_trains_as_one_process(pool, monkeypatch, transport):
    """The PS data plane (``psnet``, ZeroMQ by default) carries every push and pull of the actors
    it serves; ``AUTOSYNC_PS_TRANSPORT=ray`` puts them all back on Ray calls; an actor holding a
    locally replicated shard stays on Ray either way. Both train exactly like one process."""
    from autosync.runtime.trainer import Trainer

    monkeypatch.setenv("AUTOSYNC_PS_TRANSPORT", transport)
    md = rm.model_def("adam", learning_rate=0.05)
    strategy = Strategy((
        VarConfig("emb/embeddings", (PS("node1"), PS("node0"))),
        VarConfig("hidden/kernel", (PS("node0"),)),
        VarConfig("hidden/bias", (PS("node1"),)),
        VarConfig("out/kernel", (PS("node0"),)),
        VarConfig("out/bias", (PS("node1", local_replication=True),)),
    ))
    with Trainer(md, strategy, PAIR, pool=pool, timeout_s=120) as trainer:
        trainer.fit(steps=STEPS, steps_per_call=2)
        weights = trainer.get_weights()
        plans = trainer.session.plan.ps_actors
        stats = trainer.session.ps_stats()
    expected = rm.reference_weights(md, num_workers=2, steps=STEPS)
    for got, want in zip(weights, expected):
        assert np.allclose(got, want, rtol=1e-5, atol=1e-6)
    replicated = {p.name for p in plans if any(r.local_replication for r in p.shards)}
    assert replicated and len(replicated) < len(plans), [p.name for p in plans]
    for name, s in stats.items():
        assert s["pushes"] > 0 and s["pulls"] > 0, (name, s)
        on_wire = transport == "zmq" and name not in replicated
        assert s["data_plane_calls"] == (s["pushes"] + s["pulls"] if on_wire else 0), (transport, name, s)


def _keras_extras(_actor) -> tuple:
    """In an actor: what Keras' wrapper, visualization and array-adapter modules took of
    scikit-learn, matplotlib and pandas at import, and those packages imported by hand."""
    import sys

    import matplotlib
    import pandas
    import sklearn
    from keras.src.trainers.data_adapters import array_slicing
    from keras.src.visualization import plot_image_gallery
    from keras.src.wrappers import sklearn_wrapper

    return ("keras" if "keras" in sys.modules else None, sklearn.__name__, matplotlib.__name__, pandas.__name__,
            sklearn_wrapper.sklearn, plot_image_gallery.plt, array_slicing.pandas)


def _ps_facts(trainer) -> list[dict]:
    import ray

    return ray.get([a.ready.remote() for a in trainer.session.ps_actors])


def test_consecutive_sessions_reuse_the_ps_processes_and_train_like_fresh_ones(pool):
    """Issue 26, deliverable 3: a clean session gives its PS actors back to the pool; the next one
    (another optimizer, other shards) resets the same processes onto its plan and trains exactly
    like one process, with nothing of the first left in them (values, slots, counters)."""
    from autosync.runtime.trainer import Trainer

    pids = []
    for md, builder in ((rm.model_def("sgd", learning_rate=0.1, momentum=0.9), "partitioned_ps"),
                        (rm.model_def("adam", learning_rate=0.05), "uneven_partitioned_ps")):
        strategy = _strategy(builder, _model_spec(pool, md))
        with Trainer(md, strategy, PAIR, pool=pool, timeout_s=120) as trainer:
            trainer.fit(steps=STEPS, steps_per_call=2)
            weights = trainer.get_weights()
            pids.append(sorted(f["pid"] for f in _ps_facts(trainer)))
            stats = trainer.session.ps_stats()
        assert all(s["pushes"] == 2 * STEPS * s["chunks"] for s in stats.values()), stats
        for got, want in zip(weights, rm.reference_weights(md, num_workers=2, steps=STEPS)):
            assert np.allclose(got, want, rtol=1e-5, atol=1e-6), (builder, np.abs(got - want).max())
    assert len(pids[0]) == 2 and pids[1] == pids[0], pids
    assert not pool.ps.lent and sum(len(a) for a in pool.ps.idle.values()) == 2, "the pool keeps what a plan asked"


def test_a_keras_path_session_on_a_reused_pool_imports_nothing(pool):
    """A schedule runs the Keras optimizer in the PS actors, which imports TensorFlow there: once
    per process, so the second session on the pool starts with Keras already imported, sooner."""
    import time

    import ray

    from autosync.runtime.trainer import Trainer
    from tests.test_runtime_user_optimizer import COSINE

    md = rm.model_def("sgd", learning_rate=COSINE, momentum=0.9)
    strategy = _strategy("partitioned_ps", _model_spec(pool, md))
    facts, startup = [], []
    for _ in range(2):
        t0 = time.perf_counter()
        with Trainer(md, strategy, PAIR, pool=pool, timeout_s=120) as trainer:
            startup.append(time.perf_counter() - t0)
            facts.append(_ps_facts(trainer))
            trainer.fit(steps=STEPS, steps_per_call=2)
            weights = trainer.get_weights()
            # Keras' scikit-learn, matplotlib and pandas integrations stay out of the actors' imports
            # (lean_import), while the packages themselves import there as anywhere else
            extras = ray.get([a.__ray_call__.remote(_keras_extras)
                              for a in [*trainer.session.ps_actors, *trainer.session.workers]])
    assert extras == [("keras", "sklearn", "matplotlib", "pandas", None, None, None)] * len(extras), extras
    for got, want in zip(weights, rm.reference_weights(md, num_workers=2, steps=STEPS)):
        assert np.allclose(got, want, rtol=1e-5, atol=1e-6), np.abs(got - want).max()
    assert [f["pid"] for f in facts[1]] == [f["pid"] for f in facts[0]]
    assert all(f["keras_ready"] for f in facts[1]), facts[1]
    if not any(f["keras_ready"] for f in facts[0]):   # the first session imported it
        assert startup[1] < startup[0] / 2, startup


def test_a_fit_records_its_timeline_and_trains_the_same(pool, tmp_path):
    """``fit(timeline=...)`` writes every worker's and PS actor's spans of those steps, and what it
    records changes nothing about the training."""
    import json

    from autosync.runtime.trainer import Trainer

    md = rm.model_def("adam", learning_rate=0.05)
    strategy = _strategy("partitioned_ps", _model_spec(pool, md))
    with Trainer(md, strategy, PAIR, pool=pool, timeout_s=120) as trainer:
        trainer.fit(steps=1, steps_per_call=1)
        trainer.fit(steps=STEPS - 1, steps_per_call=2, timeline=tmp_path / "fit.json")
        weights = trainer.get_weights()
    for got, want in zip(weights, rm.reference_weights(md, num_workers=2, steps=STEPS)):
        assert np.allclose(got, want, rtol=1e-5, atol=1e-6), np.abs(got - want).max()
    trace = json.loads((tmp_path / "fit.json").read_text())
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    spans = [(names[e["pid"]], e["name"], e["args"].get("step")) for e in trace["traceEvents"] if e["ph"] == "X"]
    for worker in ("worker 0 (node0)", "worker 1 (node1)"):
        assert sorted(s for a, n, s in spans if a == worker and n == "compute") == list(range(1, STEPS))
    applied = [(a, s) for a, n, s in spans if n == "apply"]
    assert {a for a, _ in applied} == {"ps@node0", "ps@node1"} and {s for _, s in applied} == set(range(1, STEPS))
    assert trace["otherData"]["steps"] == [1, STEPS]


def test_a_failed_sessions_ps_actors_are_killed_not_reused(pool, tmp_path):
    """A session whose worker raised never gives its PS actors back, even when closed as clean
    (last in this module: the failed worker's PS is gone under it)."""
    import functools
    import time

    from autosync.runtime.engine import Session, TrialFailed
    from autosync.runtime.plan import SyncPlan
    from tests.test_runtime_failures import _all_dead

    flag = tmp_path / "misbehave"
    flag.write_text("raise")
    md = rm.model_def("sgd", learning_rate=0.1, dataset=functools.partial(rm.faulty_batches, flag=str(flag), at=2))
    spec = _model_spec(pool, md)
    plan = SyncPlan.build(_strategy("partitioned_ps", spec), spec, PAIR)
    session = Session(pool, plan)
    failed = [p["pid"] for p in session.start(time.monotonic() + 120)["ps"]]
    with pytest.raises(TrialFailed, match="injected failure in worker 1"):
        session.run(STEPS, time.monotonic() + 120)
    session.close(clean=True)
    assert not pool.ps.lent and not any(pool.ps.idle.values())
    assert _all_dead(failed), "a failed session's PS actors are still running"
    flag.unlink()
    _, _, weights = _train(pool, md, _strategy("partitioned_ps", spec))
    for got, want in zip(weights, rm.reference_weights(md, num_workers=2, steps=STEPS)):
        assert np.allclose(got, want, rtol=1e-5, atol=1e-6)
    import ray

    fresh = ray.get([a.ready.remote() for idle in pool.ps.idle.values() for a in idle])
    assert len(fresh) == 2 and not {f["pid"] for f in fresh} & set(failed), (fresh, failed)
