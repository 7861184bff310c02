"""PS pipelining without Ray: chunked pushes update exactly as whole pushes do, a chunk is applied
and served as soon as all workers pushed it (while another chunk still waits), and
``ps_chunks`` splits an actor's keys into chunks of similar bytes."""
from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from autosync.runtime.sync.ps import ps_chunks
from autosync.runtime.plan import ShardRef
from autosync.runtime.ps_shard import ParameterServerShard
from autosync.runtime.slices import dedup_rows

A, B, E = (0, 0), (1, 0), (2, 0)  # two dense keys, one sparse
CHUNKS = [[A], [B], [E]]
OPTIMIZERS = [{"class": "Adam", "learning_rate": 0.05},
              {"class": "SGD", "learning_rate": 0.1, "momentum": 0.9}]


def _values():
    rng = np.random.default_rng(0)
    return {A: rng.standard_normal((4, 3)).astype(np.float32), B: rng.standard_normal(5).astype(np.float32),
            E: rng.standard_normal((10, 2)).astype(np.float32)}


def _grads(worker, step):
    rng = np.random.default_rng(100 * worker + step)
    idx = rng.integers(0, 10, 6)
    return {A: rng.standard_normal((4, 3)).astype(np.float32), B: rng.standard_normal(5).astype(np.float32),
            E: dedup_rows(idx, rng.standard_normal((6, 2)).astype(np.float32), True)}


def _ps(opt, chunks):
    return ParameterServerShard("ps@x", _values(), [E], [], opt, num_workers=2, sync=True, chunks=chunks)


@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_chunked_pushes_equal_whole_pushes_and_serve_each_chunk_when_ready(opt):
    whole, chunked = _ps(opt, None), _ps(opt, CHUNKS)

    async def go():
        for step in range(3):
            for w in range(2):
                await whole.push(w, step, _grads(w, step))
            # chunk 0 from both workers, the others from one worker only: chunk 0 is served already
            for w in range(2):
                g = _grads(w, step)
                await chunked.push(w, step, {A: g[A]}, chunk=0)
            g0 = _grads(0, step)
            await chunked.push(0, step, {B: g0[B]}, chunk=1)
            await chunked.push(0, step, {E: g0[E]}, chunk=2)
            version, direct, _ = await asyncio.wait_for(chunked.pull(step + 1, None, "all", 0), 5)
            assert version == step + 1 and set(direct) == {A}
            assert chunked.chunk_version == [step + 1, step, step] and chunked.version == step
            late = asyncio.ensure_future(chunked.pull(step + 1, {E: np.array([3, 1], np.int32)}, "all", 2))
            await asyncio.sleep(0.01)
            assert not late.done()  # chunk 2 waits for worker 1
            g1 = _grads(1, step)
            await chunked.push(1, step, {B: g1[B]}, chunk=1)
            await chunked.push(1, step, {E: g1[E]}, chunk=2)
            version, direct, _ = await asyncio.wait_for(late, 5)
            assert version == step + 1 and set(direct) == {E}
            np.testing.assert_array_equal(direct[E], chunked.params[E][[3, 1]])
        return await chunked.stats()

    stats = asyncio.run(go())
    assert chunked.version == whole.version == 3
    for key in (A, B, E):
        np.testing.assert_array_equal(chunked.params[key], whole.params[key])
        assert not np.allclose(whole.params[key], _values()[key])
    assert stats["chunks"] == 3 and stats["pushes"] == 18 and len(stats["chunk_wait_s"]) == 3


def test_chunks_must_split_the_keys_and_need_sync():
    opt = OPTIMIZERS[0]
    with pytest.raises(ValueError, match="do not split"):
        _ps(opt, [[A], [B]])
    with pytest.raises(ValueError, match="asynchronous"):
        ParameterServerShard("ps@x", _values(), [E], [], opt, num_workers=2, sync=False, chunks=CHUNKS)


