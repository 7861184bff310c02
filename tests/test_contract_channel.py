"""The SyncChannel contract, one suite for every channel (Optuna's sampler-contract style: each
channel is a parameter of the ``harness`` fixture; a new ``SyncChannel`` subclass fails
``test_every_channel_is_covered`` until it is added to ``HARNESSES``).

A tiny plan: a dense matrix, a bias, a sparse (IndexedSlices) table with repeated rows, and a
matrix split into two shards along axis 0. Every synchronous channel leaves every worker with the
values of SGD applied to the mean gradient over the workers, step after step (duplicate rows add
up); its counters only grow; ``finish_pull(start_pull(...))`` returns what ``pull`` does; its
declared abilities (``in_graph``, ``splits_pull``) are the methods it implements. The harnesses:

* ``AllReduceChannel`` over the in-process thread collective (fast suite);
* ``PSChannel`` against two ``ParameterServerShard`` s run in this process (integration only
  because the channel imports Ray to collect replies; Ray is not started);
* ``GraphAllReduceChannel`` in Ray actors that join a TensorFlow cluster, with a Keras model
  whose gradients are the contract's (integration).
"""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from autosync.runtime.sync import backends, graph, ps
from autosync.runtime.sync.allreduce import AllReduceChannel, ARGroup, ARMember
from autosync.runtime.sync.base import SyncChannel
from strategy_space.compressor import Compressor
from tests.fake_collective import ThreadBackend, concrete_subclasses, run_ranks

SHAPES = [(6, 4), (4,), (10, 3), (6, 5)]
SPARSE = 2
SPLIT = 3        # two shards along axis 0: rows [0, 3) and [3, 6)
LR = 0.1
SGD = {"name": "SGD", "learning_rate": LR, "momentum": 0.0, "nesterov": False}
WORLD, STEPS = 2, 3


def initial() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]


def grads_for(rank: int, step: int) -> list:
    rng = np.random.default_rng([rank, step])
    out = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    idx = np.array([1, 7, 1, 3 + rank], dtype=np.int64)   # a repeated row: its slices add up
    out[SPARSE] = (idx, rng.standard_normal((4, SHAPES[SPARSE][1])).astype(np.float32))
    return out


def reference(world: int, steps: int, scale: float = 1.0) -> list[np.ndarray]:
    """SGD on the mean gradient (times ``scale``), computed without any channel."""
    params = initial()
    for step in range(steps):
        gs = [grads_for(r, step) for r in range(world)]
        for i, s in enumerate(SHAPES):
            if i == SPARSE:
                dense = np.zeros(s, np.float32)
                for g in gs:
                    np.add.at(dense, g[i][0], g[i][1])
                mean = dense / world
            else:
                mean = sum(g[i] for g in gs) / world
            params[i] = params[i] - LR * scale * mean
    return params


def squared_norm(world: int, step: int) -> float:
    """The squared global norm of step ``step``'s mean gradient as Keras computes it (a sparse
    gradient's slices squared one by one)."""
    gs = [grads_for(r, step) for r in range(world)]
    dense = sum(float(np.sum(np.square(sum(g[i] for g in gs) / world, dtype=np.float64)))
                for i in range(len(SHAPES)) if i != SPARSE)
    return dense + sum(float(np.sum(np.square(g[SPARSE][1] / world, dtype=np.float64))) for g in gs)


