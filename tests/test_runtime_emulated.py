"""Emulated compute: synthetic gradients of the spec's exact shapes and sparsity, handed over after
the profiled compute time; real synchronization applies them exactly (checked against numpy)."""
from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from autosync.runtime.digest import weights_digest, zeros_digest
from autosync.runtime.emulated import (EmulatedModelDef, EmulatedWorker, distinct_zipf_rows,
                                       emulated_model_def, step_rows, synthetic_gradients)
from autosync.runtime.initial import ZeroInitial
from strategy_space import ClusterSpec, ComputeProfile, ConfigError, ModelSpec, NodeSpec, VariableSpec
from strategy_space.yaml_io import load

SPEC = ModelSpec("emu", (
    VariableSpec("emb", (4000, 8), sparse=True, rows_per_step=50),
    VariableSpec("dense/kernel", (8, 16)),
    VariableSpec("dense/bias", (16,)),
    VariableSpec("half", (6, 4), dtype="float16"),
    VariableSpec("counter", (1,), dtype="int64"),
), batch_size=8, profile=ComputeProfile(0.01, "test", ("counter", "half", "dense/bias", "dense/kernel", "emb")))


def same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, tuple):
        return np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[1].dtype == b[1].dtype
    return np.array_equal(a, b) and a.dtype == b.dtype


@pytest.mark.parametrize("path", ["ncf.yaml", "bert_base.yaml", "resnet50.yaml"])
def test_gradients_have_the_exact_shapes_dtypes_and_sparsity_of_full_size_specs(configs_dir, path):
    spec = load(f"{configs_dir}/models/{path}", "model")
    grads = synthetic_gradients(spec, seed=1, worker=0, step=0)
    assert len(grads) == len(spec.variables)
    for var, g in zip(spec.variables, grads):
        if var.sparse:
            idx, vals = g
            assert len(idx) == len(np.unique(idx)) == var.rows_per_step      # distinct rows, as profiled
            assert 0 <= idx.min() and idx.max() < var.shape[0]
            assert vals.shape == (var.rows_per_step,) + var.shape[1:] and vals.dtype == np.dtype(var.dtype)
        else:
            assert g.shape == var.shape and g.dtype == np.dtype(var.dtype)


def test_gradients_are_deterministic_per_seed_worker_and_step():
    g = synthetic_gradients(SPEC, 3, 1, 5)
    assert all(same(a, b) for a, b in zip(g, synthetic_gradients(SPEC, 3, 1, 5)))
    assert not np.array_equal(g[0][0], synthetic_gradients(SPEC, 3, 1, 6)[0][0])      # rows change per step
    assert not np.array_equal(g[1], synthetic_gradients(SPEC, 3, 0, 5)[1])            # workers differ
    assert g[4] is None and g[3].dtype == np.float16                                  # ints get no gradient


def test_sparse_rows_are_zipf_like_and_distinct():
    rng = np.random.default_rng(0)
    counts = np.zeros(1000)
    for _ in range(200):
        rows = distinct_zipf_rows(rng, 1000, 50)
        assert len(np.unique(rows)) == 50
        counts[rows] += 1
    assert counts[:10].mean() > 5 * counts[500:].mean()            # frequent ids are drawn far more often
    assert list(distinct_zipf_rows(rng, 5, 5)) == [0, 1, 2, 3, 4]
    assert len(np.unique(distinct_zipf_rows(rng, 12, 11))) == 11   # nearly every row: filled up


class RecordingChannel:
    """A channel that records what the worker hands over, which rows it had drawn when pulling
    and which rows it asked the pull for."""

    calls = bytes_sent = bytes_received = 0

    def __init__(self, worker):
        self.worker, self.pushes, self.rows_at_pull, self.rows_asked = worker, [], [], []

    def pull(self, step, fresh=False, rows=None):
        self.rows_at_pull.append((step, {k: v.copy() for k, v in self.worker.rows.items()}))
        self.rows_asked.append((step, fresh, rows))
        return {}

    def push(self, step, grads):
        self.pushes.append((step, grads, time.perf_counter()))

    def finish(self):
        pass


