"""A parameter server restored in batches (``ps_checkpoint``): values and slots staged a part at a
time continue training exactly where the saved server was, the staged copies are taken over
without another, and a restore that does not fit changes nothing."""
from __future__ import annotations

import asyncio
import tracemalloc

import numpy as np

from autosync.runtime.ps_shard import ParameterServerShard

TABLE, DENSE = (0, 0), (1, 0)
ADAGRAD = {"class": "Adagrad", "learning_rate": 0.2}


def _server(seed=0):
    rng = np.random.default_rng(seed)
    values = {TABLE: rng.standard_normal((400, 16)).astype(np.float32), DENSE: rng.standard_normal(7).astype(np.float32)}
    for v in values.values():
        v.flags.writeable = False   # as views of the object store arrive
    return ParameterServerShard("ps@x", values, [TABLE], [], ADAGRAD, num_workers=1, sync=True)


def _push(step):
    rng = np.random.default_rng(100 + step)
    return {TABLE: (np.array([3, 17, 40]), rng.standard_normal((3, 16)).astype(np.float32)),
            DENSE: rng.standard_normal(7).astype(np.float32)}


def _read_only(arrays: dict) -> dict:
    out = {k: np.array(v) for k, v in arrays.items()}
    for v in out.values():
        v.flags.writeable = False
    return out


def test_a_restore_in_parts_goes_on_as_the_saved_server_and_copies_nothing_more():
    saved = _server()

    async def train(ps, steps):
        for step in steps:
            await ps.push(0, step, _push(step))
        return await ps.values()

    asyncio.run(train(saved, range(3)))
    state = asyncio.run(saved.checkpoint_state(None, [TABLE, DENSE]))
    assert state["version"] == 3 and state["slots"]

    fresh = _server(seed=1)   # other initial values: everything must come from the checkpoint
    values, slots = _read_only(state["values"]), _read_only(state["slots"])
    asyncio.run(fresh.stage_checkpoint({TABLE: values[TABLE]}, {}))
    for name, array in slots.items():
        asyncio.run(fresh.stage_checkpoint({}, {name: array}))
    state_bytes = sum(a.nbytes for a in [*values.values(), *slots.values()])
    tracemalloc.start()
    try:
        problems = asyncio.run(fresh.load_checkpoint({DENSE: values[DENSE]}, {}, state["version"],
                                                     state["chunk_version"]))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert problems == []
    # the staged table and slots are the server's state now; only the small dense value sent with
    # the last call is copied (the old rule copied every array again: more than the whole state)
    assert peak < 0.2 * state_bytes, (peak, state_bytes)
    assert all(v.flags.writeable for v in fresh.params.values())
    after = asyncio.run(train(fresh, range(3, 6)))
    want = asyncio.run(train(saved, range(3, 6)))
    assert fresh.version == saved.version == 6
    for key in (TABLE, DENSE):
        np.testing.assert_array_equal(after[key], want[key])


def test_a_restore_that_does_not_fit_changes_nothing_and_drops_what_was_staged():
    saved = _server()
    state = asyncio.run(saved.checkpoint_state(None, [TABLE, DENSE]))
    fresh = _server(seed=1)
    before = {k: np.array(v) for k, v in fresh.params.items()}
    asyncio.run(fresh.stage_checkpoint({DENSE: state["values"][DENSE]}, dict(state["slots"])))
    problems = asyncio.run(fresh.load_checkpoint({}, {}, 0, [0]))
    assert problems == ["ps@x: the checkpoint has no value for shard (0, 0)"]
    assert all(np.array_equal(fresh.params[k], before[k]) for k in before) and fresh.version == 0
    # the staged part is gone: sending the table alone is not a whole restore either
    problems = asyncio.run(fresh.load_checkpoint({TABLE: state["values"][TABLE]}, {}, 0, [0]))
    assert problems == ["ps@x: the checkpoint has no value for shard (1, 0)"]
    wrong = {TABLE: np.zeros((399, 16), np.float32), DENSE: state["values"][DENSE]}
    problems = asyncio.run(fresh.load_checkpoint(wrong, dict(state["slots"]), 0, [0]))
    assert problems == ["ps@x: shard (0, 0) has shape (399, 16) in the checkpoint, (400, 16) here"]
    assert asyncio.run(fresh.load_checkpoint(dict(state["values"]), dict(state["slots"]), 0, [0])) == []