def _pieces(var: int) -> list[tuple[int, int, int, int]]:
    """(shard, num_shards, start, stop) of each piece of variable ``var`` along axis 0."""
    n = SHAPES[var][0]
    return [(0, 2, 0, n // 2), (1, 2, n // 2, n)] if var == SPLIT else [(0, 1, 0, n)]


def _initial_parts() -> dict:
    init = initial()
    return {(v, k): init[v][a:b].copy() for v in range(len(SHAPES)) for k, _, a, b in _pieces(v)}


def _assemble(parts: dict) -> list[np.ndarray]:
    return [np.concatenate([parts[(v, k)] for k, _, _, _ in _pieces(v)]) for v in range(len(SHAPES))]


# ---- AllReduceChannel over threads ---------------------------------------------------------------
def _members(backend: str) -> list[ARGroup]:
    none = Compressor.parse("none")
    m = {(v, k): ARMember((v, k), a, b, 0, n, v == SPARSE, none, backend)
         for v in range(len(SHAPES)) for k, n, a, b in _pieces(v)}
    return [ARGroup(0, (m[(0, 0)], m[(1, 0)])), ARGroup(1, (m[(2, 0)],)), ARGroup(2, (m[(3, 0)],)),
            ARGroup(3, (m[(3, 1)],))]


class AllReduceHarness:
    channel = AllReduceChannel

    def __init__(self, request):
        request.getfixturevalue("monkeypatch").setitem(backends.BACKENDS, "thread", ThreadBackend)

    def train(self, world: int, steps: int, scale: float | None = None):
        setup = ThreadBackend.prepare(world, "contract")
        groups = _members("thread")

        def rank(r):
            ch = AllReduceChannel(r, world, groups, {"thread": setup}, _initial_parts(), SGD)
            counters = []
            for step in range(steps):
                ch.pull(step)
                if scale is None:
                    ch.push(step, grads_for(r, step))
                else:
                    counters.append(ch.held_sq(ch.push_held(step, grads_for(r, step))))
                    ch.release(step, scale)
                    continue
                counters.append((ch.calls, ch.bytes_sent, ch.bytes_received))
            ch.finish()
            values = _assemble(ch.finish_pull(ch.start_pull(steps, fresh=True)))
            for a, b in zip(values, _assemble(ch.pull(steps, fresh=True))):
                np.testing.assert_array_equal(a, b)
            ch.close()
            return values, counters

        return run_ranks(world, rank)


# ---- PSChannel against shards in this process ----------------------------------------------------
class _Local:
    """An actor handle whose ``method.remote(...)`` runs the shard's coroutine at once."""

    def __init__(self, shard, loop):
        self._shard, self._loop = shard, loop

    def __getattr__(self, name):
        method = getattr(self._shard, name)
        return SimpleNamespace(remote=lambda *args: self._loop.run_until_complete(method(*args)))


class PSHarness:
    """Two PS shards (the dense matrix and the table on one, the bias and the split matrix's
    shards on the other); workers take turns: all pull step t, then all push it."""

    channel = ps.PSChannel

    def __init__(self, request):
        import ray

        mp = request.getfixturevalue("monkeypatch")
        mp.setattr(ray, "get", lambda refs, **k: refs)
        mp.setattr(ray, "wait", lambda refs, num_returns=1, timeout=None, **k: (list(refs), []))

    def train(self, world: int, steps: int):
        from autosync.runtime.optimizers import squares_slices
        from autosync.runtime.plan import PSActorPlan, ShardRef
        from autosync.runtime.ps_shard import ParameterServerShard

        loop = asyncio.new_event_loop()
        parts = _initial_parts()
        layout = {"x": [(0, 0), (2, 0)], "y": [(1, 0), (3, 0), (3, 1)]}
        actors = []
        for node, keys in layout.items():
            shard = ParameterServerShard(f"ps@{node}", {k: parts[k] for k in keys},
                                         [k for k in keys if k[0] == SPARSE], [], SGD, num_workers=world, sync=True)
            refs = tuple(ShardRef(v, k, n, a, b, 0, v == SPARSE, False)
                         for v, k in keys for kk, n, a, b in _pieces(v) if kk == k)
            actors.append((_Local(shard, loop), PSActorPlan(node, refs)))
        channels = [ps.PSChannel(r, actors, SHAPES, staleness=0, squares=squares_slices(SGD)) for r in range(world)]
        counters = [[] for _ in range(world)]
        try:
            for step in range(steps):
                for ch in channels:
                    ch.pull(step)
                for r, ch in enumerate(channels):
                    ch.push(step, grads_for(r, step))
                    counters[r].append((ch.calls, ch.bytes_sent, ch.bytes_received))
            out = []
            for r, ch in enumerate(channels):
                ch.finish()
                values = _assemble(ch.finish_pull(ch.start_pull(steps, fresh=True)))
                for a, b in zip(values, _assemble(ch.pull(steps, fresh=True))):
                    np.testing.assert_array_equal(a, b)
                out.append((values, counters[r]))
                ch.close()
            return out
        finally:
            loop.close()


# ---- GraphAllReduceChannel in Ray actors with TensorFlow -----------------------------------------
class _GraphWorker:
    """A worker process: joins the TensorFlow cluster, builds a model whose gradients are the
    contract's ``grads_for`` (fed as the input) and trains it through the channel's step."""

    def address(self) -> str:
        from autosync.runtime.sync.tf_collective import free_address

        return free_address()

    def train(self, rank: int, addresses: list, world: int, steps: int, scale: float | None = None):
        import keras
        import tensorflow as tf

        from autosync.runtime.sync.tf_collective import join

        join(rank, addresses)

        class Contract(keras.Model):
            def __init__(self):
                super().__init__()
                self.vs = [self.add_weight(shape=s, initializer="zeros", name=f"v{i}") for i, s in enumerate(SHAPES)]

            def call(self, x, training=False):
                out = tf.add_n([tf.reduce_sum(v * x[f"g{i}"]) for i, v in enumerate(self.vs) if i != SPARSE])
                return out + tf.reduce_sum(tf.gather(self.vs[SPARSE], x["idx"]) * x["vals"])

        model = Contract()
        for v, value in zip(model.vs, initial()):
            v.assign(value)
        channel = graph.GraphAllReduceChannel(rank, world, _members("graph"), {"group": "contract", "base": 0})
        # held (global_clipnorm beside other channels): the clipping of the optimizer is dropped,
        # the scale given is applied instead
        optimizer = keras.optimizers.SGD(learning_rate=LR, global_clipnorm=None if scale is None else 1e-3)
        step_fn = channel.bind(model, lambda y, out: out, optimizer, hold=scale is not None)
        counters = []
        for step in range(steps):
            channel.pull(step)
            g = grads_for(rank, step)
            x = {f"g{i}": tf.constant(g[i]) for i in range(len(SHAPES)) if i != SPARSE}
            x.update(idx=tf.constant(g[SPARSE][0]), vals=tf.constant(g[SPARSE][1]))
            _, rest = step_fn(x, tf.zeros([1]))
            assert all(r is None for r in rest), "the graph reduces and applies every variable it owns"
            if scale is not None:
                counters.append(channel.held_sq(channel.push_held(step, [None] * len(SHAPES))))
                channel.release(step, scale)
                continue
            channel.push(step, [None] * len(SHAPES))
            counters.append((channel.calls, channel.bytes_sent, channel.bytes_received))
        channel.finish()
        channel.close()
        return [np.asarray(v.numpy()) for v in model.vs], counters


class GraphHarness:
    channel = graph.GraphAllReduceChannel

    def __init__(self, request):
        self.ray = request.getfixturevalue("ray_session")

    def train(self, world: int, steps: int, scale: float | None = None):
        actor = self.ray.remote(num_cpus=0)(_GraphWorker)
        workers = [actor.remote() for _ in range(world)]
        try:
            addresses = self.ray.get([w.address.remote() for w in workers], timeout=60)
            return self.ray.get([w.train.remote(r, addresses, world, steps, scale) for r, w in enumerate(workers)],
                                timeout=300)
        finally:
            for w in workers:
                self.ray.kill(w)


HARNESSES = {AllReduceChannel: AllReduceHarness, ps.PSChannel: PSHarness, graph.GraphAllReduceChannel: GraphHarness}


@pytest.fixture(params=[pytest.param(AllReduceHarness, id="allreduce"),
                        pytest.param(PSHarness, id="ps", marks=pytest.mark.integration),
                        pytest.param(GraphHarness, id="graph", marks=pytest.mark.integration)])
def harness(request):
    return request.param(request)


def test_every_channel_is_covered():
    found = concrete_subclasses(SyncChannel)
    missing = found - set(HARNESSES)
    assert not missing, f"add {sorted(c.__name__ for c in missing)} to HARNESSES in {__name__}"


@pytest.mark.parametrize("cls", list(HARNESSES), ids=lambda c: c.__name__)
def test_declared_abilities_are_the_implemented_ones(cls):
    """The worker trusts the declarations (``in_graph``, ``splits_pull``) without probing."""
    assert isinstance(cls.staleness, int) and isinstance(cls.in_graph, bool) and isinstance(cls.splits_pull, bool)
    assert (cls.bind is not SyncChannel.bind) == cls.in_graph
    assert (cls.start_pull is not SyncChannel.start_pull) == cls.splits_pull
    assert (cls.finish_pull is not SyncChannel.finish_pull) == cls.splits_pull


def test_a_channel_outside_the_graph_has_no_step_to_bind():
    ch = AllReduceChannel(0, 1, [], {}, {}, SGD)
    with pytest.raises(NotImplementedError, match="AllReduceChannel synchronizes outside the training step"):
        ch.bind(None, None, None)


def test_every_worker_ends_with_sgd_on_the_mean_gradient(harness):
    """Every worker pulls through ``start_pull``/``finish_pull`` the values ``pull`` returns."""
    results = harness.train(WORLD, STEPS)
    want = reference(WORLD, STEPS)
    assert len(results) == WORLD
    for values, counters in results:
        for got, w, s in zip(values, want, SHAPES):
            assert got.shape == s
            np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)
        # counters only grow (the runtime reports their differences per step)
        assert all(a <= b for before, after in zip(counters, counters[1:]) for a, b in zip(before, after))
    # the reference moved: a channel that drops the gradients would not pass
    assert any(not np.allclose(a, b) for a, b in zip(want, initial()))


@pytest.mark.parametrize("cls", [pytest.param(AllReduceHarness, id="allreduce"),
                                 pytest.param(GraphHarness, id="graph", marks=pytest.mark.integration)])
def test_a_held_step_gives_its_squared_norm_and_applies_the_scale_given(request, cls):
    """``global_clipnorm``'s held steps (``sync.base``): each worker's ``held_sq`` is the squared
    norm of the step's mean gradient, and ``release`` applies it times the scale (the parameter
    servers' side is ``test_ps_clip``)."""
    scale = 0.25
    results = cls(request).train(WORLD, STEPS, scale)
    want = reference(WORLD, STEPS, scale)
    for values, norms in results:
        np.testing.assert_allclose(norms, [squared_norm(WORLD, t) for t in range(STEPS)], rtol=1e-5)
        for got, w in zip(values, want):
            np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)
    assert not np.allclose(want[0], reference(WORLD, STEPS)[0])