def _ref(v, rows, sparse=False, shard=0, shards=1, axis=0):
    return ShardRef(var_index=v, shard_index=shard, num_shards=shards, start=0, stop=rows, axis=axis,
                    sparse=sparse, local_replication=False)


def test_ps_chunks_split_by_bytes_sparse_apart_small_actor_whole():
    shapes = [[1000, 256], [1000, 256], [10], [1000, 256], [5000, 64]]
    itemsize = [4] * 5
    refs = [_ref(0, 1000), _ref(1, 1000), _ref(2, 10), _ref(3, 1000), _ref(4, 5000, sparse=True)]
    # 3 dense keys of ~1 MB (and a bias): three chunks, the sparse table in a fourth
    chunks = ps_chunks(refs, shapes, itemsize, max_chunks=4, min_bytes=1 << 18)
    assert chunks == [[(0, 0)], [(1, 0), (2, 0)], [(3, 0)], [(4, 0)]]
    # the bound on chunks holds; no key is lost or repeated
    two = ps_chunks(refs, shapes, itemsize, max_chunks=3, min_bytes=1)
    assert len(two) == 3 and sorted(k for c in two for k in c) == sorted(r.key for r in refs)
    assert two[-1] == [(4, 0)]
    # too few bytes to split, or pipelining off: one call per actor
    assert ps_chunks(refs, shapes, itemsize, max_chunks=4, min_bytes=1 << 30) is None
    assert ps_chunks(refs, shapes, itemsize, max_chunks=1, min_bytes=1) is None
    # a shard of a partitioned variable counts its own bytes only
    half = [_ref(0, 500, shards=2), _ref(1, 1000)]
    assert ps_chunks(half, shapes, itemsize, max_chunks=4, min_bytes=1 << 19) == [[(0, 0)], [(1, 0)]]


def _plan(shards, layout, sync=True, replicas=("a:0", "b:0")):
    from autosync.runtime.plan import PSActorPlan, SyncPlan

    return SyncPlan(replicas=replicas, ps_actors=(PSActorPlan("a", tuple(shards)),), sync=sync, staleness=0,
                    num_vars=len(layout), layout=tuple(layout))


