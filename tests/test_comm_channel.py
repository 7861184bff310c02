"""The all-reduce channel on real Ray actors, with numpy gradients (no TensorFlow): every worker
ends with the values of SGD applied to the mean gradient, for every backend available here."""
import numpy as np
import pytest

from autosync.runtime.sync.allreduce import AllReduceChannel, ARGroup, ARMember
from autosync.runtime.sync.backends import BACKENDS
from strategy_space.compressor import Compressor

pytestmark = pytest.mark.integration

SHAPES = [(8, 4), (4,), (10, 3), (6, 5)]
SPARSE = {2}
LR = 0.1
SGD = {"name": "SGD", "learning_rate": LR, "momentum": 0.0, "nesterov": False}


def members(compressor: str, backend: str):
    m = lambda var, shard, n, start, stop, group, sparse=False: (group, ARMember(  # noqa: E731
        (var, shard), start, stop, 0, n, sparse, Compressor.parse("none" if sparse else compressor), backend))
    items = [m(0, 0, 1, 0, 8, 0), m(1, 0, 1, 0, 4, 0), m(2, 0, 1, 0, 10, 1, True), m(3, 0, 2, 0, 3, 2), m(3, 1, 2, 3, 6, 3)]
    groups: dict[int, list] = {}
    for g, mem in items:
        groups.setdefault(g, []).append(mem)
    return [ARGroup(g, tuple(ms)) for g, ms in sorted(groups.items())]


def initial():
    rng = np.random.default_rng(0)
    vals = {(i, 0): rng.standard_normal(s).astype(np.float32) for i, s in enumerate(SHAPES) if i != 3}
    full3 = rng.standard_normal(SHAPES[3]).astype(np.float32)
    vals[(3, 0)], vals[(3, 1)] = full3[:3], full3[3:]
    return vals, full3


def grads_for(rank: int, step: int):
    rng = np.random.default_rng([rank, step])
    out = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    idx = np.array([1, 7, 1, rank], dtype=np.int64)  # duplicates must add up
    out[2] = (idx, rng.standard_normal((4, 3)).astype(np.float32))
    return out


def expected(world: int, steps: int):
    vals, full3 = initial()
    params = [vals[(0, 0)], vals[(1, 0)], vals[(2, 0)], full3]
    for step in range(steps):
        gs = [grads_for(r, step) for r in range(world)]
        for i in range(4):
            if i in SPARSE:
                dense = np.zeros(SHAPES[i], np.float32)
                for g in gs:
                    np.add.at(dense, g[i][0], g[i][1])
                mean = dense / world
            else:
                mean = sum(g[i] for g in gs) / world
            params[i] = params[i] - LR * mean
    return params


class FakeWorker:
    def __init__(self, channel):
        self.channel = channel

    def run(self, rank, steps):
        for step in range(steps):
            self.channel.push(step, grads_for(rank, step))
        parts = self.channel.pull(steps)  # per (var, shard); variable 3 comes in two shards
        values = {v: parts[(v, 0)] for v in range(3)}
        values[3] = np.concatenate([parts[(3, 0)], parts[(3, 1)]])
        return values, self.channel.calls


def run_channels(ray, backend, compressor, world, steps, tag):
    groups = members(compressor, backend)
    setup = BACKENDS[backend].prepare(world, f"test-{tag}")
    vals, _ = initial()
    actor = ray.remote(num_cpus=0)(FakeWorker)
    workers = [actor.remote(AllReduceChannel(r, world, groups, {backend: setup}, vals, SGD)) for r in range(world)]
    return ray.get([w.run.remote(r, steps) for r, w in enumerate(workers)], timeout=120)


@pytest.mark.parametrize("backend", ["objectstore", "gloo"])
def test_uncompressed_equals_mean_gradient_sgd(ray_session, backend):
    world, steps = 3, 3
    results = run_channels(ray_session, backend, "none", world, steps, f"none-{backend}")
    want = expected(world, steps)
    for values, calls in results:
        for i in range(4):
            np.testing.assert_allclose(values[i], want[i], rtol=1e-5, atol=1e-6)
        # one collective per (group, kind) and step; the sparse member one all-gather
        assert calls == steps * (1 + 1 + 1 + 1)


@pytest.mark.parametrize("backend", ["objectstore", "gloo"])
def test_fp16_within_fp16_tolerance(ray_session, backend):
    world, steps = 2, 2
    results = run_channels(ray_session, backend, "fp16", world, steps, f"fp16-{backend}")
    want = expected(world, steps)
    for values, _ in results:
        for i in range(4):
            np.testing.assert_allclose(values[i], want[i], rtol=2e-3, atol=2e-3)
    # all workers agree exactly: they applied the same reduced gradient
    for i in range(4):
        assert np.array_equal(results[0][0][i], results[1][0][i])
