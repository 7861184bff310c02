"""How many copies of the model's tables the runtime holds: a parameter server starts from views
of the pool's initial values in Ray's object store (read-only) instead of copies, and never writes
them in place; a worker keeps no private copy of its trainable initial values (reset reads them
from the object store)."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from autosync.runtime.initial import ZeroInitial
from autosync.runtime.ps_shard import ParameterServerShard

TABLE, DENSE = (0, 0), (1, 0)
OPTIMIZERS = [{"class": "SGD", "learning_rate": 0.1}, {"class": "SGD", "learning_rate": 0.1, "momentum": 0.9},
              {"class": "Adam", "learning_rate": 0.05}, {"class": "AdamW", "learning_rate": 0.05, "weight_decay": 0.1},
              {"class": "Adagrad", "learning_rate": 0.2}]


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: "-".join(map(str, o.values())))
def test_a_parameter_server_holds_the_received_values_and_never_writes_them(optimizer):
    rng = np.random.default_rng(0)
    received = {TABLE: rng.standard_normal((50, 4)).astype(np.float32), DENSE: rng.standard_normal(3).astype(np.float32)}
    before = {k: v.copy() for k, v in received.items()}
    for v in received.values():
        v.flags.writeable = False  # as a view of the object store arrives
    ps = ParameterServerShard("ps@x", received, [TABLE], [], optimizer, num_workers=1, sync=True)
    assert all(ps.params[k] is received[k] for k in received)  # no copy of the tables

    async def steps():
        for step in range(2):
            grads = {TABLE: (np.array([1, 3, 3]), rng.standard_normal((3, 4)).astype(np.float32)),
                     DENSE: rng.standard_normal(3).astype(np.float32)}
            await ps.push(0, step, grads)

    asyncio.run(steps())
    for k in received:
        np.testing.assert_array_equal(received[k], before[k])  # the first update writes a copy
        assert ps.params[k] is not received[k] and not np.array_equal(ps.params[k], before[k])


def test_a_parameter_server_starts_from_views_of_the_pools_initial_values():
    table = np.arange(40, dtype=np.float32).reshape(10, 4)
    dense = np.arange(6, dtype=np.float32).reshape(2, 3)
    for v in (table, dense):
        v.flags.writeable = False
    shards = {(0, 1): (0, 5, 10, 0), (1, 0): (1, 0, 3, 1), (1, 1): (1, 1, 3, 1)}
    ps = ParameterServerShard("ps@x", shards, [(0, 1)], [], OPTIMIZERS[0], num_workers=1, sync=True,
                              description={"initial": [table, dense]})
    assert np.shares_memory(ps.params[(0, 1)], table)  # rows 5..9: a view, no copy
    np.testing.assert_array_equal(ps.params[(0, 1)], table[5:])
    assert ps.params[(1, 0)] is dense  # the whole variable
    np.testing.assert_array_equal(ps.params[(1, 1)], dense[:, 1:])  # columns: a contiguous copy
    assert ps.params[(1, 1)].flags.c_contiguous


def test_a_parameter_server_makes_described_zeros_itself_and_updates_them_in_place():
    """Emulated compute describes its zero initial values (no arrays in the object store); the
    shards are allocated by the actor, so no update needs to copy them."""
    desc = {"initial": [ZeroInitial((10, 4), "float32"), ZeroInitial((2, 3), "float32")]}
    shards = {(0, 0): (0, 0, 5, 0), (0, 1): (0, 5, 10, 0), (1, 0): (1, 1, 3, 1)}
    ps = ParameterServerShard("ps@x", shards, [(0, 0), (0, 1)], [], OPTIMIZERS[2], num_workers=1, sync=True,
                              description=desc)
    assert {k: v.shape for k, v in ps.params.items()} == {(0, 0): (5, 4), (0, 1): (5, 4), (1, 0): (2, 2)}
    assert not any(v.any() for v in ps.params.values())
    held = dict(ps.params)
    grads = {(0, 0): (np.array([1, 4]), np.ones((2, 4), np.float32)), (0, 1): (np.array([0]), np.ones((1, 4), np.float32)),
             (1, 0): np.ones((2, 2), np.float32)}
    asyncio.run(ps.push(0, 0, grads))
    assert all(ps.params[k] is held[k] and ps.params[k].any() for k in held)
    assert asyncio.run(ps.stats())["copies"] == 0


@pytest.mark.integration
def test_a_worker_keeps_no_copy_of_its_trainable_initial_values():
    from autosync.runtime.digest import weights_digest
    from autosync.runtime.worker import TrainingWorker
    from tests import runtime_models as rm

    # its constructor sizes TensorFlow's thread pools, which this process may have started already
    worker = TrainingWorker.__new__(TrainingWorker)
    desc = worker.load(rm.multi_model_def("adagrad", learning_rate=0.1), 0, 1, send_initial=True)
    trainable = sum(v.numpy().nbytes for v in worker.variables)
    fixed = sum(value.nbytes for _, value in worker._fixed)
    non_trainable = sum(w.numpy().nbytes for w in worker.model.non_trainable_weights)
    assert fixed == non_trainable < trainable  # the tables are not kept twice
    assert desc["initial_digest"] == weights_digest([v.numpy() for v in worker.variables])
    layout = [(1, 0)] * len(worker.variables)
    worker.reset(0, 1, [], layout, desc)
    worker.run(1)  # no channels: nothing synchronized, but the model has trained
    for v in worker.variables:
        v.assign(np.zeros(v.shape, v.dtype))
    worker.reset(0, 1, [], layout, desc)  # back to the initial values, from the description
    for v, want in zip(worker.variables, desc["initial"]):
        np.testing.assert_array_equal(v.numpy(), want)
    with pytest.raises(ValueError, match="needs the model's initial values"):
        worker.reset(0, 1, [], layout)