def test_worker_waits_the_compute_time_and_hands_over_the_synthetic_gradients():
    md = EmulatedModelDef(SPEC, 0.03, seed=2)
    w = EmulatedWorker(1)
    desc = w.load(md, 1, 2)
    assert [v["name"] for v in desc["variables"]] == list(SPEC.names)
    assert desc["optimizer"]["class"] == "SGD"
    assert desc["initial"] == [ZeroInitial(tuple(v.shape), v.dtype) for v in SPEC.variables]  # described, not allocated
    ch = RecordingChannel(w)
    w.reset(1, 2, [ch], [(1, 0)] * len(SPEC.variables))
    out = w.run(4)
    assert len(out["start"]) == 5 and min(out["compute"]) >= 0.03
    for step, grads, _ in ch.pushes:
        assert all(same(a, b) for a, b in zip(grads, synthetic_gradients(SPEC, 2, 1, step)))
        # the step's rows were drawn before its pull, and the pull asked for exactly those rows
        assert np.array_equal(dict(ch.rows_at_pull)[step][0], step_rows(SPEC, 2, 1, step)[0])
        asked = {s: r for s, fresh, r in ch.rows_asked if not fresh}
        assert set(asked[step]) == {0} and np.array_equal(asked[step][0], step_rows(SPEC, 2, 1, step)[0])
    # the final synchronizing pull names no rows of the sparse table (weights are pulled whole on demand)
    step, fresh, rows = ch.rows_asked[-1]
    assert fresh and step == 4 and rows[0].size == 0


def test_dilation_and_step_time_override():
    cluster = ClusterSpec("c", (NodeSpec("a"),), compute_dilation=4.0)
    assert emulated_model_def(SPEC, cluster).step_time_s == pytest.approx(0.04)
    assert emulated_model_def(SPEC, cluster, step_time_s=0.5).step_time_s == pytest.approx(2.0)
    with pytest.raises(ConfigError, match="no profile.step_time_s"):
        emulated_model_def(dataclasses.replace(SPEC, profile=None), cluster)
    with pytest.raises(ConfigError, match="not one of sgd"):
        EmulatedModelDef(SPEC, 0.1, optimizer="rmsprop")


def test_cluster_compute_fields_round_trip_and_keep_old_fingerprints():
    plain = ClusterSpec("c", (NodeSpec("a"),))
    emu = dataclasses.replace(plain, compute="emulated", compute_dilation=25.0)
    assert "compute" not in plain.to_dict() and "compute_dilation" not in plain.to_dict()
    assert ClusterSpec.from_dict(emu.to_dict()) == emu and emu.fingerprint != plain.fingerprint
    with pytest.raises(ConfigError, match="compute must be 'real' or 'emulated'"):
        ClusterSpec("c", (NodeSpec("a"),), compute="gpu")


def test_early_collectives_are_the_groups_gpu_workers_reduce_in_their_step_in_issue_order():
    from autosync.runtime.emulated import early_collectives
    from autosync.runtime.sync.allreduce import AllReduceChannel, ARGroup, ARMember
    from strategy_space import Compressor
    from strategy_space.builders import ready_times

    def member(v, in_step, shard=0, shards=1, sparse=False):
        return ARMember((v, shard), 0, 1, 0, shards, sparse, Compressor(), "gloo", in_step)

    groups = [ARGroup(0, (member(2, True),)),                     # in the step: early
              ARGroup(1, (member(1, True, 0, 2),)),                # a split variable with a shard outside
              ARGroup(2, (member(1, False, 1, 2),)),
              ARGroup(3, (member(3, True), member(4, False))),     # mixed with another backend: at hand-over
              ARGroup(4, (member(0, True, 0, 2, True),)),          # a split sparse one: never in the graph
              ARGroup(5, (member(0, True, 1, 2, True),))]
    channel = AllReduceChannel(0, 2, groups, {}, {}, {"class": "SGD", "learning_rate": 0.1})
    layout = [(2, 0), (2, 0), (1, 0), (1, 0), (1, 0)]
    times = ready_times(SPEC)
    assert early_collectives(SPEC, [RecordingChannel(None), channel], layout) == [(times["dense/bias"], channel, 0)]
    whole = [ARGroup(0, (member(2, True),)), ARGroup(1, (member(1, True),))]
    channel = AllReduceChannel(0, 2, whole, {}, {}, {"class": "SGD", "learning_rate": 0.1})
    assert [(t, i) for t, _, i in early_collectives(SPEC, [channel], [(1, 0)] * 5)] == [
        (times["dense/bias"], 0), (times["dense/kernel"], 1)]


PAIR = ClusterSpec(name="pair", nodes=(
    NodeSpec(name="node0", address="127.0.0.1", cpus=1, workers=1, chief=True),
    NodeSpec(name="node1", address="127.0.0.1", cpus=1, workers=1),
), compute="emulated")
OPTIONS = {"ps": {}, "partitioned_ps": {"min_partition_bytes": 1}, "all_reduce": {}}


