"""A synchronous parameter server adds a step's pushes in the order of their sources, whatever order
they arrive in (``ordered_sum``): three workers' pushes in every arrival order give the same bits,
the bits of the sum in worker order; sparse slices and a node aggregator's sums likewise."""
from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest

from autosync.runtime.aggregator import NodeAggregator
from autosync.runtime.ordered_sum import OrderedSums, source_key
from autosync.runtime.ps_shard import ParameterServerShard
from autosync.runtime.slices import dedup_rows

A, E = (0, 0), (1, 0)   # a dense key, a sparse one
ORDERS = list(itertools.permutations(range(3)))
SGD = {"class": "SGD", "learning_rate": 1.0}


def _values():
    return {A: np.zeros(64, np.float32), E: np.zeros((6, 2), np.float32)}


def _grads(worker, step):
    """Gradients of very different sizes: their float32 sum depends on the order it is taken in."""
    rng = np.random.default_rng(10 * step + worker)
    scale = (1e4, 1e-3, 1.0)[worker]
    rows = np.array([1, 4], np.int32)
    return {A: (rng.standard_normal(64) * scale).astype(np.float32),
            E: dedup_rows(rows, (rng.standard_normal((2, 2)) * scale).astype(np.float32), False)}


def _in_order(values: list):
    total = np.array(values[0], copy=True)
    for v in values[1:]:
        total += v
    return total


def test_the_data_tell_orders_apart():
    """(without this, the tests below could not fail)"""
    a = [_grads(w, 0)[A] for w in range(3)]
    assert not np.array_equal(_in_order(a), _in_order(a[::-1]))


def _train(orders, optimizer=SGD, chunks=None):
    ps = ParameterServerShard("ps@x", _values(), [E], [], optimizer, num_workers=3, sync=True, chunks=chunks)

    async def go():
        for step, order in enumerate(orders):
            for w in order:
                g = _grads(w, step)
                if chunks is None:
                    await ps.push(w, step, g)
                else:
                    await ps.push(w, step, {A: g[A]}, chunk=0)
                    await ps.push(w, step, {E: g[E]}, chunk=1)
        return await ps.values()

    return asyncio.run(go())


@pytest.mark.parametrize("chunks", [None, [[A], [E]]], ids=["whole", "chunked"])
def test_every_arrival_order_gives_the_bits_of_the_sum_in_worker_order(chunks):
    # one step: no order known yet, every push held until the last
    first = [_train([order], chunks=chunks) for order in ORDERS]
    dense = _in_order([_grads(w, 0)[A] for w in range(3)])
    want = -(dense / np.float32(3))
    for got in first:
        np.testing.assert_array_equal(got[A], want)
        np.testing.assert_array_equal(got[E], first[0][E])
    # later steps add in the order learned, holding pushes that come early
    runs = [_train([ORDERS[0], order, order[::-1], ORDERS[i % len(ORDERS)]], {"class": "Adam", "learning_rate": 0.1},
                   chunks) for i, order in enumerate(ORDERS)]
    for got in runs[1:]:
        for key in (A, E):
            np.testing.assert_array_equal(got[key], runs[0][key])


def test_sparse_slices_are_added_in_worker_order():
    # every worker's slices land on rows 1 and 4: the row sums depend on the order of the slices
    slices = [_grads(w, 0)[E][1] for w in range(3)]
    assert not np.array_equal(_in_order(slices), _in_order(slices[::-1]))
    runs = [_train([order]) for order in ORDERS]
    for got in runs[1:]:
        np.testing.assert_array_equal(got[E], runs[0][E])   # (0, 1, 2): the worker order


def test_ordered_sums_hold_early_pushes_and_learn_the_order():
    orders: dict = {}
    first = OrderedSums(orders)
    for source in ("n1", 2, 0, "n0"):
        first.add(A, source, np.full(2, 1.0, np.float32))
    assert A not in first.dense   # no order known: all held
    first.settle()
    assert orders[A] == (0, 2, "n0", "n1")
    second = OrderedSums(orders)
    second.add(A, "n0", np.full(2, 4.0, np.float32))
    assert A not in second.dense   # 0 and 2 come first
    second.add(A, 2, np.full(2, 1.0, np.float32))
    np.testing.assert_array_equal(second.dense[A], [1.0, 1.0])   # the first two in either order
    second.add(A, 0, np.full(2, 2.0, np.float32))
    np.testing.assert_array_equal(second.dense[A], [7.0, 7.0])   # 0, then the held n0
    second.add(A, "n1", np.full(2, 8.0, np.float32))
    np.testing.assert_array_equal(second.settle()[0][A], [15.0, 15.0])
    assert sorted([3, "a", 1, "b"], key=source_key) == [1, 3, "a", "b"]


class _FakePS:
    def __init__(self):
        self.pushed = []

        async def remote(node, step, grads, weight, kinds):
            self.pushed.append(grads)

        self.push = type("Method", (), {"remote": staticmethod(remote)})()


@pytest.mark.parametrize("order", ORDERS)
def test_a_node_aggregator_sums_its_workers_in_worker_order(order):
    ps = _FakePS()
    agg = NodeAggregator("n0", 3, [ps], [E], squares=False)

    async def go():
        for w in order:   # the last one's push goes on to the parameter server
            await agg.push(w, 0, {0: {A: _grads(w, 0)[A]}})

    asyncio.run(go())
    np.testing.assert_array_equal(ps.pushed[0][A], _in_order([_grads(w, 0)[A] for w in range(3)]))