def test_a_variable_holding_most_of_an_actors_bytes_is_cut_into_row_blocks_that_chunk_evenly():
    """vgg16's shape of problem: one kernel of 61 % and one of 30 % of a PS actor's bytes would be
    two chunks, the big one pulled only once all of it was pushed; cut into row blocks on the same
    actor, the actor's keys fall into chunks of similar bytes."""
    from strategy_space import shard_bounds

    shapes, itemsize = [[2048, 1024], [1024, 1024], [3, 3, 64, 64], [1024], [100, 8]], [4] * 5
    refs = [_ref(0, 2048), _ref(1, 1024), _ref(2, 3), _ref(3, 1024), _ref(4, 100, sparse=True)]
    plan = _plan(refs, [(1, 0)] * 5)
    cut = plan.segmented(shapes, itemsize, max_chunks=4, min_bytes=1 << 20)
    # three dense chunks (the sparse table takes the fourth) of 4.1 MiB: 8 MiB in 4 blocks, 4 MiB in
    # 2, the small ones and the sparse table whole
    assert cut.layout == ((4, 0), (2, 0), (1, 0), (1, 0), (1, 0))
    blocks = [r for r in cut.ps_actors[0].shards if r.var_index == 0]
    assert [(r.shard_index, r.num_shards, r.start, r.stop, r.axis) for r in blocks] == [
        (i, 4, a, b, 0) for i, (a, b) in enumerate(shard_bounds(2048, 4))]
    assert {r.var_index for r in cut.ps_actors[0].shards} == set(range(5))
    chunks = ps_chunks(cut.ps_actors[0].shards, shapes, itemsize, max_chunks=4, min_bytes=1 << 20)
    def size(chunk, layout):   # elements of a chunk's keys (equal blocks of each variable)
        return sum(np.prod(shapes[k[0]]) // layout[k[0]][0] for k in chunk)

    dense = [size(c, cut.layout) for c in chunks if (4, 0) not in c]
    assert len(dense) == 3 and max(dense) <= 1.5 * min(dense), dense
    before = ps_chunks(refs, shapes, itemsize, max_chunks=4, min_bytes=1 << 20)
    assert max(size(c, plan.layout) for c in before if (4, 0) not in c) > 1.5 * max(dense)


def test_nothing_is_cut_where_pipelining_cannot_use_it():
    shapes, itemsize = [[2048, 1024], [1024]], [4, 4]
    refs = [_ref(0, 2048), _ref(1, 1024)]
    plan = _plan(refs, [(1, 0), (1, 0)])
    assert plan.segmented(shapes, itemsize, max_chunks=1, min_bytes=1) is plan        # pipelining off
    assert plan.segmented(shapes, itemsize, max_chunks=4, min_bytes=1 << 30) is plan  # too few bytes
    async_plan = _plan(refs, [(1, 0), (1, 0)], sync=False)
    assert async_plan.segmented(shapes, itemsize, max_chunks=4, min_bytes=1) is async_plan
    # a variable the strategy partitioned keeps its shards; a locally replicated one stays whole
    half = _plan([_ref(0, 1024, shards=2)], [(2, 0), (1, 0)])
    assert half.segmented(shapes, itemsize, max_chunks=4, min_bytes=1) is half
    shared = _plan([dataclasses.replace(_ref(0, 2048), local_replication=True), _ref(1, 1024)], [(1, 0), (1, 0)])
    assert shared.segmented(shapes, itemsize, max_chunks=4, min_bytes=1) is shared
    # node aggregation (two workers of a node sum locally replicated shards): no chunks, no cut
    agg = _plan([dataclasses.replace(_ref(0, 2048), local_replication=True), _ref(1, 1024)], [(1, 0), (1, 0)],
                replicas=("a:0", "a:1"))
    assert agg.node_aggregation() and agg.segmented(shapes, itemsize, max_chunks=4, min_bytes=1) is agg


def test_sparse_keys_split_by_their_step_bytes_where_given():
    """An embedding model's actor: with its tables' step bytes, the sparse keys split into the
    chunks the (small, unsplit) dense keys leave, by bytes; without them, one call as before."""
    from autosync.runtime.sync.ps import sparse_step_bytes

    shapes = [[64, 8], [8], [1000, 16], [500, 16], [2000, 8], [300, 32]]
    itemsize = [4] * 6
    refs = [_ref(0, 64), _ref(1, 8)] + [_ref(v, shapes[v][0], sparse=True) for v in range(2, 6)]
    rows = (0, 0, 100, 100, 100, 50)
    sizes = sparse_step_bytes(refs, rows, shapes, itemsize)
    assert sizes == {(2, 0): 100 * (64 + 8), (3, 0): 100 * (64 + 8), (4, 0): 100 * (32 + 8), (5, 0): 50 * (128 + 8)}
    assert ps_chunks(refs, shapes, itemsize, max_chunks=4, min_bytes=1 << 20) is None
    chunks = ps_chunks(refs, shapes, itemsize, max_chunks=4, min_bytes=1 << 20, sparse_bytes=sizes)
    assert chunks[0] == [(0, 0), (1, 0)] and len(chunks) == 4
    assert sorted(k for c in chunks[1:] for k in c) == sorted(sizes)
    assert chunks[1:] == [[(2, 0)], [(3, 0), (4, 0)], [(5, 0)]]   # runs of about a third of the bytes
    # no budget left (pipelining off), or one table: nothing splits
    assert ps_chunks(refs, shapes, itemsize, max_chunks=1, min_bytes=1, sparse_bytes=sizes) is None
    assert ps_chunks(refs[:3], shapes, itemsize, max_chunks=4, min_bytes=1 << 20, sparse_bytes=sizes) is None
    # a shard of a table partitioned in two carries half its rows; across columns, every row's id
    half = [_ref(2, 500, sparse=True, shards=2), _ref(5, 16, sparse=True, shards=2, axis=1)]
    assert sparse_step_bytes(half, rows, shapes, itemsize) == {(2, 0): 50 * (64 + 8), (5, 0): 50 * 64 + 50 * 8}


def test_sparse_keys_are_pipelined_only_where_a_step_crosses_a_slow_link():
    """Each chunk costs a call: the split pays where the actor serves a worker on another node and
    a step's rows take at least a millisecond on the slowest link."""
    from autosync.runtime.sync.ps import SPARSE_CHUNK_MIN_S, pipelined_sparse
    from strategy_space import ClusterSpec, NodeSpec

    shapes, itemsize = [[1000, 16], [500, 16]], [4, 4]
    refs = (_ref(0, 1000, sparse=True), _ref(1, 500, sparse=True))
    step_bytes = 2 * 100 * (64 + 8)

    def cluster(gbps):
        return ClusterSpec("c", (NodeSpec("a", workers=1, bandwidth_gbps=gbps), NodeSpec("b", workers=1,
                                                                                       bandwidth_gbps=gbps)))

    slow = step_bytes * 8 / SPARSE_CHUNK_MIN_S / 1e9 / 2   # a step's rows take 2 ms
    plan = dataclasses.replace(_plan(refs, [(1, 0)] * 2), rows_per_step=(100, 100))
    assert pipelined_sparse(plan, plan.ps_actors[0], cluster(slow), shapes, itemsize) == {
        (0, 0): 100 * 72, (1, 0): 100 * 72}
    assert pipelined_sparse(plan, plan.ps_actors[0], cluster(slow * 4), shapes, itemsize) is None   # 0.5 ms
    local = dataclasses.replace(plan, replicas=("a:0", "a:1"))
    assert pipelined_sparse(local, local.ps_actors[0], cluster(slow), shapes, itemsize) is None
    # actors on both worker nodes send and receive at once already; one on a node without
    # workers (a dedicated server) pushes and pulls one way at a time
    from autosync.runtime.plan import PSActorPlan

    both = dataclasses.replace(plan, ps_actors=(PSActorPlan("a", refs[:1]), PSActorPlan("b", refs[1:])))
    assert pipelined_sparse(both, both.ps_actors[0], cluster(slow), shapes, itemsize) is None
    server = dataclasses.replace(plan, replicas=("b:0", "c:0"),
                                 ps_actors=(PSActorPlan("a", refs[:1]), PSActorPlan("d", refs[1:])))
    assert pipelined_sparse(server, server.ps_actors[0], cluster(slow), shapes, itemsize) == {(0, 0): 100 * 72}
    unknown = dataclasses.replace(plan, rows_per_step=())
    assert pipelined_sparse(unknown, unknown.ps_actors[0], cluster(slow), shapes, itemsize) is None


def test_a_plan_takes_rows_per_step_from_the_spec_else_from_the_workers_description():
    from autosync.runtime.plan import SyncPlan
    from strategy_space import ClusterSpec, ModelSpec, NodeSpec, Strategy, VarConfig, VariableSpec
    from strategy_space import PS as PSSync

    cluster = ClusterSpec("c", (NodeSpec("a", workers=1), NodeSpec("b", workers=1)))
    strategy = Strategy((VarConfig("e", (PSSync("a"),)), VarConfig("f", (PSSync("a"),)), VarConfig("d", (PSSync("b"),))))
    described = [{"name": "e", "rows": 7}, {"name": "f", "rows": 9}, {"name": "d", "rows": None}]
    spec = ModelSpec("m", (VariableSpec("e", (50, 4), sparse=True, rows_per_step=30),
                           VariableSpec("f", (60, 4), sparse=True), VariableSpec("d", (4, 2))))
    assert SyncPlan.build(strategy, spec, cluster).rows_per_step == (30, 0, 0)
    assert SyncPlan.build(strategy, spec, cluster, None, described).rows_per_step == (30, 9, 0)