def numpy_reference(spec, seed, workers, steps, lr, clipnorm=None):
    """Synchronous SGD on the mean of every worker's synthetic gradients, from zeros; with
    ``clipnorm``, scaled as Keras' ``global_clipnorm`` scales the global batch's gradient (its norm
    over the dense means and every worker's sparse slices, each slice squared on its own)."""
    params = [np.zeros(v.shape, dtype=v.dtype) for v in spec.variables]
    for t in range(steps):
        grads = [synthetic_gradients(spec, seed, w, t) for w in range(workers)]
        scale = 1.0
        if clipnorm is not None:
            sq = 0.0
            for v in range(len(spec.variables)):
                parts = [g[v] for g in grads if g[v] is not None]
                if parts and isinstance(parts[0], tuple):
                    sq += sum(float(np.square(p[1].astype(np.float64) / workers).sum()) for p in parts)
                elif parts:
                    sq += float(np.square(sum(p.astype(np.float64) for p in parts) / workers).sum())
            scale = min(1.0, clipnorm / np.sqrt(sq))
            assert scale < 0.9   # the clipping is felt
        for w in range(workers):
            for v, g in enumerate(grads[w]):
                if g is None:
                    continue
                if isinstance(g, tuple):
                    np.subtract.at(params[v], g[0], g[1] * params[v].dtype.type(lr * scale / workers))
                else:
                    params[v] = params[v] - g * params[v].dtype.type(lr * scale / workers)
    return params


@pytest.mark.integration
@pytest.mark.parametrize("builder,clipped", [(b, False) for b in sorted(OPTIONS)] + [("ps", True), ("all_reduce", True)])
def test_parameters_after_k_emulated_steps_equal_numpy(ray_session, builder, clipped):
    """... and a spec whose model clips by the global norm holds its steps as a TensorFlow worker
    does: the parameter servers and the numpy all-reduce apply the global batch's gradient scaled by
    ``CLIPNORM`` over its norm."""
    from autosync.runtime.binding import ClusterBinding
    from autosync.runtime.emulated import CLIPNORM
    from autosync.runtime.engine import Session, WorkerPool
    from autosync.runtime.plan import SyncPlan
    from strategy_space.builders import get_builder

    spec = dataclasses.replace(SPEC, variables=SPEC.variables[:3], profile=ComputeProfile(0.005),
                               global_clipnorm=clipped)
    md = EmulatedModelDef(spec, 0.005, "sgd", seed=7)
    pool = WorkerPool(ClusterBinding.bind(PAIR))
    try:
        pool.ensure(md, PAIR.devices, time.monotonic() + 120)
        plan = SyncPlan.build(get_builder(builder, **OPTIONS[builder]).build(spec, PAIR), spec, PAIR,
                              pool.description["optimizer"])
        session = Session(pool, plan)
        session.start(time.monotonic() + 120)
        session.run(3, time.monotonic() + 120)
        session.run(2, time.monotonic() + 120)     # a second batch continues where the first stopped
        weights = session.weights(time.monotonic() + 60)
        session.close()
    finally:
        pool.kill_all()
    for got, want, var in zip(weights, numpy_reference(spec, 7, 2, 5, 0.01, CLIPNORM if clipped else None),
                              spec.variables):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7, err_msg=var.name)
    assert any(np.abs(w).max() > 0 for w in weights)


def timed_session(spec, strategy, compute: float, steps: int) -> tuple[list, dict]:
    """Train ``spec`` with ``strategy`` on emulated workers (sgd, seed 7) of ``PAIR`` for ``steps``
    steps with every actor's timeline on: the final weights and the timelines by actor label."""
    from autosync.runtime.binding import ClusterBinding
    from autosync.runtime.engine import Session, WorkerPool
    from autosync.runtime.plan import SyncPlan
    from autosync.runtime.runner import session_timeline

    md = EmulatedModelDef(spec, compute, "sgd", seed=7)
    pool = WorkerPool(ClusterBinding.bind(PAIR))
    try:
        pool.ensure(md, PAIR.devices, time.monotonic() + 120)
        session = Session(pool, SyncPlan.build(strategy, spec, PAIR, pool.description["optimizer"]))
        session.start(time.monotonic() + 120)
        session_timeline(session, True, time.monotonic() + 60)
        session.run(steps, time.monotonic() + 120)
        streams = session_timeline(session, False, time.monotonic() + 60)
        weights = session.weights(time.monotonic() + 60)
        session.close()
    finally:
        pool.kill_all()
    return weights, streams