def test_all_reduced_tables_are_pulled_by_the_rows_a_step_reads(monkeypatch):
    """A pull given the rows a step reads hands back a sparse member's rows, ``(ids within the
    shard, rows)``, as a parameter server does, and every other member whole; the rows are the
    values the channel holds, before its first update and after (Adam moves every row)."""
    monkeypatch.setitem(backends.BACKENDS, "thread", ThreadBackend)
    none = Compressor.parse("none")
    # the table split in two shards along axis 0 (rows [0, 5) and [5, 10)), a dense bias beside it
    table = [ARMember((0, k), a, b, 0, 2, True, none, "thread") for k, (a, b) in enumerate([(0, 5), (5, 10)])]
    groups = [ARGroup(0, (*table, ARMember((1, 0), 0, 4, 0, 1, False, none, "thread")))]
    rng = np.random.default_rng(3)
    full = rng.standard_normal((10, 3)).astype(np.float32)
    values = {(0, 0): full[:5].copy(), (0, 1): full[5:].copy(), (1, 0): np.ones(4, np.float32)}
    adam = {"name": "Adam", "learning_rate": 0.01, "beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7, "amsgrad": False}
    ids = np.array([1, 4, 6, 9], np.int64)
    setup = ThreadBackend.prepare(2, "rows")

    def rank(r):
        ch = AllReduceChannel(r, 2, groups, {"thread": setup}, dict(values), adam)
        seen = [ch.pull(0, rows={0: ids})]
        ch.push(0, [(np.array([2, 6], np.int64), np.ones((2, 3), np.float32) * (r + 1)), np.ones(4, np.float32)])
        seen.append(ch.pull(1, rows={0: ids}))
        whole = ch.pull(1)
        return seen, whole

    for seen, whole in run_ranks(2, rank):
        for got, table_now in zip(seen, (full, np.concatenate([whole[(0, 0)], whole[(0, 1)]]))):
            (low, low_rows), (high, high_rows) = got[(0, 0)], got[(0, 1)]
            np.testing.assert_array_equal(low, [1, 4])
            np.testing.assert_array_equal(high, [6, 9])
            np.testing.assert_array_equal(np.concatenate([low_rows, high_rows]), table_now[ids])
            assert not isinstance(got[(1, 0)], tuple) and got[(1, 0)].shape == (4,)
        # the update moved every row with a moment (rows 2 and 6), a row never pushed did not move
        moved = np.concatenate([whole[(0, 0)], whole[(0, 1)]]) != full
        assert moved[[2, 6]].all() and not moved[[1, 4, 9]].any()


@pytest.mark.parametrize("optimizer", [
    {"name": "Adam", "learning_rate": 0.01, "beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7, "amsgrad": False},
    {"name": "Adagrad", "learning_rate": 0.1, "initial_accumulator_value": 0.1, "epsilon": 1e-7},
    SGD])
def test_repeated_rows_summed_before_the_gather_update_as_every_slice_would(monkeypatch, optimizer):
    """Each worker sums its repeated rows before the all-gather (with their summed squared slices
    where the rule squares each slice: Adam, Adagrad): the update is the one the rule makes of
    every worker's slices as they are."""
    from autosync.runtime.optimizers import make_optimizer

    monkeypatch.setitem(backends.BACKENDS, "thread", ThreadBackend)
    member = ARMember((0, 0), 0, 10, 0, 1, True, Compressor.parse("none"), "thread")
    table = np.random.default_rng(5).standard_normal((10, 3)).astype(np.float32)
    grads = [(np.array([1, 7, 1, r, 1]), np.random.default_rng([9, r]).standard_normal((5, 3)).astype(np.float32))
             for r in range(2)]
    setup = ThreadBackend.prepare(2, "summed")

    def rank(r):
        ch = AllReduceChannel(r, 2, [ARGroup(0, (member,))], {"thread": setup}, {(0, 0): table.copy()}, optimizer)
        ch.push(0, [grads[r]])
        return ch.pull(1)[(0, 0)], ch.bytes_sent

    want = {(0, 0): table.copy()}
    rule = make_optimizer(optimizer)
    rule.add_variable((0, 0), want[(0, 0)])
    rule.apply(0, want, {(0, 0): (np.concatenate([g[0] for g in grads]), np.concatenate([g[1] for g in grads]) / 2)})
    for got, sent in run_ranks(2, rank):
        np.testing.assert_allclose(got, want[(0, 0)], rtol=1e-6, atol=1e-7)
        # three distinct rows went (and one repeated row's squares), not five slices: a count, five
        # one-byte ids (padded to 8) and 15 float32 values would be 72 bytes
        assert sent < 4 + 8 + 5 * 3 * 4
