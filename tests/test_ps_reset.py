"""A pooled parameter server reset onto a new session holds nothing of the last one (no Ray: the
actor class driven in this process)."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tests.test_ps_pipelining import CHUNKS, E, OPTIMIZERS, _grads, _values
from autosync.runtime.ps_shard import ParameterServerShard


def _args(opt, chunks=None):
    return ("ps@x", _values(), [E], [], opt), {"num_workers": 2, "sync": True, "chunks": chunks}


async def _train(ps, steps=3):
    for step in range(steps):
        for w in range(2):
            await ps.push(w, step, _grads(w, step))
    return await ps.values()


@pytest.mark.parametrize("first", OPTIMIZERS)
def test_a_released_and_set_up_again_actor_trains_like_a_fresh_one(first):
    """What ``reset`` does (``_drop`` by ``release``, then ``_setup``): another optimizer, other
    chunks, every counter and slot from scratch."""
    second = OPTIMIZERS[1] if first is OPTIMIZERS[0] else OPTIMIZERS[0]
    args, kw = _args(second, CHUNKS)

    async def go():
        used = ParameterServerShard(*_args(first)[0], **_args(first)[1])
        await _train(used, steps=2)
        await used.release()
        assert not used.params and used.optimizer is None
        used._setup(*args, **kw)
        fresh = ParameterServerShard(*args, **kw)
        got, want = await _train(used), await _train(fresh)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])
        assert used.version == fresh.version == 3 and used.chunk_version == fresh.chunk_version
        assert (await used.stats())["pushes"] == (await fresh.stats())["pushes"] == 6

    asyncio.run(go())


def test_release_refuses_an_actor_with_unapplied_pushes_or_an_error():
    async def go():
        ps = ParameterServerShard(*_args(OPTIMIZERS[0])[0], **_args(OPTIMIZERS[0])[1])
        await ps.push(0, 0, _grads(0, 0))   # worker 1's push of step 0 never comes
        with pytest.raises(RuntimeError, match="released with steps still being pushed"):
            await ps.release()
        ps._pending, ps._error = {}, "ps@x: update for step 0 failed"
        with pytest.raises(RuntimeError, match="update for step 0 failed"):
            await ps.release()

    asyncio.run(go())


def test_an_empty_actor_can_be_released():
    """A pool's idle actor made by ``prepare`` (no shards yet)."""
    ps = ParameterServerShard()
    asyncio.run(ps.release())
    assert ps.name == "" and not ps.keras_ready