@pytest.mark.integration
def test_collectives_gpu_workers_reduce_in_their_step_overlap_the_emulated_compute(ray_session):
    """A collective of ``in_step`` members (backend auto) is issued during the compute, once its
    gradients are ready; gloo's waits for the hand-over, the PS push for its gradients' ready time;
    training is unchanged."""
    from strategy_space import PS, AllReduce, Strategy, VarConfig, validate
    from strategy_space.builders import ready_times

    compute = 0.06
    spec = dataclasses.replace(SPEC, variables=SPEC.variables[:3], profile=ComputeProfile(compute))
    strategy = Strategy((VarConfig("emb", (PS("node0"),)),
                         VarConfig("dense/kernel", (AllReduce(backend="auto", group=0),)),
                         VarConfig("dense/bias", (AllReduce(backend="gloo", group=1),))))
    validate(strategy, spec, PAIR)
    weights, streams = timed_session(spec, strategy, compute, 4)
    for got, want, var in zip(weights, numpy_reference(spec, 7, 2, 4, 0.01), spec.variables):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7, err_msg=var.name)
    ready = ready_times(spec)["dense/kernel"]
    for label, stream in streams.items():
        if not label.startswith("worker"):
            continue
        events = stream["events"]
        computes = {e[4]["step"]: (e[1], e[1] + e[2]) for e in events if e[0] == "compute"}
        early = {e[4]["step"]: e[1] for e in events if e[0] == "allreduce (in step)"}
        assert sorted(early) == sorted(computes) == [0, 1, 2, 3], label
        for step, start in early.items():
            c0, c1 = computes[step]
            # issued once the kernel's gradient is ready, before the compute ends (microseconds)
            assert c0 + 0.9 * ready * compute * 1e6 <= start < c1, (label, step)
        # the gloo group waits for the hand-over, after the compute; the PS push for its gradient's
        # ready time (the embedding's: the compute's end), from a thread of its own (``early_push``)
        for e in events:
            if e[0] == "allreduce":
                assert e[1] >= computes[e[4]["step"]][1] - 1e3, (label, e[0])
            if e[0] == "ps push":
                assert e[1] >= computes[e[4]["step"]][0] + 0.9 * compute * 1e6, (label, e[0])


@pytest.mark.integration
def test_an_embedding_models_tables_pipelined_across_a_slow_link_train_as_one_process(ray_session):
    """Where a step's rows take long on the link, a PS actor's tables go in several chunks (each
    pushed and pulled by its own call, applied when all workers' chunk is in): training is the
    same, to float tolerance, as single-process SGD."""
    from autosync.runtime.binding import ClusterBinding
    from autosync.runtime.engine import Session, WorkerPool
    from autosync.runtime.plan import SyncPlan
    from strategy_space.builders import get_builder

    tables = tuple(VariableSpec(f"emb{i}", (300 + 50 * i, 4), sparse=True, rows_per_step=20) for i in range(4))
    spec = ModelSpec("tables", tables + (VariableSpec("dense/kernel", (4, 3)),), batch_size=8,
                     profile=ComputeProfile(0.002))
    slow = dataclasses.replace(PAIR, nodes=tuple(dataclasses.replace(n, bandwidth_gbps=0.001) for n in PAIR.nodes))
    md = EmulatedModelDef(spec, 0.002, "sgd", seed=5)
    pool = WorkerPool(ClusterBinding.bind(slow))
    try:
        pool.ensure(md, slow.devices, time.monotonic() + 120)
        plan = SyncPlan.build(get_builder("ps").build(spec, slow), spec, slow, pool.description["optimizer"])
        session = Session(pool, plan)
        session.start(time.monotonic() + 120)
        session.run(4, time.monotonic() + 120)
        weights = session.weights(time.monotonic() + 60)
        chunks = session.chunks
        session.close()
    finally:
        pool.kill_all()
    assert len(chunks[0]) == 4 and sum(len(c) for c in chunks[0]) == 5, chunks
    for got, want, var in zip(weights, numpy_reference(spec, 5, 2, 4, 0.01), spec.variables):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7, err_msg=var.name)


@pytest.mark.integration
def test_starting_an_all_reduce_session_ships_no_copy_of_the_model(ray_session):
    """The driver used to make every all-reduced variable's initial value and send it to each
    worker with its channel: a full-size dlrm (2 GB) then crossed each 100 Mbit/s link before the
    first step, and its all-reduce trials timed out. Each worker now slices its members' values from
    its node's copy of the pool's description."""
    import tracemalloc

    from autosync.runtime.binding import ClusterBinding
    from autosync.runtime.engine import Session, WorkerPool
    from autosync.runtime.plan import SyncPlan
    from strategy_space.builders import get_builder

    spec = ModelSpec("big", (
        VariableSpec("emb", (1_000_000, 16), sparse=True, rows_per_step=40),   # 64 MB
        VariableSpec("dense/kernel", (16, 8)),
    ), batch_size=8, profile=ComputeProfile(0.001))
    md = EmulatedModelDef(spec, 0.001, "sgd", seed=3)
    pool = WorkerPool(ClusterBinding.bind(PAIR))
    try:
        pool.ensure(md, PAIR.devices, time.monotonic() + 120)
        plan = SyncPlan.build(get_builder("all_reduce").build(spec, PAIR), spec, PAIR)
        session = Session(pool, plan)
        tracemalloc.start()
        try:
            session.start(time.monotonic() + 120)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        session.run(2, time.monotonic() + 120)
        weights = session.weights(time.monotonic() + 60)
        session.close()
    finally:
        pool.kill_all()
    assert peak < spec.variables[0].bytes / 16, peak
    for got, want, var in zip(weights, numpy_reference(spec, 3, 2, 2, 0.01), spec.variables):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7, err_msg=var.name)

def test_real_compute_refuses_emulated_only_settings():
    from autosync.runtime.runner import check_real_compute

    dilated = ClusterSpec("d", (NodeSpec("a"),), compute_dilation=25.0)
    with pytest.raises(ConfigError, match="compute_dilation 25, which only emulated compute can follow"):
        check_real_compute("real", dilated, None)
    with pytest.raises(ConfigError, match="--step-time sets the compute time of emulated compute"):
        check_real_compute("real", ClusterSpec("p", (NodeSpec("a"),)), 0.1)
    with pytest.raises(ConfigError, match="compute must be one of real, emulated"):
        check_real_compute("gpu", ClusterSpec("p", (NodeSpec("a"),)), None)


def test_real_and_emulated_trials_are_never_pooled(tmp_path):
    """Emulated trials are recorded against the cluster marked ``compute: emulated``: the store,
    hence the warm start and the simulator's training groups, keeps them apart from real ones."""
    from autosync.report import _compute_note
    from strategy_space.builders import get_builder
    from tuner.records.dataset import store_groups
    from tuner.records.store import TrialStore
    from tuner.records.trial import Trial

    real = ClusterSpec("c", (NodeSpec("a", workers=2),))
    emu = dataclasses.replace(real, compute="emulated", compute_dilation=10.0)
    strategy = get_builder("all_reduce").build(SPEC, real)
    with TrialStore(tmp_path / "t.db") as store:
        for c, t in ((real, 0.1), (emu, 0.3)):
            store.add(Trial(strategy, SPEC.fingerprint, c.fingerprint, "ok", step_times=(t,)), SPEC, c)
        groups = store_groups(store)
    assert sorted((c.compute, [t.median for t in ts]) for _, c, ts in groups) == [("emulated", [0.3]), ("real", [0.1])]
    assert _compute_note(emu) == " (emulated compute, 10x dilated)" and _compute_note(real) == ""


@pytest.mark.integration
def test_tune_with_emulated_compute_from_a_model_spec_yaml(ray_session, tmp_path):
    import autosync
    from strategy_space.yaml_io import save
    from tuner.records.store import TrialStore
    from tuner.search.model_based import SearchSettings

    path = tmp_path / "emu.yaml"
    save(dataclasses.replace(SPEC, variables=SPEC.variables[:3], profile=None), path)
    result = autosync.tune(str(path), "local", compute="emulated", step_time_s=0.01, trials=1, steps=3, warmup=1,
                           precision=None, confirm=0, warm_start="none", store=tmp_path / "t.db",
                           settings=SearchSettings(batch=1, candidates=16, chains=4, anneal_steps=4))
    assert result.cluster.compute == "emulated" and result.best_trial.ok
    assert {t.compute for t in result.outcome.trials} == {"emulated"}
    with TrialStore(tmp_path / "t.db") as store:
        [(_, cfp, _)] = store.groups()
        assert store.cluster(cfp).compute == "emulated"


class RowServer:
    """Made-up parameter-server replies: the rows asked of each sparse variable, the dense ones
    whole (allocated up front, as received buffers are)."""

    calls = bytes_sent = bytes_received = 0

    def __init__(self, spec):
        self.spec = spec
        self.dense = {(v, 0): np.ones(var.shape, var.dtype) for v, var in enumerate(spec.variables) if not var.sparse}

    def pull(self, step, fresh=False, rows=None):
        out = dict(self.dense)
        for v, r in (rows or {}).items():
            out[(v, 0)] = (r, np.ones((len(r),) + self.spec.variables[v].shape[1:], np.float32))
        return out

    def push(self, step, grads):
        pass

    def finish(self):
        pass


def test_a_worker_allocates_what_it_sends_not_its_tables():
    import tracemalloc

    spec = ModelSpec("tables", (
        VariableSpec("emb_a", (300_000, 16), sparse=True, rows_per_step=100),
        VariableSpec("emb_b", (200_000, 16), sparse=True, rows_per_step=60),
        VariableSpec("dense/kernel", (16, 32)),
        VariableSpec("dense/bias", (32,)),
    ), batch_size=100)
    server = RowServer(spec)
    warm = EmulatedWorker(1)  # lazy imports and caches of a first load and step: not what is measured
    warm.load(EmulatedModelDef(SPEC, 0.0), 0, 2)
    warm.reset(0, 2, [RowServer(SPEC)], [(1, 0)] * len(SPEC.variables))
    warm.run(1)
    tracemalloc.start()
    try:
        w = EmulatedWorker(1)
        desc = w.load(EmulatedModelDef(spec, 0.0), 0, 2, send_initial=True)
        w.reset(0, 2, [server], [(1, 0)] * len(spec.variables))
        w.run(3)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # the workers' zeros compared by their sizes alone: every worker of this spec gives the same
    assert desc["initial_digest"] == zeros_digest([(v.shape, v.dtype) for v in spec.variables])
    tables = sum(v.bytes for v in spec.variables if v.sparse)  # 32 MB
    dense = sum(v.bytes for v in spec.variables if not v.sparse)
    sent = dense + sum(v.rows_per_step * v.shape[1] * 4 for v in spec.variables if v.sparse)
    # gradients, the rows drawn and pulled, Python's own bookkeeping: a few times what it sends
    assert peak < 8 * sent + (256 << 10) < tables / 20, (peak, sent, tables)


@pytest.mark.integration
def test_a_graph_all_reduce_runs_under_emulated_compute_as_auto_does(ray_session):
    """Emulated workers hold no TensorFlow graph: an all-reduce pinned to backend ``graph`` (what
    ``tune`` pins a constrained variable to) runs on the nodes' collective backend, reduced in the
    step as ``auto``'s is; it failed every trial before ("'ActorHandle' object has no attribute
    'collective_address'"). TensorFlow workers keep the graph."""
    import autosync
    from autosync.runtime.plan import SyncPlan
    from strategy_space import AllReduce, Strategy, VarConfig

    spec = dataclasses.replace(SPEC, variables=SPEC.variables[:3], profile=ComputeProfile(0.005))

    def every(backend):
        return Strategy(tuple(VarConfig(v.name, (AllReduce(backend=backend),)) for v in spec.variables),
                        origin=backend)

    runner = autosync.make_runner(spec, "local", compute="emulated", steps=3, warmup=1, precision=None)
    try:
        for graph, want in ((False, "gloo"), (True, "graph")):
            plan = SyncPlan.build(every("graph"), spec, runner.cluster, graph=graph)
            assert {(m.backend, m.in_step) for g in plan.ar_groups for m in g.members} == {(want, True)}
        graph, auto = runner.run([every("graph"), every("auto")])
    finally:
        runner.close()
    assert graph.ok and auto.ok, (graph.error, auto.error)


def test_the_zeros_digest_reads_sizes_not_bytes():
    # a table of 32 PiB: hashing its zero bytes, as the digest once did, would take a worker months
    table = [((2 ** 31 - 1, 2 ** 22), "float32"), ((8,), "float32")]
    assert zeros_digest(table) == zeros_digest([((2 ** 31 - 1, 2 ** 22), np.float32), ((8,), "float32")])
    assert len({zeros_digest(table), zeros_digest(table[:1]), zeros_digest([table[0], ((8,), "float16")]),
                zeros_digest([table[0], ((4, 2), "float32")]), weights_digest([])}) == 5
